"""finetune.hub.push against a local fake Hub, driven by the real huggingface_hub client."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers (tiny run fixture) stays offline

from finetune.hub import PushError, base_license, push, push_from_recipe  # noqa: E402
from finetune.modelcard import card_metadata, parse_front_matter, render_model_card  # noqa: E402
from finetune.recipe import load_recipe  # noqa: E402
from tests.helpers.fakehub import FakeHub  # noqa: E402
from tests.helpers.run_dirs import tree_hashes  # noqa: E402

CANARY = "hf_CANARYtoken1234567890abcdef"
ALLOWED = {
    "README.md",
    "adapter_config.json",
    "adapter_model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "recipe.resolved.yaml",
    "loss.png",
}


@pytest.fixture(scope="module")
def runs(tiny_runs):
    return tiny_runs


@pytest.fixture
def hub(monkeypatch):
    """A fake Hub on 127.0.0.1:<free port>, with the real client pointed at it.

    huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_DISABLE_XET once, at import, into
    `huggingface_hub.constants` (and transformers imported it long before this fixture runs),
    so the fixture sets the environment *and* those two constants; monkeypatch restores both.
    Xet is off because this server speaks git-LFS, not the Xet CAS protocol. The endpoint is
    read from HF_ENDPOINT by finetune.hub at call time, so no reload is needed for it.
    """
    import huggingface_hub.constants as hf_constants

    fake = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_TOKEN", CANARY)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    yield fake
    fake.stop()


def _card(files: dict[str, bytes]) -> tuple[dict, str]:
    text = files["README.md"].decode()
    return parse_front_matter(text), text


def test_push_adapter(runs, hub):
    before = tree_hashes(runs["lora"])
    url = push(runs["lora"], repo_id="acme/tiny-sft")
    assert url.startswith(hub.url) and "/acme/tiny-sft/commit/" in url
    repo = hub.repos["acme/tiny-sft"]
    assert repo.private is True
    files = hub.files("acme/tiny-sft")
    assert set(files) == ALLOWED
    for name in ALLOWED - {"README.md", "recipe.resolved.yaml"}:  # byte-identical uploads
        assert files[name] == (runs["lora"] / name).read_bytes()
    # the recipe goes up with local paths reduced to their names
    public = yaml.safe_load(files["recipe.resolved.yaml"])
    assert public["model"]["name"] == "tiny-llama"
    assert [s["path"] for s in public["data"]["sources"]] == ["chat.jsonl", "HuggingFaceH4/ultrachat_200k"]
    meta, text = _card(files)
    assert meta["library_name"] == "peft"
    assert meta["pipeline_tag"] == "text-generation"
    assert meta["tags"] == ["finetune", "sft", "lora", "trl"]
    assert meta["datasets"] == ["HuggingFaceH4/ultrachat_200k"]  # the local jsonl is not a Hub id
    assert "base_model" not in meta  # the base is a local directory, not a Hub id
    assert "license" not in meta
    for fragment in (
        "![training loss](loss.png)",
        "| final train loss | 5.5000 |",
        "| best eval loss | 6.0000 |",
        "| steps | 4 |",
        "| training tokens | 2,048 |",
        "| strategy | ddp |",
        "| hardware | cpu: CPU |",
        "LoRA r=8, alpha=16",
        "AutoPeftModelForCausalLM",
        "recipe.resolved.yaml",
    ):
        assert fragment in text
    # the weights went through git-LFS (not inlined in the commit), everything in one commit
    assert hub.count("PUT", "/lfs-upload/") >= 2
    assert len(repo.commits) == 1
    assert all(hub.authorized)
    assert tree_hashes(runs["lora"]) == before


def test_push_public_to_branch(runs, hub):
    push(runs["lora"], repo_id="acme/tiny-public", private=False, revision="exp-7", commit_message="first try")
    repo = hub.repos["acme/tiny-public"]
    assert repo.private is False
    assert hub.files("acme/tiny-public") == {}  # main untouched
    assert set(hub.files("acme/tiny-public", "exp-7")) == ALLOWED
    assert repo.commits[-1]["branch"] == "exp-7" and repo.commits[-1]["summary"] == "first try"


def test_refuses_private_push_into_existing_public_repo(runs, hub):
    push(runs["lora"], repo_id="acme/open", private=False)
    with pytest.raises(PushError) as info:
        push(runs["lora"], repo_id="acme/open")
    assert "already exists and is public" in info.value.render()
    assert len(hub.repos["acme/open"].commits) == 1


def test_failed_commit_raises_with_retry_and_resume_skips_stored_blobs(runs, hub, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    before = tree_hashes(runs["lora"])
    hub.fail["commit"] = 1
    with pytest.raises(PushError) as info:
        push(runs["lora"], repo_id="acme/flaky", revision="try")
    err = info.value
    assert err.exit_code == 5
    text = err.render()
    assert "uploading and committing" in text and "500" in text
    assert f"finetune push {runs['lora']} --repo acme/flaky --revision try" in text
    assert tree_hashes(runs["lora"]) == before  # nothing local lost or changed
    assert hub.files("acme/flaky", "try") == {}  # nothing half-committed
    puts_first = hub.count("PUT", "/lfs-upload/")
    assert puts_first >= 2  # the blobs did reach storage before the commit failed

    push(runs["lora"], repo_id="acme/flaky", revision="try")
    assert set(hub.files("acme/flaky", "try")) == ALLOWED
    assert hub.count("PUT", "/lfs-upload/") == puts_first  # resumed: no blob sent twice
    assert tree_hashes(runs["lora"]) == before
    _assert_no_canary(runs["lora"], caplog, capsys, extra=text)


def test_failed_lfs_upload_then_retry(runs, hub):
    hub.fail["lfs_put"] = 1
    hub.fail_status = 403  # e.g. an expired pre-signed storage URL; the client does not retry it
    with pytest.raises(PushError, match="uploading and committing the files") as info:
        push(runs["lora"], repo_id="acme/flaky-lfs")
    assert "--repo acme/flaky-lfs" in info.value.render()
    assert "acme/flaky-lfs" not in hub.repos or hub.files("acme/flaky-lfs") == {}
    push(runs["lora"], repo_id="acme/flaky-lfs")
    assert set(hub.files("acme/flaky-lfs")) == ALLOWED


def test_push_merged_merges_in_a_temp_dir_and_resumes(runs, hub, tmp_path, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    before = tree_hashes(runs["lora"])
    siblings = sorted(p.name for p in runs["lora"].parent.iterdir())
    hub.fail["commit"] = 1
    with pytest.raises(PushError, match="--merged"):
        push(runs["lora"], repo_id="acme/tiny-merged", merged=True, max_shard_size="200KB")
    puts_first = hub.count("PUT", "/lfs-upload/")
    push(runs["lora"], repo_id="acme/tiny-merged", merged=True, max_shard_size="200KB")
    # the merge is deterministic, so the re-merged shards are the blobs already stored
    assert hub.count("PUT", "/lfs-upload/") == puts_first
    files = hub.files("acme/tiny-merged")
    shards = {n for n in files if n.startswith("model-") and n.endswith(".safetensors")}
    assert len(shards) > 1 and "model.safetensors.index.json" in files
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "README.md",
        "recipe.resolved.yaml",
        "loss.png",
    } <= set(files)
    assert not any(n.startswith("adapter_") for n in files)
    meta, text = _card(files)
    assert meta["library_name"] == "transformers" and "merged" in meta["tags"]
    assert "AutoModelForCausalLM" in text
    # the temporary merge dir is gone and RUN_DIR is unchanged
    assert sorted(p.name for p in runs["lora"].parent.iterdir()) == siblings
    assert tree_hashes(runs["lora"]) == before

    # the pushed files load as a plain transformers model
    out = tmp_path / "downloaded"
    out.mkdir()
    for name, data in files.items():
        (out / name).write_bytes(data)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 2
    _assert_no_canary(out, caplog, capsys)


def test_push_merged_reuses_run_dir_merged(runs, hub, tmp_path):
    from finetune.merging import merge

    run = tmp_path / "run"
    shutil.copytree(runs["lora"], run)
    merge(run, run / "merged", max_shard_size="300KB")
    before = tree_hashes(run)
    push(run, repo_id="acme/reuse", merged=True)
    files = hub.files("acme/reuse")
    for path in (run / "merged").iterdir():  # exactly the already-merged files, not a re-merge
        assert files[path.name] == path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temporary merge dir
    assert tree_hashes(run) == before


def test_push_full_fine_tune(runs, hub):
    push(runs["full"], repo_id="acme/tiny-full")
    files = hub.files("acme/tiny-full")
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(files)
    assert not any(n.startswith(("checkpoints", "optimizer", "train.log")) for n in files)
    meta, _ = _card(files)
    assert meta["tags"] == ["finetune", "sft", "full", "trl"]


def test_push_from_recipe_uses_hub_section(runs, hub, tmp_path):
    # a copy: the push records pushed.json in its run dir, and the shared run must not change under the other
    # tests (another worker's test checks that a failed push leaves the run's files as they were)
    run = tmp_path / "lora"
    shutil.copytree(runs["lora"], run)
    url = push_from_recipe(run)
    assert (run / "pushed.json").is_file()
    assert "/acme/tiny-from-recipe/commit/" in url
    assert hub.repos["acme/tiny-from-recipe"].private is True
    assert set(hub.files("acme/tiny-from-recipe", "exp-1")) == ALLOWED


def test_not_logged_in(runs, hub, monkeypatch, tmp_path):
    import huggingface_hub.constants as hf_constants

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with pytest.raises(PushError, match="not logged in") as info:
        push(runs["lora"], repo_id="acme/x")
    assert "hf auth login" in info.value.render()
    assert hub.requests == []


def test_bad_repo_id(runs, hub):
    with pytest.raises(PushError, match="not a Hub repo id"):
        push(runs["lora"], repo_id="no-slash")


def test_card_for_hub_base_dpo_qlora(tmp_path):
    recipe = load_recipe(
        {
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
            "method": "dpo",
            "adapter": {"type": "qlora", "r": 16},
            "data": {"path": "trl-lib/ultrafeedback_binarized", "format": "preference"},
            "train": {"epochs": 1},
        }
    )
    meta = card_metadata(recipe, kind="adapter", license="llama3.1")
    assert meta == {
        "base_model": "meta-llama/Llama-3.1-8B-Instruct",
        "library_name": "peft",
        "pipeline_tag": "text-generation",
        "tags": ["finetune", "dpo", "qlora", "trl"],
        "datasets": ["trl-lib/ultrafeedback_binarized"],
        "license": "llama3.1",
    }
    text = render_model_card(recipe, run_dir=tmp_path, repo_id="acme/x", kind="adapter")
    assert parse_front_matter(text)["base_model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert "DPO (beta=0.1, loss sigmoid)" in text and "QLoRA r=16" in text
    assert "https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct" in text
    assert "Loss curve" not in text  # no loss.png in this run dir, so no broken image link
    assert "final train loss" not in text  # no summary/metrics: rows are left out, not faked


def test_license_from_local_base_card(runs, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: apache-2.0\n---\n# base\n")
    recipe = load_recipe(runs["lora"] / "recipe.resolved.yaml", allow_resolved=True)
    assert base_license(recipe, str(base)) == "apache-2.0"
    assert base_license(recipe, str(runs["base"])) is None
    # listed in the model registry (finetune/registry/models/llama-3.1-8b.yaml)
    listed = load_recipe({"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "data": {"path": "x.jsonl"}})
    assert base_license(listed, listed.model.name) == "llama3.1"


def _assert_no_canary(directory, caplog, capsys, extra: str = "") -> None:
    captured = capsys.readouterr()
    logs = caplog.text + "\n".join(r.getMessage() for r in caplog.records)
    assert caplog.records  # logging was on, so this checks real log lines
    for where, text in (("log", logs), ("stdout", captured.out), ("stderr", captured.err), ("error", extra)):
        assert CANARY not in text, where
    for path in directory.rglob("*"):
        if path.is_file():
            assert CANARY.encode() not in path.read_bytes(), path


def test_card_shows_names_not_local_paths_and_evaluations_as_model_index(runs, tmp_path):
    import json

    run = tmp_path / "run"
    shutil.copytree(runs["lora"], run)
    summary = json.loads((run / "summary.json").read_text())
    summary.update(
        task_eval_before={"exact_match": 0.0, "n": 10, "examples": []},
        task_eval_after={"exact_match": 0.8, "n": 10, "examples": []},
        versions={"transformers": "5.24.0", "trl": "1.16.0"},
        lm_eval={
            "version": "0.4.13",
            "num_fewshot": 0,
            "limit": 8,
            "results": {"tiny_words": {"acc,none": {"base": 0.25, "trained": 0.75}}},
        },
    )
    (run / "summary.json").write_text(json.dumps(summary))
    recipe = load_recipe(run / "recipe.resolved.yaml", allow_resolved=True)
    recipe = recipe.model_copy(
        update={
            "data": recipe.data.model_copy(
                update={
                    "task_eval": load_recipe(
                        {
                            "model": {"name": "x/y"},
                            "data": {"path": "a.jsonl", "task_eval": {"path": str(tmp_path / "held.jsonl")}},
                        }
                    ).data.task_eval
                }
            )
        }
    )
    text = render_model_card(recipe, run_dir=run, repo_id="acme/card", kind="adapter")
    assert str(runs["base"]) not in text and str(tmp_path) not in text  # no absolute local path anywhere
    assert "`tiny-llama`" in text and "chat.jsonl (messages)" in text
    from huggingface_hub import ModelCard

    card = ModelCard(text)  # parses as a Hub card, model-index included
    results = {(r.dataset_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert results[("tiny_words", "acc")] == 0.75
    assert results[("held.jsonl", "exact_match")] == 0.8
    assert results[("held-out split of the training data", "loss")] == 6.0
    assert "| tiny_words acc,none (lm-eval) | 0.2500 | 0.7500 |" in text
    assert "| exact match, 10 held-out examples | 0.0% | 80.0% |" in text
    assert "- transformers 5.24.0" in text and "## Framework versions" in text


def test_library_template_cards_are_removed_and_others_kept(tmp_path):
    from huggingface_hub import ModelCard, ModelCardData

    from finetune.modelcard import remove_library_card

    peft_card = ModelCard.from_template(ModelCardData(library_name="peft"))  # what peft writes
    (tmp_path / "README.md").write_text(str(peft_card) + "\n### Framework versions\n\n- PEFT 0.21.2\n")
    assert remove_library_card(tmp_path, made_by="peft") and not (tmp_path / "README.md").exists()
    (tmp_path / "README.md").write_text("# my notes\n")
    assert not remove_library_card(tmp_path, made_by="peft") and not remove_library_card(tmp_path, made_by="trl")
    assert (tmp_path / "README.md").read_text() == "# my notes\n"


def test_push_access_checked_before_training(runs, hub):
    from finetune.errors import RecipeError
    from finetune.hub import check_push_access

    assert check_push_access("acme/new-model") == "tester"  # member of acme, write token, repo not there yet
    assert check_push_access("tester/own") == "tester"
    with pytest.raises(RecipeError, match="not 'other-org' nor a member") as info:
        check_push_access("other-org/x")
    assert info.value.key == "hub.repo" and info.value.exit_code == 2
    with pytest.raises(RecipeError, match="placeholder"):
        check_push_access("my-org/llama-3.1-8b-lora")
    hub.whoami["auth"]["accessToken"]["role"] = "read"
    with pytest.raises(RecipeError, match="read token"):
        check_push_access("acme/new-model")
    hub.whoami["auth"]["accessToken"] = {
        "role": "fineGrained",
        "fineGrained": {
            "scoped": [{"entity": {"type": "org", "name": "acme"}, "permissions": ["repo.content.read", "repo.write"]}]
        },
    }
    assert check_push_access("acme/new-model") == "tester"
    with pytest.raises(RecipeError, match="no repo.write permission on 'tester'"):
        check_push_access("tester/own")
    hub.whoami["auth"]["accessToken"] = {"role": "write"}
    push(runs["lora"], repo_id="acme/public-one", private=False)
    with pytest.raises(RecipeError, match="exists and is public") as info:
        check_push_access("acme/public-one", private=True)
    assert info.value.key == "hub.private"
    assert CANARY not in info.value.render()


def test_push_access_offline_or_logged_out(hub, monkeypatch, tmp_path):
    import huggingface_hub.constants as hf_constants

    from finetune.errors import RecipeError
    from finetune.hub import check_push_access

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RecipeError, match="offline mode"):
        check_push_access("acme/x")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with pytest.raises(RecipeError, match="not logged in"):
        check_push_access("acme/x")
    monkeypatch.setenv("HF_TOKEN", "hf_not_valid_for_the_fake")
    hub.whoami = {}  # an empty answer: no user, so no namespace is writable
    with pytest.raises(RecipeError, match="not 'acme' nor a member"):
        check_push_access("acme/x")


def test_public_recipe_has_no_local_paths(tmp_path):
    from finetune.modelcard import public_recipe

    recipe = load_recipe(
        {
            "model": {"name": str(tmp_path / "base")},
            "data": {
                "path": str(tmp_path / "d" / "train.jsonl"),
                "cache_dir": str(tmp_path / "c"),
                "chat_template": str(tmp_path / "t.jinja"),
                "allow_paths": [str(tmp_path)],
            },
            "output": {"dir": str(tmp_path / "runs" / "r1")},
        }
    )
    public = public_recipe(recipe)
    assert str(tmp_path) not in yaml.safe_dump(public)
    assert public["model"]["name"] == "base" and public["data"]["sources"][0]["path"] == "train.jsonl"
    assert public["data"]["chat_template"] == "t.jinja" and public["output"]["dir"] == "r1"


def test_a_random_init_trial_is_not_published(runs, hub, tmp_path):

    from finetune import rundir

    trial = tmp_path / "trial"
    shutil.copytree(runs["lora"], trial)
    resolved = yaml.safe_load((trial / rundir.RESOLVED_RECIPE).read_text())
    resolved["model"]["init"] = "random"
    resolved["hub"]["repo"] = None  # a random-init recipe may not name one (load_recipe refuses it)
    (trial / rundir.RESOLVED_RECIPE).write_text(yaml.safe_dump(resolved))
    with pytest.raises(PushError, match="a throughput and memory trial: not a model to publish") as info:
        push(trial, repo_id="acme/trial")
    assert "model.init: pretrained" in info.value.render() and "acme/trial" not in hub.repos

"""KTO, ORPO, SimPO, reward modelling and continued pre-training: schema rules, the planner's view,
and each one training the tiny model (planned and compiled for real) with the loss falling."""

from __future__ import annotations

import json
import math

import pytest

from finetune import rundir
from finetune.errors import RecipeError
from finetune.recipe.load import deep_merge, load_recipe
from tests.helpers.paths import ROOT, SAMPLES
from tests.helpers.recipes import tiny_recipe

PREF = {
    "sources": [{"path": str(SAMPLES / "preference.jsonl"), "format": "preference", "max_samples": 64}],
    "eval_sources": [],
}
TEXT = {"sources": [{"path": str(SAMPLES / "text.jsonl"), "format": "text", "max_samples": 64}], "eval_sources": []}


def _recipe(method: dict, data: dict, **extra):
    return load_recipe(tiny_recipe(method=method, data=data, **extra))


@pytest.mark.parametrize("method", ["kto", "orpo", "simpo", "reward", "dpo"])
def test_preference_methods_accept_pairs_and_refuse_chat(method):
    assert _recipe({"type": method}, PREF).method.type == method
    with pytest.raises(RecipeError, match=f"method {method} trains on format"):
        _recipe({"type": method}, {"eval_sources": []})


def test_a_format_the_method_does_not_train_names_the_source_that_has_it():
    """The training data is fine here; the held-out file is pairs: that source is the one to change."""
    pairs = {"path": str(SAMPLES / "preference.jsonl"), "format": "preference"}
    with pytest.raises(RecipeError) as err:
        _recipe("sft", {**TEXT, "eval_sources": [pairs]})
    assert err.value.key == "data.eval_sources[0].format" and "set method" not in str(err.value)
    with pytest.raises(RecipeError) as err:
        _recipe("dpo", TEXT)
    assert err.value.key == "data.sources[0].format" and "data.sources[0].format: preference" in str(err.value)


def test_kto_takes_unpaired_rows_and_others_do_not(tmp_path):
    path = tmp_path / "kto.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "A", "label": True}) + "\n")
    data = {"sources": [{"path": str(path), "format": "unpaired"}], "eval_sources": []}
    assert _recipe("kto", data).data.sources[0].format == "unpaired"
    with pytest.raises(RecipeError, match="method dpo trains on format preference, got unpaired"):
        _recipe("dpo", data)


def test_pretrain_packs_text_by_default_and_refuses_chat():
    recipe = _recipe("pretrain", TEXT)
    assert recipe.data.packing is True
    assert _recipe("pretrain", {**TEXT, "packing": False}).data.packing is False
    with pytest.raises(RecipeError, match="method pretrain trains on format text"):
        _recipe("pretrain", {"eval_sources": []})
    with pytest.raises(RecipeError, match="packing is not supported for method orpo"):
        _recipe("orpo", {**PREF, "packing": True})


@pytest.mark.parametrize(
    "method,seqs,reference",
    [
        ("sft", 1, "none"),
        ("pretrain", 1, "none"),
        ("dpo", 2, "implicit"),
        ("kto", 1, "implicit"),
        ("orpo", 2, "none"),
        ("simpo", 2, "none"),
        ("reward", 2, "none"),
    ],
)
def test_planner_sequences_and_reference(method, seqs, reference):
    from finetune.plan import job_from_recipe
    from finetune.registry import get_model, get_preset

    data = TEXT if method in ("sft", "pretrain") else PREF
    recipe = _recipe({"type": method}, data)
    job = job_from_recipe(recipe, arch=get_model("llama-3.1-8b"), preset=get_preset("server-8xh100"))
    assert (job.sequences_per_sample, job.reference) == (seqs, reference)
    full = _recipe({"type": method}, data, adapter={"type": "full"})
    job = job_from_recipe(full, arch=get_model("llama-3.1-8b"), preset=get_preset("server-8xh100"))
    assert job.reference == ("copy" if reference != "none" else "none")


@pytest.mark.parametrize(
    "reference,reference_passes,forward_only", [("implicit", 2, 3), ("copy", 2, 3), ("precompute", 0, 1)]
)
def test_kto_trains_one_sequence_and_runs_three_forwards_without_gradients(reference, reference_passes, forward_only):
    """TRL 1.16's KTOTrainer: the policy forward and backward on the completion, a no-grad policy forward on the
    mismatched KL completion, and the reference on both (precomputed: neither); its LM head is the fused one."""
    from finetune.plan import job_from_recipe
    from finetune.registry import get_model, get_preset

    recipe = _recipe({"type": "kto", "reference": reference}, PREF)
    job = job_from_recipe(recipe, arch=get_model("llama-3.1-8b"), preset=get_preset("server-8xh100"))
    assert (job.sequences_per_sample, job.reference_passes, job.forward_only_passes) == (
        1,
        reference_passes,
        forward_only,
    )
    assert job.fused_lm_head and job.min_micro_batch == 2
    dpo = job_from_recipe(_recipe("dpo", PREF), arch=get_model("llama-3.1-8b"), preset=get_preset("server-8xh100"))
    assert (dpo.sequences_per_sample, dpo.forward_only_passes, dpo.min_micro_batch) == (2, 1, 1)


def test_kto_micro_batches_of_one_are_refused_before_anything_loads():
    from finetune.plan import plan

    with pytest.raises(RecipeError, match="at least 2") as err:
        _recipe("kto", PREF, train={"micro_batch_size": 1})
    assert err.value.key == "train.micro_batch_size"
    # the recipe cannot know the GPU count: the planner refuses a global batch that leaves a GPU one row a step
    recipe = _recipe(
        "kto",
        PREF,
        train={"global_batch_size": 8, "micro_batch_size": "auto"},
        model={"name": "x", "arch": "llama-3.1-8b"},
    )
    with pytest.raises(RecipeError, match="8 over 8 GPUs gives each 1") as err:
        plan(recipe, hardware="server-8xh100")
    assert err.value.key == "train.global_batch_size" and "16" in err.value.hint
    chosen = plan(
        _recipe(
            "kto",
            PREF,
            train={"global_batch_size": 16, "micro_batch_size": "auto"},
            model={"name": "x", "arch": "llama-3.1-8b"},
        ),
        hardware="server-8xh100",
    )
    assert chosen.micro_batch_size == 2 and all(c.micro_batch_size >= 2 for c in chosen.candidates)
    # a plan that does not fit weighs larger machines, over whose GPUs the same global batch would leave one row
    tight = _recipe(
        "kto",
        PREF,
        train={"global_batch_size": 2, "micro_batch_size": "auto"},
        model={"name": "x", "arch": "llama-3.1-70b"},
        distributed={"strategy": "ddp"},
    )
    refused = plan(tight, hardware="workstation-1x4090")
    assert not refused.fits  # and no crash while weighing the 8-GPU presets


def test_a_reference_copy_costs_memory_for_kto_as_for_dpo():
    from finetune.plan import plan

    sizes = {}
    for method in ("kto", "orpo"):
        recipe = _recipe(
            {"type": method},
            PREF,
            adapter={"type": "full"},
            train={"micro_batch_size": 2, "global_batch_size": 16},
            distributed={"strategy": "zero3"},
            model={"name": "x", "arch": "llama-3.1-8b"},
        )
        sizes[method] = plan(recipe, hardware="server-8xh100").memory.weights
    assert sizes["kto"] == pytest.approx(2 * sizes["orpo"])


CASES = {
    "kto": (
        {"type": "kto", "beta": 0.1},
        {"sources": [{"path": str(SAMPLES / "unpaired.jsonl"), "format": "unpaired"}], "eval_sources": []},
    ),
    "orpo": ({"type": "orpo", "beta": 0.1}, PREF),
    "simpo": ({"type": "simpo", "beta": 2.0, "simpo_gamma": 0.5}, PREF),
    "reward": ({"type": "reward"}, PREF),
    "pretrain": ({"type": "pretrain"}, TEXT),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_method_trains_end_to_end(case, tmp_path):
    """Planned and compiled by the real planner and compiler, trained in this process by the rank entry
    point (the CLI and launcher around it are the same for every method: tests/e2e/test_cli_run.py)."""
    from finetune.train.run import run_rank
    from tests.helpers.recipes import resolve_recipe

    method, data = CASES[case]
    recipe = tiny_recipe(
        **deep_merge(
            {
                "train": {"max_steps": 8, "logging_steps": 1},
                "logging": {"report_to": ["none"]},
                "data": {"allow_paths": [str(ROOT / "data")]},
            },
            {"method": method, "data": data},
        )
    )
    run_dir = tmp_path / "run"
    returned = run_rank(resolve_recipe(recipe, run_dir=run_dir), resume="never")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == json.loads(json.dumps(returned))
    assert summary["method"] == case and summary["steps"] == 8
    # every method counts the tokens it trained (ORPO's and CPO's batches have no input_ids: CountsPairTokens)
    assert summary[rundir.SUMMARY_TOKENS] > 0 and summary[rundir.SUMMARY_TOKENS_PER_S] > 0, summary
    losses = [
        json.loads(line)["loss"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if json.loads(line).get("loss") is not None
    ]
    assert all(math.isfinite(x) for x in losses)
    assert min(losses[-3:]) < losses[0], losses
    assert (run_dir / "adapter_model.safetensors").stat().st_size > 0


def test_streaming_rules():
    stream = {
        "sources": [{"path": str(SAMPLES / "text.jsonl"), "format": "text", "streaming": True}],
        "eval_sources": [],
    }
    assert _recipe("pretrain", stream).data.sources[0].streaming
    with pytest.raises(RecipeError, match="train.max_steps: a streamed corpus has no known length"):
        load_recipe(tiny_recipe(method="pretrain", data=stream, train={"max_steps": None, "epochs": 1}))
    with pytest.raises(RecipeError, match="streaming reads format text"):
        _recipe("dpo", {**PREF, "sources": [{**PREF["sources"][0], "streaming": True}]})


@pytest.mark.slow
def test_pretrain_streams_a_corpus_and_splits_long_documents(tmp_path):
    from finetune.train.run import run_rank
    from tests.helpers.recipes import resolve_recipe

    corpus = tmp_path / "corpus.jsonl"
    words = [json.loads(line)["text"] for line in (SAMPLES / "text.jsonl").read_text().splitlines()]
    # documents far longer than max_length: packed pre-training splits them instead of dropping them
    corpus.write_text(
        "".join(json.dumps({"text": " ".join(words[i : i + 12])}) + "\n" for i in range(0, len(words), 12))
    )
    raw = tiny_recipe(
        method="pretrain",
        data={"sources": [{"path": str(corpus), "format": "text", "streaming": True}], "eval_sources": []},
        train={"max_steps": 6, "logging_steps": 1},
    )
    summary = run_rank(resolve_recipe(raw, run_dir=tmp_path / "run"), resume="never")
    assert summary["steps"] == 6 and summary["final_train_loss"] < summary["first_train_loss"]
    assert summary["tokenized_cache"]["key"] == "streaming"


@pytest.mark.slow
def test_a_stream_shorter_than_one_step_is_read_again_until_max_steps(tmp_path):
    """Three short documents pack into one row, and a step takes 2 x 4 micro-batches: the Trainer, given an iterable
    that ends before a step's micro-batches are drawn, began epoch after epoch without stepping, at full CPU, never
    ending. The stream now repeats; the rank runs in a subprocess so that a hang fails the test instead of the suite."""
    import subprocess
    import sys

    from tests.helpers.processes import env
    from tests.helpers.recipes import resolve_recipe

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i} -> DOC {i}"}) + "\n" for i in range(3)))
    raw = tiny_recipe(
        method="pretrain",
        adapter={"type": "full"},
        data={"sources": [{"path": str(corpus), "format": "text", "streaming": True}], "eval_sources": []},
        train={"max_steps": 2, "global_batch_size": 8, "micro_batch_size": 2},
    )
    resolved = resolve_recipe(raw, run_dir=tmp_path / "run")
    rank = (
        "import sys; from finetune.train.run import run_rank; "
        "print('steps', run_rank(sys.argv[1], resume='never')['steps'])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", rank, str(resolved)], capture_output=True, text=True, env=env(), timeout=240
    )
    assert proc.returncode == 0 and "steps 2" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("case", ["kto", "reward"])
def test_kto_and_reward_batches_are_padded_to_the_planned_multiple(case, tmp_path):
    """resolved.row_multiple (plan.row_multiple: sdpa's padded rows on an NVIDIA GPU) reaches TRL's KTO and reward
    collators, so no batch is 64 mod 128 tokens long, where cuDNN's masked backward gives NaN
    (plan.PADDED_ROW_MULTIPLE); the rows are the ones the run trains, built by the trainer the rank builds."""
    from finetune.plan import PADDED_ROW_MULTIPLE
    from tests.helpers.recipes import tiny_trainer

    method, data = CASES[case]
    raw = tiny_recipe(method=method, data=data, train={"max_steps": 1, "micro_batch_size": 4})
    _, trainer = tiny_trainer(
        raw, run_dir=tmp_path / "run", has_eval=False, resolved={"row_multiple": PADDED_ROW_MULTIPLE}
    )
    batch = next(iter(trainer.get_train_dataloader()))
    lengths = {k: v.shape[-1] for k, v in batch.items() if k.endswith("input_ids")}
    assert lengths and all(n % PADDED_ROW_MULTIPLE == 0 for n in lengths.values()), lengths


def test_orpo_and_simpo_turn_cudnn_attention_off_where_their_rows_are_masked():
    """ORPO's and CPO's collators pad to the batch's longest with no multiple: on an NVIDIA GPU with sdpa the plan
    turns cuDNN's attention off (its masked backward's NaN lengths), says so, and compiles the decision into the
    resolved recipe the ranks read; methods that pad to whole tiles keep it, and so does the CPU."""
    from finetune.plan import cudnn_attention_off, job_from_recipe, plan
    from finetune.registry import get_model, get_preset

    gpu, cpu, arch = get_preset("server-8xh100"), get_preset("cpu"), get_model("llama-3.1-8b")
    for method, off in (("orpo", True), ("simpo", True), ("kto", False), ("reward", False), ("dpo", False)):
        data = CASES["kto"][1] if method == "kto" else PREF
        recipe = _recipe(
            {"type": method},
            {**data, "packing": False},
            model={"name": "x", "arch": "llama-3.1-8b"},
            train={"global_batch_size": 64},
        )
        assert cudnn_attention_off(job_from_recipe(recipe, arch=arch, preset=gpu)) is off, method
        assert not cudnn_attention_off(job_from_recipe(recipe, arch=arch, preset=cpu))
        planned = plan(recipe, hardware="server-8xh100")
        assert planned.cudnn_attention is not off and ("cuDNN's attention off" in planned.kernels) is off
        assert planned.to_json()["cudnn_attention"] is not off


def test_the_resolved_recipe_carries_the_cudnn_decision_to_the_ranks(tmp_path):
    """Compiled for an 8 x H100 server, ORPO's resolved recipe says cuDNN's attention is off, and the rank's setup
    turns torch's cuDNN attention backend off from it (restored after)."""
    import torch

    from finetune.train.run import apply_kernel_switches
    from tests.helpers.recipes import resolve_recipe

    raw = tiny_recipe(method={"type": "orpo", "beta": 0.1}, data={**PREF, "packing": False})
    resolved = load_recipe(resolve_recipe(raw, run_dir=tmp_path, hardware="server-8xh100"), allow_resolved=True)
    assert resolved.resolved.cudnn_attention is False
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        apply_kernel_switches(resolved)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_preference_methods_train_without_the_lora_dropout_their_trainers_turn_off(tmp_path):
    """TRL's DPO/KTO/ORPO/CPO/reward trainers set every nn.Dropout to p = 0 (disable_dropout, which finetune keeps):
    the compile drops adapter.dropout for them, the plan says so and models none, and the trainer the rank builds
    has no dropout module in its adapters (train/fused_lora.py runs a shared-input group only without one); SFT keeps
    its dropout."""
    from torch import nn

    from finetune.plan import job_from_recipe, plan
    from finetune.registry import get_model, get_preset
    from tests.helpers.recipes import tiny_trainer

    gpu, arch = get_preset("server-8xh100"), get_model("llama-3.1-8b")
    for method, kept in (("dpo", False), ("orpo", False), ("reward", False), ("sft", True)):
        data = {} if method == "sft" else {**PREF, "packing": False}
        recipe = _recipe(
            {"type": method},
            data,
            model={"name": "x", "arch": "llama-3.1-8b"},
            adapter={"dropout": 0.05},
            train={"global_batch_size": 64},
        )
        assert job_from_recipe(recipe, arch=arch, preset=gpu).lora_dropout == (0.05 if kept else 0.0), method
        said = [s for s in plan(recipe, hardware="server-8xh100").substitutions if s.startswith("adapter.dropout")]
        assert bool(said) is not kept, said
    raw = tiny_recipe(method={"type": "dpo"}, data={**PREF, "packing": False}, adapter={"dropout": 0.05})
    recipe, trainer = tiny_trainer(raw, run_dir=tmp_path / "run", has_eval=False)
    assert recipe.adapter.dropout == 0.0
    dropouts = [m for name, m in trainer.model.named_modules() if name.endswith("lora_dropout.default")]
    assert dropouts and all(isinstance(m, nn.Identity) for m in dropouts)

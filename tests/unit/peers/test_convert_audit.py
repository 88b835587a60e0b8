"""`finetune convert` on the shapes an audit against public peer configs found mis-converted (tests/data/convert, each
file names the upstream config it is modeled on): message keys and speaker names the data keeps its turns under, the
peers' defaults for SimPO's NLL term and transformers' schedule, batches shared by a model-parallel group, packing
that cuts examples, and fused-kernel switches that change nothing trained."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.data.check import check_data
from finetune.recipe.load import load_recipe
from tests.helpers.convert import CONFIGS
from tests.helpers.convert import convert_config as _convert


def _mapping(tmp_path: Path, source: str, raw: dict, *, method: str | None = None, gpus: int | None = None):
    from finetune.peers import convert_mapping

    return convert_mapping(raw, source=source, config_dir=tmp_path, out_dir=tmp_path, method=method, gpus=gpus)


def _reported(out: Path) -> tuple[set[str], set[str]]:
    """(NOT MAPPED keys, ignored keys) of a written recipe's trailing comments."""
    material, ignored = set(), set()
    for line in out.read_text().splitlines():
        if "   # " in line and line.startswith("# "):
            key = line.split(":")[0].lstrip("# ").strip("'")
            (material if "   # NOT MAPPED" in line else ignored).add(key)
    return material, ignored


def _reads_local_rows(out: Path):
    """The recipe, its local sources' rows read in their mapped formats (Hub ids are skipped)."""
    recipe = load_recipe(out)
    recipe.data.allow_outside = True  # the data lives in the repository, the recipe in tmp
    check_data(recipe)
    return recipe


# -- message keys and speakers: the format that reads them, or reported ---------------------------------------------


def test_axolotl_message_keys_pick_the_format_that_reads_them(tmp_path):
    rc, out = _convert(tmp_path, "axolotl-chat-message-keys.yaml", "axolotl")
    assert rc == 2
    r = _reads_local_rows(out)
    # from/value under field_messages: sharegpt rows in that column; human/gpt are sharegpt's own speakers
    assert (r.data.sources[0].format, r.data.sources[0].columns) == ("sharegpt", {"conversations": "dialog"})
    # role/value (message_field_*) read as sharegpt rows, in axolotl's default `messages` column
    assert (r.data.sources[1].format, r.data.sources[1].columns) == ("sharegpt", {"conversations": "messages"})
    material, _ = _reported(out)
    assert material == {"datasets[2].message_property_mappings"}  # speaker/text keys, a thinking property


@pytest.mark.parametrize(
    ("roles", "reported"),
    [({"user": ["human", "user"], "assistant": ["gpt"]}, False), ({"user": ["Q"], "assistant": ["A"]}, True)],
)
def test_axolotl_roles_map_is_read_as_finetune_reads_the_speakers(tmp_path, roles, reported):
    ds = {
        "path": "org/chat",
        "type": "chat_template",
        "message_property_mappings": {"role": "from", "content": "value"},
    }
    conv = _mapping(tmp_path, "axolotl", {"base_model": "m", "datasets": [ds | {"roles": roles}]})
    assert ("datasets[0].roles" in {d.key for d in conv.material}) is reported


@pytest.mark.parametrize(
    ("keys", "reported"),
    [
        # the legacy key and the mapping agree: read, nothing reported (axolotl merges the two)
        ({"message_field_role": "from", "message_property_mappings": {"role": "from", "content": "value"}}, set()),
        # the unreadable text key came from message_field_content: that key is named
        ({"message_field_content": "text"}, {"datasets[0].message_field_content"}),
        ({"message_property_mappings": {"content": "text"}}, {"datasets[0].message_property_mappings"}),
        ({"message_field_role": "speaker"}, {"datasets[0].message_field_role"}),
    ],
)
def test_axolotl_message_keys_name_the_key_that_set_them(tmp_path, keys, reported):
    ds = {"path": "org/chat", "type": "chat_template"} | keys
    conv = _mapping(tmp_path, "axolotl", {"base_model": "m", "datasets": [ds]})
    assert {d.key for d in conv.material if d.key.startswith("datasets[0].")} == reported


def test_axolotl_sharegpt_rows_with_role_content_keys_stay_in_their_conversations_column(tmp_path):
    ds = {"path": "org/chat", "type": "sharegpt", "message_property_mappings": {"role": "role", "content": "content"}}
    conv = _mapping(tmp_path, "axolotl", {"base_model": "m", "datasets": [ds]})
    source = conv.get("data.sources")[0]
    assert (source["format"], source.get("columns")) == ("messages", {"messages": "conversations"})


def test_axolotl_preference_message_keys_are_checked(tmp_path):
    ds = {"path": "org/pairs", "type": "chat_template.default", "message_property_mappings": {"role": "who"}}
    conv = _mapping(tmp_path, "axolotl", {"base_model": "m", "rl": "dpo", "datasets": [ds]})
    assert "datasets[0].message_property_mappings" in {d.key for d in conv.material}


def test_llamafactory_sharegpt_tags_and_unread_columns(tmp_path):
    rc, out = _convert(tmp_path, "llamafactory-sharegpt-tags.yaml", "llamafactory")
    assert rc == 2
    material, _ = _reported(out)
    # speaker/text keys; Q/A speakers; an alpaca entry's system and history columns
    assert material == {"dataset[1].tags", "dataset[2].tags", "dataset[3].columns"}
    recipe = load_recipe(out)
    recipe.data.sources = recipe.data.sources[:1]
    recipe.data.allow_outside = True
    check_data(recipe)  # role/content tags: messages rows, in LLaMA-Factory's default `conversations` column
    assert (recipe.data.sources[0].format, recipe.data.sources[0].columns) == (
        "messages",
        {"messages": "conversations"},
    )
    assert "LLaMA-Factory packs without neat_packing" in out.read_text()


def test_llamafactory_alpaca_pairs_read_their_prompt_and_pref_ftx_0_adds_nothing(tmp_path):
    rc, out = _convert(tmp_path, "llamafactory-simpo-alpaca-pairs.yaml", "llamafactory")
    assert rc == 0
    r = _reads_local_rows(out)  # the prompt is the instruction column
    assert (r.method.type, r.method.beta, r.method.cpo_alpha) == ("simpo", 2.0, 0.0)
    assert r.data.sources[0].columns == {"prompt": "instruction"}
    assert "pref_ftx" not in out.read_text()
    conv = _mapping(tmp_path, "llamafactory", {"model_name_or_path": "m", "stage": "dpo", "pref_ftx": 0.5})
    assert "pref_ftx" in {d.key for d in conv.material}


@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_llamafactory_alpaca_query_column_is_reported_where_the_data_has_one(tmp_path, stage):
    """LLaMA-Factory appends an alpaca row's query column (`input` by default) to the prompt; finetune's preference and
    KTO rows take the prompt from one column, so a query the local data holds is reported, and none is when the rows
    have no such column."""
    import json

    pairs = {"instruction": "reverse", "input": "abc", "chosen": "cba", "rejected": "abc"}
    unpaired = {"instruction": "reverse", "input": "abc", "output": "cba", "kto_tag": True}
    row = pairs if stage == "dpo" else unpaired
    entry = {"file_name": "rows.jsonl"} | ({"ranking": True} if stage == "dpo" else {"columns": {"kto_tag": "kto_tag"}})
    for with_input in (True, False):
        folder = tmp_path / f"data-{with_input}"
        folder.mkdir()
        (folder / "dataset_info.json").write_text(json.dumps({"rows": entry}))
        data = row if with_input else {k: v for k, v in row.items() if k != "input"}
        (folder / "rows.jsonl").write_text(json.dumps(data) + "\n")
        raw = {"model_name_or_path": "m", "stage": stage, "dataset": "rows", "dataset_dir": str(folder)}
        conv = _mapping(tmp_path, "llamafactory", raw)
        assert ("dataset[0].columns.query" in {d.key for d in conv.material}) is with_input, conv.material


def test_llamafactory_sft_alpaca_says_its_prompt_and_input_are_joined_by_one_newline_there(tmp_path):
    """LLaMA-Factory's alpaca rows become `instruction + "\\n" + input`; finetune's alpaca format puts a blank line
    between them (data/formats.py), so the converted recipe says so where the rows have an input, and only there."""
    import json

    for with_input in (True, False):
        folder = tmp_path / f"sft-{with_input}"
        folder.mkdir()
        (folder / "dataset_info.json").write_text(json.dumps({"rows": {"file_name": "rows.jsonl"}}))
        row = {"instruction": "reverse", "output": "cba"} | ({"input": "abc"} if with_input else {})
        (folder / "rows.jsonl").write_text(json.dumps(row) + "\n")
        raw = {"model_name_or_path": "m", "stage": "sft", "dataset": "rows", "dataset_dir": str(folder)}
        conv = _mapping(tmp_path, "llamafactory", raw)
        assert conv.get("data.sources")[0]["format"] == "alpaca"
        said = [n for n in conv.notes if "one newline" in n]
        assert bool(said) is with_input, conv.notes


def test_trl_model_init_kwargs_are_read_as_the_model_keys_they_duplicate(tmp_path):
    """SFTConfig's model_init_kwargs (from_pretrained's arguments) carry the dtype, attention and remote-code
    switches a TRL config may give nowhere else; placement-only entries are ignored, a top-level key wins, others
    are reported."""
    raw = {
        "model_name_or_path": "m",
        "dataset_name": "rows.jsonl",
        "model_init_kwargs": {
            "torch_dtype": "float32",
            "attn_implementation": "sdpa",
            "trust_remote_code": True,
            "revision": "abc123",
            "device_map": "auto",
            "rope_scaling": {"type": "linear", "factor": 2.0},
        },
    }
    conv = _mapping(tmp_path, "trl", raw, method="sft")
    assert conv.get("model.dtype") == "float32" and conv.get("model.attn_implementation") == "sdpa"
    assert conv.get("model.trust_remote_code") is True and conv.get("model.revision") == "abc123"
    material = {d.key for d in conv.material}
    ignored = {d.key for d in conv.dropped if not d.material}
    assert "model_init_kwargs.rope_scaling" in material and "model_init_kwargs.device_map" in ignored
    both = _mapping(tmp_path, "trl", raw | {"torch_dtype": "bfloat16"}, method="sft")
    assert both.get("model.dtype") == "bfloat16"
    assert "model_init_kwargs.torch_dtype" in {d.key for d in both.material}


def test_trl_activation_offloading_is_reported_like_axolotl_s(tmp_path):
    on = _mapping(tmp_path, "trl", {"model_name_or_path": "m", "activation_offloading": True}, method="sft")
    (dropped,) = [d for d in on.material if d.key == "activation_offloading"]
    assert "activation checkpointing" in dropped.reason
    off = _mapping(tmp_path, "trl", {"model_name_or_path": "m", "activation_offloading": False}, method="sft")
    assert "activation_offloading" not in {d.key for d in off.dropped}


def test_llamafactory_function_tag_is_reported(tmp_path):
    """A sharegpt entry's function_tag names tool-call turns, which finetune's formats do not read."""
    import json

    folder = tmp_path / "tools"
    folder.mkdir()
    tags = {"role_tag": "from", "content_tag": "value", "function_tag": "function_call"}
    entry = {"file_name": "rows.jsonl", "formatting": "sharegpt", "tags": tags}
    (folder / "dataset_info.json").write_text(json.dumps({"rows": entry}))
    (folder / "rows.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    raw = {"model_name_or_path": "m", "stage": "sft", "dataset": "rows", "dataset_dir": str(folder)}
    conv = _mapping(tmp_path, "llamafactory", raw)
    assert "dataset[0].tags.function_tag" in {d.key for d in conv.material}
    del tags["function_tag"]
    (folder / "dataset_info.json").write_text(json.dumps({"rows": entry}))
    conv = _mapping(tmp_path, "llamafactory", raw)
    assert not [d for d in conv.material if "function_tag" in d.key]


# -- the peers' defaults ----------------------------------------------------------------------------------------------


def test_axolotl_simpo_keeps_trl_cpo_alpha_and_reads_the_trl_section_beta(tmp_path):
    rc, out = _convert(tmp_path, "axolotl-simpo-trl-section.yaml", "axolotl")
    assert rc == 0
    r = load_recipe(out)
    # axolotl passes cpo_alpha only when set, so TRL's CPOConfig keeps 1.0; trl.beta is read before rl_beta
    assert (r.method.type, r.method.cpo_alpha, r.method.beta, r.method.simpo_gamma) == ("simpo", 1.0, 2.0, 0.5)
    assert "rl_beta" in _reported(out)[1]
    conv = _mapping(tmp_path, "axolotl", {"base_model": "m", "rl": "simpo", "cpo_alpha": 0.0})
    assert conv.get("method.cpo_alpha") == 0.0
    conv = _mapping(tmp_path, "axolotl", {"base_model": "m", "rl": "dpo", "trl": {"num_generations": 4}})
    assert "trl" in {d.key for d in conv.material}


def test_llamafactory_trains_with_transformers_defaults_where_the_config_is_silent(tmp_path):
    rc, out = _convert(tmp_path, "llamafactory-defaults-left-out.yaml", "llamafactory", "--hardware", "server-8xh100")
    assert rc == 0
    t = load_recipe(out).train
    assert (t.lr, t.epochs, t.scheduler, t.warmup_ratio) == (5e-5, 3.0, "linear", 0.0)
    assert (t.micro_batch_size, t.global_batch_size) == (8, 8 * 2 * 8)  # 8 per GPU x 2 steps x 8 GPUs
    assert "transformers' defaults written out, as the config leaves them to LLaMA-Factory" in out.read_text()


def test_trl_default_batch_counts_the_gpus_it_ran_on(tmp_path):
    rc, out = _convert(tmp_path, "trl-example-config.yaml", "trl", "--method", "sft", "--gpus", "8")
    assert rc == 0
    t = load_recipe(out).train
    assert (t.micro_batch_size, t.global_batch_size) == (8, 64)  # TRL's 8 per GPU x 8 GPUs
    assert "of ONE GPU" not in out.read_text()


def test_trl_reward_score_head_and_default_dropout_pass(tmp_path):
    rc, out = _convert(tmp_path, "trl-reward-seq-cls.yaml", "trl", "--method", "reward")
    assert rc == 0
    r = _reads_local_rows(out)  # validates: the score head is not an adapter.modules_to_save entry
    assert (r.method.type, r.adapter.type, r.adapter.modules_to_save) == ("reward", "lora", None)
    assert "disable_dropout" in _reported(out)[1]
    raw = {"model_name_or_path": "m", "dataset_name": "org/pairs", "disable_dropout": False}
    assert "disable_dropout" in {d.key for d in _mapping(tmp_path, "trl", raw, method="dpo").material}


# -- batches and packing -----------------------------------------------------------------------------------------------


def test_model_parallel_groups_share_one_batch(tmp_path):
    rc, out = _convert(tmp_path, "axolotl-sequence-parallel-batch.yaml", "axolotl", "--gpus", "8")
    assert rc == 2  # sequence parallelism is still reported
    assert load_recipe(out).train.global_batch_size == 1 * 8 * 2  # 8 GPUs in groups of 4: 2 data-parallel ranks
    material, ignored = _reported(out)
    assert material == {"sequence_parallel_degree"} and {"heads_k_stride", "ring_attn_func"} <= ignored
    raw = {"base_model": "m", "micro_batch_size": 2, "gradient_accumulation_steps": 1}
    conv = _mapping(tmp_path, "axolotl", raw | {"tensor_parallel_size": 2, "context_parallel_size": 2}, gpus=8)
    assert conv.get("train.global_batch_size") == 2 * 8 // 4
    assert _mapping(tmp_path, "axolotl", raw | {"expert_parallel_size": 2}, gpus=8).get("train.global_batch_size") == 16
    # without --gpus the batch is one GPU's, and the note says what to multiply it by: the data-parallel ranks
    conv = _mapping(tmp_path, "axolotl", raw | {"tensor_parallel_size": 2, "context_parallel_size": 2})
    assert conv.get("train.global_batch_size") == 2
    assert any("your GPU count / 4" in note for note in conv.notes), conv.notes
    assert not any("ONE GPU" in note for note in conv.notes), conv.notes  # the note it replaces said the GPU count
    # TRL through an accelerate file whose context-parallel groups pair the 2 GPUs
    raw = {"model_name_or_path": "m", "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}
    raw["accelerate_config"] = str(CONFIGS / "accelerate-context-parallel.yaml")
    assert _mapping(tmp_path, "trl", raw, method="sft", gpus=2).get("train.global_batch_size") == 4 * 2


@pytest.mark.parametrize(
    ("strategy", "packing", "material"),
    [("wrapped", True, True), ("bfd", True, None), ("bfd-requeue", True, True)],
)
def test_trl_packing_strategy_other_than_bfd_is_reported(tmp_path, strategy, packing, material):
    raw = {"model_name_or_path": "m", "dataset_name": "org/text", "dataset_text_field": "text"}
    conv = _mapping(tmp_path, "trl", raw | {"packing": packing, "packing_strategy": strategy}, method="sft")
    found = {d.key: d for d in conv.dropped}
    assert (found["packing_strategy"].material if "packing_strategy" in found else None) is material
    if strategy == "bfd-requeue":  # its earlier name: the same reason as bfd_split, the pretrain hint included
        assert "splits examples longer than max_length" in found["packing_strategy"].reason
    rc, out = _convert(tmp_path, "trl-sft-packing-strategy.yaml", "trl", "--method", "sft")
    assert rc == 2 and _reported(out)[0] == {"packing_strategy"}


def test_a_zero_accumulation_gets_no_default_batch(tmp_path):
    raw = {"model_name_or_path": "m", "dataset_name": "org/chat", "gradient_accumulation_steps": 0}
    conv = _mapping(tmp_path, "trl", raw, method="sft")
    assert conv.get("train.global_batch_size") is None
    assert "gradient_accumulation_steps" in {d.key for d in conv.material}


def test_an_invalid_micro_batch_does_not_make_the_accumulation_unknown(tmp_path):
    conv = _mapping(
        tmp_path, "axolotl", {"base_model": "m", "micro_batch_size": "auto", "gradient_accumulation_steps": 4}
    )
    found = {d.key: d for d in conv.dropped}
    assert found["micro_batch_size"].material
    assert not found["gradient_accumulation_steps"].material
    assert "unknown" not in found["gradient_accumulation_steps"].reason


# -- switches of the same math -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "source", "keys"),
    [
        ("axolotl-cce-kernels.yaml", "axolotl", {"cut_cross_entropy", "use_kernels"}),
        (
            "llamafactory-kernels-cce.yaml",
            "llamafactory",
            {"use_cce", "use_kernels", "kernel_name", "use_liger_kernel", "mfu_profile_every", "mfu_warmup_steps"},
        ),
    ],
)
def test_fused_kernel_and_report_switches_are_ignored(tmp_path, name, source, keys):
    rc, out = _convert(tmp_path, name, source)
    assert rc == 0
    material, ignored = _reported(out)
    assert not material and keys <= ignored
    _reads_local_rows(out)


def test_axolotl_alpaca_type_says_its_prompt_layout_differs(tmp_path):
    ds = {"path": "org/alpaca", "type": "alpaca"}
    conv = _mapping(tmp_path, "axolotl", {"base_model": "m", "datasets": [ds]})
    assert any("Below is an instruction" in n for n in conv.notes)

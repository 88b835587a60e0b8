"""`finetune convert` on the shapes a sweep of public peer configs found mis-converted (tests/data/convert, each
file names the upstream example it is trimmed from): evaluation a TRL config leaves to its defaults, axolotl's
fp32 and the peers' fp16 QLoRA, a guessed TRL method, both warmups, owner-less Hub ids, keys that change nothing,
accelerate's mixed precision, LLaMA-Factory predict/eval configs, launch files passed alone, flash attention."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from finetune.recipe.load import load_recipe
from tests.helpers.convert import convert_config as _convert


def _mapping(tmp_path: Path, source: str, raw: dict, method: str | None = None):
    from finetune.peers import convert_mapping

    return convert_mapping(raw, source=source, config_dir=tmp_path, out_dir=tmp_path, method=method)


# -- H2: TRL evaluates on dataset_test_split, "test" by default --------------------------------------------------


def test_trl_evaluates_on_its_default_test_split(tmp_path):
    rc, out = _convert(tmp_path, "trl-eval-default-test-split.yaml", "trl", "--method", "sft")
    assert rc == 0
    r = load_recipe(out)  # load_best_model_at_end needs the eval data, which is there
    assert [(s.path, s.split) for s in r.data.eval_sources] == [("trl-lib/Capybara", "test")]
    assert r.train.eval_steps == 500 and r.train.load_best_model_at_end
    assert "split test, TRL's dataset_test_split default" in out.read_text()


def test_trl_without_evaluation_has_no_eval_source(tmp_path):
    conv = _mapping(tmp_path, "trl", {"model_name_or_path": "m", "dataset_name": "org/chat"}, method="sft")
    assert conv.get("data.eval_sources") is None
    conv = _mapping(
        tmp_path,
        "trl",
        {"model_name_or_path": "m", "dataset_name": "org/chat", "eval_strategy": "epoch", "dataset_test_split": "val"},
        method="sft",
    )
    assert [s["split"] for s in conv.get("data.eval_sources")] == ["val"]
    assert not any("dataset_test_split default" in n for n in conv.notes)
    # trl's scripts hand over an eval dataset only when eval_strategy is not "no" (do_eval alone does not)
    conv = _mapping(tmp_path, "trl", {"model_name_or_path": "m", "dataset_name": "org/chat", "do_eval": True}, "sft")
    assert conv.get("data.eval_sources") is None


# -- H3: axolotl with bf16 and fp16 off trains without autocast ---------------------------------------------------


def test_axolotl_bf16_and_fp16_off_trains_without_mixed_precision(tmp_path):
    rc, out = _convert(tmp_path, "axolotl-fp32-gptq-lora.yaml", "axolotl")
    assert rc == 0
    r = load_recipe(out)
    assert (r.train.precision, r.model.dtype) == ("fp32", "float16")  # float16: true, no autocast
    text = out.read_text()
    assert "torch_dtype" not in text  # a key the file does not have
    assert "axolotl with bf16 and fp16 off loads the weights in float16" in text


@pytest.mark.parametrize(
    ("config", "dtype", "compute"),
    [
        ({"bf16": False, "fp16": False}, "float32", None),
        ({"bf16": "false"}, "float32", None),
        ({"bf16": False, "bfloat16": True}, "bfloat16", None),
        ({"bf16": False, "adapter": "qlora", "load_in_4bit": True}, "float32", "float32"),
    ],
)
def test_axolotl_without_autocast_writes_fp32_and_the_weights_dtype(tmp_path, config, dtype, compute):
    raw = {"base_model": "meta-llama/Llama-3.2-1B", "datasets": [{"path": "org/data", "type": "alpaca"}], **config}
    conv = _mapping(tmp_path, "axolotl", raw)
    assert (conv.get("train.precision"), conv.get("model.dtype")) == ("fp32", dtype)
    assert conv.get("adapter.compute_dtype") == compute  # QLoRA dequantizes to axolotl's torch_dtype
    assert conv.error is None and not conv.material


@pytest.mark.parametrize("config", [{}, {"bf16": "auto"}, {"bf16": True}, {"bf16": False, "fp16": True}])
def test_axolotl_with_autocast_keeps_mixed_precision(tmp_path, config):
    conv = _mapping(tmp_path, "axolotl", {"base_model": "meta-llama/Llama-3.2-1B", **config})
    assert conv.get("train.precision") in (None, "bf16", "fp16")


def test_llamafactory_full_fp32_shares_the_no_mixed_precision_note(tmp_path):
    conv = _mapping(tmp_path, "llamafactory", {"model_name_or_path": "m", "finetuning_type": "full"})
    assert (conv.get("train.precision"), conv.get("model.dtype")) == ("fp32", "float32")
    assert any("so it trains without mixed precision" in n for n in conv.notes), conv.notes


# -- H4: QLoRA trained in fp16 computes (and, in LLaMA-Factory, stores) its 4-bit weights in float16 ----------------


def test_llamafactory_fp16_qlora_computes_and_stores_in_float16(tmp_path):
    rc, out = _convert(tmp_path, "llamafactory-qlora-fp16.yaml", "llamafactory")
    assert rc == 0
    r = load_recipe(out)
    assert (r.adapter.type, r.train.precision, r.model.dtype) == ("qlora", "fp16", "float16")
    assert (r.adapter.compute_dtype, r.adapter.storage_dtype) == ("float16", "float16")
    assert "adapter.compute_dtype float16, adapter.storage_dtype float16" in out.read_text()


def test_axolotl_fp16_qlora_computes_in_float16_and_stores_in_bfloat16(tmp_path):
    raw = {"base_model": "meta-llama/Llama-3.2-1B", "adapter": "qlora", "load_in_4bit": True, "fp16": True}
    conv = _mapping(tmp_path, "axolotl", raw | {"bf16": False})
    assert (conv.get("train.precision"), conv.get("model.dtype")) == ("fp16", "float16")
    # axolotl: bnb_4bit_compute_dtype = torch_dtype, bnb_4bit_quant_storage = bfloat16 whatever it computes in
    assert (conv.get("adapter.compute_dtype"), conv.get("adapter.storage_dtype")) == ("float16", None)
    assert not conv.material


# -- H5: a TRL method guessed from keys several trainers share is reported ----------------------------------------


def test_trl_orpo_config_without_method_is_not_silently_dpo(tmp_path, capsys):
    rc, out = _convert(tmp_path, "trl-orpo-handbook.yaml", "trl")
    assert rc == 2
    captured = capsys.readouterr()
    assert "NOT MAPPED: method: the trl subcommand is not in the file (beta fit dpo, orpo, cpo and kto alike)" in (
        captured.out
    )
    assert "pass --method" in captured.out and "settle them by hand" in captured.err
    assert load_recipe(out).method.type == "dpo"  # written whole, the guess commented
    rc, out = _convert(tmp_path, "trl-orpo-handbook.yaml", "trl", "--method", "orpo")
    assert rc == 0 and load_recipe(out).method.type == "orpo"


# -- M1(b): warmup_steps and warmup_ratio both set -----------------------------------------------------------------


def test_trl_warmup_steps_override_the_ratio(tmp_path):
    rc, out = _convert(tmp_path, "trl-orpo-warmup-steps-and-ratio.yaml", "trl", "--method", "orpo")
    assert rc == 0
    train = yaml.safe_load(out.read_text())["train"]
    assert (train.get("warmup_steps"), train.get("warmup_ratio")) == (100, None)
    assert load_recipe(out).train.warmup_steps == 100
    assert "warmup_ratio 0.1 is overridden" in out.read_text()


@pytest.mark.parametrize(("steps", "want"), [(20, (20, None)), (0, (None, 0.1))])
def test_llamafactory_warmup_follows_transformers(tmp_path, steps, want):
    raw = {"model_name_or_path": "m", "warmup_steps": steps, "warmup_ratio": 0.1}
    conv = _mapping(tmp_path, "llamafactory", raw)
    assert (conv.get("train.warmup_steps"), conv.get("train.warmup_ratio")) == want
    assert "warmup" not in (conv.error or "") and not conv.dropped


# -- M2: Hub ids without their owner ---------------------------------------------------------------------------------


def test_an_owner_less_hub_dataset_is_reported_not_read_as_a_missing_file(tmp_path):
    rc, out = _convert(tmp_path, "axolotl-pretrain-c4.yaml", "axolotl")
    assert rc == 2
    text = out.read_text()
    assert "# 'data.sources[0].path': c4   # NOT MAPPED:" in text and "c4 -> allenai/c4" in text
    assert load_recipe(out).data.sources[0].subset == "en"  # the rest of the source is kept


def test_an_owner_less_name_that_is_a_local_folder_is_not_reported(tmp_path):
    (tmp_path / "c4").mkdir()
    raw = {"base_model": "meta-llama/Llama-3.2-1B", "pretraining_dataset": {"path": "c4"}, "max_steps": 10}
    conv = _mapping(tmp_path, "axolotl", raw)
    assert not conv.material


def test_an_owner_less_hub_model_gets_a_note(tmp_path):
    rc, out = _convert(tmp_path, "trl-gpt2-cpt.yaml", "trl", "--method", "sft")
    assert rc == 0
    assert load_recipe(out).model.name == "gpt2"
    assert "model.name gpt2: no such folder next to the config" in out.read_text()


# -- M3: keys that change nothing get one verdict from every converter ------------------------------------------------


@pytest.mark.parametrize(
    ("name", "source", "keys"),
    [
        (
            "axolotl-mistral-qlora-harmless.yaml",
            "axolotl",
            [
                "is_mistral_derived_model",
                "eval_table_max_new_tokens",
                "flash_attn_fuse_mlp",
                "dataloader_pin_memory",
                "dataloader_prefetch_factor",
            ],
        ),
        (
            "llamafactory-harmless-keys.yaml",
            "llamafactory",
            ["logging_strategy", "hub_strategy", "dataloader_persistent_workers"],  # pin_memory: false, silent
        ),
    ],
)
def test_keys_that_change_nothing_are_ignored_and_exit_zero(tmp_path, name, source, keys):
    from finetune.peers.common import NO_TRAINING_EFFECT

    rc, out = _convert(tmp_path, name, source)
    assert rc == 0
    text = out.read_text()
    for key in keys:
        assert f"   # ignored: {NO_TRAINING_EFFECT[key]}" in next(
            line for line in text.splitlines() if line.startswith(f"# {key}:")
        )


@pytest.mark.parametrize(
    "key",
    [
        "logging_strategy",
        "hub_strategy",
        "dataloader_num_workers",
        "dataloader_pin_memory",
        "dataloader_prefetch_factor",
        "dataloader_persistent_workers",
        "is_llama_derived_model",
        "is_mistral_derived_model",
        "eval_max_new_tokens",
        "eval_table_max_new_tokens",
        "flash_attn_rms_norm",
        "flash_attn_fuse_qkv",
        "include_mfu",
        "hf_use_auth_token",
    ],
)
def test_a_key_that_changes_nothing_gets_the_same_verdict_from_every_converter(tmp_path, key):
    verdicts = set()
    for source in ("axolotl", "llamafactory", "trl"):
        conv = _mapping(tmp_path, source, {"model_name_or_path": "m", "base_model": "m", key: 2}, method="sft")
        (dropped,) = [d for d in conv.dropped if d.key == key]
        verdicts.add((dropped.material, dropped.reason))
    assert len(verdicts) == 1 and not verdicts.pop()[0]


@pytest.mark.parametrize("source", ["axolotl", "llamafactory", "trl"])
@pytest.mark.parametrize(("packing", "material"), [(False, True), (True, False)])
def test_group_by_length_is_reported_unless_packing_builds_the_batches(tmp_path, source, packing, material):
    raw = {"model_name_or_path": "m", "base_model": "m", "group_by_length": True}
    raw["sample_packing" if source == "axolotl" else "packing"] = packing
    conv = _mapping(tmp_path, source, raw, method="sft")
    (dropped,) = [d for d in conv.dropped if d.key == "group_by_length"]
    assert dropped.material is material


# -- L3: axolotl's qwen_25 template ------------------------------------------------------------------------------


def test_axolotl_qwen_25_is_the_shipped_qwen2_5_template(tmp_path):
    conv = _mapping(tmp_path, "axolotl", {"base_model": "Qwen/Qwen2.5-0.5B", "chat_template": "qwen_25"})
    assert conv.get("data.chat_template") == "qwen2.5" and not conv.dropped


# -- L4: an accelerate file's mixed precision --------------------------------------------------------------------


def test_an_accelerate_fp8_file_under_trl_s_bf16_is_reported_as_overridden(tmp_path):
    rc, out = _convert(tmp_path, "trl-with-accelerate-fp8.yaml", "trl", "--method", "sft")
    assert rc == 0
    text = out.read_text()
    assert "# accelerate_config.mixed_precision: fp8   # ignored: the training config's bf16" in text
    assert "accelerate_config.fp8_config" in text
    assert load_recipe(out).train.precision == "bf16"


@pytest.mark.parametrize(
    ("mode", "precision", "material"),
    [("fp8", None, True), ("fp16", "fp16", False), ("no", "fp32", False), ("bf16", "bf16", False)],
)
def test_an_accelerate_file_decides_the_precision_when_the_config_turns_bf16_off(tmp_path, mode, precision, material):
    (tmp_path / "acc.yaml").write_text(
        yaml.safe_dump({"distributed_type": "MULTI_GPU", "mixed_precision": mode, "downcast_bf16": "no"})
    )
    raw = {"model_name_or_path": "m", "dataset_name": "org/d", "bf16": False, "accelerate_config": "acc.yaml"}
    conv = _mapping(tmp_path, "trl", raw, method="sft")
    assert conv.get("train.precision") == precision
    assert [d.key for d in conv.material] == (["accelerate_config.mixed_precision"] if material else [])
    assert conv.error is None


def test_an_accelerate_file_s_downcast_bf16_is_reported(tmp_path):
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump({"distributed_type": "FSDP", "downcast_bf16": "yes"}))
    conv = _mapping(tmp_path, "trl", {"model_name_or_path": "m", "accelerate_config": "acc.yaml"}, method="sft")
    (dropped,) = [d for d in conv.dropped if d.key == "accelerate_config.downcast_bf16"]
    assert not dropped.material and "TPU" in dropped.reason


# -- L1: LLaMA-Factory predict / eval configs are refused with the finetune command -----------------------------------


@pytest.mark.parametrize(
    ("name", "command"),
    [
        (
            "llamafactory-lora-predict.yaml",
            "finetune generate saves/llama3-8b/lora/sft --file PROMPTS.jsonl -o "
            "saves/llama3-8b/lora/predict/generated_predictions.jsonl",
        ),
        ("llamafactory-lora-eval.yaml", "finetune eval saves/llama3-8b/lora/sft --tasks mmlu --num-fewshot 5"),
    ],
)
def test_llamafactory_predict_and_eval_configs_are_refused_with_the_finetune_command(tmp_path, capsys, name, command):
    rc, out = _convert(tmp_path, name, "llamafactory")
    assert rc == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "there is nothing to train" in err and command in err and "Traceback" not in err


@pytest.mark.parametrize("config", [{"do_train": False}, {"do_eval": True}])
def test_llamafactory_config_that_does_not_train_is_refused(tmp_path, config):
    from finetune.errors import RecipeError

    with pytest.raises(RecipeError, match="nothing to train"):
        _mapping(tmp_path, "llamafactory", {"model_name_or_path": "m", "dataset": "d", **config})


def test_llamafactory_training_config_that_also_predicts_converts(tmp_path):
    raw = {"model_name_or_path": "m", "do_train": True, "do_predict": True, "predict_with_generate": True}
    conv = _mapping(tmp_path, "llamafactory", raw)
    assert not conv.material


# -- L2: a launch file passed in place of the training config -------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "source", "said", "fix"),
    [
        ("accelerate-fsdp.yaml", "trl", "this is an accelerate config", "accelerate_config: FILE"),
        ("accelerate-fsdp.yaml", "axolotl", "this is an accelerate config", "distributed.strategy"),
        ("ds_zero2.json", "llamafactory", "this is a DeepSpeed config", "deepspeed: FILE"),
    ],
)
def test_a_launch_file_passed_alone_is_refused(tmp_path, capsys, name, source, said, fix):
    rc, out = _convert(tmp_path, name, source)
    assert rc == 2 and not out.exists()
    err = capsys.readouterr().err
    assert said in err and fix in err and "Traceback" not in err


# -- L6: flash attention is finetune's default, not a pinned flash-attn package ------------------------------------


@pytest.mark.parametrize(
    ("source", "key", "value"),
    [
        ("trl", "attn_implementation", "flash_attention_2"),
        ("trl", "use_flash_attention_2", True),
        ("axolotl", "attn_implementation", "flash_attention_2"),
        ("axolotl", "attention", "flash"),
        ("axolotl", "flash_attention", True),
        ("llamafactory", "flash_attn", "fa2"),
        ("llamafactory", "attn", "fa2"),
    ],
)
def test_a_flash_attention_request_keeps_the_default_with_how_to_pin_it(tmp_path, source, key, value):
    from finetune.peers.common import FLASH_REASON

    conv = _mapping(tmp_path, source, {"model_name_or_path": "m", "base_model": "m", key: value}, method="sft")
    assert conv.get("model.attn_implementation") is None  # auto
    (dropped,) = [d for d in conv.dropped if d.key == key]
    assert dropped.reason == FLASH_REASON and not dropped.material
    assert "flash_attention_2" in FLASH_REASON and "flash-attn" in FLASH_REASON


# -- the batch: peers count it per GPU ---------------------------------------------------------------------------


def test_gpus_makes_the_global_batch_the_peers_over_that_many_gpus(tmp_path):
    """axolotl's micro_batch_size 2 x gradient_accumulation_steps 4 on 8 GPUs is a batch of 64 sequences a step."""
    rc, out = _convert(tmp_path, "axolotl-lora-chat.yaml", "axolotl", "--gpus", "8")
    assert rc == 0
    r = load_recipe(out)
    assert (r.train.micro_batch_size, r.train.global_batch_size) == (2, 64)
    assert "x 8 GPUs (--gpus)" in out.read_text()
    rc, out = _convert(tmp_path, "axolotl-lora-chat.yaml", "axolotl")
    assert load_recipe(out).train.global_batch_size == 8 and "convert --gpus N or --hardware PRESET does" in (
        out.read_text()
    )
    assert _convert(tmp_path, "axolotl-lora-chat.yaml", "axolotl", "--gpus", "0")[0] == 2


def test_hardware_gives_the_gpu_count_and_the_recipes_hardware(tmp_path):
    """--hardware PRESET: the preset's GPU count multiplies the per-GPU batch, the recipe plans on that preset, and a
    --gpus that says otherwise is refused; a preset file is written relative to the recipe."""
    rc, out = _convert(tmp_path, "axolotl-lora-chat.yaml", "axolotl", "--hardware", "workstation-4x4090")
    assert rc == 0
    r = load_recipe(out)
    assert (r.train.global_batch_size, r.hardware) == (32, "workstation-4x4090")
    assert "x 4 GPUs (--hardware workstation-4x4090)" in out.read_text()
    assert (
        _convert(tmp_path, "axolotl-lora-chat.yaml", "axolotl", "--hardware", "workstation-4x4090", "--gpus", "2")[0]
        == 2
    )
    preset = tmp_path / "mine.yaml"
    from finetune.registry import get_preset

    preset.write_text(yaml.safe_dump(get_preset("workstation-2x4090").model_dump(mode="json")))
    rc, out = _convert(tmp_path, "axolotl-lora-chat.yaml", "axolotl", "--hardware", str(preset))
    assert rc == 0 and load_recipe(out).hardware == "../mine.yaml"
    assert load_recipe(out).train.global_batch_size == 16


def test_llamafactory_remote_dataset_dir_says_how_to_fetch_it(tmp_path):
    """LLaMA-Factory's `dataset_dir: REMOTE:owner/repo` reads dataset_info.json from a Hub dataset: reported with the
    download, not searched for as a local folder named REMOTE:..."""
    raw = {
        "model_name_or_path": "meta-llama/Meta-Llama-3-8B-Instruct",
        "stage": "sft",
        "finetuning_type": "lora",
        "dataset": "identity",
        "dataset_dir": "REMOTE:llamafactory/demo_data",
        "template": "llama3",
    }
    conv = _mapping(tmp_path, "llamafactory", raw)
    reasons = [d.reason for d in conv.dropped if d.key.startswith("dataset")]
    assert reasons and "hf download llamafactory/demo_data --repo-type dataset" in reasons[0]
    assert "no dataset_info.json in" not in reasons[0]


def test_llamafactory_interleaved_datasets_are_reported(tmp_path):
    """mix_strategy interleave_over repeats the shorter datasets until the longest is used up: not what finetune's
    joined sources train on, so it is reported; concat, LLaMA-Factory's default, is what they do."""
    raw = {"model_name_or_path": "meta-llama/Llama-3.1-8B", "stage": "sft", "finetuning_type": "lora"}
    over = _mapping(tmp_path, "llamafactory", {**raw, "mix_strategy": "interleave_over", "interleave_probs": "0.5,0.5"})
    assert [d.key for d in over.dropped if d.material] == ["mix_strategy"]
    concat = _mapping(tmp_path, "llamafactory", {**raw, "mix_strategy": "concat"})
    assert not [d for d in concat.dropped if d.key == "mix_strategy"]


def test_the_branch_a_handbook_config_pushes_to_is_hub_revision(tmp_path):
    raw = {
        "model_name_or_path": "meta-llama/Llama-3.1-8B",
        "dataset_name": "trl-lib/Capybara",
        "hub_model_id": "me/llama-sft",
        "push_to_hub": True,
        "hub_model_revision": "v1.0",
        "push_to_hub_revision": True,
    }
    conv = _mapping(tmp_path, "trl", raw, method="sft")
    assert conv.recipe["hub"] == {"repo": "me/llama-sft", "revision": "v1.0"}
    quiet = _mapping(tmp_path, "trl", {**raw, "push_to_hub": False}, method="sft")
    assert "revision" not in quiet.recipe.get("hub", {})
    assert not [d for d in quiet.dropped if "revision" in d.key]  # read, and moot without a push

"""`finetune convert --from axolotl|llamafactory|trl`: configs written in each peer's documented format
(tests/data/convert, written for these tests) become recipes that validate and read their data; what
cannot be mapped is a comment with its reason, and a material drop exits non-zero."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from finetune.cli import main
from finetune.errors import RecipeError
from finetune.recipe.load import load_recipe
from tests.helpers.convert import CONFIGS
from tests.helpers.convert import convert_config as _convert


def _recipe_and_data(out: Path):
    from finetune.data.check import check_data

    recipe = load_recipe(out)
    recipe.data.allow_outside = True  # the samples live in the repository, the recipe in tmp
    check_data(recipe)  # every local data row converts in the mapped format
    return recipe


def test_axolotl_qlora_sft(tmp_path):
    rc, out = _convert(tmp_path, "axolotl-qlora.yaml", "axolotl")
    assert rc == 0
    r = _recipe_and_data(out)
    assert (r.model.name, r.adapter.type, r.adapter.r, r.adapter.alpha) == (
        "NousResearch/Meta-Llama-3.1-8B",
        "qlora",
        32,
        16,
    )
    assert r.adapter.target_modules == "all-linear" and r.data.packing and r.data.max_length == 4096
    assert [s.format for s in r.data.sources] == ["sharegpt", "alpaca"]
    assert (r.train.optimizer, r.train.warmup_steps, r.train.evals_per_epoch, r.output.saves_per_epoch) == (
        "paged_adamw_8bit",
        10,
        4,
        1,
    )
    assert r.train.global_batch_size == 8 and r.data.assistant_only_loss and r.data.chat_template == "llama3"
    # read from the DeepSpeed file it names (ZeRO-3, parameters and optimizer offloaded): QLoRA's 4-bit weights
    # stay on the GPUs, which the planner would refuse otherwise; the optimizer is still offloaded
    assert r.distributed.strategy == "zero3-optim-offload"
    assert "parameter offload is not carried over under QLoRA" in out.read_text()
    assert r.tokenizer.pad_token == "<|end_of_text|>"
    text = out.read_text()
    assert "# flash_attention: true   # ignored:" in text


def test_axolotl_material_drops_exit_non_zero_and_are_commented(tmp_path, capsys):
    rc, out = _convert(tmp_path, "axolotl-dpo-dropped.yaml", "axolotl")
    assert rc == 2
    text = out.read_text()
    assert "# optimizer: lion_8bit   # NOT MAPPED:" in text and "# unfrozen_parameters:" in text
    assert "settle them by hand" in capsys.readouterr().err
    r = _recipe_and_data(out)  # what was mapped still validates
    assert r.method.type == "dpo" and r.adapter.target_modules == ["q_proj", "v_proj"]
    assert r.train.max_steps == 100 and r.train.epochs is None
    assert r.data.sources[0].format == "preference"


def test_llamafactory_dpo_with_dataset_info(tmp_path):
    rc, out = _convert(tmp_path, "llamafactory-dpo.yaml", "llamafactory")
    assert rc == 0
    r = _recipe_and_data(out)
    assert (r.method.type, r.method.beta, r.adapter.type, r.adapter.r) == ("dpo", 0.1, "lora", 8)
    assert r.adapter.target_modules == "all-linear" and r.data.sources[0].format == "preference"
    assert r.data.sources[0].max_samples == 1000 and r.data.eval_fraction == 0.1
    assert (r.train.lr, r.train.epochs, r.output.save_every, r.output.dir) == (
        5e-6,
        3.0,
        500,
        "saves/llama3-8b/lora/dpo",
    )
    assert "dataset_dir" not in out.read_text()


def test_llamafactory_unsupported_stage_is_material(tmp_path):
    rc, out = _convert(tmp_path, "llamafactory-ppo.yaml", "llamafactory")
    assert rc == 2
    text = out.read_text()
    assert "# stage: ppo   # NOT MAPPED" in text and "# finetuning_type: freeze   # NOT MAPPED" in text


def test_llamafactory_unsupported_adapter_type_does_not_validate_as_lora(tmp_path):
    """finetuning_type oft (or freeze) has no finetune adapter: the recipe keeps adapter.type oft, so it fails
    validation on that key instead of training LoRA in its place; its own oft_* keys are listed with it."""
    rc, out = _convert(tmp_path, "llamafactory-oft.yaml", "llamafactory")
    assert rc == 2
    text = out.read_text()
    assert "# finetuning_type: oft   # NOT MAPPED: finetuning_type 'oft' is not offered" in text
    assert "# oft_target: all   # ignored: belongs to finetuning_type oft" in text
    assert "this recipe does not validate yet:" in text and "adapter.type" in text
    with pytest.raises(RecipeError, match="adapter.type"):
        load_recipe(out)


def test_llamafactory_export_config_is_refused_with_finetune_merge(tmp_path, capsys):
    rc, out = _convert(tmp_path, "llamafactory-merge-export.yaml", "llamafactory")
    assert rc == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "export (merge) config" in err
    assert "finetune merge saves/qwen3-4b/lora/sft -o saves/qwen3_sft_merged" in err


def test_llamafactory_lora_defaults_are_written_with_a_note(tmp_path):
    from finetune.peers import convert_mapping

    raw = {"model_name_or_path": "Qwen/Qwen3-8B", "finetuning_type": "lora", "lora_rank": 4}
    conv = convert_mapping(raw, source="llamafactory", config_dir=tmp_path, out_dir=tmp_path)
    assert (conv.get("adapter.r"), conv.get("adapter.alpha"), conv.get("adapter.target_modules")) == (
        4,
        8,
        "all-linear",
    )
    assert any("lora_alpha 8 (2 x lora_rank)" in n and "lora_target all" in n for n in conv.notes), conv.notes
    raw |= {"lora_alpha": 64, "lora_target": "q_proj,v_proj"}
    conv = convert_mapping(raw, source="llamafactory", config_dir=tmp_path, out_dir=tmp_path)
    assert (conv.get("adapter.alpha"), conv.get("adapter.target_modules")) == (64, ["q_proj", "v_proj"])
    assert not any(n.startswith("LLaMA-Factory's defaults written out") for n in conv.notes)


@pytest.mark.parametrize(("stage", "material"), [("sft", True), ("pt", False)])
def test_llamafactory_empty_template_is_reported_except_for_raw_text(tmp_path, stage, material):
    from finetune.peers import convert_mapping

    raw = {"model_name_or_path": "Qwen/Qwen3-8B", "stage": stage, "template": "empty"}
    conv = convert_mapping(raw, source="llamafactory", config_dir=tmp_path, out_dir=tmp_path)
    (dropped,) = [d for d in conv.dropped if d.key == "template"]
    assert dropped.material is material and conv.get("data.chat_template") is None
    assert ("no role markers" in dropped.reason) is material


def test_llamafactory_dataset_not_found_names_the_folder(tmp_path):
    from finetune.peers import convert_mapping

    raw = {"model_name_or_path": "Qwen/Qwen3-8B", "dataset": "identity", "dataset_dir": "lf-data"}
    conv = convert_mapping(raw, source="llamafactory", config_dir=tmp_path, out_dir=tmp_path)
    (dropped,) = [d for d in conv.material if d.key == "dataset[0]"]
    assert f"no dataset_info.json in {tmp_path / 'lf-data'}" in dropped.reason and "dataset_dir" in dropped.reason
    (tmp_path / "lf-data").mkdir()
    (tmp_path / "lf-data" / "dataset_info.json").write_text("{}")
    conv = convert_mapping(raw, source="llamafactory", config_dir=tmp_path, out_dir=tmp_path)
    (dropped,) = [d for d in conv.material if d.key == "dataset[0]"]
    assert f"not an entry of {tmp_path / 'lf-data' / 'dataset_info.json'}" in dropped.reason


def test_handbook_mixture_test_splits_train_and_a_share_is_held_out(tmp_path):
    """The handbook's get_dataset concatenates every listed split (test_* too) into the training rows and then holds
    out test_split_size of them: a share is data.eval_fraction, with the test split among the sources."""
    from finetune.peers import convert_mapping

    raw = {
        "model_name_or_path": "Qwen/Qwen3-8B",
        "eval_strategy": "steps",
        "dataset_mixture": {
            "datasets": [
                {"id": "org/prefs", "split": "train_prefs", "columns": ["chosen", "rejected"]},
                {"id": "org/prefs", "split": "test_prefs", "columns": ["chosen", "rejected"]},
            ],
            "test_split_size": 0.05,
        },
    }
    conv = convert_mapping(raw, source="trl", method="dpo", config_dir=tmp_path, out_dir=tmp_path)
    assert [s["split"] for s in conv.get("data.sources")] == ["train_prefs", "test_prefs"]
    assert conv.get("data.eval_fraction") == 0.05 and conv.get("data.eval_sources") is None
    assert not conv.dropped and conv.error is None


def test_trl_top_level_datasets_all_train(tmp_path):
    """TRL's own DatasetMixtureConfig (datasets + test_split_size at the top level) has no weights and trains on
    every listed split."""
    from finetune.peers import convert_mapping

    raw = {
        "model_name_or_path": "Qwen/Qwen3-8B",
        "datasets": [{"path": "org/chat", "split": "train"}, {"path": "org/chat", "split": "test"}],
        "test_split_size": 0.1,
        "eval_strategy": "epoch",
    }
    conv = convert_mapping(raw, source="trl", method="sft", config_dir=tmp_path, out_dir=tmp_path)
    assert [s["split"] for s in conv.get("data.sources")] == ["train", "test"]
    assert conv.get("data.eval_fraction") == 0.1


@pytest.mark.parametrize(
    ("weight", "split", "reported"),
    [(0.25, "train[:25%]", False), (0.025, "train", True), (1.5, "train", True), (1.0, "train", False)],
)
def test_handbook_mixture_weight_keeps_a_share_of_the_rows(tmp_path, weight, split, reported):
    from finetune.peers import convert_mapping

    raw = {
        "model_name_or_path": "Qwen/Qwen3-8B",
        "dataset_mixture": {"datasets": [{"id": "org/chat", "split": "train", "weight": weight}]},
    }
    conv = convert_mapping(raw, source="trl", method="sft", config_dir=tmp_path, out_dir=tmp_path)
    (src,) = conv.get("data.sources")
    assert src["split"] == split and "weight" not in src
    assert ("dataset_mixture.datasets[0].weight" in {d.key for d in conv.material}) is reported


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ("sft", {"train.lr": 2e-5, "train.epochs": 3.0, "data.max_length": 1024}),
        ("dpo", {"train.lr": 1e-6, "train.scheduler": "linear", "train.warmup_ratio": 0.0}),
        ("reward", {"train.lr": 1e-4, "train.micro_batch_size": 8, "train.global_batch_size": 16}),
        ("cpo", {"train.lr": 1e-6, "method.type": "simpo", "method.cpo_alpha": 1.0}),
    ],
)
def test_trl_defaults_the_config_leaves_out_are_written(tmp_path, method, expected):
    from finetune.peers import convert_mapping

    raw = {"model_name_or_path": "Qwen/Qwen3-8B", "dataset_name": "org/data", "gradient_accumulation_steps": 2}
    if method == "cpo":
        raw["loss_type"] = "simpo"
    conv = convert_mapping(raw, source="trl", method=method, config_dir=tmp_path, out_dir=tmp_path)
    for key, want in expected.items():
        assert conv.get(key) == want, key
    assert any(n.startswith("TRL's defaults written out") for n in conv.notes)


def test_trl_defaults_are_not_written_over_the_config(tmp_path):
    from finetune.peers import convert_mapping

    raw = {
        "model_name_or_path": "Qwen/Qwen3-8B",
        "dataset_name": "org/data",
        "learning_rate": 3e-5,
        "max_steps": 100,
        "max_seq_length": 4096,
        "per_device_train_batch_size": 2,
        "warmup_steps": 10,
        "lr_scheduler_type": "cosine",
    }
    conv = convert_mapping(raw, source="trl", method="sft", config_dir=tmp_path, out_dir=tmp_path)
    assert (conv.get("train.lr"), conv.get("train.max_steps"), conv.get("train.epochs")) == (3e-5, 100, None)
    assert (conv.get("data.max_length"), conv.get("train.micro_batch_size")) == (4096, 2)
    assert (conv.get("train.warmup_steps"), conv.get("train.warmup_ratio")) == (10, None)
    assert not any(n.startswith("TRL's defaults written out") for n in conv.notes)


def test_axolotl_unsupported_adapter_is_kept_so_the_recipe_does_not_validate(tmp_path):
    rc, out = _convert(tmp_path, "axolotl-ia3.yaml", "axolotl")
    assert rc == 2
    text = out.read_text()
    assert "# adapter: ia3   # NOT MAPPED: adapter 'ia3' is not offered" in text
    assert "# peft_target_modules: [k_proj, v_proj, down_proj]   # ignored: belongs to adapter ia3" in text
    assert text.count("# eval_steps: 0.05") == 1  # read once, for eval_strategy and evaluation_strategy
    assert "load_in_4bit" not in text  # false asks for nothing
    # bos/eos are mapped; only the unk_token is reported
    assert "# special_tokens: {unk_token: <unk>}   # NOT MAPPED" in text
    assert "bos_token: <s>" in text and "eos_token: </s>" in text
    with pytest.raises(RecipeError, match="adapter.type"):
        load_recipe(out)


def test_axolotl_data_files_without_a_path_is_noted_when_not_a_file(tmp_path):
    rc, out = _convert(tmp_path, "axolotl-qlora-dpo-llama3.yaml", "axolotl")
    assert rc == 0
    text = out.read_text()
    assert "data_files 'mlabonne/orpo-dpo-mix-40k' without a path is not a file here" in text
    assert "llama3.argilla_chat renders its rows as llama3" in text


@pytest.mark.parametrize(
    ("config", "key", "want"),
    [
        ({"bfloat16": True}, "model.dtype", "bfloat16"),
        ({"float16": True, "fp16": True}, "model.dtype", "float16"),
        ({"flex_attention": True}, "model.attn_implementation", "flex_attention"),
        ({"center_rewards_coefficient": 0.05, "reward_model": True}, "method.center_rewards_coefficient", 0.05),
        ({"cosine_min_lr_ratio": 0.2}, "train.min_lr_ratio", 0.2),
        ({"cosine_min_lr_ratio": 1.0}, "train.scheduler", "constant_with_warmup"),
        ({"cosine_min_lr_ratio": 0.2, "lr_scheduler": "constant"}, "train.scheduler", "constant"),
    ],
)
def test_axolotl_keys_map_and_are_not_reported(tmp_path, config, key, want):
    from finetune.peers import convert_mapping

    raw = {"base_model": "meta-llama/Llama-3.2-1B", "datasets": [{"path": "org/data", "type": "alpaca"}], **config}
    conv = convert_mapping(raw, source="axolotl", config_dir=tmp_path, out_dir=tmp_path)
    assert conv.get(key) == want
    assert not conv.material and conv.error is None, (conv.material, conv.error)


def test_axolotl_cosine_constant_lr_ratio_is_reported_with_its_meaning(tmp_path):
    from finetune.peers import convert_mapping

    raw = {"base_model": "meta-llama/Llama-3.2-1B", "cosine_min_lr_ratio": 0.1, "cosine_constant_lr_ratio": 0.8}
    conv = convert_mapping(raw, source="axolotl", config_dir=tmp_path, out_dir=tmp_path)
    (dropped,) = conv.material
    assert dropped.key == "cosine_constant_lr_ratio" and "after 0.8 of the steps and holds it" in dropped.reason
    assert (conv.get("train.scheduler"), conv.get("train.min_lr_ratio")) == ("cosine_with_min_lr", 0.1)


def test_deepspeed_optimizer_block_other_than_adamw_is_reported(tmp_path):
    import json

    from finetune.peers import convert_mapping

    (tmp_path / "ds.json").write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 2},
                "optimizer": {"type": "Lamb", "params": {"lr": "auto"}},
                "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto"}},
            }
        )
    )
    raw = {"base_model": "meta-llama/Llama-3.2-1B", "deepspeed": "ds.json", "optimizer": "adamw_torch"}
    conv = convert_mapping(raw, source="axolotl", config_dir=tmp_path, out_dir=tmp_path)
    assert {d.key for d in conv.material} == {"deepspeed.optimizer", "deepspeed.scheduler"}
    assert conv.get("distributed.strategy") == "zero2"


def test_deepspeed_params_only_offload_says_the_optimizer_changes(tmp_path):
    from finetune.peers import convert_mapping

    raw = {"base_model": "meta-llama/Llama-3.2-1B", "deepspeed": "deepspeed_configs/zero3_bf16_cpuoffload_params.json"}
    conv = convert_mapping(raw, source="axolotl", config_dir=tmp_path, out_dir=tmp_path)
    assert conv.get("distributed.strategy") == "zero3-offload"
    assert any("DeepSpeed's CPU AdamW, in place of the config's optimizer" in n for n in conv.notes), conv.notes


def test_trl_sft_with_an_accelerate_file(tmp_path):
    rc, out = _convert(tmp_path, "trl-sft.yaml", "trl", "--method", "sft")
    assert rc == 0
    r = load_recipe(out)
    assert (r.method.type, r.adapter.type, r.adapter.r, r.adapter.target_modules) == ("sft", "lora", 32, "all-linear")
    assert r.data.sources[0].path == "trl-lib/Capybara" and r.data.packing and r.data.max_length == 1024
    assert r.distributed.strategy == "fsdp2" and r.train.activation_checkpointing == "on"
    assert r.logging.report_to == ["none"] and r.train.global_batch_size == 16


def test_trl_dpo_guessed_from_its_keys_and_a_deepspeed_accelerate_file(tmp_path):
    config = tmp_path / "dpo.yaml"
    (tmp_path / "acc.yaml").write_text(
        yaml.safe_dump(
            {
                "distributed_type": "DEEPSPEED",
                "deepspeed_config": {
                    "zero_stage": 3,
                    "offload_optimizer_device": "none",
                    "offload_param_device": "none",
                },
            }
        )
    )
    config.write_text(
        yaml.safe_dump(
            {
                "model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct",
                "dataset_name": "trl-lib/ultrafeedback_binarized",
                "beta": 0.05,
                "loss_type": ["sigmoid"],
                "learning_rate": 5e-7,
                "use_peft": True,
                "lora_r": 16,
                "accelerate_config": "acc.yaml",
                "fancy_new_flag": 3,
            }
        )
    )
    out = tmp_path / "out.yaml"
    rc = main(["convert", str(config), "--from", "trl", "-o", str(out)])
    assert rc == 2  # fancy_new_flag is unknown, so material
    r = load_recipe(out)
    assert (r.method.type, r.method.beta, r.distributed.strategy) == ("dpo", 0.05, "zero3")
    assert r.data.sources[0].format == "preference"
    assert "# fancy_new_flag: 3   # NOT MAPPED" in out.read_text()


def test_python_api_returns_the_conversion(tmp_path):
    from finetune import convert

    conv = convert(CONFIGS / "axolotl-qlora.yaml", source="axolotl")
    assert conv.recipe["adapter"]["type"] == "qlora" and not conv.material and conv.error is None


@pytest.mark.parametrize("source", ["axolotl", "llamafactory", "trl"])
def test_a_missing_config_is_a_clear_error(tmp_path, source, capsys):
    assert main(["convert", str(tmp_path / "nope.yaml"), "--from", source, "-o", str(tmp_path / "r.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err and not (tmp_path / "r.yaml").exists()


@pytest.mark.parametrize("source", ["axolotl", "trl"])
@pytest.mark.parametrize("value", [True, False])
def test_torch_compile_becomes_regional_compilation(tmp_path, source, value):
    from finetune import convert

    config = tmp_path / "config.yaml"
    base = {"base_model": "Qwen/Qwen2.5-0.5B"} if source == "axolotl" else {"model_name_or_path": "Qwen/Qwen2.5-0.5B"}
    config.write_text(yaml.safe_dump({**base, "torch_compile": value}))
    conv = convert(config, source=source, method="sft" if source == "trl" else None)
    assert conv.recipe.get("train", {}).get("compile") == ("regions" if value else None)
    assert "torch_compile" not in {d.key for d in conv.dropped}


@pytest.mark.parametrize("source", ["axolotl", "trl"])
@pytest.mark.parametrize("compiled", [True, None])
def test_torch_compile_mode_and_backend_are_read(tmp_path, source, compiled):
    # transformers' TrainingArguments compiles when either is set; axolotl hands them over only with torch_compile
    from finetune import convert

    config = tmp_path / "config.yaml"
    base = {"base_model": "m"} if source == "axolotl" else {"model_name_or_path": "m"}
    options = {"torch_compile_mode": "max-autotune", "torch_compile_backend": "inductor"}
    config.write_text(yaml.safe_dump({**base, **options, **({"torch_compile": True} if compiled else {})}))
    conv = convert(config, source=source, method="sft" if source == "trl" else None)
    on = compiled or source == "trl"
    assert conv.recipe.get("train", {}).get("compile") == ("regions" if on else None)
    dropped = {d.key: d for d in conv.dropped}
    assert not conv.material and "torch_compile_mode" in dropped  # speed, not what is trained: reported, not material
    assert ("torch_compile_backend" in dropped) is not on  # inductor is what regions compiles with
    config.write_text(yaml.safe_dump({**base, "torch_compile": True, "torch_compile_backend": "aot_eager"}))
    conv = convert(config, source=source, method="sft" if source == "trl" else None)
    assert not conv.material and "torch_compile_backend" in {d.key for d in conv.dropped}


def test_axolotl_fsdp_parameter_offload_under_qlora_keeps_the_4bit_weights_on_the_gpus(tmp_path):
    # axolotl's 70B QLoRA example offloads FSDP1's parameters; finetune's fsdp2-offload cannot offload
    # bitsandbytes' 4-bit weights (the planner refuses it), so the conversion pins fsdp2 and says why
    from finetune import convert
    from finetune.plan import plan

    config = yaml.safe_load((CONFIGS / "axolotl-qlora-fsdp2.yaml").read_text())
    config["fsdp_config"]["offload_params"] = True
    source = tmp_path / "qlora-offload.yaml"
    source.write_text(yaml.safe_dump(config))
    conv = convert(source, source="axolotl")
    assert conv.recipe["distributed"]["strategy"] == "fsdp2" and conv.error is None
    assert any("fsdp2 instead of fsdp2-offload" in n for n in conv.notes)
    recipe = load_recipe({**conv.recipe, "model": {"name": "meta-llama/Llama-3.1-70B", "arch": "llama-3.1-70b"}})
    assert plan(recipe, hardware="server-8xh100").fits


@pytest.mark.parametrize(
    "name,source,key",
    [
        ("axolotl-fsdp1-full.yaml", "axolotl", "liger_rms_norm"),
        ("llamafactory-full-extras.yaml", "llamafactory", "enable_liger_kernel"),
    ],
)
def test_a_peer_s_liger_switch_is_answered_by_train_liger(name, source, key):
    from finetune import convert
    from finetune.peers.common import LIGER_REASON

    conv = convert(CONFIGS / name, source=source)
    assert [d.reason for d in conv.dropped if d.key == key] == [LIGER_REASON]


def test_axolotl_s_lora_kernels_are_answered_by_the_fused_lora_layer(tmp_path):
    import yaml

    from finetune import convert
    from finetune.peers.common import FUSED_LORA_REASON

    config = yaml.safe_load((CONFIGS / "axolotl-fsdp1-full.yaml").read_text())
    config.update(adapter="lora", lora_mlp_kernel=True, lora_qkv_kernel=True, lora_o_kernel=True)
    source = tmp_path / "lora-kernels.yaml"
    source.write_text(yaml.safe_dump(config))
    conv = convert(source, source="axolotl")
    kernels = {d.key: d for d in conv.dropped if d.key.startswith("lora_") and d.key.endswith("_kernel")}
    assert set(kernels) == {"lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel"}
    assert all(d.reason == FUSED_LORA_REASON and not d.material for d in kernels.values())
    assert conv.error is None and conv.recipe["adapter"]["type"] == "lora"
    assert "fused_lora" not in conv.recipe["adapter"]  # the default runs the fused layer


def test_the_output_may_be_a_stream_never_a_directory_and_a_full_disk_is_said_so(tmp_path, capfd):
    """`-o /dev/stdout` writes the recipe through the stream, the report to stderr (an atomic replace would
    swap the device's link for a file); a directory is refused by name; a disk that fills under the write
    is an error, not a traceback."""
    import os
    import subprocess
    import sys

    from tests.helpers.processes import env

    config = str(CONFIGS / "axolotl-lora-chat.yaml")
    argv = [sys.executable, "-m", "finetune.cli", "convert", config, "--from", "axolotl", "-o", "/dev/stdout"]
    piped = subprocess.run(argv, capture_output=True, text=True, env=env(), timeout=120, check=False)
    assert piped.returncode == 0, piped.stderr
    assert yaml.safe_load(piped.stdout)["adapter"]["type"] == "lora"  # the stream holds the recipe alone
    assert "wrote /dev/stdout" in piped.stderr
    with (tmp_path / "redirected.yaml").open("w") as redirect:  # `> redirected.yaml`: /dev/stdout is that file
        assert subprocess.run(argv, stdout=redirect, env=env(), timeout=120, check=False).returncode == 0
    assert load_recipe(tmp_path / "redirected.yaml").adapter.type == "lora"
    assert os.path.islink("/dev/stdout")
    assert main(["convert", config, "--from", "axolotl", "-o", str(tmp_path)]) == 2
    err = capfd.readouterr().err
    assert "-o names a directory" in err and "fix:" in err
    if os.path.exists("/dev/full"):  # every write fails with ENOSPC
        assert main(["convert", config, "--from", "axolotl", "-o", "/dev/full"]) == 1
        err = capfd.readouterr().err
        assert "error: disk full" in err and "fix:" in err and "Traceback" not in err and "internal error" not in err
        assert not os.path.isfile("/dev/full")


@pytest.mark.parametrize(
    ("source", "key", "name", "ours"),
    [
        ("trl", "optim", "adamw_torch_8bit", "adamw_8bit"),
        ("llamafactory", "optim", "adamw_torch_xla", "adamw"),
        ("axolotl", "optimizer", "adamw_apex_fused", "adamw"),
    ],
)
def test_an_optimizer_that_is_ours_under_another_implementation_is_mapped_with_a_note(
    tmp_path, source, key, name, ours
):
    from finetune.peers import convert_mapping

    raw = {"model_name_or_path": "m", "base_model": "m", key: name}
    conv = convert_mapping(raw, source=source, config_dir=tmp_path, out_dir=tmp_path)
    assert conv.get("train.optimizer") == ours
    assert not [d for d in conv.dropped if d.key == key]
    assert any(note.startswith(f"{key}: {name} -> train.optimizer {ours}") for note in conv.notes), conv.notes


def test_a_trl_hub_corpus_named_by_its_text_field_is_read_as_text(tmp_path):
    """SFTConfig's dataset_text_field names a plain-text column: a Hub dataset that cannot be opened here is
    assumed to be text then, not conversations, and the note says why."""
    from finetune.peers import convert_mapping

    raw = {"model_name_or_path": "m", "dataset_name": "org/corpus", "dataset_text_field": "content"}
    conv = convert_mapping(raw, source="trl", config_dir=tmp_path, out_dir=tmp_path, method="sft")
    (src,) = conv.get("data.sources")
    assert (src["format"], src.get("columns")) == ("text", {"text": "content"})
    assert any("(dataset_text_field is set)" in note for note in conv.notes), conv.notes
    plain = convert_mapping(
        {"model_name_or_path": "m", "dataset_name": "org/chats"}, source="trl", config_dir=tmp_path, out_dir=tmp_path
    )
    assert plain.get("data.sources")[0]["format"] == "messages"


def test_a_peers_switch_reads_as_its_own_parser_reads_it():
    from finetune.recipe.aliases import is_on

    assert all(is_on(v) for v in (True, 1, "true", "True", "yes", "1", "legacy", "disk"))
    assert not any(is_on(v) for v in (False, 0, None, "false", "False", "no", "off", "0", "none", ""))


def test_llamafactory_pure_bf16_trains_bfloat16_weights_without_an_fp32_copy(tmp_path):
    from finetune.peers import convert_mapping

    raw = {"model_name_or_path": "m", "finetuning_type": "full", "pure_bf16": True, "bf16": False}
    conv = convert_mapping(raw, source="llamafactory", config_dir=tmp_path, out_dir=tmp_path)
    assert (conv.get("model.dtype"), conv.get("train.precision")) == ("bfloat16", "bf16")
    assert not [d for d in conv.dropped if d.key == "pure_bf16"] and any("pure_bf16" in n for n in conv.notes)


@pytest.mark.parametrize(
    ("source", "raw", "key"),
    [
        ("axolotl", {"base_model": "Qwen/Qwen3-8B"}, "val_set_size"),
        ("llamafactory", {"model_name_or_path": "Qwen/Qwen3-8B", "finetuning_type": "lora"}, "val_size"),
    ],
)
def test_a_held_out_size_is_a_share_below_one_and_a_row_count_from_one(tmp_path, source, raw, key):
    """datasets' train_test_split, which the peers hand their size to, reads a float below 1 as a share and a
    whole number as rows: data.eval_fraction and data.eval_rows."""
    from finetune.peers import convert_mapping

    def held(size):
        conv = convert_mapping(raw | {key: size}, source=source, config_dir=tmp_path, out_dir=tmp_path)
        return conv.get("data.eval_fraction"), conv.get("data.eval_rows")

    assert held(0.05) == (0.05, None)
    assert held(500) == (None, 500)
    assert held(0) == (None, None)

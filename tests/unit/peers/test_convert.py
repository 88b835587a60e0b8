"""`finetune convert --from axolotl|llamafactory|trl`: configs written in each peer's documented format
(tests/data/convert, written for these tests) become recipes that validate and read their data; what
cannot be mapped is a comment with its reason, and a material drop exits non-zero."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from finetune.cli import main
from finetune.recipe.load import load_recipe
from tests.helpers.paths import TEST_DATA

CONFIGS = TEST_DATA / "convert"


def _convert(tmp_path: Path, name: str, source: str, *extra: str) -> tuple[int, Path]:
    out = tmp_path / "recipes" / "converted.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    rc = main(["convert", str(CONFIGS / name), "--from", source, "-o", str(out), *extra])
    return rc, out


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

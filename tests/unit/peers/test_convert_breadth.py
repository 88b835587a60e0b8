"""`finetune convert` on configs shaped like the peers' own shipped examples (tests/data/convert, each file
names the upstream example it stands for): every translated value lands on the right recipe key, every key
finetune cannot honour is reported by name, and the written recipe validates, reads its local data and
plans on a hardware preset offline (the models are registry Hub ids, so no Hub is needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune.api import make_plan
from finetune.cli import main
from finetune.data.check import check_data
from finetune.recipe.load import load_recipe
from finetune.registry import get_preset
from tests.helpers.convert import CONFIGS

HARDWARE = "server-8xh100"

# (config, --from, --method, {recipe key: value}, material keys reported, ignored keys reported)
CASES = [
    (
        "axolotl-lora-chat.yaml",
        "axolotl",
        None,
        {
            "adapter.type": "lora",
            "adapter.target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            "adapter.modules_to_save": ["embed_tokens", "lm_head"],
            "adapter.dora": True,
            "data.sources[0].format": "messages",
            "data.packing": True,
            "data.max_length": 2048,
            "data.eval_fraction": 0.1,
            "data.assistant_only_loss": True,
            "data.chat_template": "llama3",
            "tokenizer.added_tokens": ["<|tool_call|>"],
            "tokenizer.eos_token": "<|eot_id|>",
            "train.optimizer": "adamw_8bit",
            "train.scheduler": "cosine",
            "train.warmup_ratio": 0.05,
            "train.eval_steps": 50,
            "train.activation_checkpointing": "on",  # gradient_checkpointing: offload
            "train.global_batch_size": 8,
            "train.seed": 7,
            "output.saves_per_epoch": 2,
            "output.keep": 3,
            "hub.repo": "my-org/llama-lora",
            "logging.report_to": ["wandb"],
            "logging.project": "my-project",
            "logging.entity": "my-team",
            "logging.run_name": "run-1",
            "logging.offline": True,  # wandb_mode: offline
        },
        [],
        ["flash_attention", "pad_to_sequence_len", "model_type"],
    ),
    (
        "axolotl-fsdp1-full.yaml",
        "axolotl",
        None,
        {
            "adapter.type": "full",
            "train.lr": 2e-5,  # written `2e-5`, which YAML 1.1 reads as text
            "distributed.strategy": "fsdp2-offload",  # fsdp_offload_params: true
            "data.sources[0].format": "sharegpt",
            "data.sources[0].split": "train[:80%]",
            "data.chat_template": "chatml",
            "train.optimizer": "adamw_torch_fused",
            "train.scheduler": "linear",
            "train.warmup_steps": 100,
            "train.evals_per_epoch": 2,
            "logging.report_to": ["mlflow", "tensorboard"],
            "logging.project": "llama-fft",
        },
        [],
        ["plugins", "liger_rope", "gradient_checkpointing_kwargs", "mlflow_tracking_uri"],
    ),
    (
        "axolotl-qlora-fsdp2.yaml",
        "axolotl",
        None,
        {
            "adapter.type": "qlora",
            "adapter.target_modules": "all-linear",
            "distributed.strategy": "fsdp2",
            # its paged_adamw_8bit cannot step FSDP2's DTensor parameters (strategies.BNB_UNDER_FSDP_REFUSAL)
            "train.optimizer": "adamw",
            "train.max_steps": 200,
            "train.epochs": None,
            "train.scheduler": "cosine_with_min_lr",
            "train.min_lr_ratio": 0.1,
            "data.assistant_only_loss": False,  # train_on_inputs: true
            "data.sources[0].format": "alpaca",
            "data.eval_fraction": None,  # val_set_size: 0
        },
        [],
        ["loss_watchdog_threshold", "fsdp_version"],
    ),
    (
        "axolotl-dpo-8bit.yaml",
        "axolotl",
        None,
        {
            "method.type": "dpo",
            "method.beta": 0.05,
            "method.loss_type": "ipo",
            "adapter.type": "lora",
            "adapter.load_in_8bit": True,
            "data.sources[0].format": "preference",
            "data.sources[0].columns": {},
            "data.sources[1].format": "preference",  # ds_type json + one data_files entry
            "data.packing": False,
            # attn_implementation: flash_attention_2 asks for flash attention, which auto runs (no flash-attn)
            "model.attn_implementation": "auto",
            "tokenizer.pad_token": "<|finetune_right_pad_id|>",
        },
        ["dataset_exact_deduplication"],
        ["tokenizer_type", "ddp_find_unused_parameters", "attn_implementation"],
    ),
    (
        "axolotl-kto.yaml",
        "axolotl",
        None,
        {
            "method.type": "kto",
            "method.beta": 0.5,
            "method.desirable_weight": 0.2,
            "method.undesirable_weight": 1.0,
            "adapter.type": "qlora",
            "data.sources[0].format": "unpaired",
            "data.chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
            "train.optimizer": "adamw_8bit",
        },
        [],
        ["tf32", "eval_max_new_tokens"],
    ),
    (
        "axolotl-orpo-zero2.yaml",
        "axolotl",
        None,
        {
            "method.type": "orpo",
            "method.beta": 0.1,  # orpo_alpha, ORPO's lambda
            "data.sources[0].format": "preference",
            "train.scheduler": "constant_with_warmup",
            "train.lr": 8e-6,
            "distributed.strategy": "zero2",  # pinned as the config has it, though an adapter gains little
            "data.packing": False,  # sft/pretrain only
        },
        [],
        ["sample_packing"],
    ),
    (
        "axolotl-reward.yaml",
        "axolotl",
        None,
        {
            "method.type": "reward",
            "adapter.type": "full",
            "data.chat_template": "gemma",
            "train.warmup_ratio": 0.1,
            # axolotl's deepspeed_configs/zero3_bf16_cpuoffload_params.json, read from its name
            "distributed.strategy": "zero3-offload",
        },
        [],
        ["num_labels", "model_type"],
    ),
    (
        "axolotl-vision-dropped.yaml",
        "axolotl",
        None,
        {"adapter.type": "qlora", "data.chat_template": "gemma"},
        ["processor_type", "datasets[0].image_size", "optimizer", "lora_model_dir"],
        ["skip_prepare_dataset"],
    ),
    (
        "axolotl-pretrain.yaml",
        "axolotl",
        None,
        {
            "method.type": "pretrain",
            "data.sources[0].path": "allenai/c4",
            "data.sources[0].subset": "en",
            "data.sources[0].streaming": True,  # axolotl streams pretraining_dataset
            "data.packing": True,
            "train.max_steps": 200,
            "train.epochs": None,
            "output.saves_per_epoch": None,
        },
        [],
        ["saves_per_epoch"],
    ),
    (
        "llamafactory-pretrain.yaml",
        "llamafactory",
        None,
        {
            "method.type": "pretrain",
            "adapter.type": "lora",
            "data.sources[0].format": "text",
            "data.eval_sources[0].format": "text",
            "data.packing": True,
            "data.chat_template": None,
            "train.eval_steps": 500,
            "train.activation_checkpointing": "off",  # disable_gradient_checkpointing: true
        },
        [],
        [],
    ),
    (
        "llamafactory-lora-sft-ds3.yaml",
        "llamafactory",
        None,
        {
            "model.trust_remote_code": True,
            "adapter.r": 8,
            "adapter.alpha": 16,  # LLaMA-Factory's lora_alpha default: 2 x lora_rank
            "adapter.target_modules": "all-linear",
            "distributed.strategy": "zero3",  # from ds_z3_config.json's name; the file is LLaMA-Factory's
            "data.sources[0].format": "sharegpt",
            "data.sources[1].format": "alpaca",
            "data.sources[1].max_samples": 1000,
            "data.chat_template": "chatml",  # qwen3_nothink: ChatML without a think block
            "data.eval_fraction": 0.1,
            "train.eval_steps": 500,
            "train.global_batch_size": 2,
            "output.save_every": 500,
            "logging.report_to": ["none"],
        },
        [],
        ["plot_loss", "per_device_eval_batch_size"],
    ),
    (
        "llamafactory-qlora-fsdp.yaml",
        "llamafactory",
        None,
        {
            "adapter.type": "qlora",
            "adapter.double_quant": False,
            "adapter.target_modules": ["q_proj", "v_proj"],
            "adapter.alpha": 16,
            "adapter.r": 8,  # LLaMA-Factory's lora_rank default
            "data.sources[0].format": "messages",  # sharegpt formatting with role/content tags
            "data.assistant_only_loss": False,  # train_on_prompt: true
            "train.optimizer": "paged_adamw_8bit",
        },
        [],
        [],
    ),
    (
        "llamafactory-full-extras.yaml",
        "llamafactory",
        None,
        {
            "adapter.type": "full",
            "distributed.strategy": "zero3-offload",
            "data.packing": True,  # neat_packing
            "data.max_length": 8192,
            "train.scheduler": "cosine_with_min_lr",
            "train.min_lr_ratio": 0.1,
            "output.keep": 2,
            "model.rope_scaling": None,
        },
        ["use_galore", "mask_history", "rope_scaling"],
        ["galore_rank", "enable_liger_kernel"],
    ),
    (
        "llamafactory-kto.yaml",
        "llamafactory",
        None,
        {
            "method.type": "kto",
            "method.beta": 0.1,
            "method.desirable_weight": 1.0,
            "method.undesirable_weight": 1.5,
            "data.sources[0].format": "unpaired",
            "data.sources[0].columns": {},
            "data.chat_template": "qwen2.5",
            "logging.report_to": ["wandb"],  # swanlab is reported
            "train.micro_batch_size": "auto",  # its per-device 1 fails in TRL's KTOTrainer: left to the planner
        },
        [],
        ["report_to"],
    ),
    (
        "llamafactory-lora-extras.yaml",
        "llamafactory",
        None,
        {
            "method.type": "reward",
            "adapter.dora": True,
            "adapter.rslora": True,
            "adapter.loraplus_lr_ratio": 16.0,
            "adapter.modules_to_save": ["embed_tokens", "lm_head"],
            "tokenizer.added_tokens": ["<think>", "</think>"],
            "train.precision": "fp16",
            "model.dtype": "float16",
            "data.sources[0].format": "preference",
        },
        ["pissa_init", "adapter_name_or_path"],
        ["resize_vocab"],
    ),
    (
        "llamafactory-loraplus-defaults.yaml",
        "llamafactory",
        None,
        {
            # no lora_rank / lora_alpha: LLaMA-Factory's rank 8 and alpha 2 x rank, not finetune's 16 / 32
            "adapter.r": 8,
            "adapter.alpha": 16,
            "adapter.target_modules": "all-linear",
            "adapter.loraplus_lr_ratio": 16.0,
            "data.chat_template": "llama3",
        },
        [],
        [],
    ),
    (
        "llamafactory-full-fp32.yaml",
        "llamafactory",
        None,
        {
            # neither bf16 nor fp16: LLaMA-Factory upcasts a full fine-tune's weights to float32, no autocast
            "adapter.type": "full",
            "model.dtype": "float32",
            "train.precision": "fp32",
            "data.chat_template": "chatml",
        },
        [],
        [],
    ),
    (
        "llamafactory-template-default.yaml",
        "llamafactory",
        None,
        {"data.chat_template": None, "adapter.r": 8, "adapter.alpha": 16},
        ["template"],  # LLaMA-Factory's own "Human: ... Assistant:" layout: no shipped template renders it
        [],
    ),
    (
        "trl-dpo-handbook.yaml",
        "trl",
        "dpo",
        {
            "method.type": "dpo",
            "method.beta": 0.01,
            "method.loss_type": "sigmoid",
            "method.reference": "precompute",
            "adapter.type": "qlora",
            "adapter.double_quant": False,
            "adapter.r": 128,
            "model.dtype": "bfloat16",
            "data.sources[0].path": "HuggingFaceH4/ultrafeedback_binarized",
            "data.sources[0].split": "train_prefs",
            "data.eval_sources[0].split": "test_prefs",
            "data.max_length": 1024,
            "train.optimizer": "paged_adamw_32bit",
            "train.eval_steps": 100,
            "hub.repo": "my-org/qwen-dpo-qlora",
            "output.keep": 1,
            "distributed.strategy": "zero3-optim-offload",  # pinned as the config has it
        },
        [],
        ["max_prompt_length", "log_level"],
    ),
    (
        "trl-kto.yaml",
        "trl",
        "kto",
        {
            "method.type": "kto",
            "method.beta": 0.1,
            "method.undesirable_weight": 1.33,
            "adapter.type": "lora",
            "adapter.target_modules": "all-linear",
            "data.sources[0].format": "unpaired",
            "model.attn_implementation": "auto",
            "train.lr": 5e-7,
            "logging.report_to": ["trackio"],
        },
        ["rpo_alpha"],
        ["attn_implementation"],
    ),
    (
        "trl-sft-mixture.yaml",
        "trl",
        "sft",
        {
            "adapter.type": "full",
            "model.revision": "main",
            "model.attn_implementation": "sdpa",
            "data.sources[0].format": "messages",  # pairs and messages in one row: sft reads the messages
            "data.sources[1].format": "sharegpt",
            "data.sources[1].weight": None,  # the handbook's weight keeps that share of the rows
            "data.sources[1].split": "train[:50%]",
            "data.eval_fraction": 0.05,
            "data.assistant_only_loss": True,
            "data.packing": True,
            "train.max_steps": None,  # -1: no step limit
            "train.epochs": 2.0,
            "train.min_lr_ratio": 0.1,
            "train.evals_per_epoch": 1,  # eval_strategy: epoch
            "hub.repo": "my-org/qwen-sft",  # push_to_hub: true
            "logging.report_to": ["tensorboard", "wandb"],
        },
        ["dataset_kwargs"],
        ["dataset_num_proc"],
    ),
    (
        "trl-sft-peft.yaml",
        "trl",
        "sft",
        {
            "adapter.type": "lora",
            "adapter.load_in_8bit": True,
            "adapter.rslora": True,
            "adapter.modules_to_save": ["lm_head"],
            "adapter.target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
            "data.sources[0].format": "prompt_completion",
            "data.assistant_only_loss": False,  # completion_only_loss: false
            "train.max_steps": 300,
            "train.adam_beta2": 0.95,
            "train.neftune_noise_alpha": 5,
            "logging.report_to": ["mlflow"],
            "logging.run_name": "llama-sft",
            "hub.repo": None,  # hub_model_id without push_to_hub pushes nothing in TRL
        },
        [],
        ["dataset_test_split", "hub_model_id"],
    ),
    (
        "axolotl-kto-hub.yaml",
        "axolotl",
        None,
        {"method.type": "kto", "data.sources[0].format": "unpaired"},  # axolotl's KTO types read unpaired rows
        [],
        [],
    ),
    (
        "axolotl-dpo-parallel-dims.yaml",
        "axolotl",
        None,
        {"method.type": "dpo", "train.evals_per_epoch": None, "distributed.strategy": "fsdp2"},
        [],  # parallel sizes of 1 ask for nothing
        ["evals_per_epoch"],  # 0: no evaluation
    ),
    (
        "axolotl-yarn-overrides.yaml",
        "axolotl",
        None,
        {
            "model.rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096},
            "model.attention_dropout": 0.0,
            "data.sources[0].format": "text",
            "data.max_length": 8192,
        },
        ["overrides_of_model_config", "sequence_parallel_degree"],
        [],
    ),
    (
        "llamafactory-galore-warmup.yaml",
        "llamafactory",
        None,
        {"train.warmup_ratio": 0.1, "train.warmup_steps": None, "adapter.type": "full"},
        ["use_galore"],
        ["galore_rank", "galore_target"],
    ),
    (
        "llamafactory-nested-train.yaml",
        "llamafactory",
        None,
        {
            "model.name": "Qwen/Qwen2.5-7B",
            "adapter.type": "full",
            "model.rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
            "model.attn_implementation": "auto",  # attn: fa2, as flash_attn: fa2
            "data.max_length": 4096,
            "train.lr": 1e-5,
        },
        [],
        [],
    ),
    (
        "axolotl-long-context-savers.yaml",
        "axolotl",
        None,
        {"data.max_length": 16384, "train.activation_checkpointing": "on", "train.optimizer": "adamw_torch_fused"},
        ["activation_offloading", "tiled_mlp"],  # on: memory savers with no switch here
        ["use_scattermoe"],  # speed only; a false switch and sequence_parallel_degree 1 ask for nothing
    ),
    (
        "trl-dpo-qlora-fp16-dtype.yaml",
        "trl",
        "dpo",
        {"adapter.type": "qlora", "model.dtype": "bfloat16", "train.precision": "bf16"},
        [],
        ["torch_dtype"],  # float16 weights under bf16 training are not offered
    ),
    (
        "trl-cpt-dataset-configs.yaml",
        "trl",
        "sft",
        {
            "data.sources[0].subset": "tiny",
            "data.sources[1].subset": "full",
            "data.sources[1].split": "train[:50%]",  # dataset_mixer: the split's first half of the rows
            "tokenizer.eos_token": "<|end_of_text|>",
            "model.attn_implementation": "auto",
            "distributed.strategy": "fsdp2",
        },
        ["accelerate_config.parallelism_config.parallelism_config_cp_size", "average_tokens_across_devices"],
        ["use_flash_attention_2"],
    ),
]


CASES += [
    (
        "trl-handbook-test-splits.yaml",
        "trl",
        "sft",
        {
            # every split the mixture lists is training data there, test_sft too
            "data.sources[0].split": "train_sft",
            "data.sources[1].split": "test_sft",
            "data.eval_sources": [],
            "data.eval_fraction": None,
            "data.eval_rows": 1000,  # test_split_size 1000: a count of rows, as datasets' train_test_split reads it
            "adapter.type": "qlora",
            "adapter.r": 16,
            "train.evals_per_epoch": 1,
        },
        [],
        ["do_eval"],
    ),
    (
        "trl-handbook-smollm3-sft.yaml",
        "trl",
        "sft",
        {
            "data.sources[0].split": "smoltalk_smollm3_everyday_conversations_no_think",
            "data.sources[1].split": "smoltalk_smollm3_smol_magpie_ultra_no_think[:50%]",  # weight 0.5
            "data.sources[2].split": "OpenThoughts3_1.2M_think[:2%]",  # weight 0.02
            "data.sources[1].weight": None,
            "data.seed": 0,
            "tokenizer.eos_token": "<|im_end|>",
        },
        [f"dataset_mixture.datasets[{i}].columns" for i in range(3)],  # each row's chat_template_kwargs
        [],
    ),
    (
        "trl-example-config.yaml",
        "trl",
        "sft",
        {
            # TRL's defaults the config relies on, written out
            "train.epochs": 3.0,
            "train.micro_batch_size": 8,
            "train.global_batch_size": 8,
            "data.max_length": 1024,
            "train.warmup_ratio": 0.0,
            # and what it sets
            "train.lr": 1e-4,
            "train.scheduler": "cosine",
            "logging.report_to": ["none"],
        },
        [],
        [],
    ),
]


CASES += [
    (
        "axolotl-reward-center-zero1.yaml",
        "axolotl",
        None,
        {
            "method.type": "reward",
            "method.center_rewards_coefficient": 0.01,
            "train.optimizer": "adamw",  # the DeepSpeed file's AdamW block replaces adamw_bnb_8bit
            "distributed.strategy": "zero2",  # ZeRO-1
            "train.scheduler": "linear",
        },
        [],
        ["eval_batch_size", "num_labels"],
    ),
    (
        "axolotl-qat-constant-lr.yaml",
        "axolotl",
        None,
        {
            "train.scheduler": "constant_with_warmup",  # cosine_min_lr_ratio 1.0: the peak held after warmup
            "train.min_lr_ratio": None,
            "train.warmup_ratio": 0.1,
            "adapter.type": "full",
            "data.sources[0].split": "train[:95%]",
        },
        ["qat"],
        ["save_only_model"],  # load_in_4bit: false and cosine_constant_lr_ratio: 0 ask for nothing
    ),
    (
        "axolotl-qlora-dpo-llama3.yaml",
        "axolotl",
        None,
        {
            "method.type": "dpo",
            "adapter.type": "qlora",
            "data.chat_template": "llama3",  # llama3.argilla_chat renders with llama3's markers
            "data.sources[0].path": "mlabonne/orpo-dpo-mix-40k",
            "data.sources[0].format": "preference",
        },
        [],
        ["flash_attention"],
    ),
]


def _value(obj, path: str):
    for part in path.split("."):
        name, _, index = part.partition("[")
        obj = obj[name] if isinstance(obj, dict) else getattr(obj, name)
        if index:
            obj = obj[int(index.rstrip("]"))]
    return obj


@pytest.mark.parametrize(("name", "source", "method", "expected", "material", "ignored"), CASES, ids=lambda c: c)
def test_peer_example_converts_validates_and_plans(tmp_path, name, source, method, expected, material, ignored):
    out = tmp_path / "recipes" / "converted.yaml"
    argv = ["convert", str(CONFIGS / name), "--from", source, "-o", str(out)]
    rc = main(argv + (["--method", method] if method else []))
    assert rc == (2 if material else 0)
    text = out.read_text()
    assert "this recipe does not validate" not in text
    reported = {line.split(":")[0].lstrip("# ").strip("'") for line in text.splitlines() if "   # " in line}
    assert set(material) | set(ignored) <= reported
    for line in text.splitlines():
        if "   # NOT MAPPED" in line:
            assert line.split(":")[0].lstrip("# ").strip("'") in material, line  # nothing else is material

    recipe = load_recipe(out)
    for key, want in expected.items():
        assert _value(recipe, key) == want, key
    recipe.data.allow_outside = True  # the samples live in the repository, the recipe in tmp
    if all(not Path(s.path).is_absolute() and (out.parent / s.path).exists() for s in recipe.data.sources):
        check_data(recipe)  # every local row reads in the mapped format
    if "of ONE GPU" in text:  # the batch as the conversion's note asks: times the GPU count
        recipe.train.global_batch_size *= get_preset(HARDWARE).world_size
    _, plan = make_plan(recipe, hardware=HARDWARE)
    assert plan.fits, plan.to_json()


def test_every_shipped_peer_config_is_exercised():
    configs = {p.name for p in CONFIGS.glob("*.yaml") if p.name.split("-")[0] in ("axolotl", "llamafactory", "trl")}
    covered = {c[0] for c in CASES} | {
        "axolotl-qlora.yaml",
        "axolotl-dpo-dropped.yaml",
        "llamafactory-dpo.yaml",
        "llamafactory-ppo.yaml",
        "trl-sft.yaml",
        "llamafactory-oft.yaml",
        "llamafactory-merge-export.yaml",
        "axolotl-ia3.yaml",
    }  # the rest: tests/unit/peers/test_convert.py
    covered |= {
        "trl-eval-default-test-split.yaml",
        "axolotl-fp32-gptq-lora.yaml",
        "llamafactory-qlora-fp16.yaml",
        "trl-orpo-handbook.yaml",
        "trl-orpo-warmup-steps-and-ratio.yaml",
        "axolotl-pretrain-c4.yaml",
        "trl-gpt2-cpt.yaml",
        "axolotl-mistral-qlora-harmless.yaml",
        "llamafactory-harmless-keys.yaml",
        "trl-with-accelerate-fp8.yaml",
        "llamafactory-lora-predict.yaml",
        "llamafactory-lora-eval.yaml",
    }  # tests/unit/peers/test_convert_sweep.py
    covered |= {
        "axolotl-chat-message-keys.yaml",
        "axolotl-simpo-trl-section.yaml",
        "axolotl-sequence-parallel-batch.yaml",
        "axolotl-cce-kernels.yaml",
        "llamafactory-defaults-left-out.yaml",
        "llamafactory-sharegpt-tags.yaml",
        "llamafactory-simpo-alpaca-pairs.yaml",
        "llamafactory-kernels-cce.yaml",
        "trl-sft-packing-strategy.yaml",
        "trl-reward-seq-cls.yaml",
    }  # tests/unit/peers/test_convert_audit.py
    assert configs <= covered, configs - covered


@pytest.mark.parametrize(
    ("source", "config", "key"),
    [
        ("axolotl", {"special_tokens": True}, "special_tokens"),
        ("axolotl", {"dpo_loss_type": [], "rl": "dpo"}, "dpo_loss_type"),
        ("axolotl", {"micro_batch_size": 2, "gradient_accumulation_steps": {"k": "v"}}, "gradient_accumulation_steps"),
        ("axolotl", {"optimizer": ["adamw_torch"]}, "optimizer"),
        ("axolotl", {"num_epochs": []}, "num_epochs"),
        ("axolotl", {"datasets": [{"path": "x.jsonl", "type": "alpaca", "roles": "user"}]}, "datasets[0].roles"),
        ("llamafactory", {"dataset": {"name": "x"}}, "dataset[0]"),
        ("trl", {"dataset_mixer": {"org/data": "all"}}, "dataset_mixer"),
        ("trl", {"loss_type": [], "beta": 0.1}, "loss_type"),
    ],
)
def test_odd_value_shapes_are_reported_by_key_not_raised(tmp_path, source, config, key):
    from finetune.peers import convert_mapping

    raw = {"base_model" if source == "axolotl" else "model_name_or_path": "meta-llama/Llama-3.2-1B", **config}
    conv = convert_mapping(raw, source=source, config_dir=tmp_path, out_dir=tmp_path)
    assert key in {d.key for d in conv.material}, [d.key for d in conv.dropped]


@pytest.mark.parametrize(
    ("keys", "method", "guessed"),
    [
        ({"desirable_weight": 1.0, "beta": 0.1}, "kto", False),
        ({"simpo_gamma": 0.5, "loss_type": "simpo"}, "simpo", False),
        ({"center_rewards_coefficient": 0.01}, "reward", False),
        ({"rpo_alpha": 1.0, "beta": 0.1}, "dpo", False),
        ({"packing": True}, "sft", False),
        # keys DPO, ORPO, CPO and KTO configs share, or none: a guess, which --method must confirm (exit 2)
        ({"beta": 0.1}, "dpo", True),
        ({"beta": 0.1, "packing": True}, "dpo", True),
        ({}, "sft", True),
    ],
)
def test_trl_method_is_read_from_keys_only_one_trainer_has(tmp_path, keys, method, guessed):
    from finetune.peers import convert_mapping

    raw = {"model_name_or_path": "meta-llama/Llama-3.2-1B", **keys}
    conv = convert_mapping(raw, source="trl", config_dir=tmp_path, out_dir=tmp_path)
    assert conv.recipe["method"]["type"] == method
    if guessed:
        (dropped,) = [d for d in conv.material if d.key == "method"]
        assert "is a guess; pass --method" in dropped.reason
    else:
        assert any("pass --method to say otherwise" in note for note in conv.notes)
        assert "method" not in {d.key for d in conv.dropped}


def test_llamafactory_sharegpt_kto_rows_are_reported_not_read_as_prompt_completion(tmp_path):
    """LLaMA-Factory's kto_en_demo layout (a sharegpt conversation plus a kto_tag) has no prompt/completion
    columns, so it is reported by its dataset key rather than written as unpaired rows that cannot be read."""
    import json

    from finetune.peers import convert_mapping

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dataset_info.json").write_text(
        json.dumps(
            {
                "kto_chat": {
                    "file_name": "kto_chat.json",
                    "formatting": "sharegpt",
                    "columns": {"messages": "messages", "kto_tag": "label"},
                    "tags": {"role_tag": "role", "content_tag": "content"},
                }
            }
        )
    )
    raw = {"model_name_or_path": "Qwen/Qwen3-8B", "stage": "kto", "dataset": "kto_chat"}
    conv = convert_mapping(raw, source="llamafactory", config_dir=tmp_path, out_dir=tmp_path)
    assert "dataset[0]" in {d.key for d in conv.material}
    assert not conv.get("data.sources")


@pytest.mark.parametrize(
    ("source", "extra"),
    [
        ("axolotl", {"adapter": "lora", "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}),
        ("trl", {"use_peft": True, "lora_target_modules": ["q_proj", "v_proj"]}),
    ],
)
def test_lora_on_the_routed_experts_is_target_experts_and_a_part_of_them_is_reported(tmp_path, source, extra):
    """peft's target_parameters (axolotl's and TRL's lora_target_parameters) on both fused expert weights of every
    MoE layer, as the peers' MoE examples write it, is adapter.target_experts: true; by layer, as OpenAI's gpt-oss
    recipe writes it, the list of those layers; one of the two weights, or another parameter, is not offered."""
    from finetune.peers import convert_mapping

    model = {"base_model" if source == "axolotl" else "model_name_or_path": "mistralai/Mixtral-8x7B-v0.1"}
    every = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    conv = convert_mapping(
        {**model, **extra, "lora_target_parameters": every}, source=source, config_dir=tmp_path, out_dir=tmp_path
    )
    assert conv.get("adapter.target_experts") is True
    assert "lora_target_parameters" not in {d.key for d in conv.dropped}
    layered = [f"{i}.mlp.experts.{w}" for i in (7, 15, 23) for w in ("gate_up_proj", "down_proj")]
    conv = convert_mapping(
        {**model, **extra, "lora_target_parameters": layered}, source=source, config_dir=tmp_path, out_dir=tmp_path
    )
    assert conv.get("adapter.target_experts") == [7, 15, 23]
    for part in (["mlp.experts.down_proj"], ["7.mlp.experts.gate_up_proj"], [*every, "mlp.router.weight"]):
        conv = convert_mapping(
            {**model, **extra, "lora_target_parameters": part}, source=source, config_dir=tmp_path, out_dir=tmp_path
        )
        assert conv.get("adapter.target_experts") is None
        (dropped,) = [d for d in conv.material if d.key == "lora_target_parameters"]
        assert "adapter.target_experts" in dropped.reason


@pytest.mark.parametrize(
    ("model", "config", "method"),
    [("openai/gpt-oss-20b", "Mxfp4Config", "mxfp4"), ("deepseek-ai/DeepSeek-R1", "FineGrainedFP8Config", "fp8")],
)
def test_axolotl_dequantize_config_is_what_finetune_does_and_kept_quantized_weights_are_reported(
    tmp_path, model, config, method
):
    """axolotl's gpt-oss examples load the MXFP4 checkpoint with model_quantization_config: Mxfp4Config and
    {dequantize: true} (and FineGrainedFP8Config does the same for an FP8 one), which finetune does for such a
    checkpoint by itself; any other quantization config would train on quantized weights, which is not offered."""
    from finetune.peers import convert_mapping

    base = {"base_model": model, "adapter": "lora"}
    dequantized = {"model_quantization_config": config, "model_quantization_config_kwargs": {"dequantize": True}}
    conv = convert_mapping({**base, **dequantized}, source="axolotl", config_dir=tmp_path, out_dir=tmp_path)
    (dropped,) = [d for d in conv.dropped if d.key == "model_quantization_config"]
    assert not dropped.material and f"published in {method} dequantized" in dropped.reason
    assert "model_quantization_config_kwargs" not in {d.key for d in conv.dropped}
    kept = {"model_quantization_config": config}
    conv = convert_mapping({**base, **kept}, source="axolotl", config_dir=tmp_path, out_dir=tmp_path)
    assert "model_quantization_config" in {d.key for d in conv.material}


def test_axolotl_end_of_turn_options_pass_when_they_ask_for_what_finetune_trains(tmp_path):
    """axolotl's eot_tokens name the tokens that end a turn, and train_on_eot (default: train_on_eos, "turn") whether
    the loss covers them; finetune trains each assistant turn through the tokens its chat template closes it with.
    So eot_tokens are ignored with that reason, train_on_eot/train_on_eos "turn" pass silently (top level and per
    dataset), and any other choice is reported as changing training."""
    from finetune.peers import convert_mapping

    base = {
        "base_model": "Qwen/Qwen2.5-7B-Instruct",
        "adapter": "lora",
        "chat_template": "qwen_25",
        "datasets": [
            {"path": "org/chat", "type": "chat_template", "eot_tokens": ["<|im_end|>"], "train_on_eot": "turn"}
        ],
    }
    conv = convert_mapping(
        {**base, "eot_tokens": ["<|im_end|>"], "train_on_eot": "turn", "train_on_eos": "turn"},
        source="axolotl",
        config_dir=tmp_path,
        out_dir=tmp_path,
    )
    assert not conv.material, conv.material
    ignored = {d.key: d.reason for d in conv.dropped}
    assert set(ignored) == {"eot_tokens", "datasets[0].eot_tokens"}
    assert all("chat template's own rendering" in r for r in ignored.values())
    for option in ("train_on_eot", "train_on_eos"):
        conv = convert_mapping({**base, option: "all"}, source="axolotl", config_dir=tmp_path, out_dir=tmp_path)
        (reported,) = conv.material
        assert reported.key == option and "data.assistant_only_loss: false" in reported.reason
    per_dataset = {**base, "datasets": [{**base["datasets"][0], "train_on_eot": "last"}]}
    conv = convert_mapping(per_dataset, source="axolotl", config_dir=tmp_path, out_dir=tmp_path)
    assert [d.key for d in conv.material] == ["datasets[0].train_on_eot"]

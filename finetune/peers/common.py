"""What the peer converters share: the alias pass, DeepSpeed/accelerate files, optimizers, templates."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, get_args

from finetune.data.formats import MESSAGE_KEYS, ROLES, SHAREGPT_KEYS, SHAREGPT_ROLES
from finetune.data.sources import LOCAL_SUFFIXES
from finetune.peers import Conversion
from finetune.plan.workload import FUSED_EXPERT_WEIGHTS
from finetune.recipe.aliases import checkpointing_setting, held_out_key, is_on, lookup
from finetune.recipe.schema import (
    COMPILE_BACKEND,
    METHOD_FORMATS,
    PACKED_EXAMPLE_METHODS,
    LoggingSection,
    TrainSection,
    bnb_under_fsdp,
    least_micro_batch,
)
from finetune.strategies import BNB_UNDER_FSDP_REFUSAL

# transformers / bitsandbytes optimizer names -> ours
OPTIMIZERS = {
    "adamw_torch": "adamw",
    "adamw_hf": "adamw",
    "adamw": "adamw",
    "adamw_torch_fused": "adamw_torch_fused",
    "adamw_bnb_8bit": "adamw_8bit",
    "adamw_8bit": "adamw_8bit",
    "paged_adamw_8bit": "paged_adamw_8bit",
    "paged_adamw_32bit": "paged_adamw_32bit",
    "adafactor": "adafactor",
}
# transformers' names for the same update run by another implementation -> ours, and what the user should know
OPTIMIZER_EQUIVALENTS = {
    "adamw_torch_8bit": (
        "adamw_8bit",
        "torchao's 8-bit AdamW runs as bitsandbytes' 8-bit AdamW (the same 8-bit states)",
    ),
    "adamw_apex_fused": ("adamw", "apex's fused AdamW (transformers 4) runs as torch's fused AdamW (the same update)"),
    "adamw_torch_xla": ("adamw", "the XLA AdamW runs as torch's fused AdamW on the GPUs (the same update)"),
    "adamw_torch_npu_fused": ("adamw", "the NPU AdamW runs as torch's fused AdamW on the GPUs (the same update)"),
}
# TRL's CPOConfig.cpo_alpha (the NLL term on chosen), which a CPO/SimPO run of TRL's trainer keeps unless the config
# sets it (trl cpo, axolotl's rl: simpo); finetune's simpo has none by default
CPO_ALPHA = 1.0
# the scheduler names are transformers' own (SchedulerType), so the schema's list is the table
SCHEDULERS = {name: name for name in get_args(TrainSection.model_fields["scheduler"].annotation)}
# the peers' template names -> our shipped templates (finetune/registry/templates)
TEMPLATES = {
    "chatml": "chatml",
    "llama3": "llama3",
    "qwen": "qwen2.5",
    "qwen2.5": "qwen2.5",
    "qwen2": "qwen2.5",
    "qwen_25": "qwen2.5",  # axolotl's name for it
    "qwen3": "qwen3",
    "qwen3_nothink": "chatml",  # LLaMA-Factory's: plain ChatML, no think block and no default system prompt
    "mistral": "mistral",
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "llama3.1": "llama3",
    "llama3.2": "llama3",
    "llama-3": "llama3",
    "mistral_v3": "mistral",
    "phi": "phi-3",
    "phi_3": "phi-3",
    "phi3": "phi-3",
    "phi-3": "phi-3",
}
# axolotl's names for "the tokenizer's own template" (LLaMA-Factory's `default` and `empty` are templates of its own)
TOKENIZER_DEFAULT = ("tokenizer_default", "tokenizer_default_fallback_chatml")
DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "float32": "float32",
    "fp32": "float32",
    "auto": None,
}


# our count/interval keys whose 0 the peers read as "none" (axolotl's evals_per_epoch: 0), and what that is here
_NO_EVAL_CADENCE = "with no cadence set finetune evaluates only before and after training"
_NO_SAVE_CADENCE = "with no cadence set finetune writes no checkpoint, only the final model"
ZERO_MEANS_NONE = {
    "train.evals_per_epoch": _NO_EVAL_CADENCE,
    "train.eval_steps": _NO_EVAL_CADENCE,
    "output.saves_per_epoch": _NO_SAVE_CADENCE,
    "output.save_every": _NO_SAVE_CADENCE,
}

# a peer's switch for Liger's kernels: finetune's train.liger (plan/__init__.py liger_enabled) decides it
LIGER_REASON = (
    "train.liger: auto uses Liger's RMSNorm/RoPE/SwiGLU kernels on NVIDIA GPUs when liger-kernel is installed "
    "(train.liger: on requires them)"
)

# a peer's fused-LoRA switch (axolotl's lora_*_kernel): finetune's adapter.fused_lora does it for every targeted
# linear, on by default (finetune/train/fused_lora.py)
FUSED_LORA_REASON = (
    "adapter.fused_lora (on by default for LoRA) runs each targeted linear and its adapter as one autograd "
    "function, the scale and adds inside the GEMMs"
)


# a peer's request for flash attention (transformers' flash_attention_2/3, axolotl's flash_attention: true and
# attention: flash, LLaMA-Factory's fa2/fa3, TRL's use_flash_attention_2): finetune's default runs PyTorch's own
# flash kernels, so no flash-attn package is needed (model.attn_implementation's auto, plan/__init__.py)
FLASH_KERNELS = ("flash_attention_2", "flash_attention_3")
FLASH_REASON = (
    "model.attn_implementation: auto (the default) runs PyTorch's flash varlen kernel on packed rows on NVIDIA "
    "GPUs and sdpa's flash backend otherwise, with no flash-attn package; to pin the flash-attn kernel set "
    "model.attn_implementation: flash_attention_2 (pip install flash-attn)"
)

# keys that do not change what is trained (logging, Hub upload cadence, data-loading workers, evaluation-only
# settings, axolotl's derived model-family flags, fused kernels of the same math): one verdict for every peer,
# merged into each converter's IGNORED. A key that changes the batches or the numbers trained on (group_by_length,
# dataloader_drop_last, torch_compile_backend, which turns compilation on in transformers) does not belong here.
_LOGGING_ONLY = "logging only; finetune logs every train.logging_steps steps to logging.report_to"
_LOADING_ONLY = "data-loading speed only (the same rows, in the same order); finetune picks its workers"
_EVAL_ONLY = "evaluation only (the trained weights are the same); finetune evaluates on its own settings"
_DERIVED = "axolotl derives it from the model's config.json to pick its patches; finetune reads the architecture itself"
_FUSED = "a fused kernel of the same math; finetune picks its kernels (train.liger, model.attn_implementation)"
_RUN = "finetune decides this itself or has no such switch"
NO_TRAINING_EFFECT: dict[str, str] = {
    **dict.fromkeys(
        (
            "logging_strategy",
            "logging_first_step",
            "log_level",
            "logging_dir",
            "include_tokens_per_second",
            "include_num_input_tokens_seen",
            "include_mfu",
            "plot_loss",
            "print_param_status",
            "mfu_profile_every",  # LLaMA-Factory's MFU report (include_mfu)
            "mfu_warmup_steps",
        ),
        _LOGGING_ONLY,
    ),
    **dict.fromkeys(
        (
            "dataloader_num_workers",
            "dataloader_pin_memory",
            "dataloader_prefetch_factor",
            "dataloader_persistent_workers",
            "preprocessing_num_workers",
            "dataset_num_proc",
            "dataset_processes",
            "overwrite_cache",
        ),
        _LOADING_ONLY,
    ),
    **dict.fromkeys(
        (
            "per_device_eval_batch_size",
            "eval_batch_size",
            "eval_sample_packing",
            "eval_table_size",
            "eval_max_new_tokens",
            "eval_table_max_new_tokens",
            "eval_causal_lm_metrics",
            "bf16_full_eval",
            "predict_with_generate",
        ),
        _EVAL_ONLY,
    ),
    **dict.fromkeys(
        ("is_llama_derived_model", "is_mistral_derived_model", "is_falcon_derived_model", "is_qwen_derived_model"),
        _DERIVED,
    ),
    **dict.fromkeys(
        (
            "flash_attn_cross_entropy",
            "flash_attn_rms_norm",
            "flash_attn_fuse_qkv",
            "flash_attn_fuse_mlp",
            "cut_cross_entropy",  # axolotl's and LLaMA-Factory's Cut Cross-Entropy: the loss without the logits
            "use_cce",
        ),
        _FUSED,
    ),
    # transformers' TrainingArguments switch, read by TRL and LLaMA-Factory alike
    "use_liger_kernel": LIGER_REASON,
    # Hub kernels (axolotl's and LLaMA-Factory's use_kernels, LLaMA-Factory's kernel_name)
    **dict.fromkeys(
        ("use_kernels", "kernel_name"),
        "Hub kernels are not loaded; finetune's own (varlen attention, Liger, the fused LoRA layer) are planned and "
        "switchable in the recipe",
    ),
    **dict.fromkeys(("flash_attention", "use_flash_attention_2"), FLASH_REASON),
    **dict.fromkeys(
        (
            "do_train",
            "do_eval",
            "ddp_timeout",
            "ddp_find_unused_parameters",
            "save_safetensors",
            "overwrite_output_dir",
            "resume_from_checkpoint",
            "gradient_checkpointing_kwargs",
            "remove_unused_columns",
            "tf32",
            "debug",
        ),
        _RUN,
    ),
    "hub_strategy": "finetune pushes once, after the run (hub.repo)",
    "hf_use_auth_token": "the Hub token comes from the environment (HF_TOKEN) or `hf auth login`",
    "save_only_model": "finetune's checkpoints always keep the optimizer state, so a run can resume from them",
}


# memory savers finetune has no switch for: reported (material) when on, silent when off
NOT_OFFERED_WHEN_ON = {  # axolotl's and TRL's keys
    "activation_offloading": "activations offloaded to host RAM are not offered; the planner fits activations with "
    "activation checkpointing on as many layers as needed (train.activation_checkpointing: auto)",
    "tiled_mlp": "the MLP tiled along the sequence is not offered; the planner fits long sequences with activation "
    "checkpointing, or lower data.max_length",
}


def not_offered_when_on(conv: Conversion) -> None:
    """NOT_OFFERED_WHEN_ON's keys: reported where the config turns them on, taken either way."""
    for key, reason in NOT_OFFERED_WHEN_ON.items():
        if conv.has(key) and is_on(conv.raw[key]):
            conv.drop(key, conv.raw[key], reason)
        conv.used.add(key)


def map_aliases(conv: Conversion, *, ignore: dict[str, str]) -> None:
    """Every key no peer handler took: ignored with a reason, renamed through the alias table, or dropped."""
    for key, value in conv.raw.items():
        if key in conv.used:
            continue
        if key in ignore:
            if value not in (None, False, "", [], {}):
                conv.drop(key, value, ignore[key], material=False)
            continue
        if value is None:  # an empty YAML entry asks for nothing
            continue
        alias = lookup("", key)
        if alias is None:
            conv.drop(
                key,
                value,
                f"no finetune setting does this (unknown to the {conv.source} converter); if it changes training, "
                "find the nearest recipe key in docs/porting.md, else delete this line",
            )
            continue
        try:
            ours = alias.value(value) if alias.value else value
        except (ValueError, TypeError) as exc:
            conv.drop(key, value, f"not a value finetune reads here ({exc})")
            continue
        if ours == 0 and alias.key in ZERO_MEANS_NONE:
            conv.drop(key, value, f"0 asks for none; {ZERO_MEANS_NONE[alias.key]}", material=False)
            continue
        conv.used.add(key)
        if ours is not None:
            conv.set(alias.key, ours)
    if conv.get("train.epochs") is not None and conv.get("train.max_steps") is not None:
        del conv.recipe["train"]["epochs"]  # the peers stop at max_steps; here the two exclude each other
        conv.notes.append("train.max_steps kept and the epoch count removed: the peers stop at max_steps")
    if conv.get("data.eval_fraction") is not None:
        key = next((k for k in sorted(conv.used) if (a := lookup("", k)) and a.key == "data.eval_fraction"), "")
        held_out(conv, key or "data.eval_fraction", conv.recipe["data"].pop("eval_fraction"))


def held_out(conv: Conversion, key: str, size: object) -> None:
    """A peer's held-out eval size, as datasets' train_test_split reads it (TRL's test_split_size, LLaMA-Factory's
    val_size, axolotl's val_set_size): a share below 1 (data.eval_fraction), a whole number of rows from 1
    (data.eval_rows); 0 holds out nothing."""
    if size is None or size == 0 or isinstance(size, bool):
        return
    ours = held_out_key(size)
    if ours == "data.eval_fraction" and isinstance(size, (int, float)) and 0 < size < 1:
        conv.set(ours, float(size))
    elif ours == "data.eval_rows" and isinstance(size, (int, float)) and float(size).is_integer():
        conv.set(ours, int(size))
    else:
        conv.drop(
            key, size, "must be a share (0 < x < 1) or a whole number of rows; set data.eval_fraction or data.eval_rows"
        )


def dtype_for_precision(conv: Conversion) -> None:
    """float16 weights under bf16 autocast (the handbooks' QLoRA torch_dtype: float16 with bf16: true) are not
    offered; the bf16 the config trains in decides, and the weights load in bfloat16."""
    if conv.get("model.dtype") != "float16" or conv.get("train.precision", "bf16") != "bf16":
        return
    # the key that asked for float16 weights: TRL's torch_dtype / dtype, axolotl's float16 switch
    key = next((k for k in ("torch_dtype", "dtype", "float16") if conv.raw.get(k) is not None), "torch_dtype")
    del conv.recipe["model"]["dtype"]
    conv.drop(
        key,
        conv.raw.get(key, "float16"),
        "float16 weights with bf16 training are not offered; they load in bfloat16 (set train.precision: fp16 "
        "for float16 throughout)",
        material=False,
    )


def no_mixed_precision(conv: Conversion, *, dtype: str, why: str) -> None:
    """The peer trains with neither bf16 nor fp16 autocast: train.precision fp32 and the weights in the dtype the
    peer loads them in (float32 unless it was told a 16-bit one, which then computes without autocast). The one
    place the converters write a run without mixed precision (LLaMA-Factory's full fine-tune without bf16/fp16,
    axolotl's bf16 and fp16 off, an accelerate file's mixed_precision: no)."""
    conv.set("model.dtype", dtype)
    conv.set("train.precision", "fp32")
    conv.notes.append(
        f"model.dtype {dtype}, train.precision fp32: {why}, so it trains without mixed precision"
        + (
            " (set bf16: true there, or train.precision: bf16 and model.dtype: bfloat16 here, for half the memory)"
            if dtype == "float32"
            else ""
        )
    )


# peers whose QLoRA stores the packed 4-bit weights in its compute dtype: LLaMA-Factory (bnb_4bit_quant_storage =
# compute_dtype, model_utils/quantization.py). axolotl stores them in bfloat16 whatever it computes in, and TRL in
# its own bnb_4bit_quant_storage (uint8 by default), so their adapter.storage_dtype stays as it is
STORAGE_FOLLOWS_COMPUTE = ("llamafactory",)


def qlora_dtypes(conv: Conversion) -> None:
    """Every peer dequantizes QLoRA's 4-bit weights to the dtype it loads the model in (bnb_4bit_compute_dtype:
    axolotl's torch_dtype, LLaMA-Factory's compute_dtype, TRL's dtype): a float16 (fp16 training, GPUs without
    bf16) or float32 model.dtype is adapter.compute_dtype too, not finetune's bfloat16 default. Run after the
    precision and dtype keys are mapped."""
    dtype = conv.get("model.dtype")
    if conv.get("adapter.type") != "qlora" or dtype not in ("float16", "float32"):
        return
    conv.set("adapter.compute_dtype", dtype)
    stored = conv.source in STORAGE_FOLLOWS_COMPUTE
    if stored:
        conv.set("adapter.storage_dtype", dtype)
    conv.notes.append(
        f"adapter.compute_dtype {dtype}"
        + (f", adapter.storage_dtype {dtype}" if stored else "")
        + f": the {conv.source} config dequantizes QLoRA's 4-bit weights to the dtype it loads the model in"
        + (" and stores them in it" if stored else "")
    )


# a Hub repo name without its owner (the characters the Hub allows in one)
_REPO_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _owner_less(conv: Conversion, value: object) -> bool:
    """`value` names no file or folder near the config or the recipe and reads as a Hub id without its owner."""
    if not isinstance(value, str) or not _REPO_NAME.match(value) or Path(value).suffix in LOCAL_SUFFIXES:
        return False
    return not any((folder / value).exists() for folder in (conv.out_dir, conv.config_dir, Path.cwd()))


def owner_less_hub_ids(conv: Conversion) -> None:
    """A model or dataset named without its owner (`gpt2`, `c4`: legacy Hub ids the Hub now keeps under an owner,
    openai-community/gpt2, allenai/c4). A model name loads as a Hub id all the same (a note); a data path without
    exactly one '/' is read as a local file here (finetune.data.sources.resolve_path), so it is reported."""
    name = conv.get("model.name")
    if _owner_less(conv, name):
        conv.notes.append(
            f"model.name {name}: no such folder next to the config, so it is read as a Hub id without its owner "
            "(a legacy id the Hub redirects, e.g. gpt2 -> openai-community/gpt2); write it as owner/name so "
            "`finetune plan` finds its config.json"
        )
    for section in ("data.sources", "data.eval_sources"):
        for i, src in enumerate(conv.get(section) or []):
            if isinstance(src, dict) and _owner_less(conv, src.get("path")):
                conv.drop(
                    f"{section}[{i}].path",
                    src["path"],
                    "no such file next to the config, and finetune reads a data path without exactly one '/' as a "
                    "local file: if it is a Hub dataset, write its owner/name id (legacy ids moved under an owner, "
                    "e.g. c4 -> allenai/c4); if it is a local file, give its path with its extension",
                )


def _named(conv: Conversion, key: str, *, table: dict[str, str], ours: str, what: str, offered: str) -> None:
    """The peer's `key` (a name) mapped through `table` onto our `ours`, or dropped with what we offer."""
    name = conv.take(key)
    if name is None:
        return
    if not isinstance(name, str):
        conv.drop(key, name, f"must be one {what} name; finetune has {offered}")
    elif name in table:
        conv.set(ours, table[name])
    else:
        conv.drop(key, name, f"{what} {name!r} is not offered; finetune has {offered}")


def optimizer(conv: Conversion, key: str) -> None:
    name = conv.raw.get(key)
    if isinstance(name, str) and name in OPTIMIZER_EQUIVALENTS:
        ours, why = OPTIMIZER_EQUIVALENTS[conv.take(key)]
        conv.set("train.optimizer", ours)
        conv.notes.append(f"{key}: {name} -> train.optimizer {ours}: {why}")
        return
    _named(
        conv,
        key,
        table=OPTIMIZERS,
        ours="train.optimizer",
        what="optimizer",
        offered=", ".join(sorted(set(OPTIMIZERS.values()))),
    )


def sharded_optimizer(conv: Conversion) -> None:
    """A peer's bitsandbytes optimizer under FSDP: the peer's FSDP1 hands it plain flat parameters, finetune's FSDP2
    DTensors it cannot step (strategies.BNB_UNDER_FSDP_REFUSAL), so the converted recipe trains with torch's AdamW
    there. Run after the optimizer and distributed.strategy are mapped."""
    name, strategy = conv.get("train.optimizer"), conv.get("distributed.strategy")
    if not (isinstance(name, str) and isinstance(strategy, str) and bnb_under_fsdp(name, strategy)):
        return
    conv.set("train.optimizer", "adamw")
    conv.notes.append(
        f"train.optimizer adamw instead of {name} under {strategy}: {BNB_UNDER_FSDP_REFUSAL}; the planner counts "
        "AdamW's fp32 states"
    )


def scheduler(conv: Conversion, key: str) -> None:
    _named(conv, key, table=SCHEDULERS, ours="train.scheduler", what="scheduler", offered=", ".join(SCHEDULERS))


def template(conv: Conversion, key: str) -> None:
    name = conv.take(key)
    if name is None or name in TOKENIZER_DEFAULT:
        return
    if str(name) in TEMPLATES:
        conv.set("data.chat_template", TEMPLATES[str(name)])
    elif "{%" in str(name):
        conv.set("data.chat_template", name)
    else:
        conv.drop(
            key,
            name,
            "no shipped template of that name; the tokenizer's own template is used (set "
            "data.chat_template to a .jinja file to pin it)",
        )


# role/content is a messages row; from/value, or a mix of the two spellings, a sharegpt row (whose reader takes either,
# as preference rows do)
def message_format(role: object, content: object) -> str | None:
    """The format whose rows keep a message's speaker under `role` and its text under `content` (data/formats.py
    MESSAGE_KEYS, SHAREGPT_KEYS): messages, sharegpt, or None where finetune reads neither key."""
    readable = tuple(zip(MESSAGE_KEYS, SHAREGPT_KEYS))
    if role not in readable[0] or content not in readable[1]:
        return None
    return "messages" if (role, content) == MESSAGE_KEYS else "sharegpt"


def read_role(fmt: str, speaker: object) -> str | None:
    """The chat role finetune reads a message's speaker as in format `fmt`: a messages row's roles as they are,
    a sharegpt or preference row's common spellings too (human, gpt, ...); None: not read."""
    name = str(speaker).lower()
    if fmt == "messages":
        return name if name in ROLES else None
    return SHAREGPT_ROLES.get(name)


def find_file(conv: Conversion, value: str, *, base: Path | None = None) -> Path | None:
    """A file a config names: relative to `base`, the config's folder, or the current directory."""
    path = Path(value).expanduser()
    for folder in (base, conv.config_dir, Path.cwd()):
        if folder is None:
            continue
        full = path if path.is_absolute() else folder / path
        if full.is_file():
            return full
    return None


def as_list(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return list(value) if isinstance(value, (list, tuple)) else [value]


def batch_sizes(conv: Conversion, *, micro_key: str = "per_device_train_batch_size", also: str = "") -> None:
    """micro-batch x gradient_accumulation_steps (transformers' TrainingArguments names; axolotl's
    micro_batch_size): our micro-batch, and the global batch over the GPUs the config ran on (convert --gpus; one
    GPU's when not given, said in the notes, since ours spans every GPU)."""
    micro, accumulation = conv.raw.get(micro_key), conv.raw.get("gradient_accumulation_steps")
    conv.used.update({micro_key, "gradient_accumulation_steps"})
    bad = [k for k, v in ((micro_key, micro), ("gradient_accumulation_steps", accumulation)) if not _count(v)]
    for key in (micro_key, "gradient_accumulation_steps"):
        if key in bad:
            conv.drop(key, conv.raw[key], "must be a positive whole number; set train.global_batch_size by hand")
        elif bad and conv.has(key):  # the global batch needs both
            conv.drop(key, conv.raw[key], f"{bad[0]} is not a whole number, so no global batch is read", material=False)
    if bad:
        return
    if micro:
        global_batch(conv, micro, accumulation or 1, micro_key=micro_key, also=also)


def _count(value: object) -> bool:
    """A batch count a config may hold: unset, or a positive whole number."""
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def global_batch(conv: Conversion, micro: int, accumulation: int, *, micro_key: str, also: str = "") -> None:
    """train.micro_batch_size and train.global_batch_size: micro x accumulation x the GPUs the config ran on
    (convert --gpus / --hardware; one GPU's when not given, said in a note)."""
    conv.set("train.micro_batch_size", micro)
    conv.set("train.global_batch_size", micro * accumulation * (conv.gpus or 1))
    if conv.gpus:
        conv.notes.append(
            f"train.global_batch_size is {micro_key} x gradient_accumulation_steps x {conv.gpus} GPUs "
            f"({conv.gpus_from})"
        )
    else:
        conv.one_gpu_batch_note = len(conv.notes)
        conv.notes.append(
            f"train.global_batch_size is {micro_key} x gradient_accumulation_steps of ONE GPU; {also}multiply it "
            "by your GPU count for the same effective batch (convert --gpus N or --hardware PRESET does)"
        )


# transformers' TrainingArguments defaults that change training and differ from finetune's own: the peers built on
# it (TRL's trainers, LLaMA-Factory) train with them where the config leaves the key out. (their keys, our key, value)
TRAINER_DEFAULTS: tuple[tuple[tuple[str, ...], str, object], ...] = (
    (("num_train_epochs", "max_steps"), "train.epochs", 3.0),
    (("lr_scheduler_type",), "train.scheduler", "linear"),
    (("warmup_steps", "warmup_ratio"), "train.warmup_ratio", 0.0),
)
TRAINER_LR = 5e-5  # TrainingArguments.learning_rate (TRL's trainers set their own)
PER_DEVICE_BATCH = 8  # TrainingArguments.per_device_train_batch_size


def trainer_defaults(
    conv: Conversion, *, lr: float, more: tuple[tuple[tuple[str, ...], str, object], ...] = ()
) -> list[str]:
    """Write the TrainingArguments defaults the config leaves out (TRAINER_DEFAULTS, the learning rate `lr`, the
    per-device batch, and the peer's own `more`) where they differ from finetune's; the ones written, for the
    caller's note. The per-device batch only where the config has none, so batch_sizes (which reads the one it has,
    and reports an invalid accumulation) may run before or after it."""
    written = []
    if not conv.has("learning_rate"):
        conv.set("train.lr", lr)
        written.append(f"learning_rate {lr:g}")
    steps = conv.raw.get("max_steps")
    for keys, ours, value in TRAINER_DEFAULTS + more:
        if any(conv.has(k) and not (k == "max_steps" and isinstance(steps, (int, float)) and steps <= 0) for k in keys):
            continue
        conv.set(ours, value)
        written.append(f"{keys[0]} {value:g}" if isinstance(value, float) else f"{keys[0]} {value}")
    accumulation = conv.raw.get("gradient_accumulation_steps")
    accumulation = 1 if accumulation is None else accumulation  # 0 or a bad value: batch_sizes reported it
    if not conv.has("per_device_train_batch_size") and _count(accumulation):
        global_batch(conv, PER_DEVICE_BATCH, accumulation, micro_key="per_device_train_batch_size")
        written.append(f"per_device_train_batch_size {PER_DEVICE_BATCH}")
    return written


# a reward model's score head, which peft trains whole for a sequence-classification adapter (task SEQ_CLS,
# finetune/train/model.py lora_config); peer configs list it in modules_to_save (TRL's reward example)
SCORE_HEADS = ("score", "classifier")


def reward_head(conv: Conversion) -> None:
    """The score head in adapter.modules_to_save of a reward model: trained already, so it goes, with a note."""
    modules = conv.get("adapter.modules_to_save")
    if conv.get("method.type") != "reward" or not isinstance(modules, list):
        return
    heads = [m for m in modules if m in SCORE_HEADS]
    if not heads:
        return
    rest = [m for m in modules if m not in SCORE_HEADS]
    if rest:
        conv.set("adapter.modules_to_save", rest)
    else:
        del conv.recipe["adapter"]["modules_to_save"]
    conv.notes.append(
        f"adapter.modules_to_save: {', '.join(heads)} removed: a reward model's adapter trains its score head whole "
        "already (peft's sequence-classification task)"
    )


def micro_batch_minimum(conv: Conversion) -> None:
    """A micro-batch below the method's least (recipe.schema.MIN_MICRO_BATCH: KTO's 2) fails in the peer as well,
    whose KTO is TRL's KTOTrainer: the pin goes, and the planner picks a micro-batch of at least that."""
    method, micro = conv.get("method.type", "sft"), conv.get("train.micro_batch_size")
    least, why = least_micro_batch(method)
    if isinstance(micro, int) and micro < least:
        del conv.recipe["train"]["micro_batch_size"]
        conv.notes.append(
            f"train.micro_batch_size {micro} removed: {method} trains micro-batches of at least {least} ({why}; "
            "the config fails as written, TRL's trainer refusing it there too); the planner picks the micro-batch"
        )


def loss_type(conv: Conversion, key: str) -> None:
    """A DPO loss name, or TRL's list of losses (only one is offered) -> method.loss_type."""
    losses = as_list(conv.take(key))
    if not losses or not all(isinstance(v, str) for v in losses):
        conv.drop(key, losses, "must name one DPO loss (sigmoid, ipo, hinge, robust, ...)")
        return
    conv.set("method.loss_type", losses[0])
    if len(losses) > 1:
        conv.drop(key, losses, f"combined DPO losses are not offered; only {losses[0]} is used")


# YAML 1.1 (PyYAML) reads `2e-5` (no dot) as a string; the peers' loaders read it as a number
_EXPONENT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def coerce_numbers(raw: dict) -> dict:
    return {k: float(v) if isinstance(v, str) and _EXPONENT.match(v) else v for k, v in raw.items()}


# torch.compile's options beside torch_compile: transformers' TrainingArguments turns compilation on when either is set
# (its __post_init__), axolotl passes them to it only under torch_compile: true
COMPILE_OPTIONS = ("torch_compile_backend", "torch_compile_mode")


def _compile_options(conv: Conversion) -> None:
    """torch_compile_backend and torch_compile_mode: compilation on where the peer's trainer turns it on for them;
    their values change how fast the compiled layers run, not what they compute (reported, not material)."""
    present = [key for key in COMPILE_OPTIONS if conv.has(key) and key not in conv.used]
    if not present:
        return
    compiled = conv.get("train.compile") == "regions"
    if not compiled and conv.source != "axolotl":
        conv.set("train.compile", "regions")
        conv.notes.append(
            f"{present[0]} turns torch.compile on in transformers' TrainingArguments: read as train.compile: regions "
            "(each decoder layer compiled, not the whole model)"
        )
        compiled = True
    for key in present:
        value = conv.take(key)
        if not compiled:
            conv.drop(key, value, "read only with torch_compile: true, which this config leaves off", material=False)
        elif key == "torch_compile_backend" and str(value).lower() == COMPILE_BACKEND:
            continue
        elif key == "torch_compile_backend":
            conv.drop(
                key,
                value,
                f"train.compile: regions compiles with {COMPILE_BACKEND}; another backend changes how fast the layers "
                "run, not what they compute",
                material=False,
            )
        else:
            conv.drop(
                key,
                value,
                "the compile mode (max-autotune's kernel search, reduce-overhead's CUDA graphs) changes how fast the "
                "compiled layers run, not what they compute; train.compile: regions uses inductor's default mode",
                material=False,
            )


def shared_keys(conv: Conversion) -> None:
    """Top-level keys every peer spells the same way (transformers' TrainingArguments names, mostly) whose
    values need more than a rename; run after the peer module, before the alias pass."""
    if conv.has("gradient_checkpointing") and "gradient_checkpointing" not in conv.used:
        value = conv.take("gradient_checkpointing")
        try:
            conv.set("train.activation_checkpointing", checkpointing_setting(value))
        except ValueError as exc:  # not a value the peers define: the planner decides
            conv.drop("gradient_checkpointing", value, f"{exc}; the planner chooses (auto)", material=False)
        if str(value).lower() == "offload":
            conv.notes.append(
                "gradient_checkpointing: offload read as activation checkpointing on; finetune keeps the "
                "checkpointed activations on the GPU (the planner counts them)"
            )
    if conv.has("torch_compile") and "torch_compile" not in conv.used:
        if is_on(conv.take("torch_compile")):
            conv.set("train.compile", "regions")
            conv.notes.append(
                "torch_compile: true read as train.compile: regions (each decoder layer compiled, not the whole "
                "model); docs/benchmarks.md has what it measured"
            )
    _compile_options(conv)
    _warmup_both(conv)
    _length_grouping(conv)
    warmup = conv.raw.get("warmup_steps")
    if isinstance(warmup, float) and 0 < warmup < 1 and not conv.has("warmup_ratio"):
        # transformers reads a warmup_steps below 1 as a share of the run (its warmup_ratio)
        conv.set("train.warmup_ratio", conv.take("warmup_steps"))
        conv.notes.append(f"warmup_steps {warmup} is a share of the run (below 1): read as train.warmup_ratio")
    steps = conv.raw.get("max_steps")
    if isinstance(steps, (int, float)) and steps <= 0:
        conv.used.add("max_steps")  # transformers' -1: no step limit, the epochs decide
    scheduler_kwargs(conv, "lr_scheduler_kwargs")
    _hub(conv)
    _trackers(conv)
    _cadence(conv, strategy="save_strategy", steps="save_steps", per_epoch="output.saves_per_epoch")
    _cadence(conv, strategy="eval_strategy", steps="eval_steps", per_epoch="train.evals_per_epoch")
    _cadence(conv, strategy="evaluation_strategy", steps="eval_steps", per_epoch="train.evals_per_epoch")
    if is_on(conv.raw.get("fp16")) and not conv.get("model.dtype"):
        conv.set("model.dtype", "float16")  # the peers load the weights in the fp16 they train in


def _warmup_both(conv: Conversion) -> None:
    """warmup_steps and warmup_ratio both set (TRL, LLaMA-Factory; axolotl refuses the pair and its converter
    reports it): transformers 4's get_warmup_steps, which these configs were written for, uses warmup_steps when
    it is above 0 and the ratio only otherwise."""
    steps, ratio = conv.raw.get("warmup_steps"), conv.raw.get("warmup_ratio")
    if steps is None or ratio is None or "warmup_ratio" in conv.used or isinstance(steps, bool):
        return
    if isinstance(steps, int) and steps > 0:
        conv.used.add("warmup_ratio")
        conv.notes.append(
            f"train.warmup_steps {steps}: warmup_ratio {ratio} is overridden, as transformers uses warmup_steps "
            "when it is above 0"
        )
    elif steps == 0:
        conv.used.add("warmup_steps")  # 0: the ratio decides


def _length_grouping(conv: Conversion) -> None:
    """group_by_length (transformers' LengthGroupedSampler) puts rows of similar length into one batch, which
    changes what each step trains on; finetune shuffles. Under packing it does nothing (axolotl's multipack
    sampler skips it; packed rows all have about data.max_length tokens)."""
    if not conv.has("group_by_length") or "group_by_length" in conv.used:
        return
    value = conv.take("group_by_length")
    if not is_on(value):
        return
    packed = any(is_on(conv.raw.get(k)) for k in ("sample_packing", "packing", "neat_packing"))
    if packed and conv.get("method.type", "sft") in PACKED_EXAMPLE_METHODS:
        conv.drop(
            "group_by_length", value, "packing builds the batches, so rows are not grouped by length", material=False
        )
    else:
        conv.drop(
            "group_by_length",
            value,
            "batches of rows of similar length are not offered: finetune draws shuffled batches (data.packing: true "
            "saves the padding instead); remove it to train on shuffled batches",
        )


def take_mapping(conv: Conversion, key: str, *, of: str) -> dict | None:
    """A peer's mapping-valued key as a copy its entries can be popped from as they are mapped; None when it is
    unset or not a mapping (then reported)."""
    value = conv.take(key)
    if not value:
        return None
    if not isinstance(value, dict):
        conv.drop(key, value, f"must be a mapping of {of}")
        return None
    return dict(value)


def scheduler_kwargs(conv: Conversion, key: str) -> None:
    """transformers' lr_scheduler_kwargs: cosine_with_min_lr's min_lr / min_lr_rate."""
    rest = take_mapping(conv, key, of="scheduler arguments")
    if rest is None:
        return
    if "min_lr_rate" in rest:
        conv.set("train.min_lr_ratio", rest.pop("min_lr_rate"))
    if "min_lr" in rest:
        conv.set("train.min_lr", rest.pop("min_lr"))
    if rest:
        conv.drop(key, rest, "only min_lr / min_lr_rate (cosine_with_min_lr) have finetune settings")


# a local file's columns -> our format, as TRL and the handbooks infer it from the first row
_SNIFF = (
    ({"chosen", "rejected"}, "preference"),
    ({"label", "completion"}, "unpaired"),
    ({"messages"}, "messages"),
    ({"conversations"}, "sharegpt"),
    ({"prompt", "completion"}, "prompt_completion"),
    ({"instruction", "output"}, "alpaca"),
    ({"text"}, "text"),
)


def first_row(conv: Conversion, path: str) -> dict | None:
    """The first row of a local .jsonl/.json file a config names (None: not local, or not a row of columns)."""
    full = find_file(conv, path)
    if full is None or full.suffix not in (".jsonl", ".json"):
        return None
    try:
        with full.open(encoding="utf-8") as fh:
            first = fh.readline() if full.suffix == ".jsonl" else fh.read()
        row = json.loads(first)
    except (OSError, ValueError):
        return None
    row = row[0] if isinstance(row, list) and row else row
    return row if isinstance(row, dict) else None


def sniff_format(conv: Conversion, path: str, *, method: str | None = None) -> str | None:
    """The format of a local .jsonl/.json file from its first row's columns (None: not local or unknown);
    with `method`, the first format that method trains on (a row may carry both messages and pairs)."""
    row = first_row(conv, path)
    if row is None:
        return None
    found = [fmt for keys, fmt in _SNIFF if keys <= set(row)]
    allowed = METHOD_FORMATS.get(method or "", tuple(found))
    return next((fmt for fmt in found if fmt in allowed), None)


def _hub(conv: Conversion) -> None:
    """hub_model_id (+ push_to_hub, hub_private_repo) -> hub.repo; a set hub.repo pushes after the run."""
    repo = conv.take("hub_model_id")
    push = conv.take("push_to_hub")
    revision = _hub_revision(conv)
    if conv.has("hub_private_repo"):
        conv.set("hub.private", bool(conv.take("hub_private_repo")))
    if not repo:
        return
    if conv.source != "axolotl" and not push:  # TrainingArguments push only with push_to_hub
        conv.drop(
            "hub_model_id", repo, "push_to_hub is off, so nothing is pushed; set hub.repo to push", material=False
        )
    elif "/" not in str(repo):
        conv.drop("hub_model_id", repo, f"the Hub repo needs its owner; set hub.repo: YOUR-NAME/{repo}", material=False)
    else:
        conv.set("hub.repo", str(repo))
        if revision:
            conv.set("hub.revision", revision)


def _hub_revision(conv: Conversion) -> str | None:
    """The branch a config pushes to (read whether or not it pushes): transformers' hub_revision, or the alignment
    handbook's hub_model_revision with its push_to_hub_revision switch."""
    revision = conv.take("hub_revision")
    handbook = conv.take("hub_model_revision")
    if is_on(conv.take("push_to_hub_revision")) and handbook:
        revision = revision or handbook
    return str(revision) if revision else None


TRACKERS = get_args(get_args(LoggingSection.model_fields["report_to"].annotation)[0])


def _trackers(conv: Conversion) -> None:
    """report_to (a name, a comma list or a list) -> logging.report_to, the trackers finetune offers."""
    if not conv.has("report_to"):
        return
    wanted = [str(t) for t in as_list(conv.take("report_to"))]
    kept = [t for t in wanted if t in TRACKERS]
    if len(kept) < len(wanted):
        conv.drop(
            "report_to",
            wanted,
            f"finetune logs to {', '.join(t for t in TRACKERS if t != 'none')}; "
            f"{', '.join(t for t in wanted if t not in TRACKERS)} dropped",
            material=False,
        )
    if kept:
        conv.set("logging.report_to", kept)


def _cadence(conv: Conversion, *, strategy: str, steps: str, per_epoch: str) -> None:
    """TrainingArguments' save/eval strategy and steps: 'epoch' is once per epoch, 'no' ignores the steps,
    and steps below 1 are a share of the whole run (which finetune does not take)."""
    mode = conv.take(strategy)
    value = None if steps in conv.used else conv.raw.get(steps)  # eval_steps: read once, for either strategy key
    if str(mode) == "epoch":
        conv.set(per_epoch, 1)
        if value is not None:
            conv.drop(steps, conv.take(steps), f"{strategy} is epoch", material=False)
    elif str(mode) == "no" and value is not None and "save" in steps:
        conv.drop(steps, conv.take(steps), f"{strategy} is no: a checkpoint at the end only", material=False)
    elif isinstance(value, float) and 0 < value < 1:
        conv.drop(
            steps,
            conv.take(steps),
            f"a share of the run is not offered; set {per_epoch} (or an interval in steps) instead",
        )


def drop_packing(conv: Conversion) -> None:
    """Packing examples together is SFT/pretrain; the peers accept the key for preference methods and use it
    loosely, so it is not read as finetune's padding-free DPO pairs (which a recipe asks for itself)."""
    if conv.get("data.packing") and conv.get("method.type", "sft") not in PACKED_EXAMPLE_METHODS:
        del conv.recipe["data"]["packing"]
        key = next((k for k in ("sample_packing", "packing", "neat_packing") if conv.raw.get(k)), "packing")
        conv.drop(
            key,
            conv.raw.get(key, True),
            f"packing is for sft/pretrain here; {conv.get('method.type')} pads each batch instead"
            + (" (data.packing: true runs DPO pairs padding-free)" if conv.get("method.type") == "dpo" else ""),
            material=False,
        )


def target_parameters(conv: Conversion, key: str) -> None:
    """peft's target_parameters (axolotl's and TRL's lora_target_parameters): LoRA on the routed experts' fused
    weights is adapter.target_experts, which adapts both of them (FUSED_EXPERT_WEIGHTS) in every MoE layer (true)
    or in the layers it lists; names with a layer index (OpenAI's gpt-oss recipe: 7.mlp.experts.gate_up_proj) give
    the list. One weight without the other, or other parameters, have no recipe equivalent."""
    names = [str(n) for n in as_list(conv.take(key))]
    if not names:
        return
    layers: dict[int | None, set[str]] = {}
    for name in names:
        weight = next((w for w in FUSED_EXPERT_WEIGHTS if name == w or name.endswith("." + w)), None)
        index = next((int(part) for part in name.split(".") if part.isdigit()), None)
        if weight is None:
            layers = {}
            break
        layers.setdefault(index, set()).add(weight)
    whole = all(kinds == set(FUSED_EXPERT_WEIGHTS) for kinds in layers.values())
    if layers and whole and (None not in layers or len(layers) == 1):
        conv.set("adapter.target_experts", True if None in layers else sorted(i for i in layers if i is not None))
        return
    conv.drop(
        key,
        names,
        "adapter.target_experts adapts both fused expert weights (" + ", ".join(FUSED_EXPERT_WEIGHTS) + ") of every "
        "MoE layer (true) or of listed layers ([7, 15, 23]); one of the two weights, or other parameters, are not "
        "offered",
    )


def continue_adapter(conv: Conversion, key: str) -> None:
    """A LoRA adapter to train on from (axolotl lora_model_dir, LLaMA-Factory adapter_name_or_path)."""
    if conv.has(key):
        conv.drop(
            key,
            conv.take(key),
            "training on from an existing adapter is not offered: merge it into the base first (finetune merge, "
            "or peft's merge_and_unload) and set model.name to the merged model",
        )


# transformers' attn_implementation values pinned as asked (the flash ones are FLASH_KERNELS: auto runs flash)
ATTENTION_KERNELS = ("sdpa", "eager", "flex_attention")


def attention(conv: Conversion, key: str) -> None:
    """transformers' attn_implementation -> model.attn_implementation."""
    value = conv.take(key)
    if value in ATTENTION_KERNELS:
        conv.set("model.attn_implementation", value)
    elif value in FLASH_KERNELS:
        flash_attention(conv, key, value)
    elif value is not None:
        conv.drop(
            key,
            value,
            f"finetune offers {', '.join(ATTENTION_KERNELS + FLASH_KERNELS)} (Hub kernels are not loaded); auto "
            "picks one",
            material=False,
        )


def flash_attention(conv: Conversion, key: str, value: object) -> None:
    """A peer's "use flash attention": finetune's default does, with PyTorch's kernels (FLASH_REASON)."""
    conv.drop(key, value, FLASH_REASON, material=False)

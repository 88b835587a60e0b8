"""What the peer converters share: the alias pass, DeepSpeed/accelerate files, optimizers, templates."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

from finetune.peers import Conversion, read_mapping
from finetune.recipe.aliases import lookup
from finetune.recipe.schema import TrainSection

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
# the scheduler names are transformers' own (SchedulerType), so the schema's list is the table
SCHEDULERS = {name: name for name in get_args(TrainSection.model_fields["scheduler"].annotation)}
# the peers' template names -> our shipped templates (finetune/registry/templates)
TEMPLATES = {
    "chatml": "chatml",
    "llama3": "llama3",
    "qwen": "qwen2.5",
    "qwen2.5": "qwen2.5",
    "qwen2": "qwen2.5",
    "qwen3": "qwen3",
    "mistral": "mistral",
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "phi": "phi-3",
    "phi_3": "phi-3",
    "phi3": "phi-3",
    "phi-3": "phi-3",
}
TOKENIZER_DEFAULT = ("tokenizer_default", "default", "empty", "tokenizer_default_fallback_chatml")
DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "float32": "float32",
    "fp32": "float32",
    "auto": None,
}


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
            conv.drop(key, value, "no finetune setting does this")
            continue
        try:
            ours = alias.value(value) if alias.value else value
        except ValueError as exc:
            conv.drop(key, value, str(exc))
            continue
        conv.used.add(key)
        if ours is not None:
            conv.set(alias.key, ours)
    if conv.get("train.epochs") is not None and conv.get("train.max_steps") is not None:
        del conv.recipe["train"]["epochs"]  # the peers stop at max_steps; here the two exclude each other
        conv.notes.append("train.max_steps kept and the epoch count removed: the peers stop at max_steps")
    if conv.get("data.eval_fraction") == 0:
        del conv.recipe["data"]["eval_fraction"]


def _named(conv: Conversion, key: str, *, table: dict[str, str], ours: str, what: str, offered: str) -> None:
    """The peer's `key` (a name) mapped through `table` onto our `ours`, or dropped with what we offer."""
    name = conv.take(key)
    if name is None:
        return
    if name in table:
        conv.set(ours, table[name])
    else:
        conv.drop(key, name, f"{what} {name!r} is not offered; finetune has {offered}")


def optimizer(conv: Conversion, key: str) -> None:
    _named(
        conv,
        key,
        table=OPTIMIZERS,
        ours="train.optimizer",
        what="optimizer",
        offered=", ".join(sorted(set(OPTIMIZERS.values()))),
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


def deepspeed_file(conv: Conversion, key: str) -> None:
    """A DeepSpeed JSON file (or an inline mapping) -> distributed.strategy."""
    value = conv.take(key)
    if value is None:
        return
    if isinstance(value, dict):
        config = value
    else:
        path = Path(str(value))
        path = path if path.is_absolute() else conv.config_dir / path
        if not path.is_file():
            conv.drop(key, value, f"DeepSpeed file {path} not found; the planner picks the strategy", material=False)
            return
        config = read_mapping(path, what="DeepSpeed config")
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    devices = {(zero.get(k) or {}).get("device") for k in ("offload_optimizer", "offload_param")}
    if stage == 3:
        strategy = "zero3-nvme" if "nvme" in devices else "zero3-offload" if "cpu" in devices else "zero3"
        conv.set("distributed.strategy", strategy)
        nvme = (zero.get("offload_param") or zero.get("offload_optimizer") or {}).get("nvme_path")
        if strategy == "zero3-nvme" and nvme:
            conv.set("distributed.nvme_path", nvme)
        conv.notes.append(
            f"{key}: ZeRO-3 pinned as distributed.strategy {strategy}; set it to auto to let the planner choose"
        )
    else:
        conv.drop(
            key,
            value,
            f"ZeRO stage {stage} has no tier here; the planner picks DDP, FSDP2 or ZeRO-3 (distributed.strategy: auto)",
            material=False,
        )


def accelerate_file(conv: Conversion, key: str) -> None:
    """An accelerate config file -> distributed.strategy (its DeepSpeed part through deepspeed_file)."""
    value = conv.take(key)
    if value is None:
        return
    named = {
        "zero3": "zero3",
        "zero3_offload": "zero3-offload",
        "fsdp2": "fsdp2",
        "fsdp": "fsdp2",
        "multi_gpu": "ddp",
        "ddp": "ddp",
    }
    if str(value) in named:
        conv.set("distributed.strategy", named[str(value)])
        return
    path = Path(str(value))
    path = path if path.is_absolute() else conv.config_dir / path
    if not path.is_file():
        conv.drop(key, value, f"accelerate file {path} not found; the planner picks the strategy", material=False)
        return
    config = read_mapping(path, what="accelerate config")
    kind = str(config.get("distributed_type", "")).upper()
    if kind == "DEEPSPEED":
        ds = config.get("deepspeed_config") or {}
        if ds.get("deepspeed_config_file"):
            conv.raw["_accelerate_deepspeed"] = ds["deepspeed_config_file"]
        else:
            conv.raw["_accelerate_deepspeed"] = {
                "zero_optimization": {
                    "stage": ds.get("zero_stage", 0),
                    "offload_optimizer": {"device": ds.get("offload_optimizer_device", "none")},
                    "offload_param": {"device": ds.get("offload_param_device", "none")},
                }
            }
        deepspeed_file(conv, "_accelerate_deepspeed")
    elif kind == "FSDP":
        conv.set("distributed.strategy", "fsdp2")
    elif kind == "MULTI_GPU":
        conv.set("distributed.strategy", "ddp")


def as_list(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return list(value) if isinstance(value, (list, tuple)) else [value]


def batch_sizes(conv) -> None:
    """per_device_train_batch_size x gradient_accumulation_steps (transformers' TrainingArguments): our
    micro-batch, and a global batch for ONE GPU (said in the notes, since ours spans every GPU)."""
    micro, accumulation = conv.take("per_device_train_batch_size"), conv.take("gradient_accumulation_steps")
    if micro:
        conv.set("train.micro_batch_size", micro)
        conv.set("train.global_batch_size", micro * (accumulation or 1))
        conv.notes.append(
            "train.global_batch_size is per_device_train_batch_size x gradient_accumulation_steps "
            "of ONE GPU; multiply it by your GPU count for the same effective batch"
        )

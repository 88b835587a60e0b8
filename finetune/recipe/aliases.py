"""The names axolotl, LLaMA-Factory and TRL/transformers give our keys, and how their values translate.

Used by the loader's "did you mean" (an unknown key that is a peer's name for one of ours is pointed
at ours, never at a key that merely looks alike) and by `finetune convert`. A value function returns
our value for the peer's, or raises ValueError when there is none. Pure: no heavy imports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def is_on(value: Any) -> bool:
    """A peer's switch as its own parser reads it: YAML booleans, the strings and numbers that CLI-style
    configs (LLaMA-Factory's, TRL's argparse) pass for them, and a named mode (axolotl's
    `activation_offloading: legacy`, transformers' `bf16: auto`), which is on."""
    if isinstance(value, str):
        return value.strip().lower() not in ("false", "no", "off", "0", "none", "")
    return bool(value)


def _precision(flag: Any) -> str | None:
    return "bf16" if is_on(flag) else None  # false asks for nothing by itself


def _fp16(flag: Any) -> str | None:
    return "fp16" if is_on(flag) else None


def _listify(value: Any) -> list:
    return value if isinstance(value, list) else [v.strip() for v in str(value).split(",")]


def _inverse(flag: Any) -> bool:
    return not bool(flag)


def checkpointing_setting(flag: Any) -> str:
    """A peer's gradient_checkpointing value as train.activation_checkpointing (on/off)."""
    # axolotl's "unsloth" and "offload" checkpoint too (offloading the saved activations, which finetune
    # does not: its checkpointing keeps them on the GPU)
    if flag in (True, "true", "unsloth", "offload", "offload_disk"):
        return "on"
    if flag in (False, "false", None):
        return "off"
    raise ValueError(f"{flag!r} is not a checkpointing setting; use true or false")


def _epochs(value: Any) -> float:
    return float(value)


def _qlora(flag: Any) -> str:
    if flag not in (True, "true"):
        raise ValueError("load_in_4bit: false has no setting of its own; remove it")
    return "qlora"


def held_out_key(size: Any) -> str:
    """Our key for a peer's held-out eval size, as datasets' train_test_split reads it (TRL's test_split_size,
    LLaMA-Factory's val_size, axolotl's val_set_size): a share below 1, a whole number of rows from 1."""
    rows = isinstance(size, (int, float)) and not isinstance(size, bool) and size >= 1
    return "data.eval_rows" if rows else "data.eval_fraction"


@dataclass(frozen=True)
class Alias:
    key: str  # our dotted key path
    # the peer's value -> ours (None: the same value); returning None means "nothing to set"
    value: Callable[[Any], Any] | None = None
    note: str = ""  # said with the suggestion when the meaning shifts
    # where the value decides which of our keys it is (None: always `key`)
    key_for: Callable[[Any], str] | None = None

    def target(self, value: Any) -> str:
        """Our key for the peer's `value`."""
        return self.key_for(value) if self.key_for else self.key


# peer name (bare, or SECTION.name when it only means this inside one of our sections) -> ours
ALIASES: dict[str, Alias] = {
    "learning_rate": Alias("train.lr"),
    "lr": Alias("train.lr"),
    "num_epochs": Alias("train.epochs", _epochs),
    "num_train_epochs": Alias("train.epochs", _epochs),
    "max_steps": Alias("train.max_steps"),
    "warmup_steps": Alias("train.warmup_steps"),
    "warmup_ratio": Alias("train.warmup_ratio"),
    "evals_per_epoch": Alias("train.evals_per_epoch"),
    "eval_steps": Alias("train.eval_steps"),
    "saves_per_epoch": Alias("output.saves_per_epoch"),
    "save_steps": Alias("output.save_every"),
    "train.saves_per_epoch": Alias("output.saves_per_epoch"),
    "train.save_steps": Alias("output.save_every"),
    "train.save_every": Alias("output.save_every"),
    "save_total_limit": Alias("output.keep"),
    "output_dir": Alias("output.dir"),
    "micro_batch_size": Alias("train.micro_batch_size"),
    "per_device_train_batch_size": Alias("train.micro_batch_size"),
    "lr_scheduler": Alias("train.scheduler"),
    "lr_scheduler_type": Alias("train.scheduler"),
    "train.lr_scheduler_type": Alias("train.scheduler"),
    "weight_decay": Alias("train.weight_decay"),
    "max_grad_norm": Alias("train.max_grad_norm"),
    "optim": Alias("train.optimizer"),
    "optimizer": Alias("train.optimizer"),
    "train.optim": Alias("train.optimizer"),
    "adam_beta1": Alias("train.adam_beta1"),
    "adam_beta2": Alias("train.adam_beta2"),
    "adam_epsilon": Alias("train.adam_epsilon"),
    "seed": Alias("train.seed"),
    "logging_steps": Alias("train.logging_steps"),
    "neftune_noise_alpha": Alias("train.neftune_noise_alpha"),
    "early_stopping_patience": Alias("train.early_stopping_patience"),
    "load_best_model_at_end": Alias("train.load_best_model_at_end"),
    "cosine_min_lr_ratio": Alias("train.min_lr_ratio"),
    "min_lr_ratio": Alias("train.min_lr_ratio"),
    "gradient_checkpointing": Alias("train.activation_checkpointing", checkpointing_setting),
    "train.gradient_checkpointing": Alias("train.activation_checkpointing", checkpointing_setting),
    "bf16": Alias("train.precision", _precision),
    "fp16": Alias("train.precision", _fp16),
    "lora_r": Alias("adapter.r"),
    "adapter.rank": Alias("adapter.r"),
    "adapter.lora_r": Alias("adapter.r"),
    "lora_rank": Alias("adapter.r"),
    "adapter.lora_rank": Alias("adapter.r"),
    "lora_alpha": Alias("adapter.alpha"),
    "adapter.lora_alpha": Alias("adapter.alpha"),
    "lora_dropout": Alias("adapter.dropout"),
    "adapter.lora_dropout": Alias("adapter.dropout"),
    "lora_target_modules": Alias("adapter.target_modules"),
    "lora_target": Alias("adapter.target_modules"),
    "adapter.lora_target_modules": Alias("adapter.target_modules"),
    "lora_modules_to_save": Alias("adapter.modules_to_save"),
    "additional_target": Alias("adapter.modules_to_save"),
    "loraplus_lr_ratio": Alias("adapter.loraplus_lr_ratio"),
    "use_dora": Alias("adapter.dora"),
    "peft_use_dora": Alias("adapter.dora"),
    "use_rslora": Alias("adapter.rslora"),
    "peft_use_rslora": Alias("adapter.rslora"),
    "load_in_8bit": Alias("adapter.load_in_8bit"),
    "load_in_4bit": Alias("adapter.type", _qlora),
    "base_model": Alias("model.name"),
    "model_name_or_path": Alias("model.name"),
    "trust_remote_code": Alias("model.trust_remote_code"),
    "rope_scaling": Alias("model.rope_scaling"),
    "sequence_len": Alias("data.max_length"),
    "cutoff_len": Alias("data.max_length"),
    "max_seq_length": Alias("data.max_length"),
    "max_length": Alias("data.max_length"),
    "sample_packing": Alias("data.packing"),
    "packing": Alias("data.packing"),
    "chat_template": Alias("data.chat_template"),
    "train_on_inputs": Alias("data.assistant_only_loss", _inverse, "its meaning is inverted"),
    "val_set_size": Alias("data.eval_fraction", key_for=held_out_key),
    "tokens": Alias("tokenizer.added_tokens"),
    "add_tokens": Alias("tokenizer.added_tokens"),
    "new_special_tokens": Alias("tokenizer.added_tokens"),
    "hub_model_id": Alias("hub.repo"),
    "wandb_project": Alias("logging.project"),
    "report_to": Alias("logging.report_to", _listify),
    "pref_beta": Alias("method.beta"),
    "dpo_beta": Alias("method.beta"),
    "rl_beta": Alias("method.beta"),
    "simpo_gamma": Alias("method.simpo_gamma"),
    "cpo_alpha": Alias("method.cpo_alpha"),
    "rank": Alias("adapter.r"),
    "max_seq_len": Alias("data.max_length"),
    "torch_dtype": Alias("model.dtype"),
    "batch_size": Alias("train.global_batch_size"),
    "total_batch_size": Alias("train.global_batch_size"),
    "micro_batch": Alias("train.micro_batch_size"),
    "max_grad_norm_clip": Alias("train.max_grad_norm"),
}


def lookup(section: str, name: str) -> Alias | None:
    """Our key for a peer's `name` written inside `section` ('' at the top level)."""
    qualified = f"{section}.{name}" if section else name
    return ALIASES.get(qualified) or ALIASES.get(name)

"""A TRL CLI config (`trl sft|dpo|kto|reward --config FILE`: SFTConfig/DPOConfig keys, ModelConfig,
ScriptArguments) -> a recipe. The method is the subcommand, which the file does not say: --method
names it, else DPO-only keys (beta, loss_type, max_prompt_length) mean dpo and the rest sft."""

from __future__ import annotations

from finetune.peers import Conversion
from finetune.peers.common import DTYPES, accelerate_file, as_list, batch_sizes, optimizer, scheduler

IGNORED = {
    k: "finetune decides this itself or has no such switch"
    for k in (
        "dataset_num_proc",
        "logging_strategy",
        "save_strategy",
        "eval_strategy",
        "per_device_eval_batch_size",
        "run_name",
        "log_level",
        "logging_first_step",
        "overwrite_output_dir",
        "do_train",
        "do_eval",
        "dataloader_num_workers",
        "ddp_timeout",
        "push_to_hub",
        "hub_strategy",
        "use_liger_kernel",
        "gradient_checkpointing_kwargs",
        "remove_unused_columns",
        "dataset_text_field",
        "completion_only_loss",
        "assistant_only_loss",
        "ignore_bias_buffers",
        "torch_compile",
        "tf32",
        "save_safetensors",
        "padding_free",
        "packing_strategy",
        "lora_task_type",
        "use_bnb_nested_quant",
        "bnb_4bit_quant_storage",
    )
}
DPO_KEYS = ("beta", "loss_type", "max_prompt_length", "precompute_ref_log_probs", "rpo_alpha")
METHODS = ("sft", "dpo", "kto", "reward", "orpo", "cpo")


def convert(conv: Conversion, *, method: str | None) -> None:
    conv.set("model.name", conv.take("model_name_or_path", ""))
    if method is None:
        method = "dpo" if any(conv.has(k) for k in DPO_KEYS) else "sft"
        conv.notes.append(f"method {method}: the trl subcommand is not in the file; pass --method to say it")
    if method not in METHODS:
        conv.drop("method", method, f"trl {method} has no finetune method")
        method = "sft"
    conv.set("method.type", {"cpo": "simpo"}.get(method, method))
    if method in ("dpo", "kto", "orpo", "cpo") and conv.has("beta"):
        conv.set("method.beta", conv.take("beta"))
    if method == "dpo" and conv.has("loss_type"):
        loss = as_list(conv.take("loss_type"))
        conv.set("method.loss_type", loss[0])
        if len(loss) > 1:
            conv.drop("loss_type", loss, "combined DPO losses are not offered; the first is used")
    if conv.take("use_peft"):
        conv.set("adapter.type", "qlora" if conv.take("load_in_4bit") else "lora")
        if conv.take("load_in_8bit"):
            conv.set("adapter.load_in_8bit", True)
        targets = conv.take("lora_target_modules")
        if targets is not None:
            conv.set("adapter.target_modules", targets if targets == "all-linear" else as_list(targets))
    else:
        conv.set("adapter.type", "full")
        for key in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "load_in_4bit", "load_in_8bit"):
            if conv.has(key):
                conv.drop(key, conv.raw[key], "use_peft is off, so this LoRA setting does nothing", material=False)
    name = conv.take("dataset_name")
    if name:
        source = {"path": conv.local_path(str(name)), "format": _format(method)}
        if conv.has("dataset_config"):
            source["subset"] = conv.take("dataset_config")
        source["split"] = conv.take("dataset_train_split", "train")
        conv.set("data.sources", [source])
        conv.notes.append(f"data.sources[0].format {source['format']} assumed for {name}; check it")
        if conv.has("dataset_test_split") and conv.raw.get("eval_strategy", "no") != "no":
            conv.set("data.eval_sources", [{**source, "split": conv.take("dataset_test_split")}])
    dtype = conv.take("dtype") or conv.take("torch_dtype")
    if dtype is not None and DTYPES.get(str(dtype)):
        conv.set("model.dtype", DTYPES[str(dtype)])
    attention = conv.take("attn_implementation")
    if attention in ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"):
        conv.set("model.attn_implementation", attention)
    optimizer(conv, "optim")
    scheduler(conv, "lr_scheduler_type")
    batch_sizes(conv)  # transformers' TrainingArguments names, as both tools use them
    if conv.has("max_seq_length"):
        conv.set("data.max_length", conv.take("max_seq_length"))
    accelerate_file(conv, "accelerate_config")
    if conv.has("hub_model_id"):
        conv.set("hub.repo", conv.take("hub_model_id"))


def _format(method: str) -> str:
    return "messages" if method == "sft" else "unpaired" if method == "kto" else "preference"

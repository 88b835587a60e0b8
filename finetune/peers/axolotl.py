"""axolotl's YAML config (base_model, datasets, adapter, rl, ...) -> a finetune recipe."""

from __future__ import annotations

from finetune.peers import Conversion
from finetune.peers.common import (
    CPO_ALPHA,
    FUSED_LORA_REASON,
    LIGER_REASON,
    NO_TRAINING_EFFECT,
    TEMPLATES,
    as_list,
    attention,
    batch_sizes,
    continue_adapter,
    find_file,
    flash_attention,
    is_on,
    loss_type,
    message_format,
    no_mixed_precision,
    not_offered_when_on,
    optimizer,
    read_role,
    scheduler,
    sniff_format,
    take_mapping,
    target_parameters,
    template,
)
from finetune.peers.distributed import deepspeed_file, fsdp_strategy, parallel_sizes
from finetune.registry.derive import DEQUANTIZING_CONFIGS

# keys that change nothing finetune does (axolotl's own; the peers' shared ones are NO_TRAINING_EFFECT)
IGNORED = (
    NO_TRAINING_EFFECT
    | {
        k: "finetune decides this itself or has no such switch"
        for k in (
            "strict",
            "model_type",
            "tokenizer_type",
            "sdp_attention",
            "xformers_attention",
            "dataset_prepared_path",
            "wandb_watch",
            "wandb_log_model",
            "wandb_run_id",
            "auto_resume_from_checkpoints",
            "local_rank",
            "pad_to_sequence_len",
            "plugins",
            "special_tokens_pad_to_multiple_of",
            "save_first_step",
            "lora_fan_in_fan_out",
            "tokenizer_use_fast",
            "tokenizer_legacy",
            "unsloth_cross_entropy_loss",
            "experimental_skip_move_to_device",
            "skip_prepare_dataset",
            "shuffle_merged_datasets",
            "sample_packing_eff_est",
            "total_num_tokens",
            "gc_steps",
            "eager_attention",
        )
    }
    | {
        "fsdp_version": "finetune always uses FSDP2 when it picks FSDP",
        "loss_watchdog_threshold": "no loss watchdog; a non-finite loss stops the run (train.on_nonfinite)",
        "loss_watchdog_patience": "no loss watchdog; a non-finite loss stops the run (train.on_nonfinite)",
        "num_labels": "a reward model (method: reward) has one score head; other heads are not offered",
    }
    | dict.fromkeys(
        ("heads_k_stride", "ring_attn_func"),
        "a setting of sequence parallelism, read only with sequence_parallel_degree above 1 (which is reported)",
    )
)
IGNORED.update(
    {
        k: LIGER_REASON
        for k in (
            "liger_rope",
            "liger_rms_norm",
            "liger_glu_activation",
            "liger_layer_norm",
            "liger_fused_linear_cross_entropy",
        )
    }
    | {k: FUSED_LORA_REASON for k in ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel")}
)
IGNORED.update(
    {
        k: "the routed experts run transformers' grouped_mm, as the planner times them; other MoE kernels are "
        "not loaded"
        for k in ("use_scattermoe", "use_sonicmoe")
    }
)
# axolotl's attention switch -> model.attn_implementation (flash: FLASH_REASON, finetune's default runs flash)
ATTENTION = {"sdpa": "sdpa", "eager": "eager", "flex": "flex_attention", "flash": None, "xformers": None}
# axolotl's older per-kernel switches -> model.attn_implementation (the others are in IGNORED: finetune picks)
ATTENTION_SWITCHES = {"flex_attention": "flex_attention"}
# axolotl's preference/KTO prompt strategies named TEMPLATE.kind render their rows with that template's markers
# written in (prompt_strategies/dpo/llama3.py, chatml.py), whatever chat_template says
STRATEGY_TEMPLATES = ("llama3", "chatml")
_OPTION_FIX = {
    "data_files": "a file inside a Hub dataset is not selected here; download it and set path to the file",
}
# dataset options that keep finetune's defaults (anything else is reported): axolotl's train_on_eot defaults to
# train_on_eos, "turn"
_SAME = {
    "train_on_eos": ("turn",),
    "train_on_eot": ("turn",),
    "roles_to_train": (["assistant"], ["gpt"], ["assistant", "gpt"]),
}
# what finetune's assistant-only loss covers, for the options above that ask otherwise
_TURN_LOSS = (
    "finetune's loss covers each assistant turn through its end-of-turn token (roles_to_train [assistant], "
    "train_on_eos and train_on_eot turn); set data.assistant_only_loss: false to train on every token"
)
# axolotl's eot_tokens (default: the EOS token) tells it which tokens end a turn, to find each turn's terminator
_EOT_TOKENS = (
    "finetune reads where an assistant turn ends from the chat template's own rendering (the tokens that close the "
    "turn are trained), so no end-of-turn token list is needed"
)
# axolotl dataset types -> our formats (instruction prompt styles all read alpaca-like columns)
FORMATS = {
    "alpaca": "alpaca",
    "alpaca_chat": "alpaca",
    "alpaca:chat": "alpaca",
    "sharegpt": "sharegpt",
    "chat_template": "messages",
    "completion": "text",
    "input_output": "prompt_completion",
}
PREFERENCE_TYPES = (
    "chat_template.default",
    "chatml.intel",
    "chatml.ultra",
    "llama3.ultra",
    "llama3.intel",
    "chatml.argilla",
    "llama3.argilla",
    "chatml.prompt_pairs",
    "llama3.prompt_pairs",
    "chat_template.argilla_chat",
    "user_defined.default",
)
RL = {"dpo": "dpo", "ipo": "dpo", "kto": "kto", "orpo": "orpo", "simpo": "simpo"}


def _source(conv: Conversion, i: int, ds: dict, *, preference: bool) -> dict | None:
    key = f"datasets[{i}]"
    if isinstance(ds, dict) and not ds.get("path") and len(as_list(ds.get("data_files"))) == 1:
        ds = {**ds, "path": as_list(ds["data_files"])[0], "data_files": None}  # axolotl reads the one file
        if find_file(conv, str(ds["path"])) is None:
            conv.notes.append(
                f"{key}: data_files {ds['path']!r} without a path is not a file here; it is read as a Hub dataset id "
                f"(axolotl would load it as a local {ds.get('ds_type') or 'json'} file): check data.sources[{i}].path"
            )
    if not isinstance(ds, dict) or not ds.get("path"):
        conv.drop(key, ds, "a dataset entry needs a path (or one data_files entry)")
        return None
    ds = dict(ds)
    for option in ("message_property_mappings", "roles"):
        if ds.get(option) is not None and not isinstance(ds[option], dict):
            conv.drop(f"{key}.{option}", ds.pop(option), "must be a mapping")
    src: dict = {"path": conv.local_path(str(ds["path"]))}
    kind = str(ds.get("type") or ("chat_template.default" if preference else "alpaca"))
    if preference and kind.split(".")[0] in STRATEGY_TEMPLATES:
        _strategy_template(conv, f"{key}.type", kind)
    if preference:
        src["format"] = "preference"
        sniffed = sniff_format(conv, str(ds["path"]), method="kto") if conv.get("method.type") == "kto" else None
        if conv.get("method.type") == "kto" and sniffed != "preference":
            src["format"] = "unpaired"  # axolotl's KTO types all read prompt/completion/label rows
        columns = {c: ds[f"field_{c}"] for c in ("prompt", "chosen", "rejected") if ds.get(f"field_{c}")}
        if ds.get("field_messages") and "prompt" not in columns:
            columns["prompt"] = ds["field_messages"]
        columns = {k: v for k, v in columns.items() if k != v}
        if src["format"] == "unpaired":
            columns = {}
        if columns:
            src["columns"] = columns
        _message_keys(conv, key, ds, default=("role", "content"))  # preference rows read either spelling
        if src["format"] == "unpaired" and sniffed is None:
            conv.notes.append(f"{key}: KTO type {kind!r} read as prompt/completion/label rows; check data.sources[{i}]")
        elif kind not in PREFERENCE_TYPES:
            conv.notes.append(
                f"{key}: preference type {kind!r} read as prompt/chosen/rejected (implicit prompts "
                f"and message lists are recognized); check data.sources[{i}]"
            )
    elif kind in FORMATS:
        src["format"] = FORMATS[kind]
        if src["format"] == "alpaca":
            conv.notes.append(
                f"{key}: axolotl's {kind} type writes each row into a prompt layout of its own (alpaca: \"Below is "
                "an instruction ... ### Response:\"), not the chat template; finetune's alpaca format renders it with "
                "the chat template (data.chat_template, else the tokenizer's), so the model learns that layout instead"
            )
        if src["format"] in ("messages", "sharegpt"):  # from/value speakers are a sharegpt row
            default = ("role", "content") if src["format"] == "messages" else ("from", "value")
            src["format"] = _message_keys(conv, key, ds, default=default) or src["format"]
        # chat_template rows sit under `messages` and sharegpt rows under `conversations` unless field_messages says
        # otherwise (axolotl's defaults), whichever of finetune's formats their message keys make them
        defaults = {"chat_template": "messages", "sharegpt": "conversations"}
        field = ds.get("field_messages") or ds.get("field") or defaults.get(kind)
        if field:
            column = {"messages": "messages", "sharegpt": "conversations", "text": "text"}.get(src["format"])
            if column and field != column:
                src["columns"] = {column: field}
    else:
        conv.drop(
            key,
            ds,
            f"dataset type {kind!r} has no finetune format (messages, alpaca, sharegpt, text, "
            f"prompt_completion, preference)",
        )
        return None
    for ours, theirs in (("split", "split"), ("subset", "name")):
        if ds.get(theirs):
            src[ours] = ds[theirs]
    for option, same in _SAME.items():
        if option in ds and ds[option] not in same:
            conv.drop(
                f"{key}.{option}",
                ds[option],
                _TURN_LOSS,
            )
    if ds.get("eot_tokens"):
        conv.drop(f"{key}.eot_tokens", ds["eot_tokens"], _EOT_TOKENS, material=False)
    roles = ds.get("roles") or {}
    # each speaker listed must be one finetune reads as that role (a sharegpt row's human is user, ...)
    if any(read_role(src["format"], v) != str(r) for r, vs in roles.items() for v in as_list(vs)):
        conv.drop(
            f"{key}.roles",
            roles,
            "renamed roles are not mapped; finetune reads user/assistant/system (and sharegpt's human/gpt); "
            "rename them in the data",
        )
    leftover = sorted(
        {k for k, v in ds.items() if v is not None}
        - set(_SAME)
        - {
            "roles",
            "path",
            "type",
            "split",
            "name",
            "field_messages",
            "field",
            "field_prompt",
            "field_chosen",
            "field_rejected",
            "message_property_mappings",
            "message_field_role",
            "message_field_content",
            "roles_to_train",
            "eot_tokens",
            "ds_type",
        }
    )
    for option in leftover:
        conv.drop(
            f"{key}.{option}",
            ds[option],
            _OPTION_FIX.get(option, "dataset option without a finetune equivalent")
            + ("; multimodal rows are not trained (text-only causal LMs)" if "image" in option else ""),
        )
    return src


def _message_keys(conv: Conversion, key: str, ds: dict, *, default: tuple[str, str]) -> str | None:
    """message_property_mappings (message_field_role / message_field_content before it): the keys each message
    keeps its speaker and text under, `default` where unset. The format that reads them (common.message_format), or
    None, reported, where finetune reads neither; other message properties are not read either (reported)."""
    mapping = dict(ds.get("message_property_mappings") or {})
    mapped_role, mapped_content = mapping.pop("role", None), mapping.pop("content", None)
    role = ds.get("message_field_role") or mapped_role or default[0]
    content = ds.get("message_field_content") or mapped_content or default[1]
    fmt = message_format(role, content)
    if fmt is None:
        # the key that gave the value finetune cannot read (the legacy message_field_* take precedence)
        unread_role = message_format(role, default[1]) is None
        field = "message_field_role" if unread_role else "message_field_content"
        named = field if ds.get(field) else "message_property_mappings"
        conv.drop(
            f"{key}.{named}",
            {"role": role, "content": content},
            "finetune reads a message's speaker from `role` (or `from`) and its text from `content` (or `value`); "
            "rename those keys in the data",
        )
    mapping = {k: v for k, v in mapping.items() if v is not None}
    if mapping:
        conv.drop(
            f"{key}.message_property_mappings",
            mapping,
            "message properties beside role and content are not read; finetune trains each message's role and content",
        )
    return fmt


def _strategy_template(conv: Conversion, key: str, kind: str) -> None:
    """A `llama3.*` / `chatml.*` preference type renders with that template: data.chat_template, unless the
    config names another one (then the two disagree and it is reported)."""
    wanted = TEMPLATES[kind.split(".")[0]]
    if conv.get("data.chat_template") in (None, wanted):
        if conv.get("data.chat_template") is None:
            conv.notes.append(f"{key}: {kind} renders its rows as {wanted}: data.chat_template {wanted}")
        conv.set("data.chat_template", wanted)
    else:
        conv.drop(
            key,
            kind,
            f"renders its rows as {wanted} whatever chat_template says; finetune renders every row with "
            f"data.chat_template ({conv.get('data.chat_template')}): set it to {wanted}, or use type "
            "chat_template.default",
        )


def _pretraining(conv: Conversion, entries: list) -> list[dict]:
    """pretraining_dataset: a streamed text corpus (axolotl streams it and needs max_steps, as we do)."""
    sources = []
    for i, ds in enumerate(entries):
        ds = ds if isinstance(ds, dict) else {"path": ds}
        if not ds.get("path") or not isinstance(ds["path"], str):
            conv.drop(f"pretraining_dataset[{i}]", ds, "a pretraining dataset needs a path")
            continue
        src: dict = {"path": conv.local_path(ds["path"]), "format": "text", "streaming": True}
        for ours, theirs in (("subset", "name"), ("split", "split")):
            if ds.get(theirs):
                src[ours] = ds[theirs]
        if ds.get("text_column", "text") != "text":
            src["columns"] = {"text": ds["text_column"]}
        for option in sorted(set(ds) - {"path", "name", "split", "text_column", "type"}):
            conv.drop(f"pretraining_dataset[{i}].{option}", ds[option], "dataset option without a finetune equivalent")
        sources.append(src)
    if sources:
        conv.set("method.type", "pretrain")
        for key, fix in (("saves_per_epoch", "output.save_every"), ("evals_per_epoch", "train.eval_steps")):
            if conv.raw.get(key):
                conv.drop(key, conv.take(key), f"a streamed corpus has no epochs; set {fix} (steps)", material=False)
        if conv.raw.get("val_set_size"):
            conv.drop("val_set_size", conv.take("val_set_size"), "a streamed corpus is not split; add test_datasets")
        conv.used.add("num_epochs")  # axolotl stops a streamed corpus at max_steps
    return sources


def convert(conv: Conversion) -> None:
    conv.set("model.name", conv.take("base_model", ""))
    rl = conv.take("rl")
    if rl is not None:
        if str(rl) in RL:
            conv.set("method.type", RL[str(rl)])
            if rl == "ipo":
                conv.set("method.loss_type", "ipo")
        else:
            conv.drop(
                "rl", rl, f"method {rl!r} is not offered; finetune has sft, dpo, kto, orpo, simpo, reward, pretrain"
            )
    if conv.get("method.type") == "simpo" and not conv.has("cpo_alpha"):
        # axolotl hands cpo_alpha to TRL's CPOConfig only when set, which then keeps its own
        conv.set("method.cpo_alpha", CPO_ALPHA)
        conv.notes.append(f"method.cpo_alpha {CPO_ALPHA:g}: TRL's CPOConfig default, which rl: simpo trains with")
    if conv.has("dpo_loss_type"):
        loss_type(conv, "dpo_loss_type")
    if conv.has("orpo_alpha"):
        conv.set("method.beta", conv.take("orpo_alpha"))  # ORPO's lambda is our method.beta
    _trl_section(conv)
    for theirs, ours in (
        ("kto_desirable_weight", "desirable_weight"),
        ("kto_undesirable_weight", "undesirable_weight"),
    ):
        if conv.has(theirs):
            conv.set(f"method.{ours}", conv.take(theirs))
    if conv.has("processor_type"):
        conv.drop(
            "processor_type",
            conv.take("processor_type"),
            "multimodal (image/audio) fine-tuning is not offered; finetune trains text-only causal LMs "
            "(convert the rows to text, or train this model with axolotl)",
        )
    if conv.has("reward_model"):
        conv.take("reward_model")
        conv.set("method.type", "reward")
    if conv.has("center_rewards_coefficient"):  # RewardConfig's, passed through by axolotl
        conv.set("method.center_rewards_coefficient", conv.take("center_rewards_coefficient"))
    for key in ("load_in_4bit", "load_in_8bit"):  # false asks for nothing, whatever the adapter
        if conv.has(key) and not is_on(conv.raw[key]):
            conv.used.add(key)
    adapter = conv.take("adapter")
    if adapter in ("lora", "qlora"):
        conv.set("adapter.type", "qlora" if adapter == "qlora" or conv.raw.get("load_in_4bit") else "lora")
        conv.used.add("load_in_4bit")
        if conv.take("load_in_8bit") and adapter == "lora":
            conv.set("adapter.load_in_8bit", True)
    elif adapter is None:
        conv.set("adapter.type", "full")
        conv.used.update({"load_in_8bit", "load_in_4bit"})
    else:
        # written as it is, so the recipe fails validation on adapter.type rather than train LoRA in its place
        conv.set("adapter.type", str(adapter))
        conv.drop(
            "adapter",
            adapter,
            f"adapter {adapter!r} is not offered: finetune trains every weight (adapter.type: full) or LoRA adapters "
            f"(lora, qlora); the recipe keeps adapter.type {adapter!r} so it does not validate until you pick one",
        )
        for key in [k for k in conv.raw if k.startswith("peft_") and conv.raw[k] is not None]:
            conv.drop(key, conv.take(key), f"belongs to adapter {adapter}", material=False)
    target_parameters(conv, "lora_target_parameters")
    _model_quantization(conv)
    if conv.take("lora_target_linear"):
        conv.set("adapter.target_modules", "all-linear")
        conv.used.add("lora_target_modules")
    preference = conv.get("method.type") in ("dpo", "kto", "orpo", "simpo", "reward")
    sources = [
        s for i, ds in enumerate(as_list(conv.take("datasets"))) if (s := _source(conv, i, ds, preference=preference))
    ]
    sources += _pretraining(conv, as_list(conv.take("pretraining_dataset")))
    eval_sources = [
        s
        for i, ds in enumerate(as_list(conv.take("test_datasets")))
        if (s := _source(conv, i, ds, preference=preference))
    ]
    if sources:
        conv.set("data.sources", sources)
    if eval_sources:
        conv.set("data.eval_sources", eval_sources)
    if conv.get("method.type") == "kto" and any(s["format"] == "preference" for s in sources):
        conv.notes.append("KTO: paired rows are unpaired; rows with a boolean label need data.format: unpaired")
    tokens = conv.take("special_tokens") or {}
    if not isinstance(tokens, dict):
        conv.drop("special_tokens", tokens, "must be a mapping such as {pad_token: ..., eos_token: ...}")
        tokens = {}
    for name in ("pad_token", "eos_token", "bos_token"):
        if tokens.get(name):
            conv.set(f"tokenizer.{name}", tokens[name])
    rest = {k: v for k, v in tokens.items() if k not in ("pad_token", "eos_token", "bos_token")}
    if rest:
        conv.drop(
            "special_tokens",
            rest,
            "only pad/eos/bos have overrides here (tokenizer.*, mapped); the tokenizer keeps its own "
            + ", ".join(rest),
        )
    jinja = conv.take("chat_template_jinja")
    if jinja and conv.raw.get("chat_template") in (None, "jinja"):
        conv.take("chat_template")
        conv.set("data.chat_template", jinja)
    else:
        template(conv, "chat_template")
    _turn_ends(conv)
    continue_adapter(conv, "lora_model_dir")
    optimizer(conv, "optimizer")
    scheduler(conv, "lr_scheduler")
    _cosine_floor(conv)
    batch_sizes(conv, micro_key="micro_batch_size", also="axolotl multiplies by the GPU count too; ")
    deepspeed_file(conv, "deepspeed")
    parallel_sizes(conv, conv.raw)
    not_offered_when_on(conv)
    _model_overrides(conv)
    flags, fsdp_config = as_list(conv.take("fsdp")), conv.take("fsdp_config")
    if flags or fsdp_config:
        fsdp_strategy(conv, "fsdp_config" if fsdp_config else "fsdp", fsdp_config or {}, flags=flags)
    kernel = conv.take("attention")
    if kernel is not None:
        if str(kernel) == "flash":
            flash_attention(conv, "attention", kernel)
        elif str(kernel) in ATTENTION:
            if ATTENTION[str(kernel)]:
                conv.set("model.attn_implementation", ATTENTION[str(kernel)])
        else:
            conv.drop(
                "attention", kernel, "unknown kernel; finetune offers sdpa, eager, flex (model.attn_implementation)"
            )
    attention(conv, "attn_implementation")
    for switch, kernel in ATTENTION_SWITCHES.items():
        if is_on(conv.take(switch)) and conv.get("model.attn_implementation") is None:
            conv.set("model.attn_implementation", kernel)
    _weights_dtype(conv)
    for theirs, ours in (("wandb_entity", "logging.entity"), ("wandb_name", "logging.run_name")):
        if conv.has(theirs):
            conv.set(ours, conv.take(theirs))
    if conv.has("warmup_steps") and conv.has("warmup_ratio"):
        conv.drop("warmup_ratio", conv.take("warmup_ratio"), "warmup_steps is set too; finetune takes one")
    _trackers(conv)


def _trl_section(conv: Conversion) -> None:
    """axolotl's trl: section. Its beta is the trainer's beta, read before rl_beta and orpo_alpha; the rest
    configures axolotl's GRPO trainer (generation, reward functions), which finetune does not offer."""
    rest = take_mapping(conv, "trl", of="TRL trainer settings")
    if rest is None:
        return
    beta = rest.pop("beta", None)
    if beta is not None:
        conv.set("method.beta", beta)
        for key in ("rl_beta", "orpo_alpha"):
            if conv.has(key):
                conv.drop(key, conv.take(key), "trl.beta is set, which axolotl reads first", material=False)
    rest = {k: v for k, v in rest.items() if v is not None}
    if rest:
        conv.drop(
            "trl",
            rest,
            "axolotl's trl: settings beside beta configure its GRPO trainer (generation, reward functions); "
            "finetune trains sft, dpo, kto, orpo, simpo, reward and pretrain",
        )


def _turn_ends(conv: Conversion) -> None:
    """axolotl's top-level train_on_eot / train_on_eos and eot_tokens (the datasets' defaults): the turn-end loss
    finetune has (`_SAME`) passes silently, any other is reported; the token list is not needed (`_EOT_TOKENS`)."""
    for option in ("train_on_eos", "train_on_eot"):
        value = conv.take(option)
        if value is not None and str(value) not in _SAME[option]:
            conv.drop(option, value, _TURN_LOSS)
    tokens = conv.take("eot_tokens")
    if tokens:
        conv.drop("eot_tokens", tokens, _EOT_TOKENS, material=False)


def _model_quantization(conv: Conversion) -> None:
    """axolotl's model_quantization_config (a transformers quantization config class by name, with its kwargs): the
    one its gpt-oss examples use, Mxfp4Config with dequantize, is what finetune does for an MXFP4 checkpoint by
    itself, and so is FineGrainedFP8Config with dequantize for an FP8 one (registry.derive.DEQUANTIZING_CONFIGS);
    training weights kept quantized by such a config is not offered."""
    name = conv.take("model_quantization_config")
    kwargs = conv.take("model_quantization_config_kwargs")
    if name is None:
        return
    method = {config: method for method, config in DEQUANTIZING_CONFIGS.items()}.get(str(name))
    if method and isinstance(kwargs, dict) and is_on(kwargs.get("dequantize")):
        conv.drop(
            "model_quantization_config",
            name,
            f"finetune loads a checkpoint published in {method} dequantized to 16 bits itself "
            f"({name}(dequantize=True))",
            material=False,
        )
        return
    conv.drop(
        "model_quantization_config",
        {"config": name, "kwargs": kwargs} if kwargs else name,
        "training on weights kept quantized by a transformers quantization config is not offered: finetune loads "
        "an MXFP4 or FP8 checkpoint dequantized, and quantizes the base with bitsandbytes for adapter.type: qlora",
    )


def _weights_dtype(conv: Conversion) -> None:
    """axolotl's bfloat16 / float16 switches load the weights in that dtype (bf16 or bfloat16 first). With bf16
    off (not its default `auto`) and fp16 off, axolotl's resolve_dtype turns no autocast on and loads the weights
    in float32 (float16 with float16 or load_in_8bit, bfloat16 with bfloat16): no mixed precision."""
    bf16 = is_on(conv.take("bfloat16"))
    fp16 = is_on(conv.take("float16"))
    if bf16:
        conv.set("model.dtype", "bfloat16")
    elif fp16 and not is_on(conv.raw.get("bf16")):
        conv.set("model.dtype", "float16")
    if conv.has("bf16") and not is_on(conv.raw["bf16"]) and not is_on(conv.raw.get("fp16")):
        dtype = "bfloat16" if bf16 else "float16" if fp16 or is_on(conv.raw.get("load_in_8bit")) else "float32"
        no_mixed_precision(conv, dtype=dtype, why=f"axolotl with bf16 and fp16 off loads the weights in {dtype}")


def _cosine_floor(conv: Conversion) -> None:
    """cosine_min_lr_ratio: axolotl's cosine decays to that share of the peak (lr_scheduler cosine only); 1.0 holds
    the peak after warmup. cosine_constant_lr_ratio (with it): the floor is reached at that share of the steps and
    held for the rest, which finetune's schedules do not do."""
    ratio, constant = conv.take("cosine_min_lr_ratio"), conv.take("cosine_constant_lr_ratio")
    if ratio is None:
        if constant:
            conv.drop(
                "cosine_constant_lr_ratio", constant, "axolotl reads it only with cosine_min_lr_ratio", material=False
            )
        return
    if conv.get("train.scheduler", "cosine") != "cosine":
        for key, value in (("cosine_min_lr_ratio", ratio), ("cosine_constant_lr_ratio", constant)):
            if value is not None:
                conv.drop(
                    key,
                    value,
                    f"axolotl reads it only with lr_scheduler cosine, not {conv.get('train.scheduler')}",
                    material=False,
                )
        return
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 <= ratio <= 1:
        conv.drop(
            "cosine_min_lr_ratio", ratio, "must be a share of the peak learning rate (0 to 1); set train.min_lr_ratio"
        )
        return
    if ratio == 1:
        conv.set("train.scheduler", "constant_with_warmup")
        conv.notes.append(
            "cosine_min_lr_ratio 1.0 holds the peak learning rate after warmup: train.scheduler constant_with_warmup"
        )
        if constant:
            conv.drop("cosine_constant_lr_ratio", constant, "the learning rate is constant already", material=False)
        return
    conv.set("train.scheduler", "cosine_with_min_lr")
    conv.set("train.min_lr_ratio", ratio)
    if constant and constant < 1:
        conv.drop(
            "cosine_constant_lr_ratio",
            constant,
            f"axolotl's cosine reaches its floor ({ratio:g} of the peak) after {constant:g} of the steps and holds it "
            "for the rest; finetune's cosine_with_min_lr reaches it at the last step: remove the key to decay over the "
            "whole run, or shorten the run (train.max_steps) to the decay",
        )
    elif constant:
        conv.drop("cosine_constant_lr_ratio", constant, "1 or more decays over the whole run, as here", material=False)


def _model_overrides(conv: Conversion) -> None:
    """overrides_of_model_config (model_config before it): its rope_scaling is model.rope_scaling, its
    attention_dropout model.attention_dropout; any other config.json override is reported."""
    for key in ("overrides_of_model_config", "model_config"):
        rest = take_mapping(conv, key, of="model config.json keys")
        if rest is None:
            continue
        rope = rest.pop("rope_scaling", None)
        if isinstance(rope, dict):
            conv.set("model.rope_scaling", rope)
        elif rope is not None:
            rest["rope_scaling"] = rope
        dropout = rest.pop("attention_dropout", None)
        if isinstance(dropout, (int, float)) and not isinstance(dropout, bool):
            conv.set("model.attention_dropout", float(dropout))
        elif dropout is not None:
            rest["attention_dropout"] = dropout
        if rest:
            conv.drop(
                key,
                rest,
                "only rope_scaling (model.rope_scaling) and attention_dropout (model.attention_dropout) have "
                "finetune settings; the model keeps its own values for the rest (edit its config.json, or remove them)",
            )


def _trackers(conv: Conversion) -> None:
    """axolotl turns a tracker on by naming its project (wandb_project, mlflow_experiment_name)."""
    trackers = []
    mode = str(conv.take("wandb_mode") or "online")
    if conv.has("wandb_project") and mode != "disabled":
        trackers.append("wandb")
        conv.set("logging.offline", mode == "offline")
    if conv.has("mlflow_experiment_name") or conv.has("mlflow_tracking_uri"):
        trackers.append("mlflow")
        if conv.has("mlflow_experiment_name") and not conv.has("wandb_project"):
            conv.set("logging.project", conv.take("mlflow_experiment_name"))
        if conv.has("mlflow_tracking_uri"):
            conv.drop(
                "mlflow_tracking_uri",
                conv.take("mlflow_tracking_uri"),
                "set MLFLOW_TRACKING_URI in the environment",
                material=False,
            )
    if conv.take("use_tensorboard"):
        trackers.append("tensorboard")
    if trackers:
        conv.set("logging.report_to", trackers)

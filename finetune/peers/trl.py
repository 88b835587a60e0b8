"""A TRL CLI config (`trl sft|dpo|kto|reward --config FILE`: SFTConfig/DPOConfig keys, ModelConfig,
ScriptArguments) -> a recipe. The method is the subcommand, which the file does not say: --method
names it, else a key only one trainer's config has; a guess from keys several trainers share (beta: DPO,
ORPO, CPO, KTO) is reported, so the command exits non-zero until --method confirms it."""

from __future__ import annotations

from finetune.data.splits import has_slice
from finetune.peers import Conversion
from finetune.peers.common import (
    CPO_ALPHA,
    DTYPES,
    NO_TRAINING_EFFECT,
    as_list,
    attention,
    batch_sizes,
    held_out,
    loss_type,
    not_offered_when_on,
    optimizer,
    scheduler,
    sniff_format,
    target_parameters,
    template,
    trainer_defaults,
)
from finetune.peers.distributed import accelerate_file
from finetune.recipe.aliases import is_on
from finetune.recipe.schema import FORMAT_COLUMNS

# TRL's own keys that change nothing finetune does (the peers' shared ones are NO_TRAINING_EFFECT)
IGNORED = (
    NO_TRAINING_EFFECT
    | {
        k: "finetune decides this itself or has no such switch"
        for k in (
            "run_name",
            "bnb_4bit_quant_storage",
            "ignore_bias_buffers",
            "padding_free",
            "lora_task_type",
        )
    }
    | {
        "max_prompt_length": "TRL 1.x has no prompt limit either; a pair longer than data.max_length is truncated "
        "whole",
        "dataset_test_split": "read only when eval_strategy is not 'no'",
    }
)
METHODS = ("sft", "dpo", "kto", "reward", "orpo", "cpo")
# keys only one trainer's config has (TRL 1.x's KTOConfig, CPOConfig, RewardConfig, DPOConfig, SFTConfig): the
# method they name when --method is not given
ONLY_IN = (
    ("kto", ("desirable_weight", "undesirable_weight")),
    ("cpo", ("simpo_gamma", "cpo_alpha")),
    ("reward", ("center_rewards_coefficient",)),
    ("dpo", ("rpo_alpha",)),
    ("sft", ("dataset_text_field", "packing", "completion_only_loss", "assistant_only_loss")),
)
# keys several preference trainers share (DPO, ORPO, CPO and KTO all have beta): dpo is only a guess from them
PREFERENCE_KEYS = ("beta", "loss_type", "max_prompt_length", "precompute_ref_log_probs")
# ScriptArguments.dataset_test_split's default: what `trl sft|dpo|...` evaluates on when eval_strategy is not "no"
TEST_SPLIT = "test"


# TRL 1.x's own defaults (SFTConfig, DPOConfig, KTOConfig, RewardConfig, trl.experimental's ORPOConfig and
# CPOConfig) that change training and differ from finetune's, beside transformers' (common.TRAINER_DEFAULTS): written
# out when the config leaves the key out
LEARNING_RATES = {"sft": 2e-5, "dpo": 1e-6, "kto": 1e-6, "orpo": 1e-6, "cpo": 1e-6, "reward": 1e-4}
TRL_DEFAULTS: tuple[tuple[tuple[str, ...], str, object], ...] = (
    (("max_length", "max_seq_length"), "data.max_length", 1024),
)
# per-row columns TRL hands to the chat template (SFT/DPO rows): each row renders with its own arguments
TEMPLATE_COLUMNS = {
    "chat_template_kwargs": "each row's template arguments (e.g. enable_thinking)",
    "tools": "each row's tool schemas",
}


# SFTConfig/DPOConfig's model_init_kwargs (from_pretrained's arguments when the model is a name) -> the top-level
# ModelConfig key each one is, read as those are; what from_pretrained takes for placement only changes nothing here
INIT_KWARGS = {
    "dtype": "dtype",
    "torch_dtype": "torch_dtype",
    "attn_implementation": "attn_implementation",
    "trust_remote_code": "trust_remote_code",
    "revision": "model_revision",
}
INIT_KWARGS_IGNORED = {
    "device_map": "finetune places the model on the ranks' GPUs itself (the plan's strategy)",
    "low_cpu_mem_usage": "finetune loads the weights as the plan's host RAM says (sharded under FSDP2)",
    "use_cache": "training never uses the KV cache",
}


def _model_init_kwargs(conv: Conversion) -> None:
    """model_init_kwargs' entries read as the top-level keys they duplicate (a key the config also sets at the top
    level keeps that value); placement-only entries are ignored with the reason, any other is reported."""
    kwargs = conv.take("model_init_kwargs")
    if not isinstance(kwargs, dict):
        if kwargs is not None:
            conv.drop("model_init_kwargs", kwargs, "not a mapping of from_pretrained's arguments")
        return
    for name, value in kwargs.items():
        key = f"model_init_kwargs.{name}"
        if name in INIT_KWARGS:
            top = INIT_KWARGS[name]
            if conv.raw.get(top) is None:
                conv.raw[top] = value
            elif conv.raw[top] != value:
                conv.drop(key, value, f"the config's top-level {top} ({conv.raw[top]}) is read instead")
        elif name in INIT_KWARGS_IGNORED:
            conv.drop(key, value, INIT_KWARGS_IGNORED[name], material=False)
        else:
            conv.drop(key, value, "a from_pretrained argument finetune does not pass (docs/porting.md: the model keys)")


def convert(conv: Conversion, *, method: str | None) -> None:
    conv.set("model.name", conv.take("model_name_or_path", ""))
    _model_init_kwargs(conv)
    if method is None:
        method = _method_from_keys(conv)
    if method not in METHODS:
        conv.drop("method", method, f"trl {method} has no finetune method")
        method = "sft"
    conv.set("method.type", {"cpo": "simpo"}.get(method, method))
    if method in ("dpo", "kto", "orpo", "cpo") and conv.has("beta"):
        conv.set("method.beta", conv.take("beta"))
    if method == "dpo" and conv.has("loss_type"):
        loss_type(conv, "loss_type")
    if method == "cpo" and conv.raw.get("loss_type", "sigmoid") != "simpo":
        conv.drop(
            "loss_type",
            conv.take("loss_type") or "sigmoid",
            "CPO is offered with loss simpo only (method: simpo; cpo_alpha > 0 adds CPO's NLL term)",
        )
    conv.used.add("loss_type")
    _method_knobs(conv, method)
    if conv.take("use_peft"):
        conv.set("adapter.type", "qlora" if conv.take("load_in_4bit") else "lora")
        if conv.get("adapter.type") == "qlora":
            if conv.has("bnb_4bit_quant_type"):
                conv.set("adapter.quant_type", conv.take("bnb_4bit_quant_type"))
            conv.set("adapter.double_quant", bool(conv.take("use_bnb_nested_quant")))  # TRL's default: off
        else:
            conv.used.update({"bnb_4bit_quant_type", "use_bnb_nested_quant"})
        if conv.take("load_in_8bit"):
            conv.set("adapter.load_in_8bit", True)
        targets = conv.take("lora_target_modules")
        if targets is not None:
            conv.set("adapter.target_modules", targets if targets == "all-linear" else as_list(targets))
        target_parameters(conv, "lora_target_parameters")
    else:
        conv.set("adapter.type", "full")
        for key in (
            "lora_r",
            "lora_alpha",
            "lora_dropout",
            "lora_target_modules",
            "lora_target_parameters",
            "lora_modules_to_save",
            "load_in_4bit",
            "load_in_8bit",
            "use_dora",
            "use_rslora",
        ):
            if conv.has(key):
                conv.drop(key, conv.raw[key], "use_peft is off, so this LoRA setting does nothing", material=False)
    _datasets(conv, method)
    _loss_mask(conv, method)
    _packing_strategy(conv)
    if conv.has("model_revision"):
        conv.set("model.revision", conv.take("model_revision"))
    template(conv, "chat_template")
    if conv.has("run_name"):
        conv.set("logging.run_name", conv.take("run_name"))
    dtype = conv.take("dtype") or conv.take("torch_dtype")
    if dtype is not None and DTYPES.get(str(dtype)):
        conv.set("model.dtype", DTYPES[str(dtype)])
    attention(conv, "attn_implementation")
    not_offered_when_on(conv)  # SFTConfig's activation_offloading
    if conv.take("average_tokens_across_devices") is False:
        conv.drop(
            "average_tokens_across_devices",
            False,
            "finetune averages the loss over the tokens of every rank (transformers' default); a per-rank mean "
            "is not offered",
        )
    for name in ("eos_token", "pad_token"):  # SFTConfig's token overrides
        if conv.has(name):
            conv.set(f"tokenizer.{name}", conv.take(name))
    field = conv.take("dataset_text_field")
    if field and field != "text":
        for src in conv.get("data.sources", []) + conv.get("data.eval_sources", []):
            if src["format"] == "text":
                src["columns"] = {"text": field}
    _trl_defaults(conv, method)
    optimizer(conv, "optim")
    scheduler(conv, "lr_scheduler_type")
    batch_sizes(conv)  # transformers' TrainingArguments names, as both tools use them
    if conv.has("max_seq_length"):
        conv.set("data.max_length", conv.take("max_seq_length"))
    # the config's own mixed precision (TRL's bf16 is on unless fp16 is); with both off the accelerate file decides
    bf16 = not conv.has("bf16") or is_on(conv.raw["bf16"])
    precision = "fp16" if is_on(conv.raw.get("fp16")) else "bf16" if bf16 else None
    accelerate_file(conv, "accelerate_config", precision=precision)


def _method_from_keys(conv: Conversion) -> str:
    """The trainer a config without --method is for: named by keys only its config has, else guessed (dpo from
    the shared preference keys) and reported, since ORPO, CPO and KTO configs look like DPO ones."""
    preference = [k for k in PREFERENCE_KEYS if conv.has(k)]
    named = {m: [k for k in keys if conv.has(k)] for m, keys in ONLY_IN if any(conv.has(k) for k in keys)}
    if len(named) == 1 and not (preference and "sft" in named):
        ((method, keys),) = named.items()
        conv.notes.append(
            f"method {method}: the trl subcommand is not in the file; {', '.join(keys)} only trl {method}'s config "
            "has (pass --method to say otherwise)"
        )
        return method
    method = "dpo" if preference else next(iter(named), "sft")
    why = [f"{', '.join(preference)} fit dpo, orpo, cpo and kto alike"] if preference else []
    why += [f"{', '.join(keys)} point at {m}" for m, keys in named.items()]
    conv.drop(
        "method",
        method,
        f"the trl subcommand is not in the file ({'; '.join(why) or 'no key names a trainer'}): {method} is a guess; "
        f"pass --method with the subcommand the config is for ({' | '.join(METHODS)}, e.g. --method orpo for an "
        "ORPOTrainer config)",
    )
    return method


def _trl_defaults(conv: Conversion, method: str) -> None:
    """The TRL defaults the config relies on where finetune's differ (3 epochs, per-device batch 8, max_length
    1024, a linear schedule without warmup, the trainer's own learning rate), written out with a note."""
    written = trainer_defaults(conv, lr=LEARNING_RATES[method], more=TRL_DEFAULTS)
    if method == "cpo" and not conv.has("cpo_alpha"):
        conv.set("method.cpo_alpha", CPO_ALPHA)
        written.append(f"cpo_alpha {CPO_ALPHA:g}")
    if written:
        conv.notes.append(
            f"TRL's defaults written out, as the config leaves them to trl {method}: {', '.join(written)}"
        )


def _format(conv: Conversion, method: str) -> str:
    if method == "sft":  # SFTConfig's dataset_text_field names a plain-text column; without it, conversations
        return "text" if conv.raw.get("dataset_text_field") else "messages"
    return "unpaired" if method == "kto" else "preference"


def _eval_strategy(conv: Conversion) -> str:
    return str(conv.raw.get("eval_strategy", conv.raw.get("evaluation_strategy", "no")))


def _evaluates(conv: Conversion) -> bool:
    return _eval_strategy(conv) != "no" or bool(conv.raw.get("do_eval"))


def _source(conv: Conversion, path: str, method: str, **extra) -> dict:
    fmt = sniff_format(conv, path, method=method)
    if fmt is None:
        fmt = _format(conv, method)
        why = " (dataset_text_field is set)" if fmt == "text" else ""
        note = f"format {fmt} assumed for {path}{why}; check data.sources[].format"
        if note not in conv.notes:
            conv.notes.append(note)
    src = {"path": conv.local_path(path), "format": fmt}
    return src | {k: v for k, v in extra.items() if v is not None}


def _datasets(conv: Conversion, method: str) -> None:
    """dataset_name (ScriptArguments), the handbooks' dataset_mixer + dataset_splits, and dataset_mixture /
    datasets (a list of {path|id, config|name, split, columns, weight}) -> data.sources."""
    sources: list[dict] = []
    evals: list[dict] = []
    name = conv.take("dataset_name")
    test_split = conv.take("dataset_test_split")
    if name:
        src = _source(conv, str(name), method, subset=conv.take("dataset_config"))
        src["split"] = conv.take("dataset_train_split", "train")
        sources.append(src)
        # trl's scripts evaluate on dataset[dataset_test_split] whenever eval_strategy is not "no"
        if (_evaluates(conv) and test_split) or (not test_split and _eval_strategy(conv) != "no"):
            evals.append({**src, "split": test_split or TEST_SPLIT})
            if not test_split:
                conv.notes.append(
                    f"data.eval_sources: {name} split {TEST_SPLIT}, TRL's dataset_test_split default, which trl "
                    "evaluates on when eval_strategy is not 'no'; check that the dataset has that split"
                )
        elif test_split:
            conv.drop("dataset_test_split", test_split, "eval_strategy is 'no', so it is not read", material=False)
    mixer = conv.take("dataset_mixer")
    if mixer:
        splits = [str(x) for x in as_list(conv.take("dataset_splits"))] or ["train", "test"]
        weights = mixer if isinstance(mixer, dict) else {str(m): 1.0 for m in as_list(mixer)}
        if not all(isinstance(w, (int, float)) and w > 0 for w in weights.values()):
            conv.drop("dataset_mixer", mixer, "must map dataset ids to positive weights")
            weights = {}
        # the handbooks' dataset_configs: one config (our subset) per dataset_mixer entry, in its order
        configs = [None if c in (None, "None") else str(c) for c in as_list(conv.take("dataset_configs"))]
        if configs and len(configs) != len(weights):
            conv.drop(
                "dataset_configs",
                configs,
                f"needs one config per dataset_mixer entry ({len(weights)}); set data.sources[].subset by hand",
            )
            configs = []
        for j, (path, weight) in enumerate(weights.items()):
            for split in splits:
                src = _source(conv, str(path), method, split=split, subset=configs[j] if configs else None)
                if "test" in split:  # the older handbooks' mix_datasets: test splits are held out, never subsampled
                    if _evaluates(conv):
                        evals.append(src)
                else:  # and a train split keeps its first weight x rows
                    _share(conv, f"dataset_mixer.{path}", src, weight, index=len(sources), shuffled=False)
                    sources.append(src)
    mixture = conv.take("dataset_mixture")
    entries, prefix = conv.take("datasets"), "datasets"
    holdout: tuple[str, object] | None = None
    if isinstance(mixture, dict):
        if mixture.get("datasets"):
            entries, prefix = mixture["datasets"], "dataset_mixture.datasets"
        if mixture.get("seed") is not None:
            conv.set("data.seed", mixture["seed"])
        if mixture.get("test_split_size") is not None:
            holdout = ("dataset_mixture.test_split_size", mixture["test_split_size"])
        for key in sorted(set(mixture) - {"datasets", "seed", "test_split_size"}):
            conv.drop(f"dataset_mixture.{key}", mixture[key], "dataset_mixture option without a finetune equivalent")
    elif mixture is not None:
        conv.drop("dataset_mixture", mixture, "must be a mapping with datasets (and seed, test_split_size)")
    if conv.has("test_split_size"):  # TRL's own DatasetMixtureConfig, at the top level
        holdout = ("test_split_size", conv.take("test_split_size"))
    # the handbook's get_dataset (and TRL's) concatenates every listed split into the training rows, whatever the
    # split is named, and then holds out test_split_size of them
    for i, entry in enumerate(as_list(entries)):
        key = f"{prefix}[{i}]"
        if not isinstance(entry, dict) or not (entry.get("path") or entry.get("id")):
            conv.drop(key, entry, "a dataset entry needs a path (or id)")
            continue
        src = _source(
            conv,
            str(entry.get("path") or entry.get("id")),
            method,
            subset=entry.get("config") or entry.get("name"),
            split=entry.get("split"),
        )
        _share(conv, f"{key}.weight", src, entry.get("weight"), index=len(sources), shuffled=True)
        _template_columns(conv, f"{key}.columns", entry.get("columns"), src["format"])
        rest = set(entry) - {"path", "id", "config", "name", "split", "weight", "columns"}
        for option in sorted(rest):
            conv.drop(f"{key}.{option}", entry[option], "dataset option without a finetune equivalent")
        sources.append(src)
    if sources:
        conv.set("data.sources", sources)
    if evals:
        conv.set("data.eval_sources", evals)
    if holdout is not None:
        _holdout(conv, *holdout, given=bool(evals))


def _share(conv: Conversion, key: str, src: dict, weight: object, *, index: int, shuffled: bool) -> None:
    """A handbook weight keeps that share of the split's rows (it does not set a sampling proportion): a
    whole percentage becomes a slice of data.sources[].split; any other share is reported."""
    if weight is None or weight == 1:
        return
    split = str(src.get("split") or "train")
    ours = f"data.sources[{index}].split"
    if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not 0 < weight < 1:
        conv.drop(key, weight, f"keeps that share of the split's rows (0 < weight <= 1); set {ours} to a slice")
        return
    percent = weight * 100
    if has_slice(split) or abs(percent - round(percent)) > 1e-9:
        conv.drop(
            key,
            weight,
            f"keeps {weight:g} of the split's rows; finetune slices a split by whole percentages or row numbers: "
            f"set {ours} to {split.split('[')[0]}[:N%] or [:ROWS]",
        )
        return
    src["split"] = f"{split}[:{round(percent)}%]"
    note = "weights below 1 keep that share of each split's rows (data.sources[].split slices): " + (
        "the handbook draws them at random (its seed), here they are the split's first rows"
        if shuffled
        else "its first rows, as the handbook's dataset_mixer takes them"
    )
    if note not in conv.notes:
        conv.notes.append(note)


def _template_columns(conv: Conversion, key: str, columns: object, fmt: str) -> None:
    """columns: the handbook keeps only these; the ones TRL passes to the chat template per row are reported."""
    for column in as_list(columns):
        if column in TEMPLATE_COLUMNS and column not in FORMAT_COLUMNS[fmt]:
            conv.drop(
                key,
                column,
                f"TRL renders {TEMPLATE_COLUMNS[column]} from the {column} column; finetune renders every row with "
                "the same template arguments, so rows that set them differently train on other text: drop the "
                "column to render every row alike, or render the rows to text yourself (format text)",
            )


def _holdout(conv: Conversion, key: str, size: object, *, given: bool) -> None:
    """test_split_size: a share (float) or a row count (int) of the mixed training rows held out for eval."""
    if given:
        conv.drop(key, size, "held-out splits are given too (data.eval_sources); finetune takes one")
    else:
        held_out(conv, key, size)


def _loss_mask(conv: Conversion, method: str) -> None:
    """TRL's SFT defaults: completion_only_loss (None = on) for prompt/completion rows, assistant_only_loss
    (off) for conversations; finetune has one switch, data.assistant_only_loss."""
    completion, assistant = conv.take("completion_only_loss"), conv.take("assistant_only_loss")
    if method != "sft":
        return
    formats = {s["format"] for s in conv.get("data.sources", [])}
    if formats <= {"prompt_completion"} and formats:
        conv.set("data.assistant_only_loss", completion is not False)
    elif formats <= {"text"} and formats:
        return
    else:
        conv.set("data.assistant_only_loss", bool(assistant))
        if assistant is None:
            conv.notes.append(
                "data.assistant_only_loss false: TRL's default trains conversations on every token; set it "
                "to true for loss on the assistant turns only"
            )


# SFTConfig.packing_strategy values other than bfd, finetune's sft packing (whole examples, padding-free, each
# attending only to itself, one longer than max_length truncated): what they train on instead
PACKING_STRATEGIES = {
    "wrapped": "cuts the examples into rows of max_length mid-sequence (attending across examples without "
    "padding_free)",
    "bfd_split": "splits examples longer than max_length across rows instead of truncating them",
}


# TRL's earlier names of its strategies (SFTConfig renames them and warns)
PACKING_RENAMED = {"bfd-requeue": "bfd_split"}


def _packing_strategy(conv: Conversion) -> None:
    written = conv.take("packing_strategy")
    strategy = PACKING_RENAMED.get(written, written) if isinstance(written, str) else written
    if strategy in (None, "bfd"):
        return
    if not is_on(conv.raw.get("packing")):
        conv.drop("packing_strategy", written, "packing is off, so it is not read", material=False)
        return
    conv.drop(
        "packing_strategy",
        written,
        f"TRL's {strategy} packing {PACKING_STRATEGIES.get(str(strategy), 'is not offered')}; finetune packs whole "
        "examples, each attending only to itself, and truncates one longer than data.max_length (TRL's bfd): "
        "remove it for that"
        + (
            "; method: pretrain splits long documents across rows (format text, loss on every token)"
            if strategy == "bfd_split"
            else ""
        ),
    )


def _method_knobs(conv: Conversion, method: str) -> None:
    """DPOConfig / KTOConfig / RewardConfig settings with a finetune field, and those without one."""
    if conv.take("precompute_ref_log_probs"):
        conv.set("method.reference", "precompute")
    for key in ("desirable_weight", "undesirable_weight", "center_rewards_coefficient"):
        if conv.has(key):
            conv.set(f"method.{key}", conv.take(key))
    for key in ("rpo_alpha", "label_smoothing", "sync_ref_model", "use_weighting", "ld_alpha", "f_divergence_type"):
        if conv.raw.get(key) not in (None, False, 0, 0.0, "reverse_kl"):
            conv.drop(key, conv.take(key), f"not offered for {method}: finetune runs TRL's loss with its defaults")
        conv.used.add(key)
    # the preference and reward trainers' configs turn dropout off by default, as finetune runs them
    # (recipe.schema.DROPOUT_OFF_METHODS); SFTConfig has no such key
    if method != "sft" and conv.has("disable_dropout"):
        value = conv.take("disable_dropout")
        if is_on(value):
            conv.drop("disable_dropout", value, f"TRL's default for trl {method}, which finetune keeps", material=False)
        else:
            conv.drop(
                "disable_dropout",
                value,
                f"finetune runs trl {method} with the model's dropout off (TRL's default); keeping it is not offered",
            )

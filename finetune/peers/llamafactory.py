"""LLaMA-Factory's YAML config (model_name_or_path, stage, finetuning_type, dataset names) -> a recipe.

Dataset names are looked up in `dataset_info.json` under `dataset_dir` (default: data/ next to the
config, then the current directory), as LLaMA-Factory does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune.data.preference import PROMPT_FALLBACKS
from finetune.errors import RecipeError
from finetune.peers import Conversion
from finetune.peers.common import (
    FLASH_KERNELS,
    LIGER_REASON,
    NO_TRAINING_EFFECT,
    TRAINER_LR,
    as_list,
    batch_sizes,
    coerce_numbers,
    continue_adapter,
    first_row,
    flash_attention,
    held_out,
    message_format,
    no_mixed_precision,
    optimizer,
    read_role,
    scheduler,
    template,
    trainer_defaults,
)
from finetune.peers.distributed import deepspeed_file
from finetune.recipe.aliases import is_on
from finetune.recipe.schema import AdapterSection

# LLaMA-Factory's own keys that change nothing finetune does (the peers' shared ones are NO_TRAINING_EFFECT)
IGNORED = (
    NO_TRAINING_EFFECT
    | {
        k: "finetune decides this itself or has no such switch"
        for k in (
            "do_predict",
            "use_unsloth",
            "infer_backend",
            "tokenized_path",
            "streaming",
            "buffer_size",
            "trust_remote_code_hf",
            "upcast_layernorm",
            "upcast_lmhead_output",
            "create_new_adapter",
            "packing_strategy",
            "quantization_device_map",
            "report_to_swanlab",
            "export_dir",
        )
    }
    | {
        "resize_vocab": "finetune grows the embeddings itself when tokenizer.added_tokens needs it",
    }
)
IGNORED["enable_liger_kernel"] = LIGER_REASON
# optimizer families LLaMA-Factory switches on with use_X (their own keys come along: galore_rank, ...)
OPTIMIZER_SWITCHES = ("use_galore", "use_badam", "use_apollo", "use_adam_mini", "use_muon")
# LoRA initializations and variants finetune does not offer
LORA_EXTRAS = ("pissa_init", "pissa_convert", "use_llama_pro", "use_mca")
STAGES = {"sft": "sft", "pt": "pretrain", "dpo": "dpo", "kto": "kto", "rm": "reward"}
# LLaMA-Factory's LoraArguments defaults: lora_rank 8, lora_alpha unset = 2 x lora_rank, lora_target all
LORA_RANK = 8
LORA_ALPHA_PER_RANK = 2
LORA_TARGET = "all"
# LLaMA-Factory's own templates with no shipped equivalent here: what each renders (data/template.py)
TEMPLATE_RENDERS = {
    "default": "'Human: {user}<eos>\\nAssistant:' before each answer and '{answer}<eos>\\n' after it",
    "empty": "the turns' text run together with no role markers and no end-of-sequence token",
}
# an export (merge) config's keys: `llamafactory-cli export` merges adapter_name_or_path into the base
EXPORT_KEYS = ("export_dir", "export_size", "export_device", "export_legacy_format", "export_quantization_bit")
# LLaMA-Factory's flash_attn / attn -> model.attn_implementation; fa2/fa3 (and transformers' names) ask for flash
# attention, which finetune's default runs (FLASH_REASON)
ATTENTION = {"sdpa": "sdpa", "disabled": "eager", "eager": "eager"}
FLASH_ATTENTION = ("fa2", "fa3", *FLASH_KERNELS)
PREF_LOSS = {
    "orpo": ("orpo", None),
    "simpo": ("simpo", None),
    "sigmoid": ("dpo", "sigmoid"),
    "ipo": ("dpo", "ipo"),
    "hinge": ("dpo", "hinge"),
}


# dataset_info.json columns finetune's formats have no place for (LLaMA-Factory's system prompt, earlier turns of an
# alpaca row, tool schemas, media)
UNREAD_COLUMNS = ("system", "history", "tools", "images", "videos", "audios")
# the sharegpt speaker tags (data/README.md) and the chat role each names; function_tag (a tool call) is a turn of
# its own that neither format reads
TAG_ROLES = {"user_tag": "user", "assistant_tag": "assistant", "system_tag": "system", "observation_tag": "tool"}


# LLaMA-Factory's dataset_dir naming a Hub dataset repo that holds its dataset_info.json
REMOTE_PREFIX = "REMOTE:"


def _dataset_info(conv: Conversion) -> tuple[dict | None, Path | None, str]:
    """dataset_info.json under dataset_dir (the config's folder, then the current one): its entries, its folder,
    and where it was looked for (said when a name is not found)."""
    named = str(conv.take("dataset_dir") or "data")
    if named.startswith(REMOTE_PREFIX):  # LLaMA-Factory reads dataset_info.json from a Hub dataset repo
        repo = named[len(REMOTE_PREFIX) :]
        return (
            None,
            None,
            (
                f"dataset_dir {named}: a dataset_info.json in the Hub dataset {repo} is not read (finetune reads local "
                f"files and Hub datasets by id): download it (hf download {repo} --repo-type dataset --local-dir DIR)"
            ),
        )
    folder = Path(named)
    looked = []
    for base in (conv.config_dir, Path.cwd()):
        path = (folder if folder.is_absolute() else base / folder) / "dataset_info.json"
        if path.is_file():
            try:
                info = json.loads(path.read_text(encoding="utf-8"))
            except ValueError as exc:
                return None, None, f"{path} is not valid JSON ({exc})"
            return (info, path.parent, str(path)) if isinstance(info, dict) else (None, None, f"{path} is no mapping")
        looked.append(str(path.parent))
        if folder.is_absolute():
            break
    return None, None, f"no dataset_info.json in {' or '.join(dict.fromkeys(looked))} (dataset_dir)"


def _source(conv: Conversion, name: str, info: dict | None, folder: Path | None, key: str, where: str) -> dict | None:
    if not isinstance(name, str):
        conv.drop(key, name, "must be a dataset name from dataset_info.json (comma-separated for several)")
        return None
    entry = (info or {}).get(name)
    if not isinstance(entry, dict):
        found = f"not an entry of {where}" if info is not None else where
        conv.drop(
            key,
            name,
            f"{found}; set dataset_dir to the folder with LLaMA-Factory's dataset_info.json, or add the data to "
            "data.sources by path",
        )
        return None
    if entry.get("file_name"):
        src: dict[str, Any] = {"path": conv.local_path(str(folder / entry["file_name"]))}
    elif entry.get("hf_hub_url"):
        src = {"path": entry["hf_hub_url"]}
        if entry.get("subset"):
            src["subset"] = entry["subset"]
        if entry.get("split"):
            src["split"] = entry["split"]
    else:
        conv.drop(key, name, "dataset_info.json entry without file_name or hf_hub_url (ms/om hubs are not read)")
        return None
    columns = entry.get("columns") or {}
    sharegpt = entry.get("formatting") == "sharegpt"
    unread = {k: columns[k] for k in UNREAD_COLUMNS if columns.get(k)}
    if unread:
        conv.drop(
            f"{key}.columns",
            unread,
            "a separate system/history/tools/images column is not read; put the system prompt and earlier turns into "
            "the messages (images and videos are not trained)",
        )
    messages = _message_tags(conv, key, entry.get("tags") or {}) if sharegpt else None
    if entry.get("ranking"):
        src["format"] = "preference"  # conversations + chosen/rejected objects are recognized as they are
        # the prompt: the conversation (sharegpt) or the instruction column (alpaca), LLaMA-Factory's defaults
        prompt = columns.get("messages", "conversations") if sharegpt else columns.get("prompt", "instruction")
        mapped = {
            "prompt": None if prompt in PROMPT_FALLBACKS else prompt,
            "chosen": columns.get("chosen"),
            "rejected": columns.get("rejected"),
        }
        mapped = {ours: theirs for ours, theirs in mapped.items() if theirs and theirs != ours}
        if mapped:
            src["columns"] = mapped
        if not sharegpt:
            _query_column(conv, key, columns, src["path"], prompt=prompt, rows="preference rows")
    elif columns.get("kto_tag") and sharegpt:
        # LLaMA-Factory's kto_en_demo layout: one conversation whose last assistant turn is the completion
        conv.drop(
            key,
            name,
            "KTO rows as a sharegpt conversation plus a kto_tag are not read; finetune's KTO rows are "
            "prompt/completion/label (data.format: unpaired): split each conversation before its last assistant "
            "turn into prompt and completion, and add it to data.sources by path",
        )
        return None
    elif columns.get("kto_tag"):
        src["format"] = "unpaired"
        # LLaMA-Factory's alpaca columns default to instruction / output
        mapped = {
            "label": columns["kto_tag"],
            "prompt": columns.get("prompt", "instruction"),
            "completion": columns.get("response", "output"),
        }
        mapped = {k: v for k, v in mapped.items() if v and v != k}
        if mapped:
            src["columns"] = mapped
        _query_column(conv, key, columns, src["path"], prompt=columns.get("prompt", "instruction"), rows="KTO rows")
        conv.notes.append(
            f"{key}: KTO rows read as prompt/completion/label; map prompt/completion with "
            f"data.sources[].columns if they are named otherwise"
        )
    elif sharegpt:
        src["format"] = messages or "sharegpt"
        column = "messages" if src["format"] == "messages" else "conversations"
        theirs = columns.get("messages", "conversations")  # LLaMA-Factory's default, whatever the tags
        if theirs != column:
            src["columns"] = {column: theirs}
    elif conv.get("method.type") == "pretrain":
        src["format"] = "text"
        if columns.get("prompt", "text") != "text":
            src["columns"] = {"text": columns["prompt"]}
    else:
        src["format"] = "alpaca"
        mapped = {
            ours: columns[theirs]
            for ours, theirs in (("instruction", "prompt"), ("input", "query"), ("output", "response"))
            if columns.get(theirs)
        }
        mapped = {k: v for k, v in mapped.items() if k != v}
        if mapped:
            src["columns"] = mapped
        _query_join(conv, key, columns, src["path"])
    return src


def _query(conv: Conversion, columns: dict, path: str) -> tuple[str, bool | None]:
    """An alpaca entry's query column (LLaMA-Factory's default `input`, which it appends to the prompt) and whether
    its rows have one: True where the config names it or the local data's first row has one, None for a Hub
    dataset (its rows are not read here), False otherwise."""
    query = columns.get("query", "input")
    row = first_row(conv, path)
    if columns.get("query") or (row is not None and row.get(query)):
        return query, True
    return query, None if row is None and not Path(path).suffix else False


def _query_join(conv: Conversion, key: str, columns: dict, path: str) -> None:
    """LLaMA-Factory joins an alpaca row's prompt and query (input) with one newline (converter.py:
    "\\n".join(query)); finetune's alpaca format puts a blank line between them (data/formats.py). Said where the
    rows may have a query (`_query`)."""
    query, held = _query(conv, columns, path)
    if held is not False:
        conv.notes.append(
            f"{key}: LLaMA-Factory joins the instruction and the {query} column with one newline, finetune with a "
            f"blank line, so the trained prompts of rows with an {query} differ by that newline"
        )


def _query_column(conv: Conversion, key: str, columns: dict, path: str, *, prompt: str, rows: str) -> None:
    """An alpaca entry's query column (LLaMA-Factory's default `input`), which LLaMA-Factory appends to the prompt:
    finetune's preference and KTO rows take the prompt from one column, so a query the data holds is not trained.
    Reported where the rows have one (`_query`); a Hub dataset gets a note."""
    query, held = _query(conv, columns, path)
    why = (
        f"{rows} take the prompt from one column; join the query ({query}) column into the {prompt} column in the data"
    )
    if held:
        conv.drop(f"{key}.columns.query", query, why)
    elif held is None:
        conv.notes.append(f"{key}: if its rows have a {query} column, {why}")


def _message_tags(conv: Conversion, key: str, tags: dict) -> str:
    """A sharegpt entry's tags: the keys each message keeps its speaker and text under (role_tag / content_tag:
    role/content are messages rows, from/value sharegpt ones) and the speakers' names, each of which finetune must
    read as its role (common.read_role); any other is reported. The format its rows read as."""
    role, content = tags.get("role_tag", "from"), tags.get("content_tag", "value")
    fmt = message_format(role, content)
    if fmt is None:
        conv.drop(
            f"{key}.tags",
            {"role_tag": role, "content_tag": content},
            "finetune reads a message's speaker from `role` (or `from`) and its text from `content` (or `value`); "
            "rename those keys in the data",
        )
        fmt = "sharegpt"
    renamed = {tag: tags[tag] for tag, ours in TAG_ROLES.items() if tag in tags and read_role(fmt, tags[tag]) != ours}
    if renamed:
        conv.drop(
            f"{key}.tags",
            renamed,
            "renamed speakers are not mapped; finetune reads user/assistant/system/tool (and sharegpt's human/gpt/"
            "observation); rename them in the data",
        )
    if tags.get("function_tag"):
        conv.drop(
            f"{key}.tags.function_tag",
            tags["function_tag"],
            "a tool-call turn of its own has no place in finetune's formats (a row with that speaker is refused by "
            "`finetune validate`); write the call into the assistant turn's content in the data",
        )
    return fmt


def convert(conv: Conversion) -> None:
    section = conv.raw.get("train")
    if list(conv.raw) == ["train"] and isinstance(section, dict):
        # one upstream example (examples/extras/dyn_rope) keeps every argument under a `train:` section
        conv.raw = coerce_numbers(section)
        conv.notes.append("train: its keys read as the config's own (the train command's arguments)")
    _refuse_export(conv)
    _refuse_evaluation(conv)
    conv.set("model.name", conv.take("model_name_or_path", ""))
    stage = str(conv.take("stage", "sft"))
    if stage in STAGES:
        conv.set("method.type", STAGES[stage])
    else:
        conv.drop("stage", stage, f"stage {stage!r} is not offered (sft, pt, dpo, kto, rm)")
    if conv.has("pref_loss"):
        loss = str(conv.take("pref_loss"))
        if loss in PREF_LOSS:
            method, loss_type = PREF_LOSS[loss]
            conv.set("method.type", method)
            if loss_type:
                conv.set("method.loss_type", loss_type)
        else:
            conv.drop("pref_loss", loss, "no such preference loss here")
    if is_on(conv.take("pure_bf16")):
        # bf16 weights and no fp32 copy of them: what finetune trains with bfloat16 weights under bf16
        conv.set("model.dtype", "bfloat16")
        conv.set("train.precision", "bf16")
        conv.notes.append("pure_bf16: the weights load in bfloat16 and train in bf16 with no fp32 copy, as asked")
    kind = conv.take("finetuning_type", "lora")
    bits = conv.take("quantization_bit")
    quant = str(conv.take("quantization_method", "bnb") or "bnb").lower()
    if bits and quant not in ("bnb", "bitsandbytes"):
        conv.drop("quantization_method", quant, "only bitsandbytes quantization is offered (QLoRA NF4, 8-bit LoRA)")
    if bits not in (None, 4, 8):
        conv.drop("quantization_bit", bits, "only 4-bit (adapter: qlora) and 8-bit (load_in_8bit) are offered")
    if kind == "full":
        conv.set("adapter.type", "full")
        _full_precision(conv)
    elif kind == "lora":
        conv.set("adapter.type", "qlora" if bits == 4 else "lora")
        if bits == 8:
            conv.set("adapter.load_in_8bit", True)
        _lora_shape(conv)
    else:
        # written as it is, so the recipe fails validation on adapter.type rather than train LoRA in its place
        conv.set("adapter.type", str(kind))
        conv.drop(
            "finetuning_type",
            kind,
            f"finetuning_type {kind!r} is not offered: finetune trains every weight (adapter.type: full) or LoRA "
            f"adapters (lora, qlora); the recipe keeps adapter.type {kind!r} so it does not validate until you pick "
            "one",
        )
        for key in [k for k in conv.raw if k.startswith(f"{kind}_") or k == "module_dropout"]:
            conv.drop(key, conv.take(key), f"belongs to finetuning_type {kind}", material=False)
    info, folder, where = _dataset_info(conv)
    for ours, theirs in (("data.sources", "dataset"), ("data.eval_sources", "eval_dataset")):
        names = as_list(conv.take(theirs))
        sources = [s for i, n in enumerate(names) if (s := _source(conv, n, info, folder, f"{theirs}[{i}]", where))]
        if sources:
            conv.set(ours, sources)
    _mix_strategy(conv)
    max_samples = conv.take("max_samples")
    if max_samples:
        for src in conv.get("data.sources", []):
            src["max_samples"] = max_samples
    _method_extras(conv)
    continue_adapter(conv, "adapter_name_or_path")
    _template(conv)
    optimizer(conv, "optim")
    scheduler(conv, "lr_scheduler_type")
    batch_sizes(conv)  # transformers' TrainingArguments names, as both tools use them
    written = trainer_defaults(conv, lr=TRAINER_LR)  # LLaMA-Factory trains with TrainingArguments' own
    if written:
        conv.notes.append(
            f"transformers' defaults written out, as the config leaves them to LLaMA-Factory: {', '.join(written)}"
        )
    if conv.has("val_size"):
        held_out(conv, "val_size", conv.take("val_size"))
    deepspeed_file(conv, "deepspeed")


def _mix_strategy(conv: Conversion) -> None:
    """LLaMA-Factory's mix_strategy: concat (its default) joins the datasets, as finetune's data.sources do;
    interleave_under / interleave_over alternate them, stopping at the shortest or repeating the shorter ones
    until the longest is used up (datasets' interleave_datasets), which changes what is trained on."""
    strategy = str(conv.take("mix_strategy", "concat"))
    probs = conv.take("interleave_probs")
    if strategy == "concat":
        if probs is not None:
            conv.drop("interleave_probs", probs, "read only by an interleave mix_strategy", material=False)
        return
    conv.drop(
        "mix_strategy",
        strategy,
        "interleaving the datasets (stopping at the shortest, or repeating the shorter ones) is not offered: "
        "finetune joins data.sources and shuffles them; to weigh a source, repeat it or slice its split",
    )
    if probs is not None:
        conv.drop("interleave_probs", probs, "belongs to the interleave mix_strategy", material=False)


def _refuse_export(conv: Conversion) -> None:
    """An export config (`llamafactory-cli export`: merge an adapter into its base) trains nothing."""
    if conv.has("dataset") or not any(conv.has(k) for k in EXPORT_KEYS):
        return
    adapter = conv.raw.get("adapter_name_or_path") or "ADAPTER_DIR"
    out = conv.raw.get("export_dir") or "MERGED_DIR"
    raise RecipeError(
        "this is a LLaMA-Factory export (merge) config (export_dir, no dataset), not a training config; "
        "there is nothing to train",
        hint=f"merge the adapter with `finetune merge {adapter} -o {out}` (a directory with adapter_config.json), "
        "or convert the training config that produced it",
    )


# `llamafactory-cli eval` benchmarks (task: NAME_SPLIT) -> lm-eval's task names (finetune eval --tasks)
EVAL_TASKS = {"mmlu": "mmlu", "cmmlu": "cmmlu", "ceval": "ceval-valid"}


def _refuse_evaluation(conv: Conversion) -> None:
    """A config that trains nothing: `llamafactory-cli eval` (task: mmlu_test, ...) or `llamafactory-cli train`
    with do_predict / do_eval and no do_train (the Trainer trains only with do_train). Refused with the finetune
    command that does its job, as the export config is."""
    weights = conv.raw.get("adapter_name_or_path") or conv.raw.get("model_name_or_path") or "RUN_DIR"
    if conv.has("task") and not conv.has("dataset"):
        task = str(conv.raw["task"])
        name = EVAL_TASKS.get(task.split("_")[0], "TASKS")
        shots = f" --num-fewshot {conv.raw['n_shot']}" if conv.has("n_shot") else ""
        batch = f" --batch-size {conv.raw['batch_size']}" if conv.has("batch_size") else ""
        raise RecipeError(
            f"this is a LLaMA-Factory eval config (task: {task}, `llamafactory-cli eval`), not a training config; "
            "there is nothing to train",
            hint=f"run the benchmark with `finetune eval {weights} --tasks {name}{shots}{batch} --no-base` "
            "(lm-eval's task names; a directory with adapter_config.json or a model), or convert the training "
            "config that produced the model",
        )
    trains = is_on(conv.raw.get("do_train"))
    asked = [k for k in ("do_predict", "do_eval", "predict_with_generate") if is_on(conv.raw.get(k))]
    if trains or not (asked or conv.has("do_train")):
        return
    names = ",".join(str(n) for n in as_list(conv.raw.get("eval_dataset") or conv.raw.get("dataset"))) or "?"
    out = conv.raw.get("output_dir") or "OUT_DIR"
    raise RecipeError(
        f"this is a LLaMA-Factory {'predict' if asked else 'non-training'} config "
        f"({', '.join(asked) or 'do_train: false'}), not a training config; there is nothing to train",
        hint=f"generate with `finetune generate {weights} --file PROMPTS.jsonl -o "
        f"{out}/generated_predictions.jsonl` (PROMPTS.jsonl: the prompts of dataset {names} as "
        + '{"prompt"} or {"messages"} rows), score a benchmark with '
        + f"`finetune eval {weights} --tasks TASKS`, or convert the training config that produced "
        "the model",
    )


def _lora_shape(conv: Conversion) -> None:
    """lora_rank / lora_alpha / lora_target with LLaMA-Factory's defaults written out where they differ from
    ours (rank 8 and alpha 2 x rank there, 16 and 32 here; every linear layer there, the registry's here)."""
    rank = conv.take("lora_rank", LORA_RANK)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        conv.drop("lora_rank", rank, "must be a positive whole number; set adapter.r and adapter.alpha by hand")
        conv.used.add("lora_alpha")
        return
    alpha = conv.take("lora_alpha") or rank * LORA_ALPHA_PER_RANK  # LLaMA-Factory: `lora_alpha or 2 x rank`
    target = conv.take("lora_target", LORA_TARGET)
    conv.set("adapter.r", rank)
    conv.set("adapter.alpha", alpha)
    conv.set("adapter.target_modules", "all-linear" if target == LORA_TARGET else as_list(target))
    defaulted = [
        f"{theirs} {value}"
        for theirs, value in (
            ("lora_rank", rank),
            ("lora_alpha", f"{alpha} (2 x lora_rank)"),
            ("lora_target", f"{LORA_TARGET} (all-linear)"),
        )
        if not conv.raw.get(theirs)
    ]
    if defaulted:
        fields = AdapterSection.model_fields
        conv.notes.append(
            f"LLaMA-Factory's defaults written out: {', '.join(defaulted)} (finetune's own: adapter.r "
            f"{fields['r'].default}, adapter.alpha {fields['alpha'].default:g}, the model registry's targets)"
        )


def _full_precision(conv: Conversion) -> None:
    """A full fine-tune with neither bf16 nor fp16 (nor pure_bf16): LLaMA-Factory upcasts the trained weights to
    float32 and the Trainer runs no autocast, so it trains in fp32. BAdam keeps half-precision weights there
    (and is reported as not offered)."""
    if any(is_on(conv.raw.get(k)) for k in ("bf16", "fp16", "pure_bf16", "use_badam")):
        return
    no_mixed_precision(
        conv, dtype="float32", why="a LLaMA-Factory full fine-tune without bf16/fp16 upcasts the weights to float32"
    )


def _template(conv: Conversion) -> None:
    """template: a shipped template of the same rendering, or reported (stage pt reads no template)."""
    name = conv.raw.get("template")
    if isinstance(name, str) and name in TEMPLATE_RENDERS:
        pretrain = conv.get("method.type") == "pretrain"
        conv.drop(
            "template",
            conv.take("template"),
            "stage pt reads raw text; no template is applied"
            if pretrain
            else f"LLaMA-Factory's {name} template renders {TEMPLATE_RENDERS[name]}; no shipped template does, so "
            "the tokenizer's own would be used: write that layout as a .jinja file (assistant turns inside "
            "{% generation %}) and set data.chat_template to it, or pick a shipped one (chatml, llama3, ...)",
            material=not pretrain,
        )
        return
    template(conv, "template")


def _method_extras(conv: Conversion) -> None:
    """LLaMA-Factory's own method keys: loss masking, packing, KTO weights, LoRA extras, optimizer families."""
    if conv.take("disable_gradient_checkpointing"):
        conv.set("train.activation_checkpointing", "off")
    if conv.has("train_on_prompt"):
        conv.set("data.assistant_only_loss", not conv.take("train_on_prompt"))
    if conv.take("mask_history"):
        conv.drop(
            "mask_history",
            True,
            "loss on the last turn only is not offered; finetune trains every assistant turn (split the "
            "conversations into one row per final turn to get the same loss)",
        )
    if is_on(conv.raw.get("packing")) and not is_on(conv.raw.get("neat_packing")):
        conv.notes.append(
            "packing: LLaMA-Factory packs without neat_packing so that packed examples attend to one another; "
            "finetune's packing keeps each example to itself (what neat_packing does)"
        )
    if conv.take("neat_packing"):
        conv.set("data.packing", True)
        conv.notes.append("neat_packing: finetune's packing is padding-free, each example attends only to itself")
    for theirs, ours in (("kto_chosen_weight", "desirable_weight"), ("kto_rejected_weight", "undesirable_weight")):
        if conv.has(theirs):
            conv.set(f"method.{ours}", conv.take(theirs))
    if conv.has("double_quantization"):
        conv.set("adapter.double_quant", bool(conv.take("double_quantization")))
    if conv.has("quantization_type"):
        conv.set("adapter.quant_type", conv.take("quantization_type"))
    for key, ours in (
        ("additional_target", "adapter.modules_to_save"),
        ("new_special_tokens", "tokenizer.added_tokens"),
    ):
        if conv.has(key):
            conv.set(ours, as_list(conv.take(key)))
    if conv.has("rope_scaling") and not isinstance(conv.raw["rope_scaling"], dict):
        conv.drop(
            "rope_scaling",
            conv.take("rope_scaling"),
            "LLaMA-Factory derives the factor from cutoff_len; write it out as model.rope_scaling: "
            "{rope_type: linear|dynamic|yarn|llama3, factor: cutoff_len / the model's max_position_embeddings}",
        )
    for switch in OPTIMIZER_SWITCHES:
        if conv.take(switch):
            family = switch.removeprefix("use_")
            conv.drop(
                switch,
                True,
                f"the {family} optimizer is not offered; use train.optimizer adamw_8bit or adafactor, or a LoRA "
                "adapter, for the memory it saves",
            )
            for key in [k for k in conv.raw if k.startswith(f"{family}_")]:
                conv.drop(key, conv.take(key), f"belongs to {switch}", material=False)
    for key in LORA_EXTRAS:
        if conv.take(key):
            conv.drop(key, True, "this LoRA variant/initialization is not offered; remove it for plain (Do/rs)LoRA")
    if conv.take("pref_ftx"):  # 0, its default, adds no SFT loss
        conv.drop(
            "pref_ftx",
            conv.raw["pref_ftx"],
            "an added SFT loss in preference training is offered only as simpo's cpo_alpha (method: simpo)",
        )
    for key in ("flash_attn", "attn"):  # attn: the newer examples' name for it
        value = str(conv.take(key))
        if value in ATTENTION:
            conv.set("model.attn_implementation", ATTENTION[value])
        elif value in FLASH_ATTENTION:
            flash_attention(conv, key, value)
        elif conv.has(key) and value != "auto":  # auto: LLaMA-Factory picks the kernel, as finetune's auto does
            conv.drop(
                key,
                value,
                "not a LLaMA-Factory attention setting (auto, sdpa, eager, disabled, fa2, fa3); auto picks one",
                material=False,
            )

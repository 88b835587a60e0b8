"""`finetune merge`: fold a run's LoRA/DoRA/QLoRA adapter into its base model.

The output is a plain transformers model (sharded safetensors, config, generation config,
tokenizer) that loads with `AutoModelForCausalLM.from_pretrained` and needs neither peft nor
bitsandbytes. It is written into a temporary sibling directory and renamed into place at the
end, so OUT_DIR either does not exist or is complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from finetune.errors import FinetuneError
from finetune.rundir import CHECKPOINTS, RESOLVED_RECIPE

logger = logging.getLogger(__name__)

# Files that make up a tokenizer in a saved run / model directory (copied byte for byte).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_DTYPES = ("bfloat16", "float16", "float32")


class MergeError(FinetuneError):
    """The run directory cannot be merged (full fine-tune, no adapter, bad output dir)."""


def run_kind(run_dir: Path) -> str:
    """'adapter' (adapter_config.json present), 'full' (a saved model) or 'unknown'."""
    if (run_dir / "adapter_config.json").is_file():
        return "adapter"
    if (run_dir / "config.json").is_file() and any(run_dir.glob("model*.safetensors")):
        return "full"
    return "unknown"


def _load_run_recipe(run_dir: Path):
    path = run_dir / RESOLVED_RECIPE
    if not path.is_file():
        return None
    from finetune.recipe import load_recipe

    return load_recipe(path, allow_resolved=True)


def refuse_random_init(run_dir: Path, recipe, *, why: str, error: type[FinetuneError] = FinetuneError) -> None:
    """The one rule for using a run's result: a run trained on random weights (model.init: random) is a
    throughput and memory trial, not a model; `why` says what that means for the command refusing it."""
    if recipe is not None and recipe.model.init == "random":
        raise error(
            f"this run trained on random weights (model.init: random), a throughput and memory trial: {why}",
            file=str(run_dir),
            hint="train with model.init: pretrained to use the result",
        )


def check_base_exists(run_dir: Path, recipe) -> None:
    """A run trained from random weights has no base model anywhere to load."""
    refuse_random_init(
        run_dir, recipe, why="its base model was never saved, so there is no base to load or apply the adapter to"
    )


def resolve_base(run_dir: Path, adapter_config: dict, recipe) -> str:
    """The base model to merge into: adapter_config's base path/id, else the recipe's model.name.

    A relative local path is tried as given and relative to RUN_DIR; otherwise it is a Hub id.
    """
    check_base_exists(run_dir, recipe)
    base = adapter_config.get("base_model_name_or_path") or (recipe.model.name if recipe else None)
    if not base:
        raise MergeError(
            "adapter_config.json names no base model (base_model_name_or_path)",
            file=str(run_dir / "adapter_config.json"),
            hint="set base_model_name_or_path to the base model's Hub id or directory",
        )
    if not Path(base).exists() and (run_dir / base).exists():
        return str((run_dir / base).resolve())
    return base


def merge_dtype(recipe, dtype: str | None) -> str:
    """Explicit dtype, else QLoRA's compute dtype, else the recipe's model dtype, else bfloat16."""
    if dtype is not None:
        if dtype not in _DTYPES:
            raise MergeError(f"unknown dtype {dtype!r}", hint=f"use one of {', '.join(_DTYPES)}")
        return dtype
    if recipe is None:
        return "bfloat16"
    if recipe.adapter.type == "qlora":
        return recipe.adapter.compute_dtype
    return recipe.model.dtype


def _check_output(output_dir: Path, run_dir: Path, overwrite: bool) -> None:
    out, run = output_dir.resolve(), run_dir.resolve()
    if out == run or out == run / CHECKPOINTS or run / CHECKPOINTS in out.parents:
        raise MergeError(
            "the output directory would overwrite the run's own files",
            file=str(output_dir),
            hint=f"use a new directory, e.g. -o {run_dir}/merged or -o {run_dir.name}-merged",
        )
    if output_dir.exists() and not (output_dir.is_dir() and not any(output_dir.iterdir())):
        if not overwrite:
            raise MergeError(
                "the output directory already exists and is not empty",
                file=str(output_dir),
                hint="choose another -o directory or remove it",
            )


def merge(
    run_dir: str | Path,
    output_dir: str | Path,
    *,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
) -> Path:
    """Merge RUN_DIR's adapter into its base model and write a standalone model to OUT_DIR.

    How: shard by shard (finetune/merge_stream.py). Each base tensor is read, cast to the merge
    dtype, and for the modules the adapter targets merged by peft's own layer merge on a one-module
    skeleton (so DoRA, rsLoRA scaling and rank patterns are handled exactly as in training); output
    shards of at most `max_shard_size` are written as they fill. Host RAM: about one output shard
    plus one weight matrix and its fp32 delta, not the model. Adapters that also save whole modules
    (modules_to_save, trainable tokens) or LoRA biases go through peft's whole-model
    `merge_and_unload` instead, which holds the model once in host RAM.

    QLoRA: the adapter was trained against NF4-quantised base weights in `adapter.compute_dtype`.
    The merge loads the *original* base weights unquantised in that compute dtype and adds the
    delta there; merging into 4-bit weights is not possible without re-quantising (which would
    round the small LoRA update away), and a bf16/fp16 model is what users deploy. The result
    differs from the trained QLoRA model only by the NF4 quantisation error of the base, the
    same as loading the base unquantised with the adapter in peft.

    Returns OUT_DIR. Raises MergeError for a full fine-tune (nothing to merge) or no adapter.
    """
    run_dir, output_dir = Path(run_dir), Path(output_dir)
    if not run_dir.is_dir():
        raise MergeError(
            "run directory not found",
            file=str(run_dir),
            hint="pass the run's output directory (it has adapter_config.json)",
        )
    recipe = _load_run_recipe(run_dir)
    kind = run_kind(run_dir)
    if kind == "full" or (kind != "adapter" and recipe is not None and recipe.adapter.type == "full"):
        raise MergeError(
            "nothing to merge: this is a full fine-tune, it is already a complete model",
            file=str(run_dir),
            hint=f"load it directly with AutoModelForCausalLM.from_pretrained('{run_dir}') "
            f"or push it with `finetune push {run_dir} --repo ORG/NAME`",
        )
    if kind != "adapter":
        raise MergeError(
            "no adapter_config.json found: not a LoRA/QLoRA run directory",
            file=str(run_dir),
            hint="pass the directory `finetune run` wrote the adapter to",
        )
    missing = [f for f in ADAPTER_FILES if not (run_dir / f).is_file()]
    if missing:
        raise MergeError(
            f"missing {', '.join(missing)}",
            file=str(run_dir),
            hint="the run did not finish saving its adapter; resume it with `finetune run`",
        )
    adapter_config = json.loads((run_dir / "adapter_config.json").read_text())
    base = resolve_base(run_dir, adapter_config, recipe)
    torch_dtype_name = merge_dtype(recipe, dtype)
    _check_output(output_dir, run_dir, overwrite)

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    # same filesystem as OUT_DIR, so the final rename is atomic
    tmp = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.partial-", dir=output_dir.parent))
    try:
        _merge_into(run_dir, tmp, base=base, recipe=recipe, dtype=torch_dtype_name, max_shard_size=max_shard_size)
        if output_dir.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.old-", dir=output_dir.parent))
            os.replace(output_dir, trash / "old")
            os.replace(tmp, output_dir)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("merged %s into %s (%s) -> %s", run_dir, base, torch_dtype_name, output_dir)
    return output_dir


def _merge_into(run_dir: Path, out: Path, *, base: str, recipe, dtype: str, max_shard_size: str | int) -> None:
    from finetune import merge_stream

    adapter_config = json.loads((run_dir / "adapter_config.json").read_text())
    why_not = merge_stream.streamable(adapter_config)
    base_dir = _local_base(base, recipe)
    if not why_not and _published_quantized(base_dir):
        # its shards hold packed blocks and scales, not the 16-bit weights the streaming merge adds deltas to
        why_not = "the base checkpoint is published quantized; it loads dequantized"
    if why_not or not merge_stream.base_shards(base_dir):
        logger.info("merging in memory (%s)", why_not or "the base has no safetensors shards")
        _merge_in_memory(run_dir, out, base=base, recipe=recipe, dtype=dtype, max_shard_size=max_shard_size)
        return
    try:
        merge_stream.adapter_tensors(run_dir)
    except Exception as exc:  # truncated/corrupt safetensors: fail before the long part
        raise MergeError(
            f"cannot load the adapter onto {base!r}: {type(exc).__name__}: {exc}",
            file=str(run_dir / "adapter_model.safetensors"),
            hint="check that the run finished saving and that the base model is the one it was trained on",
        ) from None
    try:
        merge_stream.merge_checkpoint(
            base_dir=base_dir, run_dir=run_dir, out=out, dtype=dtype, max_shard_size=max_shard_size
        )
    except ValueError as exc:
        raise MergeError(
            f"cannot merge the adapter into {base!r}: {exc}",
            file=str(run_dir),
            hint="check that the base model is the one the adapter was trained on",
        ) from None
    _write_model_files(base_dir, out, dtype=dtype)
    _copy_tokenizer(run_dir, out, base=base, recipe=recipe)


def _published_quantized(base_dir: Path) -> bool:
    """The base's config.json names a quantization (a checkpoint published quantized, e.g. gpt-oss's MXFP4)."""
    from finetune.registry.derive import prequantized_method

    config = base_dir / "config.json"
    if not config.is_file():
        return False
    settings = json.loads(config.read_text())
    return bool(prequantized_method(settings, settings.get("text_config") or {}))


def _local_base(base: str, recipe) -> Path:
    """The base model's directory: local as given, else the Hub snapshot of its config and weights."""
    if Path(base).is_dir():
        return Path(base)
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                base,
                revision=recipe.model.revision if recipe else None,
                allow_patterns=["*.json", "*.safetensors", *TOKENIZER_FILES],
            )
        )
    except Exception as exc:
        raise MergeError(
            f"cannot fetch the base model {base!r}: {type(exc).__name__}: {exc}",
            hint="make the base model available (local dir, or Hub access and login)",
        ) from None


def _write_model_files(base_dir: Path, out: Path, *, dtype: str) -> None:
    """config.json in the merge dtype without quantization, and the generation config."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(base_dir)
    config.dtype = dtype
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    try:
        generation = GenerationConfig.from_pretrained(base_dir)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(out)


def _copy_tokenizer(run_dir: Path, out: Path, *, base: str, recipe) -> None:
    tokenizer_files = [f for f in TOKENIZER_FILES if (run_dir / f).is_file()]
    for name in tokenizer_files:
        shutil.copy2(run_dir / name, out / name)
    if not tokenizer_files:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(
            base,
            revision=recipe.model.revision if recipe else None,
            trust_remote_code=bool(recipe and recipe.model.trust_remote_code),
        ).save_pretrained(out)


def _merge_in_memory(run_dir: Path, out: Path, *, base: str, recipe, dtype: str, max_shard_size: str | int) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer_files = [f for f in TOKENIZER_FILES if (run_dir / f).is_file()]
    tokenizer = None
    if not tokenizer_files:  # fail fast, before the long part, if the base has no tokenizer either
        tokenizer = AutoTokenizer.from_pretrained(
            base,
            revision=recipe.model.revision if recipe else None,
            trust_remote_code=bool(recipe and recipe.model.trust_remote_code),
        )
    load_kwargs = {}
    if recipe is not None:
        load_kwargs = {"revision": recipe.model.revision, "trust_remote_code": recipe.model.trust_remote_code}
    from finetune.train.model import dequantizing_kwargs

    try:
        load_kwargs.update(dequantizing_kwargs(base, **load_kwargs))  # a base published quantized (gpt-oss's MXFP4)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype), device_map="cpu", **load_kwargs)
    except OSError as exc:
        raise MergeError(
            f"cannot load the base model {base!r}: {exc}",
            hint="make the base model available (local dir, or Hub access and login)",
        ) from None
    if tokenizer_files:  # tokens added in training (tokenizer.added_tokens): the base grows to match
        vocab = len(AutoTokenizer.from_pretrained(run_dir))
        if vocab > model.get_input_embeddings().weight.shape[0]:
            model.resize_token_embeddings(vocab, mean_resizing=False)  # the adapter's rows replace them
    try:
        model = PeftModel.from_pretrained(model, str(run_dir), is_trainable=False)
    except Exception as exc:  # truncated/corrupt safetensors, shape mismatch with the base
        raise MergeError(
            f"cannot load the adapter onto {base!r}: {type(exc).__name__}: {exc}",
            file=str(run_dir / "adapter_model.safetensors"),
            hint="check that the run finished saving and that the base model is the one it was trained on",
        ) from None
    # safe_merge: checks the merged weights for NaN/inf before replacing the originals
    model = model.merge_and_unload(safe_merge=True)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    for name in tokenizer_files:
        shutil.copy2(run_dir / name, out / name)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)

"""The recipe fields a checkpoint's marker records, and which of them may change when a run resumes.

A field is a leaf of the resolved recipe keyed by its path ("train.lr", "data.sources.0.path"). The
fields whose change makes a resumed run a different run are hashed into the marker; the rest (where
and how often things are logged or saved, publishing, timeouts, kernels computing the same function)
may change freely, and the length of the run may grow.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

# Recipe keys that may change between a checkpoint and its resume without changing the training
# it continues: where and how often things are logged/saved/evaluated, publishing, and timeouts.
SAFE_KEYS = (
    "logging.",
    "hub.",
    "output.",
    "train.eval_steps",
    "train.logging_steps",
    "train.on_nonfinite",
    "train.max_bad_steps",
    "distributed.timeout_minutes",
    "distributed.nvme_path",
    "data.task_eval",
    "data.cache_dir",
    "data.example_tokens",  # measured for the planner's speed estimate; the training is the same
    "data.sequence_tokens",  # measured for the planner's time and memory; the training is the same
    "data.allow_paths",
    "data.allow_outside",
    "hardware",
    "resolved.predicted_peak_gib",
    "resolved.hardware",
    "train.activation_checkpointing",
    "resolved.activation_checkpointing_by",
    # when FSDP2 reduces the accumulated gradients (every micro-batch or a step's last): the same sum, a
    # memory/speed setting the planner and the out-of-memory re-plan may change like the two above
    "distributed.sync_each_batch",
    # kernels that compute the same function (compile resolves them per machine: a resume on another
    # machine may get another attention kernel or no Liger)
    "model.attn_implementation",
    "train.liger",
    "adapter.cast_adapter_inputs",
    # what to do after an out-of-memory failure, and the measurement mode (which saves nothing)
    "train.oom_retries",
    "resolved.measure",
)
# Safe only when they grow: the run continues further with the same schedule of the steps it did.
GROWING_KEYS = ("train.max_steps", "train.epochs")
# How the global batch is laid out over processes; checked by the world-size rule instead.
LAYOUT_KEYS = (
    "resolved.world_size",
    "resolved.num_nodes",
    "resolved.gpus_per_node",
    "resolved.gradient_accumulation_steps",
    "train.micro_batch_size",
)
CONTENT_SUFFIX = ".content"  # data.sources.N.content: the fingerprint of the file's bytes (or Hub revision)


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out: dict = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = {}
        for i, item in enumerate(value):
            out.update(_flatten(item, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: value}


def recipe_fields(recipe) -> dict:
    """Every leaf of the resolved recipe as {"train.lr": 0.0002, ...} (JSON values)."""
    raw = recipe.model_dump(mode="json")
    # lists of sections (data.sources) are keyed by position, so a change names data.sources.0.path
    return _flatten(raw)


def data_fields(*, train: Sequence[str | None], eval: Sequence[str | None] = ()) -> dict:
    """The data's content fingerprints as recipe fields, so resume and rerun checks see a file replaced
    at the same path."""
    out = {f"data.sources.{i}{CONTENT_SUFFIX}": fp for i, fp in enumerate(train)}
    out.update({f"data.eval_sources.{i}{CONTENT_SUFFIX}": fp for i, fp in enumerate(eval)})
    return out


def is_safe(key: str) -> bool:
    """A key whose change leaves the training a resume continues the same."""
    return any(key == k or (k.endswith(".") and key.startswith(k)) or key.startswith(k + ".") for k in SAFE_KEYS)


def training_fields(fields: dict) -> dict:
    """The fields whose change makes a resumed run a different run (hashed into the marker)."""
    return {k: v for k, v in fields.items() if not is_safe(k) and k not in GROWING_KEYS and k not in LAYOUT_KEYS}


def recipe_hash(fields: dict) -> str:
    text = json.dumps(training_fields(fields), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _fmt(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def compare_fields(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """(notes on safe changes, refused changes) between a saved run's recipe fields and this one's.
    A data content fingerprint counts only where both sides have one (Hub data is fingerprinted in
    the ranks, not before launch; older markers carry none)."""
    notes, refused = [], []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b or (key.endswith(CONTENT_SUFFIX) and (a is None or b is None)):
            continue
        change = f"{key} ({_fmt(a)} -> {_fmt(b)})"
        if key.endswith(CONTENT_SUFFIX):
            refused.append(f"{key.removesuffix(CONTENT_SUFFIX)}.path (same path, new content: {_fmt(a)} -> {_fmt(b)})")
        elif key in GROWING_KEYS:
            if a is not None and b is not None and b > a:
                notes.append(
                    f"{change}: the run continues further; the learning-rate schedule is stretched to the new length"
                )
            else:
                refused.append(change)
        elif is_safe(key) or key in LAYOUT_KEYS:
            notes.append(change)
        else:
            refused.append(change)
    return notes, refused


def grown(old: dict, new: dict) -> bool:
    """A larger train.max_steps / train.epochs than the saved run's."""
    return any(old.get(k) is not None and new.get(k) is not None and new[k] > old[k] for k in GROWING_KEYS)

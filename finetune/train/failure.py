"""An exception raised inside a rank, as one paragraph: the cause, where, and advice that fits it.

FinetuneErrors pass through; a full disk, running out of memory, unreadable weights, remote code, a chat
template that raises and anything else become a FinetuneError whose message keeps the original text
(FINETUNE_DEBUG=1 prints the traceback as well).
"""

from __future__ import annotations

from pathlib import Path

from finetune.checkpoints.resume import resume_advice
from finetune.errors import DataError, FinetuneError, RecipeError, TrainingFailed, is_disk_full
from finetune.prelaunch import free_bytes

MAX_DETAIL = 400
# torch's autograd node of sdpa's cuDNN kernel. Its masked backward returns NaN at a row length of 64 mod 128
# (torch 2.11-2.13 on H100/H200, pytorch/pytorch#196678; a padded Gemma-3-1B DPO batch on an H200, docs/validation.md
# thirty-first and thirty-second sessions), which the planner's whole 128-key tiles avoid (plan.PADDED_ROW_MULTIPLE)
CUDNN_ATTENTION_BACKWARD = "ScaledDotProductCudnnAttentionBackward"


def _detail(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= MAX_DETAIL else text[: MAX_DETAIL - 3] + "..."


def as_finetune_error(exc: BaseException, *, run_dir: Path) -> FinetuneError:
    if isinstance(exc, FinetuneError):
        return exc
    from finetune.train.diskspace import SAVE_SLACK_BYTES

    name, detail = type(exc).__name__, _detail(exc)
    if is_disk_full(exc):
        where = getattr(exc, "filename", None) or run_dir
        return TrainingFailed(
            f"disk full while writing {where} ({exc.strerror})",
            key="output.dir",
            hint=f"free disk space there, then {resume_advice(run_dir)}",
        )
    try:
        free: int | None = free_bytes(run_dir)
    except OSError:
        free = None
    if free is not None and free < SAVE_SLACK_BYTES:
        # a writer that does not raise ENOSPC as OSError (torch.save's C++ stream: "basic_ios::clear:
        # iostream error", "PytorchStreamWriter failed writing file") on a disk that has filled up
        return TrainingFailed(
            f"disk full: {free / 2**20:.1f} MiB free in {run_dir} when the run failed ({name}: {detail})",
            key="output.dir",
            hint=f"free disk space there, then {resume_advice(run_dir)}",
        )
    if name == "OutOfMemoryError" or "out of memory" in detail.lower():
        return TrainingFailed(
            f"out of memory: {detail}",
            key="train.micro_batch_size",
            hint="lower train.micro_batch_size or data.max_length, set "
            "train.activation_checkpointing: on, or use QLoRA / more GPUs; then " + resume_advice(run_dir),
        )
    if "returned nan values" in detail:  # torch's anomaly mode (FINETUNE_DETECT_ANOMALY) found the first NaN
        if CUDNN_ATTENTION_BACKWARD in detail:
            return TrainingFailed(
                f"the backward made a NaN in cuDNN's attention kernel: {detail}",
                key="model.attn_implementation",
                hint="sdpa runs padded rows (an attention mask) on cuDNN on this GPU, whose backward gives NaN at row "
                "lengths of 64 mod 128: compile the run again (the planner pads rows to whole 128-key tiles), or set "
                "data.packing: true (no mask: the varlen kernel) or model.attn_implementation: eager (slower, more "
                "memory), then " + resume_advice(run_dir),
            )
        return TrainingFailed(
            f"the backward made a NaN: {detail} (the forward code that computed its input is printed above)",
            key="train.on_nonfinite",
            hint="the operation named is where the NaN started: look at its inputs (a padded row, an overflowing "
            "activation in 16 bits); lower train.lr, use bf16 rather than fp16, or " + resume_advice(run_dir),
        )
    if name in ("SafetensorError", "HeaderTooLarge", "HeaderTooSmall") or "deserializing header" in detail:
        return RecipeError(
            f"the model's weights cannot be read ({name}: {detail})",
            key="model.name",
            hint="download the model again, or point model.name at a complete copy",
        )
    if "trust_remote_code" in detail:
        return RecipeError(
            f"the model needs its own Python code to load ({detail})",
            key="model.trust_remote_code",
            hint="read that code, then set model.trust_remote_code: true if you trust it",
        )
    if name.startswith("Template") or type(exc).__module__.startswith("jinja2"):
        return DataError(
            f"the chat template failed: {name}: {detail}",
            key="data.chat_template",
            hint="fix the template (data.chat_template), or the rows it rejects",
        )
    return TrainingFailed(
        f"{name}: {detail}",
        hint="this looks like a bug in finetune or a library under it: rerun with "
        "FINETUNE_DEBUG=1 for the traceback and report it; " + resume_advice(run_dir),
    )

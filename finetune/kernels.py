"""Which attention kernel a packed example runs on: the rule the run (finetune/train/attention.py), the planner
(finetune/plan/attention_time.py) and the recipe's documentation share, and whether the installed torch's varlen kernel
has sliding windows (read from its version). Pure: no torch import.

Packed examples of at least CUDNN_MIN_EXAMPLE_TOKENS run on sdpa's cuDNN causal kernel (model.cudnn_long_examples)
on GPUs of compute capability CUDNN_COMPUTE_MAJOR, the rest on torch's varlen kernel. Through finetune's attention
path on an H200 (plan/attention_time.py: CUDNN_RATES) cuDNN ran 1.27x the varlen kernel's rate on 8k-token examples
and 1.53-1.65x on 16k-64k, but 0.83x on 4k ones (a call, a padded copy and a gather per example), hence the 8,192.
cuDNN builds an execution plan for each new length (0.13-0.18 s forward + backward), so each such example is
zero-padded at its end to one of CUDNN_LENGTHS_PER_OCTAVE lengths per power of two (`cudnn_padded_length`): a run
meets a few dozen lengths, and an example computes at most 2/16 more than its own triangle.
"""

from __future__ import annotations

from functools import lru_cache

CUDNN_MIN_EXAMPLE_TOKENS = 8192
CUDNN_LENGTHS_PER_OCTAVE = 16
CUDNN_COMPUTE_MAJOR = 9
# the cards of compute capability CUDNN_COMPUTE_MAJOR among the presets' and nvidia-smi's names (Hopper), where it
# was measured
CUDNN_CARDS = ("h100", "h200", "h800", "gh200")


def cudnn_padded_length(tokens: int) -> int:
    """The length an example of `tokens` runs at on cuDNN: rounded up to a multiple of 1/CUDNN_LENGTHS_PER_OCTAVE of
    the power of two at or below it."""
    step = max(1, (1 << (int(tokens).bit_length() - 1)) // CUDNN_LENGTHS_PER_OCTAVE)
    return -(-int(tokens) // step) * step


def card_runs_cudnn_long_examples(gpu_model: str, vendor: str) -> bool:
    """A run's long examples go to cuDNN on this card (the run checks its device's compute capability itself)."""
    name = gpu_model.lower()
    return vendor == "nvidia" and any(card in name for card in CUDNN_CARDS)


@lru_cache(maxsize=1)
def _installed_torch() -> str | None:
    from finetune.envreport import package_version  # here: envreport imports the planner, which imports this module

    return package_version("torch")


# the torch release whose varlen kernel (torch.nn.attention.varlen) takes flash-attention's window_size: on older ones
# finetune's varlen path runs sliding-window layers on sdpa over the masked packed row (finetune/train/attention.py:
# takes_windows, which asks the kernel itself; the planner: plan/workload.py varlen_fallback_layers)
VARLEN_WINDOW_TORCH = (2, 11)
VARLEN_WINDOW_RELEASE = ".".join(map(str, VARLEN_WINDOW_TORCH))  # as messages name it


def torch_runs_varlen_windows(torch_version: str | None = None) -> bool:
    """The installed torch's varlen kernel runs sliding windows, read from its version without importing it (the
    planner is torch-free); True where torch is not installed here (`finetune plan` on a machine without it plans
    for the torch finetune's varlen path is written for). `torch_version` in place of the installed one."""
    if torch_version is None:
        torch_version = _installed_torch()
        if torch_version is None:
            return True
    # its release's first two numbers, parsed by hand: `finetune plan`'s own dependencies have no version parser
    release = []
    for part in torch_version.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit()) or "0"
        release.append(int(digits))
    return tuple(release) >= VARLEN_WINDOW_TORCH

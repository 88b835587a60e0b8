"""bitsandbytes on CPU: keep 4-bit weights in the trainable layout after an evaluation.

bitsandbytes >= 0.49 (seen in 0.50.2), `Linear4bit.forward` in bitsandbytes/nn/modules.py:
on a CPU with AVX512-BF16, a forward in eval mode without grad (an evaluation, a generate)
converts the weight to a packed inference layout (`_convert_weight_packed_for_cpu`) and never
converts it back. Training after that runs `matmul_4bit` through `gemv_4bit`, which has no
autograd kernel: torch warns "bitsandbytes::gemv_4bit: an autograd kernel was not registered"
and the gradient to the layer's input is dropped, so LoRA weights below that layer get wrong
gradients. The module instances expose `support_avx512bf16_for_cpu`, the switch bitsandbytes
consults before converting; we turn it off on our own model for CPU training. This configures
our model object; it changes no library code.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

AFFECTED_FROM = Version("0.49.0")


def affected() -> bool:
    try:
        return Version(version("bitsandbytes")) >= AFFECTED_FROM
    except PackageNotFoundError:
        return False


def keep_trainable_layout(model) -> int:
    """Disable the eval-time CPU repacking on every Linear4bit of `model`; returns how many."""
    if not affected():
        return 0
    import bitsandbytes as bnb

    count = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit) and hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count

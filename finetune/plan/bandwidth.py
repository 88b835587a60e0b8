"""Seconds that memory-bound kernels take: bytes over the bandwidth a GPU's streaming kernels reach.

Elementwise, copy, gather and reduction kernels move bytes and barely compute; they run at what the
card's HBM delivers to a streaming kernel, below the datasheet figure the presets carry
(gpu_memory_bandwidth_gbps): device-local copy and STREAM-type benchmarks (nvbandwidth, BabelStream)
reach about 75-90% of it on A100/H100/H200, PyTorch's vectorized elementwise kernels the lower part
of that range with their mixed dtypes and broadcasts. One share for every such term of the step time
(attention masks, DoRA, MoE dispatch), so they stay comparable.
"""

from __future__ import annotations

from finetune.registry.schema import HardwarePreset

ACHIEVED_BANDWIDTH = 0.8  # share of the datasheet HBM bandwidth a streaming kernel reaches


def memory_seconds(preset: HardwarePreset, nbytes: float) -> float:
    """Seconds to move `nbytes` through HBM on one GPU of `preset` (0 when the preset has no bandwidth)."""
    bandwidth = preset.gpu_memory_bandwidth_gbps
    if not bandwidth or nbytes <= 0:
        return 0.0
    return nbytes / (ACHIEVED_BANDWIDTH * bandwidth * 1e9)

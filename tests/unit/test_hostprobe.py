"""finetune.hostprobe: this machine's host time a kernel, timed as the difference of two depths of a tiny LoRA model
over the kernels the planner counts for them. On CPU the code path runs (the figure is the CPU's compute there);
on a GPU machine the planner uses it for a host-bound plan made for that machine (`--hardware auto`)."""

from __future__ import annotations

import pytest

from finetune import hostprobe
from finetune.plan.host_time import (
    KERNELS_PER_ADAPTED_LINEAR,
    KERNELS_PER_LAYER,
    KERNELS_WITHOUT_LIGER_PER_LAYER,
)
from finetune.plan.workload import ALL_LINEAR


def test_the_probe_divides_by_the_planners_own_count_of_a_layers_kernels():
    with_liger = KERNELS_PER_LAYER + len(ALL_LINEAR) * KERNELS_PER_ADAPTED_LINEAR
    assert hostprobe.planned_kernels_per_layer(liger=True) == pytest.approx(with_liger)
    assert hostprobe.planned_kernels_per_layer(liger=False) == pytest.approx(
        with_liger + KERNELS_WITHOUT_LIGER_PER_LAYER
    )


def test_the_probe_runs_a_real_lora_forward_and_backward_at_two_depths_on_cpu():
    probe = hostprobe.measure("cpu", iterations=1, repeats=1)
    assert not probe.liger  # Liger's kernels are GPU kernels
    assert probe.kernels_per_layer == pytest.approx(hostprobe.planned_kernels_per_layer(liger=False))
    assert probe.seconds_per_layer > 0 and probe.s_per_kernel == pytest.approx(
        probe.seconds_per_layer / probe.kernels_per_layer
    )
    assert probe.device_name == "cpu"


def test_without_a_gpu_the_planner_gets_no_figure_and_keeps_its_floor():
    # the real child process: CUDA is not available on this machine, so the probe fails and says nothing
    hostprobe.measured_s_per_kernel.cache_clear()
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU: the probe measures it")
        assert hostprobe.measured_s_per_kernel() is None
    finally:
        hostprobe.measured_s_per_kernel.cache_clear()

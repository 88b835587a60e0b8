"""The mask traffic of masked attention kernels (finetune/plan/attention_time.py) and its place in the
planner's step time."""

from __future__ import annotations

import dataclasses

import pytest

from finetune.plan.attention_time import mask_seconds
from finetune.plan.bandwidth import ACHIEVED_BANDWIDTH
from finetune.plan.timing import linear_traffic_seconds, step_time
from finetune.plan.workload import Job
from finetune.registry import get_model
from tests.helpers.calibration_rows import preset_for

H100 = preset_for("NVIDIA H100 80GB HBM3", gpus_per_node=1)


def _job(**changes) -> Job:
    arch = get_model("mistral-7b-v0.3").model_copy(update={"sliding_window": 4096, "sliding_layers": 32})
    base = Job(arch=arch, preset=H100, seq_len=4096, packed=True, attention="sdpa", liger=True, global_batch_size=8)
    return dataclasses.replace(base, **changes)


def test_mask_bytes_by_hand():
    job = _job()
    # one packed row of 2 x 4096 tokens, 32 layers, 32 heads, bf16: the bool -> bf16 conversion
    # (3 bytes per element) and one read per head forward, one per head backward
    square = 8192**2
    moved = 32 * (square * 3 + 2 * 32 * square * 2)
    assert mask_seconds(job, micro_batch=2) == pytest.approx(moved / (ACHIEVED_BANDWIDTH * 3350e9))
    # a checkpointed layer converts and reads again in its recompute
    again = mask_seconds(job, micro_batch=2, checkpointed_share=1.0)
    assert again == pytest.approx((moved + 32 * (square * 3 + 32 * square * 2)) / (ACHIEVED_BANDWIDTH * 3350e9))
    # the square grows with the packed row: four times the bytes at twice the micro-batch
    assert mask_seconds(job, micro_batch=4) == pytest.approx(4 * mask_seconds(job, micro_batch=2))
    # layers the varlen kernel still serves read no mask
    assert mask_seconds(_job(varlen_layers=8), micro_batch=2) == pytest.approx(0.75 * mask_seconds(job, micro_batch=2))


def test_no_mask_no_time():
    assert mask_seconds(_job(attention="varlen"), micro_batch=2) == 0.0
    assert mask_seconds(_job(attention="flash"), micro_batch=2) == 0.0
    assert mask_seconds(_job(packed=False), micro_batch=1) == 0.0  # sdpa on one unpadded row: is_causal
    assert mask_seconds(_job(packed=False), micro_batch=2) > 0.0  # padded rows get a mask
    no_bandwidth = H100.model_copy(update={"gpu_memory_bandwidth_gbps": None})
    assert mask_seconds(_job(preset=no_bandwidth), micro_batch=2) == 0.0


def test_mask_time_is_in_the_step():
    job = _job()
    masked = step_time(job, strategy="ddp", micro_batch=2, grad_accum=4, checkpointing=False)
    bare = step_time(
        dataclasses.replace(job, preset=H100.model_copy(update={"gpu_memory_bandwidth_gbps": None})),
        strategy="ddp",
        micro_batch=2,
        grad_accum=4,
        checkpointing=False,
    )
    # without a bandwidth neither the mask nor the streaming passes around the linears take time
    streaming = mask_seconds(job, micro_batch=2) + linear_traffic_seconds(job, micro_batch=2)
    assert masked.compute_s - bare.compute_s == pytest.approx(4 * streaming)


def test_memory_seconds_runs_below_the_datasheet():
    from finetune.plan.bandwidth import memory_seconds

    assert memory_seconds(H100, 3350e9) == pytest.approx(1 / ACHIEVED_BANDWIDTH)
    assert 0.7 <= ACHIEVED_BANDWIDTH < 1.0
    assert memory_seconds(H100.model_copy(update={"gpu_memory_bandwidth_gbps": None}), 1e9) == 0.0


def test_sliding_layers_stay_on_the_varlen_kernel_where_long_examples_run_on_cudnn():
    """cuDNN's causal kernel has no window (train/attention.py keeps a sliding layer's long examples on the varlen
    kernel), so model.cudnn_long_examples speeds up only a Gemma-3's full layers; the sliding layers' bands run at
    the band's measured rate (attention_time.windowed_rate)."""
    from finetune.plan.attention_time import WINDOW_RATES, kernel_extra_seconds, varlen_rate, windowed_rate
    from tests.helpers.recipes import shape_job

    preset = preset_for("NVIDIA H200", gpus_per_node=1)

    def extra(model: str, on_cudnn: bool, arch_update: dict | None = None) -> float:
        job = shape_job(
            model,
            "lora",
            preset,
            seq=16384,
            global_batch=4,
            data__packing=True,
            train__micro_batch_size=1,
            model__cudnn_long_examples=on_cudnn,
        )
        assert job.attention == "varlen" and job.cudnn_long_examples == on_cudnn
        if arch_update:
            job = dataclasses.replace(job, arch=job.arch.model_copy(update=arch_update))
        return kernel_extra_seconds(job, micro_batch=1, checkpointed_share=0.0, flop_seconds=1e-15)

    gemma = shape_job("gemma-3-12b", "lora", preset, seq=16384, global_batch=4, data__packing=True)
    assert windowed_rate(gemma, 16384) == WINDOW_RATES[256][0][1] < varlen_rate(256, 2048)  # its 1,024-token window
    assert windowed_rate(gemma, 1000) == varlen_rate(256, 1000)  # examples within the window: causal
    gemma_gain = extra("gemma-3-12b", False) - extra("gemma-3-12b", True)
    assert gemma_gain > 0
    # the same model without its windows gains on all 48 layers what Gemma-3-12B gains on its 8 full ones
    unwindowed = {"sliding_window": None, "sliding_layers": 0}
    all_full = extra("gemma-3-12b", False, unwindowed) - extra("gemma-3-12b", True, unwindowed)
    assert gemma_gain == pytest.approx(all_full * 8 / 48)


def test_a_model_whose_every_layer_slides_runs_no_example_on_cudnn():
    """Mistral-7B-v0.1's 4,096-token window is on every layer, so none of its long examples reach cuDNN (which has no
    window): model.cudnn_long_examples changes neither its time nor its memory, and the kernels line says none do."""
    from finetune.plan import plan_job
    from finetune.plan.workload import long_examples_on_cudnn
    from tests.helpers.recipes import shape_job

    preset = preset_for("NVIDIA H200", gpus_per_node=1)
    on, off = (
        shape_job(
            "mistral-7b-v0.1",
            "lora",
            preset,
            seq=32768,
            global_batch=4,
            data__packing=True,
            model__cudnn_long_examples=cudnn,
        )
        for cudnn in (True, False)
    )
    assert not long_examples_on_cudnn(on)
    planned_on, planned_off = plan_job(on), plan_job(off)
    assert planned_on.tokens_per_second == planned_off.tokens_per_second
    assert planned_on.per_gpu_memory_gib == planned_off.per_gpu_memory_gib
    assert "cuDNN" not in planned_on.kernels and "32 of 32 layers within their 4,096-token window" in planned_on.kernels


def test_the_layers_a_masked_row_leaves_to_the_varlen_kernel_count_the_row_as_computed():
    """A packed row whose layers partly fall back (the sliding layers of the runs before they took the varlen kernel):
    the masked layers' positions and the served layers' are both counted over the row as computed (the measured
    sequences' tokens, not micro-batch x max_length), so the served layers' share is never negative."""
    from dataclasses import replace

    from finetune.plan.attention_time import kernel_extra_seconds
    from finetune.plan.workload import (
        computed_tokens_per_micro_batch,
        executed_attention_positions,
        packed_example_tokens,
    )
    from tests.helpers.recipes import shape_job

    preset = preset_for("NVIDIA H200", gpus_per_node=1)
    gemma = shape_job("gemma-3-12b", "lora", preset, seq=4096, global_batch=8, data__packing=True)
    legacy = replace(gemma, attention="sdpa", varlen_layers=8, sequence_tokens=1000.0)  # rows a quarter full
    row = computed_tokens_per_micro_batch(legacy, 2)
    assert row < 2 * 4096
    served = 8 * packed_example_tokens(legacy) / 2  # the global layers' triangles
    assert executed_attention_positions(legacy, micro_batch=2) == pytest.approx(40 * row + served)
    # at a vanishing step rate only the served layers' own rate remains: positive, as their positions are
    extra = kernel_extra_seconds(legacy, micro_batch=2, checkpointed_share=0.0, flop_seconds=1e-30)
    assert extra > 0

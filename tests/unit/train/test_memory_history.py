"""finetune/train/memory_history.py: the peak of one step's allocator trace, and what held it.

The trace is shaped as torch.cuda.memory._snapshot() writes it (device_traces[d]: alloc / free_requested /
free_completed / segment_* events, frames innermost first); the recording itself needs a CUDA device and runs in
the GPU tests' profiled runs."""

from __future__ import annotations

from finetune.train.memory_history import NO_FRAME, allocator_counters, peak_summary, site

GIB = 1024**3


def _frames(*paths):
    return [{"filename": p, "line": 10 + i, "name": f"f{i}"} for i, p in enumerate(paths)]


MLP = _frames(
    "/usr/lib/python3/site-packages/torch/nn/functional.py",
    "/venv/lib/python3.11/site-packages/transformers/models/llama/modeling_llama.py",
)
ATTN = _frames("/venv/lib/python3.11/site-packages/liger_kernel/ops/rope.py")


def _ev(action, addr, gib, frames=()):
    return {"action": action, "addr": addr, "size": int(gib * GIB), "frames": list(frames)}


def test_site_is_the_innermost_frame_outside_torch():
    assert site(MLP) == "transformers/models/llama/modeling_llama.py:11 f1"
    assert site(_frames("/x/site-packages/torch/autograd/graph.py")) == NO_FRAME
    # torch installed under a folder named torch: the package path decides, not a '/torch/' anywhere in it
    under = _frames("/opt/torch/venv/lib/python3.12/site-packages/transformers/models/llama/modeling_llama.py")
    assert site(under) == "transformers/models/llama/modeling_llama.py:10 f0"
    assert site(_frames("/work/repo/finetune/train/fused_lora.py")) == "train/fused_lora.py:10 f0"


def test_the_peak_splits_into_what_the_step_found_and_what_it_allocated():
    trace = [
        _ev("segment_map", 0, 4.0),
        _ev("free_requested", 99, 1.5),  # a block held from before the step (a gradient, say) is freed
        _ev("free_completed", 99, 1.5),
        _ev("alloc", 1, 2.0, MLP),
        _ev("alloc", 2, 1.0, ATTN),
        _ev("alloc", 3, 0.5, MLP),
        _ev("alloc", 4, 1.0, []),  # the peak: 10 - 1.5 + 4.5 = 13 GiB
        _ev("free_requested", 1, 2.0),
        _ev("free_completed", 1, 2.0),
        _ev("alloc", 5, 0.25, ATTN),  # after the peak: does not change it
    ]
    s = peak_summary(trace, allocated_at_start=10 * GIB, reserved_at_start=12 * GIB)
    assert s["peak_allocated_gib"] == 13.0
    assert s["held_from_before_the_step_gib"] == 8.5
    assert s["allocated_in_the_step_gib"] == 4.5
    assert s["reserved_at_that_peak_gib"] == 16.0 and s["peak_reserved_in_the_step_gib"] == 16.0
    assert s["by_site"] == [
        {"gib": 2.5, "site": "transformers/models/llama/modeling_llama.py:11 f1"},
        {"gib": 1.0, "site": "liger_kernel/ops/rope.py:10 f0"},
        {"gib": 1.0, "site": NO_FRAME},
    ]
    assert s["complete"] and s["events"] == len(trace)


def test_a_step_that_only_frees_peaks_at_its_start():
    s = peak_summary(
        [_ev("free_requested", 7, 1.0), _ev("segment_unmap", 0, 2.0)], allocated_at_start=GIB, reserved_at_start=3 * GIB
    )
    assert s["peak_allocated_gib"] == 1.0 and s["held_from_before_the_step_gib"] == 1.0
    assert s["by_site"] == [] and s["peak_reserved_in_the_step_gib"] == 3.0


def test_allocator_counters_read_torch_memory_stats_keys():
    stats = {
        "allocated_bytes.all.peak": 2 * GIB,
        "reserved_bytes.all.peak": 3 * GIB,
        "inactive_split_bytes.all.peak": GIB // 2,
        "num_alloc_retries": 4,
    }
    assert allocator_counters(stats) == {
        "max_allocated_gib": 2.0,
        "max_reserved_gib": 3.0,
        "max_inactive_split_gib": 0.5,
        "alloc_retries": 4,
    }

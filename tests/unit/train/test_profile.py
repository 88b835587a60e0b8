"""finetune/train/profile.py: where the GPU sat idle in a profiler trace, and which host work filled the gaps."""

from __future__ import annotations

import traceback

from finetune.train.profile import SyncSites, idle_gaps


def _x(name, cat, ts, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_idle_gaps_name_the_host_work_between_kernels():
    trace = {
        "traceEvents": [
            # kernels on two streams: busy 0-100 (overlapping), idle 100-400, busy 400-500, idle 500-505 (too short)
            _x("gemm", "kernel", 0, 80, tid=7),
            dict(_x("add", "kernel", 50, 50, tid=8), args={"correlation": 11}),
            dict(_x("gemm", "kernel", 400, 100, tid=7), args={"correlation": 12}),
            _x("gemm", "kernel", 505, 10, tid=7),
            # host: the optimizer step (with an inner op) covers 90-300 of the gap, nothing recorded 300-400
            _x("Optimizer.step#AdamW.step", "user_annotation", 90, 210),
            _x("aten::_foreach_add_", "cpu_op", 100, 50),
            _x("ProfilerStep#3", "user_annotation", 0, 600),  # the window's own annotation is not a cause
            _x("aten::add", "cpu_op", 20, 10),
            dict(_x("cudaLaunchKernel", "cuda_runtime", 22, 3), args={"correlation": 11}),
            _x("aten::mm", "cpu_op", 390, 9),
            dict(_x("cudaLaunchKernel", "cuda_runtime", 395, 3), args={"correlation": 12}),
        ]
    }
    idle = idle_gaps(trace)
    assert idle["idle_s"] == 300 / 1e6 and idle["gaps"] == 1 and idle["largest_gaps_ms"] == [0.3]
    assert idle["host_ops_during_gaps_s"] == {"Optimizer.step#AdamW.step": 200 / 1e6, "aten::mm": 9 / 1e6}
    assert idle["no_host_op_s"] == 100 / 1e6 - 9 / 1e6  # aten::mm ran 390-399, inside the gap
    assert idle["largest_gaps"] == [{"ms": 0.3, "after": "aten::add", "before": "aten::mm"}]


def test_idle_gaps_of_a_trace_without_kernels():
    assert idle_gaps({"traceEvents": [_x("aten::mm", "cpu_op", 0, 10)]})["idle_s"] == 0.0


def test_sync_sites_count_each_call_site_by_its_innermost_frames():
    sites = SyncSites()
    here = traceback.FrameSummary("/x/lib/python3.11/site-packages/transformers/masking_utils.py", 120, "sdpa_mask")
    caller = traceback.FrameSummary("/repo/finetune/train/attention.py", 40, "forward")
    noise = traceback.FrameSummary("/usr/lib/python3.11/warnings.py", 1, "warn")
    for _ in range(3):
        sites.record([caller, here, noise])
    sites.record([here, caller])
    table = sites.table()
    assert table[0] == {
        "calls": 3,
        "site": "transformers/masking_utils.py:120 sdpa_mask < train/attention.py:40 forward",
    }
    assert table[1]["calls"] == 1 and table[1]["site"].startswith("train/attention.py:40 forward")

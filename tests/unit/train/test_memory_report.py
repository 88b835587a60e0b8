"""The host figures a rank records at its first step (finetune/train/memory_report.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from finetune.train.memory_report import host_pss_gib, storage_read_gib


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="no /proc/self/io on this system")
def test_storage_reads_count_bytes_fetched_from_the_disk_not_from_the_page_cache(tmp_path):
    before = storage_read_gib()
    assert before is not None and before >= 0
    path = tmp_path / "cached.bin"
    path.write_bytes(os.urandom(8 << 20))
    path.read_bytes()  # just written: served from the page cache
    assert storage_read_gib() - before < 8 / 1024


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="no smaps_rollup on this system")
def test_pss_is_read_in_gib():
    pss = host_pss_gib()
    assert pss is not None and 0 < pss < 1024


@pytest.mark.skipif(host_pss_gib("Pss_Anon:") is None, reason="no Pss_Anon in smaps_rollup (Linux < 5.7)")
def test_the_anonymous_part_of_pss_leaves_out_a_mapped_file_read_into_memory(tmp_path):
    import mmap

    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(64 << 20))
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        before_pss, before_anon = host_pss_gib(), host_pss_gib("Pss_Anon:")
        sum(mapped[i] for i in range(0, len(mapped), 4096))  # touch every page, as a safetensors read does
        grown_pss = host_pss_gib() - before_pss
        grown_anon = host_pss_gib("Pss_Anon:") - before_anon
    assert grown_pss > 48 / 1024  # the 64 MiB of mapped pages count in PSS
    assert grown_anon < 16 / 1024  # not in its anonymous part


def test_the_figures_taken_right_after_loading_reach_every_rank_file(tmp_path):
    """run.py measures the GPU right after the model is loaded (load_figures; nothing without CUDA) and the
    callback writes it beside the figures of training, at every rewrite."""
    import json

    from transformers import TrainerState, TrainingArguments

    from finetune import rundir
    from finetune.train.memory_report import PeakMemoryCallback, load_figures

    assert load_figures(object()) == {}  # this machine has no CUDA: nothing measured, nothing invented
    at_load = {"gpu_peak_after_load_gib": 2.5, "weights_on_gpu_after_load_gib": 2.25}
    callback = PeakMemoryCallback(tmp_path, at_load=at_load)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    callback.on_log(args, TrainerState(global_step=3), None)
    written = json.loads((tmp_path / rundir.memory_file(0)).read_text())
    assert {k: written[k] for k in at_load} == at_load and written["step"] == 3

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

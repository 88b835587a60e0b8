"""A fast subset of the hostile-user probe (scripts/probe_hostile.py; the full run and its result are in
docs/reliability.md): no data lost, no traceback, every non-zero exit names a fix."""

from __future__ import annotations

import importlib.util
import sys

from tests.helpers.paths import ROOT


def _probe():
    spec = importlib.util.spec_from_file_location("probe_hostile", ROOT / "scripts" / "probe_hostile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_hostile_probe_quick_subset(tmp_path, monkeypatch):
    probe = _probe()
    monkeypatch.delenv("FINETUNE_DEBUG", raising=False)
    attempts = probe.quick_attempts()
    assert len(attempts) >= 30 and len(probe.all_attempts(full=False)) >= 200
    summary = probe.report(probe.probe(attempts, root=tmp_path, verbose=False))
    assert summary["bad"] == [], summary
    assert summary["data_lost"] == 0 and summary["tracebacks"] == 0 and summary["nonzero_without_fix"] == 0
    assert summary["nonzero_exits"] > 0

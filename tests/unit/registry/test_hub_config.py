"""Any Hub model id plans: `finetune plan` fetches only config.json through huggingface_hub (from the
fake Hub here), caches it, and plans from the cache when offline; errors say what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.helpers.fakehub import FakeHub
from tests.helpers.paths import ROOT, TINY_MODEL

CONFIG = json.loads((TINY_MODEL / "config.json").read_text())


@pytest.fixture
def hub():
    fake = FakeHub().start()
    fake.add_model("acme/tiny-chat", {"config.json": json.dumps(CONFIG).encode(), "model.safetensors": b"\0" * 1024})
    fake.add_model("acme/gated", {"config.json": json.dumps(CONFIG).encode()}, gated=True)
    yield fake
    fake.stop()


def _plan(tmp_path, name: str, *, hub: FakeHub | None, offline: bool, token: bool = False):
    recipe = {
        "model": {"name": name},
        "data": {"path": "train.jsonl", "max_length": 256},
        "hardware": "cpu",
        "train": {"max_steps": 2},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(
        PYTHONPATH=str(ROOT),
        HF_HUB_CACHE=str(tmp_path / "cache"),
        HF_HUB_DISABLE_XET="1",
        HF_HUB_OFFLINE="1" if offline else "0",
        HF_ENDPOINT=hub.url if hub else "http://127.0.0.1:9",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_ETAG_TIMEOUT="5",
        HF_HOME=str(tmp_path / "hf"),
    )
    if token:
        env["HF_TOKEN"] = "hf_test_token_0123456789"
    return subprocess.run(
        [sys.executable, "-m", "finetune.cli", "plan", str(path), "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_any_hub_id_plans_online_then_offline_from_the_cache(tmp_path, hub):
    online = _plan(tmp_path, "acme/tiny-chat", hub=hub, offline=False)
    assert online.returncode == 0, online.stderr
    plan = json.loads(online.stdout)
    assert plan["model"] == "tiny-chat" and plan["total_params"] > 0
    cached = sorted(p.name for p in (tmp_path / "cache").rglob("*") if p.is_file() and "snapshots" in p.parts)
    assert cached == ["config.json"]  # only that file, never the weights
    assert not any("model.safetensors" in path for _, path, _ in hub.requests)
    hub.stop()
    offline = _plan(tmp_path, "acme/tiny-chat", hub=None, offline=True)
    assert offline.returncode == 0, offline.stderr
    assert json.loads(offline.stdout)["total_params"] == plan["total_params"]


@pytest.mark.parametrize(
    "name,online,words",
    [
        ("acme/missing", True, "no model 'acme/missing' on the Hub"),
        ("acme/gated", True, "is gated"),
        ("acme/tiny-chat", False, "offline (HF_HUB_OFFLINE=1) and acme/tiny-chat's config.json is not in the"),
    ],
)
def test_hub_errors_say_what_to_do(tmp_path, hub, name, online, words):
    proc = _plan(tmp_path, name, hub=hub, offline=not online)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert words in proc.stderr and "model.name" in proc.stderr and "fix:" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_gated_model_with_a_token_plans(tmp_path, hub):
    proc = _plan(tmp_path, "acme/gated", hub=hub, offline=False, token=True)
    assert proc.returncode == 0, proc.stderr


def test_python_api_fetches_through_the_same_path(tmp_path, hub, monkeypatch):
    import huggingface_hub.constants as hf_constants

    from finetune.recipe.schema import ModelSection
    from finetune.registry import resolve_model

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
    arch = resolve_model(ModelSection(name="acme/tiny-chat"), base_dir=tmp_path)
    assert arch.hidden_size == CONFIG["hidden_size"] and arch.hub_ids == ["acme/tiny-chat"]

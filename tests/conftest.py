"""Shared fixtures: offline Hugging Face, the shipped tiny model, resolved recipes for train tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / "data" / "tiny-llama"
SAMPLES = ROOT / "data" / "samples"
QUICKSTART_DATA = ROOT / "data" / "quickstart"

# Nothing in the suite may reach the Hub; set before transformers/datasets are imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)


@pytest.fixture
def tiny_model_path() -> Path:
    return TINY_MODEL


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # every test gets its own tokenized-data cache unless it sets one itself
    monkeypatch.setenv("FINETUNE_CACHE_DIR", str(tmp_path_factory.mktemp("tokcache")))


def resolve_recipe(raw: dict, *, run_dir: Path, base_dir: Path | None = None) -> Path:
    """Stand-in for `finetune compile` on one CPU process: fill the resolved section and concrete
    values, make data paths absolute, write RUN_DIR/recipe.resolved.yaml and return its path."""
    import copy

    from finetune.recipe.load import dump_recipe, load_recipe

    raw = copy.deepcopy(raw)
    base = Path(base_dir or ROOT)
    model = raw.setdefault("model", {})
    if (base / model.get("name", "")).is_dir():
        model["name"] = str((base / model["name"]).resolve())
    data = raw.setdefault("data", {})
    for key in ("sources", "eval_sources"):
        for src in data.get(key, []):
            if not Path(src["path"]).is_absolute():
                src["path"] = str((base / src["path"]).resolve())
    if "path" in data and not Path(data["path"]).is_absolute():
        data["path"] = str((base / data["path"]).resolve())
    if data.get("task_eval") and not Path(data["task_eval"]["path"]).is_absolute():
        data["task_eval"]["path"] = str((base / data["task_eval"]["path"]).resolve())
    train = raw.setdefault("train", {})
    mbs = train.get("micro_batch_size", "auto")
    train["micro_batch_size"] = mbs if isinstance(mbs, int) else 4
    if train.get("activation_checkpointing", "auto") == "auto":
        train["activation_checkpointing"] = "off"
    raw.setdefault("distributed", {})["strategy"] = "ddp"
    raw.setdefault("output", {})["dir"] = str(Path(run_dir).resolve())
    raw.setdefault("logging", {}).setdefault("report_to", ["none"])
    gbs = train.get("global_batch_size", 16)
    raw["resolved"] = dict(hardware="cpu", world_size=1, num_nodes=1, gpus_per_node=0, device="cpu",
                           gradient_accumulation_steps=max(1, gbs // train["micro_batch_size"]),
                           predicted_peak_gib=0.5, decoder_layer_class="LlamaDecoderLayer",
                           lora_targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                         "down_proj"], model_family="llama")
    recipe = load_recipe(raw, allow_resolved=True)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "recipe.resolved.yaml"
    out.write_text(dump_recipe(recipe))
    return out


def tiny_recipe(**sections) -> dict:
    """A small fast recipe on the shipped tiny model; keyword sections are merged over it."""
    from finetune.recipe.load import deep_merge

    base = {
        "model": {"name": str(TINY_MODEL), "dtype": "float32"},
        "adapter": {"type": "lora", "r": 8, "alpha": 16},
        "data": {"sources": [{"path": str(QUICKSTART_DATA / "train.jsonl"), "max_samples": 64}],
                 "eval_sources": [{"path": str(QUICKSTART_DATA / "eval.jsonl"), "max_samples": 16}],
                 "max_length": 32},
        "train": {"max_steps": 6, "lr": 3e-3, "global_batch_size": 8, "micro_batch_size": 8,
                  "precision": "fp32", "warmup_ratio": 0.0, "scheduler": "constant"},
        "hardware": "cpu",
    }
    return deep_merge(base, sections)

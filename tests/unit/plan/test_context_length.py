"""data.max_length against the model's max_position_embeddings: refused without RoPE scaling, a warning
with it (within its reach), refused past its reach; said before anything is launched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from finetune.errors import RecipeError
from finetune.plan import plan
from finetune.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[3]


def _raw(max_length: int, **model) -> dict:
    return {
        "model": {"name": "Qwen/Qwen2.5-7B", "arch": "qwen2.5-7b", **model},
        "adapter": "qlora",
        "data": {"path": "t.jsonl", "max_length": max_length},
        # liger pinned off: auto plans differ by whether liger-kernel is installed here (and warn when it is not)
        "train": {"global_batch_size": 8, "liger": "off"},
        "hardware": "server-8xh100",
    }


def test_the_models_own_context_plans_without_a_warning():
    assert plan(load_recipe(_raw(32768))).warnings == []


def test_beyond_max_position_embeddings_without_rope_scaling_is_refused_with_the_fix():
    with pytest.raises(RecipeError) as err:
        plan(load_recipe(_raw(65536)))
    assert err.value.key == "data.max_length"
    assert "max_position_embeddings 32768" in str(err.value)
    assert "32768 or less" in err.value.hint and "model.rope_scaling" in err.value.hint
    assert "factor: 2" in err.value.hint


def test_rope_scaling_that_reaches_the_length_plans_with_a_warning():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    result = plan(load_recipe(_raw(65536, rope_scaling=yarn)))
    assert len(result.warnings) == 1 and "reach 131072" in result.warnings[0]
    assert result.to_json()["warnings"] == result.warnings


def test_rope_scaling_too_small_for_the_length_is_refused():
    with pytest.raises(RecipeError) as err:
        plan(load_recipe(_raw(65536, rope_scaling={"rope_type": "yarn", "factor": 1.5})))
    assert err.value.key == "data.max_length" and "49152" in str(err.value)
    assert "factor to 2" in err.value.hint


@pytest.mark.parametrize(
    "scaling", [{"factor": "4x"}, {"factor": 0}, {"factor": 4, "original_max_position_embeddings": "8k"}]
)
def test_rope_scaling_that_is_not_a_number_is_a_recipe_error(scaling):
    """The planner computes the reach from these two; a typo is the recipe's error, before any plan."""
    with pytest.raises(RecipeError) as err:
        load_recipe(_raw(65536, rope_scaling={"rope_type": "yarn", **scaling}))
    assert err.value.key == "model.rope_scaling" and "must be a finite number" in str(err.value)


def test_cli_plan_refuses_without_a_traceback(tmp_path):
    recipe = tmp_path / "long.yaml"
    recipe.write_text(yaml.safe_dump(_raw(65536)))
    proc = subprocess.run(
        [sys.executable, "-m", "finetune.cli", "plan", str(recipe)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "data.max_length" in proc.stderr + proc.stdout


def _qwen3_dir(tmp_path: Path, rope_scaling: dict | None) -> Path:
    """Qwen3-8B's config.json (max_position_embeddings 40960), with the YaRN block Qwen's card adds for long
    inputs where given."""
    import json

    cfg = json.loads((ROOT / "tests/data/hub_configs/qwen3-8b/config.json").read_text())
    if rope_scaling:
        cfg["rope_scaling"] = rope_scaling
    model = tmp_path / "qwen3-8b-long"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(cfg))
    return model


def _local(model: Path, max_length: int, **extra) -> dict:
    raw = _raw(max_length, **extra)
    raw["model"] = {"name": str(model), **extra}
    return raw


QWEN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def test_config_json_rope_scaling_reaches_the_length_with_a_warning(tmp_path):
    # config.json's own YaRN reaches 4 x 32768: 65536 tokens plan, past max_position_embeddings with a warning
    result = plan(load_recipe(_local(_qwen3_dir(tmp_path, QWEN_YARN), 65536)))
    assert len(result.warnings) == 1
    assert "config.json's RoPE scaling" in result.warnings[0] and "reach 131072" in result.warnings[0]


def test_config_json_rope_scaling_too_short_asks_for_a_factor_merged_over_it(tmp_path):
    with pytest.raises(RecipeError) as err:
        plan(load_recipe(_local(_qwen3_dir(tmp_path, QWEN_YARN), 262144)))
    assert err.value.key == "data.max_length" and "131072" in str(err.value)
    assert "factor to 8" in err.value.hint
    # the recipe's factor alone, merged over config.json's yarn and its original context, reaches it
    result = plan(load_recipe(_local(_qwen3_dir(tmp_path / "b", QWEN_YARN), 262144, rope_scaling={"factor": 8.0})))
    assert "reach 262144" in result.warnings[0] and "merged over it" in result.warnings[0]


def test_without_rope_scaling_in_config_json_the_length_is_refused(tmp_path):
    with pytest.raises(RecipeError) as err:
        plan(load_recipe(_local(_qwen3_dir(tmp_path, None), 65536)))
    assert "max_position_embeddings 40960" in str(err.value)

"""DeepSpeed's engine trains every parameter in the 16-bit compute dtype, a DoRA adapter's and its magnitude too,
where peft keeps them in fp32 under DDP: what the planner's params_16bit says (plan/memory.py), checked on the
run's own model and compiled ds_config through DeepSpeed's engine (its CPU accelerator here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.deepspeed_launch import DEEPSPEED_PRESET, launch_rank
from tests.helpers.recipes import tiny_recipe

pytestmark = pytest.mark.slow


def _engine_dtypes_rank(resolved: str, out: str) -> None:
    """One rank: the run's model with its adapter as the trainer adds it (peft's get_peft_model with the run's
    LoraConfig) through deepspeed.initialize on the run's compiled ds_config; the dtypes of the trainable
    parameters before and after, as JSON."""
    import deepspeed
    import torch
    from peft import get_peft_model

    from finetune.recipe.load import load_recipe
    from finetune.train.model import load_model, lora_config

    recipe = load_recipe(resolved, allow_resolved=True)
    config = json.loads((Path(resolved).parent / "ds_config.json").read_text())
    base = load_model(recipe)
    model = get_peft_model(base, lora_config(recipe, base))
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    before = {name: str(p.dtype) for name, p in trained.items()}
    optimizer = torch.optim.AdamW(list(trained.values()), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    after = {name: str(p.dtype) for name, p in engine.module.named_parameters() if p.requires_grad}
    Path(out).write_text(json.dumps({"before": before, "after": after}))


def test_deepspeed_trains_dora_adapters_and_magnitudes_in_16_bits(tmp_path):
    from finetune.plan import job_from_recipe, lookup
    from finetune.plan.memory import adapter_input_casts, params_16bit
    from finetune.recipe.load import load_recipe

    raw = tiny_recipe(
        model={"dtype": "bfloat16"},
        adapter={"dora": True},
        train={"precision": "bf16"},
        distributed={"strategy": "zero2"},
        logging={"report_to": ["none"]},
    )
    out = tmp_path / "dtypes.json"
    done, log = launch_rank(raw, tmp_path / "run", module=__name__, extra=[str(out)])
    assert done.returncode == 0, log
    seen = json.loads(out.read_text())
    magnitudes = [name for name in seen["after"] if "lora_magnitude_vector" in name]
    assert magnitudes and any("lora_A" in name for name in seen["after"]), seen
    assert "torch.float32" in seen["before"].values(), seen  # peft made fp32 adapters ...
    assert set(seen["after"].values()) == {"torch.bfloat16"}, seen  # ... which the engine cast to bf16

    recipe = load_recipe(raw)
    arch, preset, _ = lookup(recipe, hardware=DEEPSPEED_PRESET)
    job = job_from_recipe(recipe, arch=arch, preset=preset)
    assert params_16bit("zero2") and not params_16bit("ddp")
    casts = adapter_input_casts(job, "zero2")
    assert job.dora_dtype_bytes(casts=casts, params_16bit=params_16bit("zero2")) == (2, 2)
    assert job.dora_dtype_bytes(casts=adapter_input_casts(job, "ddp")) == (4, 4)  # DDP's fp32 adapters


if __name__ == "__main__":  # a rank of the test above: RESOLVED OUT
    _engine_dtypes_rank(*sys.argv[1:3])

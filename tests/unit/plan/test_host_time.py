"""The kernels a micro-batch launches (plan/host_time.py kernels_per_micro_batch): the eager RMSNorm's count as the
aten ops transformers' norm modules run, and the terms a model's q/k norms and lora dropout add."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from finetune.plan.host_time import KERNELS_PER_EAGER_NORM, KERNELS_PER_LORA_DROPOUT, kernels_per_micro_batch
from finetune.plan.lora_time import grouped_kernels_saved
from finetune.plan.workload import targeted_linears
from finetune.registry.derive import arch_from_config
from tests.helpers.aten_ops import KernelOps
from tests.helpers.paths import ROOT
from tests.helpers.recipes import shape_job


def _ops(module=None) -> int:
    """Non-view aten ops of `module`'s forward and backward on a bf16 input (the loss's own ops alone without it)."""
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    counter = KernelOps()
    with counter:
        (module(x) if module is not None else x).float().sum().backward()
    return sum(counter.ops.values())


@pytest.mark.parametrize(
    "module",
    [
        "transformers.models.llama.modeling_llama.LlamaRMSNorm",
        "transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm",
        "transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm",
    ],
)
def test_an_eager_rmsnorm_runs_the_planned_ops(module):
    import importlib

    path, name = module.rsplit(".", 1)
    norm = getattr(importlib.import_module(path), name)(64).to(torch.bfloat16)
    assert abs(_ops(norm) - _ops() - KERNELS_PER_EAGER_NORM) <= 1


def _olmo2(**kw):
    """OLMo-2-7B's job with Liger on (its q/k norms over all heads, which Liger leaves to transformers)."""
    job = shape_job("llama-3.1-8b", "lora", **kw)
    arch = arch_from_config(Path(ROOT, "tests/data/hub_configs/olmo-2-7b/config.json"), key="olmo-2-7b")
    return dataclasses.replace(job, arch=arch, liger=True)


def test_q_k_norms_liger_leaves_eager_add_two_norms_a_layer_and_dropout_two_kernels_a_linear():
    olmo = _olmo2()
    assert olmo.liger and olmo.arch.qk_norm and not olmo.liger_qk_norms
    qwen3 = dataclasses.replace(shape_job("qwen3-8b", "lora"), liger=True)
    assert qwen3.liger and qwen3.liger_qk_norms

    def kernels(job):
        return kernels_per_micro_batch(job, strategy="ddp", checkpointed_layers=0)

    layers = olmo.arch.num_layers
    without = dataclasses.replace(olmo, arch=olmo.arch.model_copy(update={"qk_norm": False}))
    assert kernels(olmo) - kernels(without) == pytest.approx(2 * KERNELS_PER_EAGER_NORM * layers)
    # Qwen3's are Liger's: nothing beyond its layer; without Liger they are eager too
    qwen3_plain = dataclasses.replace(qwen3, arch=qwen3.arch.model_copy(update={"qk_norm": False}))
    assert kernels(qwen3) == pytest.approx(kernels(qwen3_plain))
    off, off_plain = (dataclasses.replace(j, liger=False) for j in (qwen3, qwen3_plain))
    assert kernels(off) - kernels(off_plain) == pytest.approx(2 * KERNELS_PER_EAGER_NORM * qwen3.arch.num_layers)

    # dropout: two kernels a targeted linear, and the shared-input groups no longer run as one (each adapter reads
    # its own dropped-out input: plan/lora_time.py)
    dropped = dataclasses.replace(olmo, lora_dropout=0.05)
    targeted = sum(n for n, _, _ in targeted_linears(olmo.arch, olmo.lora_targets))
    grouped = grouped_kernels_saved(olmo, "ddp")
    assert grouped > 0 and grouped_kernels_saved(dropped, "ddp") == 0
    assert kernels(dropped) - kernels(olmo) == pytest.approx(KERNELS_PER_LORA_DROPOUT * targeted + grouped)


def test_liger_launches_are_counted_as_gemma3_dpos_profile_launched_them():
    """host_time.liger_launches_per_micro_batch against blind2-06's kernel profile (Gemma-3-1B DPO with Liger, one
    micro-batch a step, docs/results/profiles/blind2-06-profiled-h200x2-2026-11-30.txt): in two steps 628 RMSNorm,
    104 GELU-mul and 104 RoPE forwards, 312 RMSNorm and 52 GELU-mul backwards and, below the table's cut, RoPE's
    52: six norms, RoPE and GeGLU a layer over the policy's forward and backward and the reference's forward."""
    import json

    from finetune.plan.host_time import liger_launches_per_micro_batch
    from tests.helpers.calibration_rows import row_job

    rows = json.loads((ROOT / "tests/data/gpu_calibration.json").read_text())
    row = next(r for r in rows if r["name"] == "blind2-06-profiled")
    job = row_job(row)
    profiled = (628 + 104 + 104 + 312 + 52 + 52) / 2
    assert liger_launches_per_micro_batch(job, checkpointed_layers=0) == pytest.approx(profiled, abs=1)
    assert liger_launches_per_micro_batch(dataclasses.replace(job, liger=False), checkpointed_layers=0) == 0


def test_qlora_counts_three_dequantization_kernels_a_use_of_a_4bit_weight(monkeypatch):
    """bitsandbytes dequantizes a 4-bit weight (its absmax, the weight, a cast) at each use: every linear of every
    layer in its forward and backward, a checkpointed layer's recompute and the forwards without gradients again, as
    blind4-02's profile counted them (Qwen2.5-1.5B, 28 layers of 7 quantized linears, every layer checkpointed: 560
    of each kernel a micro-batch against the 588 uses counted here)."""
    from finetune.plan import host_time

    qlora, lora = shape_job("qwen2.5-7b", "qlora"), shape_job("qwen2.5-7b", "lora")
    layers = qlora.arch.num_layers
    planned = {c: kernels_per_micro_batch(qlora, strategy="ddp", checkpointed_layers=c) for c in (0, layers)}
    adapters = kernels_per_micro_batch(lora, strategy="ddp", checkpointed_layers=0)
    monkeypatch.setattr(host_time, "KERNELS_PER_QUANTIZED_USE", 0.0)
    for checkpointed in (0, layers):
        uses = 7 * (2 * layers + checkpointed)
        assert host_time.quantized_uses_per_micro_batch(qlora, checkpointed_layers=checkpointed) == uses
        without = kernels_per_micro_batch(qlora, strategy="ddp", checkpointed_layers=checkpointed)
        assert planned[checkpointed] - without == pytest.approx(3 * uses)
    # a LoRA run's 16-bit weights are not dequantized
    assert kernels_per_micro_batch(lora, strategy="ddp", checkpointed_layers=0) == adapters

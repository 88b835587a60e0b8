"""The planner on the config.json files popular open-weight models ship on the Hub.

tests/unit/plan/test_arch_sweep.py builds small configs with transformers' own classes; these are the files
models ship (tests/data/hub_configs/MODEL/config.json), at their real sizes and with their extra and legacy keys:
copies found in public repositories where there were any, the others written from the published architecture
(tests/data/hub_configs/README.md says which is which).
Each is either planned with the total (and, for a mixture of experts, active) parameter count its model card
or paper publishes, or refused by name with what to do. Published counts are rounded (close) and
some leave out the input embedding from the active count (DeepSeek, OpenAI): those cases say so.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from finetune.errors import RecipeError
from finetune.plan.workload import count_params
from finetune.recipe.schema import ModelSection
from finetune.registry import resolve_model
from finetune.registry.families import FAMILIES
from tests.helpers.paths import ROOT

CONFIGS = ROOT / "tests" / "data" / "hub_configs"
# published counts are rounded (30.5B total, 3.3B active): a planned count may differ by half the published
# figure's last digit, and by 1% more for what counts differently (norms, biases, routers)
CONVENTION = 0.01

# model: (published total, published active or None for dense, where it is published)
PLANNED: dict[str, tuple[float, float | None, str]] = {
    "llama-3.1-8b": (8.03e9, None, "Hub safetensors metadata"),
    "llama-3.1-70b": (70.6e9, None, "Hub safetensors metadata"),
    "llama-3.1-405b": (406e9, None, "Hub safetensors metadata"),
    "llama-3.2-1b": (1.24e9, None, "Hub safetensors metadata (tied embeddings)"),
    "llama-3.2-3b": (3.21e9, None, "Hub safetensors metadata (tied embeddings)"),
    "qwen2.5-7b": (7.61e9, None, "model card: 7.61B"),
    "qwen2.5-72b": (72.7e9, None, "model card: 72.7B"),
    "qwen2.5-0.5b": (0.49e9, None, "model card: 0.49B (tied embeddings)"),
    "qwen2.5-1.5b": (1.54e9, None, "model card: 1.54B (tied embeddings)"),
    "qwen3-8b": (8.2e9, None, "model card: 8.2B"),
    "qwen3-32b": (32.8e9, None, "model card: 32.8B"),
    "qwen3-30b-a3b": (30.5e9, 3.3e9, "model card: 30.5B total, 3.3B activated"),
    "qwen3-235b-a22b": (235e9, 22e9, "model card: 235B total, 22B activated"),
    "qwen1.5-moe-a2.7b": (14.3e9, 2.7e9, "model card: 14.3B total, 2.7B activated"),
    "qwen2-57b-a14b": (57.4e9, 14.2e9, "Hub safetensors metadata 57.4B; Qwen2 report: A14B"),
    "mistral-7b-v0.3": (7.25e9, None, "Hub safetensors metadata"),
    "mistral-small-24b": (23.6e9, None, "Hub safetensors metadata (head_dim 128, not 5120 / 32)"),
    "mixtral-8x7b": (46.7e9, 12.9e9, "Mixtral paper: 47B total, 13B active; Hub 46.7B"),
    "mixtral-8x22b": (141e9, 39e9, "Mistral announcement: 141B total, 39B active"),
    "gemma-2-9b": (9.24e9, None, "Hub safetensors metadata"),
    "gemma-3-1b": (1.0e9, None, "model card: 1B (tied embeddings)"),
    "gemma-2-27b": (27.2e9, None, "Hub safetensors metadata"),
    "phi-3-mini-4k": (3.82e9, None, "model card: 3.8B"),
    "phi-4": (14.7e9, None, "model card: 14B; Hub safetensors metadata 14.7B"),
    "phi-4-mini": (3.84e9, None, "model card: 3.8B (tied embeddings)"),
    "deepseek-v2.5": (236e9, 21e9, "model card: 236B total, 21B activated"),
    "deepseek-v3-bf16": (671e9, 37e9, "paper: 671B total, 37B activated (the Hub's 685B adds the MTP module)"),
    # published in FP8 only: loaded dequantized, planned as the 16-bit model (test_published_quantized_is_planned_...)
    "deepseek-v3": (671e9, 37e9, "paper: 671B total, 37B activated (the Hub's 685B adds the MTP module)"),
    "olmo-2-7b": (7.30e9, None, "Hub safetensors metadata"),
    "olmoe-1b-7b": (6.9e9, 1.3e9, "OLMoE paper: 6.9B total, 1.3B active"),
    "olmo-2-13b": (13.7e9, None, "Hub safetensors metadata"),
    "granite-3.1-8b": (8.17e9, None, "Hub safetensors metadata"),
    "falcon3-7b": (7.46e9, None, "Hub safetensors metadata (head_dim 256)"),
    "falcon3-10b": (10.3e9, None, "Hub safetensors metadata"),
    "smollm3-3b": (3.08e9, None, "model card: 3B; Hub safetensors metadata 3.08B"),
    "command-r-v01": (35e9, None, "model card: 35B"),
    "internlm3-8b": (8.8e9, None, "model card: 8.8B"),
}
# published active counts that leave out the input embedding (a lookup, not a matmul)
ACTIVE_WITHOUT_EMBEDDING: dict[str, tuple[float, str]] = {
    "deepseek-v2-lite": (2.4e9, "model card: 15.7B total, 2.4B activated"),
    "gpt-oss-20b-bf16": (3.61e9, "model card: 20.9B total, 3.6B active (3.61B, embeddings aside)"),
    # published in MXFP4 only: loaded dequantized, planned as the 16-bit model (test_mxfp4_is_planned_dequantized)
    "gpt-oss-20b": (3.61e9, "model card: 20.9B total, 3.6B active (3.61B, embeddings aside)"),
    "gpt-oss-120b": (5.13e9, "model card: 117B total, 5.1B active (5.13B, embeddings aside)"),
    "granite-3.1-3b-a800m": (800e6, "Granite 3.0 report: 3.3B total, 800M active (its tied embedding aside)"),
}
PLANNED_TOTAL_ONLY = {
    "deepseek-v2-lite": 15.7e9,
    "gpt-oss-20b-bf16": 20.9e9,
    "gpt-oss-20b": 20.9e9,
    "gpt-oss-120b": 117e9,
    "granite-3.1-3b-a800m": 3.3e9,
}
# multimodal checkpoints planned as their text decoder plus frozen towers (finetune/registry/families.py
# TEXT_OF_MULTIMODAL): the published count includes the vision tower and projector, whose size transformers'
# meta-device Gemma3ForConditionalGeneration gives exactly
TEXT_OF_MULTIMODAL: dict[str, tuple[float, int, str]] = {
    "gemma-3-4b": (4.30e9, 419_816_304, "Hub safetensors metadata 4.3B, of which the SigLIP tower and projector"),
    "gemma-3-27b": (27.4e9, 423_060_336, "Hub safetensors metadata 27.4B, of which the SigLIP tower and projector"),
}
# model: words the refusal must contain
REFUSED: dict[str, tuple[str, ...]] = {
    # published quantized in a format finetune does not load dequantized itself: the fix names the 16-bit model
    "qwen2.5-7b-awq": ("quantized", "'awq'", "unquantized model"),
    "llama-4-scout": ("'llama4'", "mixture-of-experts"),
    "internlm2.5-7b": ("'internlm2'",),
}


def plan_counts(model: str):
    arch = resolve_model(ModelSection(name=str(CONFIGS / model)), base_dir=ROOT)
    return count_params(arch)


def close(planned: float, published: float) -> bool:
    digits = f"{published:.3g}".split("e")[0].replace(".", "").strip("0")  # "2.4e+09" -> "24"
    last = 10 ** (math.floor(math.log10(published)) - len(digits) + 1)
    return abs(planned - published) <= last / 2 + CONVENTION * published


@pytest.mark.parametrize("model", sorted(PLANNED))
def test_planned_with_the_published_counts(model):
    total, active, source = PLANNED[model]
    p = plan_counts(model)
    assert close(p.total, total), f"{model}: planned {p.total:,} total, published {total:,.0f} ({source})"
    if active is None:
        assert p.active == p.total
    else:
        assert close(p.active, active), f"{model}: planned {p.active:,} active, published {active:,.0f} ({source})"


@pytest.mark.parametrize("model", sorted(ACTIVE_WITHOUT_EMBEDDING))
def test_active_counts_published_without_the_input_embedding(model):
    active, source = ACTIVE_WITHOUT_EMBEDDING[model]
    p = plan_counts(model)
    assert close(p.total, PLANNED_TOTAL_ONLY[model]), f"{model}: planned {p.total:,} total ({source})"
    assert close(p.active - p.embed, active), f"{model}: planned {p.active - p.embed:,} ({source})"


@pytest.mark.parametrize("model", sorted(TEXT_OF_MULTIMODAL))
def test_multimodal_wrapper_is_planned_as_its_text_decoder_and_its_frozen_towers(model):
    # Gemma-3's nested text_config leaves out the keys equal to Gemma3TextConfig's defaults (the 4B's names
    # neither its heads nor its vocab): the planner once refused both as "not a decoder-only LM"; then it left
    # the ~0.42B vision tower out of the weights it planned
    total, towers, source = TEXT_OF_MULTIMODAL[model]
    p = plan_counts(model)
    assert p.towers == towers, f"{model}: towers {p.towers:,} against transformers' {towers:,}"
    assert close(p.total, total), f"{model}: planned {p.total:,}, published {total:,.0f} ({source})"
    # a token runs the text model only; a full fine-tune trains it only
    assert p.active == p.text_model == p.total - towers


@pytest.mark.parametrize("model", sorted(REFUSED))
def test_refused_by_name_with_a_fix(model):
    with pytest.raises(RecipeError) as caught:
        plan_counts(model)
    err = caught.value
    text = err.render()
    assert all(w in text for w in REFUSED[model]), text
    assert err.hint and err.key == "model.name", text


def test_every_stored_config_is_a_case():
    cases = {*PLANNED, *ACTIVE_WITHOUT_EMBEDDING, *TEXT_OF_MULTIMODAL, *REFUSED}
    assert {p.name for p in CONFIGS.iterdir() if (p / "config.json").is_file()} == cases


def test_gemma3_class_defaults_are_transformers():
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma3TextConfig()
    for family in ("gemma3", "gemma3_text"):
        defaults = FAMILIES[family].defaults
        assert defaults == {k: getattr(config, k) for k in defaults}


def test_finetune_plan_cli_plans_gemma3_4b_from_its_hub_config(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        json.dumps(
            {
                "model": {"name": str(CONFIGS / "gemma-3-4b")},
                "method": "sft",
                "adapter": {"type": "lora", "r": 16, "alpha": 32},
                "data": {"sources": [{"path": str(ROOT / "data/samples/alpaca.jsonl")}], "max_length": 2048},
                "train": {"epochs": 1, "global_batch_size": 32},
            }
        )
    )
    run = subprocess.run(
        [sys.executable, "-m", "finetune.cli", "plan", str(recipe), "--hardware", "server-8xh100", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    # the text decoder (3,880,263,168) and the SigLIP tower with its projector, as transformers builds them
    assert json.loads(run.stdout)["total_params"] == 3_880_263_168 + TEXT_OF_MULTIMODAL["gemma-3-4b"][1]


def test_an_adapter_on_an_moe_model_says_its_routed_experts_train_no_lora():
    """transformers 5 fuses the routed experts into 3D parameters: LoRA reaches the attention and the shared experts
    only, and QLoRA leaves the experts in the model's dtype; a recipe written for transformers 4's per-expert
    linears is told so by the plan (the planned trainable count and weights already follow it)."""
    from finetune.plan import plan
    from finetune.recipe import load_recipe

    def warnings(model: str, adapter: str) -> str:
        raw = {
            "model": {"name": str(CONFIGS / model)},
            "adapter": {"type": adapter, "target_modules": "all-linear"},
            "data": {"path": "t.jsonl"},
            "train": {"liger": "off"},
            "hardware": "server-8xh100",
        }
        return " ".join(plan(load_recipe(raw)).warnings)

    qlora = warnings("qwen1.5-moe-a2.7b", "qlora")
    assert "routed experts (12.5B of its 14.3B parameters) train no LoRA" in qlora
    assert "can reach the attention and the shared experts only" in qlora
    assert "the experts load in bfloat16" in qlora
    assert "the dense layers' MLPs" in warnings("deepseek-v2-lite", "lora")
    assert "routed experts" not in warnings("llama-3.1-8b", "lora")


@pytest.mark.parametrize(
    ("model", "method", "loader", "hardware"),
    [
        ("gpt-oss-20b", "mxfp4", "Mxfp4Config", "server-8xh100"),  # gpt-oss as OpenAI publishes it
        ("deepseek-v3", "fp8", "FineGrainedFP8Config", "cluster-4x8xh100"),  # DeepSeek-V3/R1 as published
    ],
)
def test_published_quantized_is_planned_dequantized_and_qlora_on_it_is_refused(model, method, loader, hardware):
    """A checkpoint published in MXFP4 (gpt-oss) or block-scaled FP8 (DeepSeek-V3/R1) loads through transformers'
    dequantizing config: the plan is the 16-bit model's, says so, counts the load as a converted copy (not mapped file
    pages) and a whole-model load under FSDP2 (finetune's sharded load reads 16-bit tensors); bitsandbytes cannot
    quantize it again in that load."""
    from finetune.plan import job_from_recipe, plan
    from finetune.recipe import load_recipe
    from finetune.registry import get_preset

    raw = {
        "model": {"name": str(CONFIGS / model)},
        "adapter": {"type": "lora"},
        "data": {"path": "t.jsonl"},
        "train": {"liger": "off"},
        "distributed": {"strategy": "fsdp2"},
    }
    arch = resolve_model(ModelSection(name=str(CONFIGS / model)), base_dir=ROOT)
    assert arch.dequantized_from == method and arch.checkpoint_dtype is None
    recipe = load_recipe(raw)
    job = job_from_recipe(recipe, arch=arch, preset=get_preset(hardware))
    assert job.load_copies and not job.sharded_load
    planned = plan(recipe, hardware=hardware)
    said = f"published {method} checkpoint -> bfloat16, dequantized while loading (transformers' {loader}("
    assert any(said in s for s in planned.substitutions), planned.substitutions
    with pytest.raises(RecipeError) as refused:
        plan(load_recipe({**raw, "adapter": {"type": "qlora"}}), hardware=hardware)
    assert refused.value.key == "adapter.type" and "lora" in refused.value.hint

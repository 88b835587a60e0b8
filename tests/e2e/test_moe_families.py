"""Mixture-of-experts conventions the planner reads train end to end with `finetune run` on CPU: tiny random
models of each family's own transformers config class, the shipped tokenizer, a few optimizer steps.

Each covers what only a real run shows: Granite's MoE config names its expert count in a way TRL's chunked
LM head did not read (finetune/compat/moe_expert_count.py), and its trained config.json is read back by the
planner; GPT-OSS's attention sinks need its eager attention (sdpa is refused by transformers, and the
varlen kernel would drop them); DeepSeek-V3's latent attention and routed experts train with LoRA on
their own projection names; OLMoE's and GLM-4.5's experts (the latter DeepSeek's, beside grouped-query
attention with per-head q/k norms) train as the planner reads them."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from finetune.plan.workload import count_params
from finetune.recipe.schema import ModelSection
from finetune.registry import resolve_model
from finetune.rundir import RESOLVED_RECIPE, read_metrics
from tests.helpers.paths import TINY_MODEL
from tests.helpers.processes import cli_argv, run
from tests.helpers.recipes import write_recipe

pytestmark = pytest.mark.slow

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)
FAMILIES = {
    # granitemoe: the auxiliary router loss on (the class default), multipliers as the Hub's 3B-A800M has them
    "granitemoe": dict(
        num_key_value_heads=2,
        intermediate_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.015625,
        logits_scaling=6.0,
    ),
    "gpt_oss": dict(
        num_key_value_heads=2, head_dim=16, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2
    ),
    "olmoe": dict(num_key_value_heads=4, intermediate_size=96, num_experts=4, num_experts_per_tok=2),
    "glm4_moe": dict(
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        use_qk_norm=True,
    ),
    "deepseek_v3": dict(
        num_key_value_heads=4,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        head_dim=8,
    ),
}


def moe_model_dir(tmp_path, family: str):
    """A config.json of `family` (written by its config class) beside the tiny model's tokenizer."""
    from transformers import CONFIG_MAPPING

    folder = tmp_path / family
    shutil.copytree(TINY_MODEL, folder, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    tiny = json.loads((TINY_MODEL / "config.json").read_text())
    ids = {k: tiny.get(k) for k in ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")}
    CONFIG_MAPPING[family](**SMALL, **FAMILIES[family], **ids).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("family", "adapter"),
    [
        ("granitemoe", "full"),
        ("gpt_oss", "lora"),
        ("gpt_oss", "experts"),  # its experts stored transposed (in x out): peft's is_transposed path
        ("deepseek_v3", "lora"),
        ("olmoe", "lora"),
        ("glm4_moe", "lora"),
    ],
)
def test_each_moe_convention_trains_end_to_end(tmp_path, family, adapter):
    folder = moe_model_dir(tmp_path, family)
    planned = count_params(resolve_model(ModelSection(name=str(folder)), base_dir=tmp_path))
    assert planned.active < planned.total  # read as a mixture of experts, not guessed dense
    recipe = write_recipe(
        tmp_path / "recipe.yaml",
        model={"name": str(folder), "dtype": "float32", "init": "random"},
        adapter={"type": adapter}
        if adapter == "full"
        else {"type": "lora", "r": 8, "alpha": 16, "target_experts": adapter == "experts"},
        train={"epochs": None, "max_steps": 6, "logging_steps": 1},
        output={"save_every": None},
    )
    done = run(cli_argv(recipe, tmp_path / "run"), cache=tmp_path / "cache")
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in out, out[-3000:]
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    if family == "gpt_oss":  # the ranks loaded the attention the plan chose for the sinks
        resolved = yaml.safe_load((tmp_path / "run" / RESOLVED_RECIPE).read_text())
        assert resolved["model"]["attn_implementation"] == "eager"
    if adapter == "full":  # the trained model's config.json is read back as the same model
        again = count_params(resolve_model(ModelSection(name=str(tmp_path / "run")), base_dir=tmp_path))
        assert (again.total, again.active) == (planned.total, planned.active)


def test_lora_on_the_routed_experts_trains_saves_and_merges(tmp_path):
    """adapter.target_experts on OLMoE: the run trains an adapter per expert (as many parameters as the plan says),
    saves them with peft's target_parameters, and `finetune merge` (peft's whole-model merge: the streaming one
    covers modules only) writes a model whose logits are the adapted model's."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.api import plan
    from finetune.cli import main
    from finetune.recipe import load_recipe

    folder = moe_model_dir(tmp_path, "olmoe")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    recipe = write_recipe(
        tmp_path / "recipe.yaml",
        model={"name": str(folder), "dtype": "float32"},
        adapter={"type": "lora", "r": 8, "alpha": 16, "target_experts": True},
        train={"epochs": None, "max_steps": 4, "logging_steps": 1},
        output={"save_every": None},
    )
    done = run(cli_argv(recipe, tmp_path / "run"), cache=tmp_path / "cache")
    assert done.returncode == 0 and "Traceback" not in done.stdout + done.stderr, (done.stdout + done.stderr)[-3000:]
    saved = load_file(tmp_path / "run" / "adapter_model.safetensors")
    assert any(".experts." in k for k in saved)
    assert sum(t.numel() for t in saved.values()) == plan(load_recipe(recipe), hardware="cpu").trainable_params
    assert json.loads((tmp_path / "run" / "adapter_config.json").read_text())["target_parameters"]

    assert main(["merge", str(tmp_path / "run"), "-o", str(tmp_path / "merged")]) == 0
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, tmp_path / "run").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        want, got = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(input_ids=ids).logits
    assert not torch.allclose(want, plain, atol=1e-5)  # the adapter changed the experts
    assert torch.allclose(want, got, atol=1e-4), (want - got).abs().max()


def _publish_quantized(folder, quantize, quantization_config: dict) -> None:
    """The folder's config as a seeded random bf16 checkpoint, each tensor replaced by what `quantize(name, value)`
    returns in its place (None: kept), and config.json naming `quantization_config`."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).to(torch.bfloat16).save_pretrained(folder)
    packed = {}
    for name, value in load_file(folder / "model.safetensors").items():
        packed.update(quantize(name, value) or {name: value.contiguous()})
    save_file(packed, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))


def _mxfp4_checkpoint(folder):
    """A tiny GPT-OSS checkpoint as openai/gpt-oss-* publish theirs: the routed experts as MXFP4 blocks and scales
    (uint8, 32 weights a block), everything else bf16, config.json naming quant_method mxfp4."""
    import torch

    generator = torch.Generator().manual_seed(0)

    def quantize(name, value):
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return None
        experts, fan_in, fan_out = value.shape  # GPT-OSS stores its experts in x out
        blocks = (experts, fan_out, fan_in // 32, 16)
        return {
            f"{name}_blocks": torch.randint(0, 256, blocks, dtype=torch.uint8, generator=generator),
            f"{name}_scales": torch.full(blocks[:3], 124, dtype=torch.uint8),  # 2^-3 a block
        }

    modules_to_not_convert = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    _publish_quantized(folder, quantize, {"quant_method": "mxfp4", "modules_to_not_convert": modules_to_not_convert})


FP8_BLOCK = 8  # the tiny shapes' widths are multiples of 8 (DeepSeek publishes 128 x 128 blocks)


def _fp8_checkpoint(folder):
    """A tiny DeepSeek-V3 checkpoint as DeepSeek publishes V3 and R1 (and Qwen its -FP8 releases): each decoder
    layer's projection, routed experts one by one included, an e4m3 weight with a float32 weight_scale_inv per
    FP8_BLOCK x FP8_BLOCK block; norms, the router, the embedding and lm_head bf16; config.json naming quant_method
    fp8."""
    import torch

    b = FP8_BLOCK

    def quantize(name, value):
        if not (".layers." in name and name.endswith("proj.weight")):  # saved per expert: transformers fuses on load
            return None
        rows, cols = value.shape
        blocks = value.float().reshape(rows // b, b, cols // b, b)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
        return {
            name: (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn),
            name.removesuffix("weight") + "weight_scale_inv": scale,
        }

    quantization = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [b, b]}
    _publish_quantized(folder, quantize, quantization)


# the published quant_method: the family it is published for and the tiny checkpoint writer
PUBLISHED_QUANTIZED = {"mxfp4": ("gpt_oss", _mxfp4_checkpoint), "fp8": ("deepseek_v3", _fp8_checkpoint)}


def published_quantized_recipe(tmp_path, method: str, *, hardware: str = "cpu"):
    """A recipe training LoRA on a tiny model published in `method` (PUBLISHED_QUANTIZED), on its attention and, as
    OpenAI's gpt-oss recipe picks layers, on the routed experts of its second layer."""
    family, write = PUBLISHED_QUANTIZED[method]
    folder = moe_model_dir(tmp_path, family)
    write(folder)
    return write_recipe(
        tmp_path / "recipe.yaml",
        model={"name": str(folder), "dtype": "bfloat16"},
        adapter={"type": "lora", "r": 8, "alpha": 16, "target_experts": [1]},
        train={"epochs": None, "max_steps": 4, "logging_steps": 1, "precision": "bf16", "liger": "off"},
        output={"save_every": None},
        hardware=hardware,
    )


@pytest.mark.parametrize("method", sorted(PUBLISHED_QUANTIZED))
def test_a_model_published_quantized_trains_dequantized_and_merges_to_16_bits(tmp_path, method):
    """GPT-OSS as OpenAI publishes it (MXFP4 experts), DeepSeek-V3 as DeepSeek does (block-scaled FP8): planned as the
    16-bit model, loaded through transformers' dequantizing config, trained with LoRA on its experts too, and merged
    (in memory: the base's shards hold quantized tensors) into a 16-bit model without the quantization in its
    config."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.api import plan
    from finetune.cli import main
    from finetune.recipe import load_recipe

    recipe = published_quantized_recipe(tmp_path, method)
    planned = plan(load_recipe(recipe), hardware="cpu")
    assert any(f"{method} checkpoint -> bfloat16" in s for s in planned.substitutions), planned.substitutions
    done = run(cli_argv(recipe, tmp_path / "run"), cache=tmp_path / "cache")
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in out, out[-3000:]
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(losses) == 4 and all(loss == loss for loss in losses), losses  # trained, finite
    saved = json.loads((tmp_path / "run" / "adapter_config.json").read_text())["target_parameters"]
    assert sorted(saved) == ["layers.1.mlp.experts.down_proj", "layers.1.mlp.experts.gate_up_proj"]

    assert main(["merge", str(tmp_path / "run"), "-o", str(tmp_path / "merged")]) == 0
    merged_config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert not merged_config.get("quantization_config")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.bfloat16)
    assert {p.dtype for p in merged.parameters()} <= {torch.bfloat16, torch.float32}
    assert merged.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16

"""Parameter counts of mixture-of-experts configs in every convention transformers uses, against the
real models: each family's config is built small with transformers' own config class, saved as the
config.json the Hub would serve, read by the planner's config reader (finetune/registry/derive.py), and
the planner's total must equal sum(p.numel()) of the model transformers instantiates on the meta device.
The active count (parameters one token uses) is checked by construction: total minus the experts a token
is not routed to."""

from __future__ import annotations

import json

import pytest

from finetune.errors import RecipeError
from finetune.plan.workload import count_params, expert_size, moe_layer_count
from finetune.recipe.schema import ModelSection
from finetune.registry import resolve_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
)

CONFIGS = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=80,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=2, head_dim=16),
    ),
    # DeepSeek-V2-Lite style: no query compression (q_proj), one dense layer first
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=2,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            num_key_value_heads=4,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            first_k_dense_replace=2,
            q_lora_rank=24,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            num_key_value_heads=4,
            n_group=2,
            topk_group=1,
        ),
    ),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8)),
}


def _config_dir(tmp_path, family):
    cls_name, extra = CONFIGS[family]
    config = getattr(transformers, cls_name)(**{**SMALL, **extra})
    folder = tmp_path / family
    folder.mkdir()
    config.to_json_file(str(folder / "config.json"))
    return config, folder


def _real_count(config) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_total_params_equal_transformers_models(tmp_path, family):
    config, folder = _config_dir(tmp_path, family)
    arch = resolve_model(ModelSection(name=str(folder)), base_dir=tmp_path)
    assert arch.num_experts > 1
    assert count_params(arch).total == _real_count(config)  # exact


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_active_params_leave_out_the_unrouted_experts(tmp_path, family):
    _, folder = _config_dir(tmp_path, family)
    arch = resolve_model(ModelSection(name=str(folder)), base_dir=tmp_path)
    p = count_params(arch)
    h, i = arch.hidden_size, expert_size(arch)
    one_expert = 3 * h * i + ((2 * i + h) if arch.expert_bias else 0)  # gate, up, down (+ GPT-OSS biases)
    unrouted = moe_layer_count(arch) * (arch.num_experts - arch.experts_per_token) * one_expert
    assert p.total - p.active == unrouted > 0


def test_layer_mix_read_from_each_convention(tmp_path):
    read = {f: resolve_model(ModelSection(name=str(_config_dir(tmp_path, f)[1])), base_dir=tmp_path) for f in CONFIGS}
    assert read["qwen2_moe"].moe_layers == 3  # mlp_only_layers [1] of 4
    assert read["qwen3_moe"].moe_layers == 2  # decoder_sparse_step 2: layers 1 and 3
    assert read["deepseek_v3"].moe_layers == 2  # first_k_dense_replace 2
    assert read["deepseek_v2"].shared_expert_intermediate_size == 2 * 16  # n_shared x moe width
    assert read["deepseek_v3"].lora_targets[:2] == ["q_a_proj", "q_b_proj"]
    assert read["deepseek_v2"].lora_targets[0] == "q_proj"
    assert (read["gpt_oss"].sliding_window, read["gpt_oss"].sliding_layers) == (8, 2)


def _write(tmp_path, name, cfg):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_unknown_model_type_is_refused_by_name(tmp_path):
    folder = _write(tmp_path, "x", {"model_type": "jamba", **SMALL})
    with pytest.raises(RecipeError, match="jamba"):
        resolve_model(ModelSection(name=str(folder)), base_dir=tmp_path)


def test_unknown_moe_keys_are_refused_not_planned_dense(tmp_path):
    # a DeepSeek-style config under a dense model_type: its expert keys are not read as dense
    folder = _write(
        tmp_path, "y", {"model_type": "llama", **SMALL, "n_routed_experts": 64, "moe_intermediate_size": 32}
    )
    with pytest.raises(RecipeError, match="moe_intermediate_size, n_routed_experts"):
        resolve_model(ModelSection(name=str(folder)), base_dir=tmp_path)


def test_finetune_plan_prints_total_and_active_params(tmp_path):
    from finetune.plan import job_from_recipe, plan_job, render_plan_table
    from finetune.recipe import load_recipe
    from finetune.registry import get_preset

    _, folder = _config_dir(tmp_path, "deepseek_v3")
    recipe = load_recipe(
        {
            "model": {"name": str(folder)},
            "data": {"path": "train.jsonl"},
            "adapter": {"type": "lora"},
            "hardware": "server-8xh100",
        }
    )
    arch = resolve_model(recipe.model, base_dir=tmp_path)
    plan = plan_job(job_from_recipe(recipe, arch=arch, preset=get_preset("server-8xh100")))
    p = count_params(arch)
    assert (plan.total_params, plan.active_params) == (p.total, p.active)
    assert f"{p.total / 1e6:.1f}M params total, {p.active / 1e6:.1f}M active per token" in render_plan_table(plan)

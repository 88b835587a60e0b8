"""Every causal-LM architecture transformers ships is either planned exactly or refused by name.

For each model type of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES a small config is built with the
type's own config class, saved as the config.json the Hub would serve (only the values that differ
from the class defaults, as save_pretrained writes them) and read by the planner's config reader. Then
exactly one of:
- planned: the planner's total parameter count equals sum(p.numel()) of the model
  AutoModelForCausalLM builds on the meta device (exact, no tolerance), and for a mixture of experts the
  active count leaves out exactly the experts a token is not routed to;
- refused: a RecipeError that names the model type and says what to do (never another exception, never
  a dense guess).
PLANNED lists the types that must be planned, so support cannot vanish into a refusal unnoticed.
"""

from __future__ import annotations

import os

import pytest

from finetune.errors import RecipeError
from finetune.plan.workload import count_params, expert_size, lora_param_count, moe_layer_count
from finetune.recipe.schema import ModelSection
from finetune.registry import resolve_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import CONFIG_MAPPING, AutoModelForCausalLM  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

# set on whichever config (top level or text_config) has the key; 2 layers of 64 wide keep meta models cheap;
# head_dim 24 is not hidden / heads (16), so a family that reads head_dim and one that does not both show
SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    head_dim=24,
    num_local_experts=4,
    num_experts=4,
    n_routed_experts=4,
    moe_intermediate_size=32,
    num_experts_per_tok=2,
    max_position_embeddings=256,
)
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")

# types whose config class needs more than SMALL to build at this size (each with the reason)
OVERRIDES: dict[str, tuple[dict, str]] = {
    "deepseek_v3": (
        dict(first_k_dense_replace=1, n_group=1, topk_group=1),
        "the default 3 dense layers would leave 2 layers no experts, and the default 8 expert groups need 8 experts",
    ),
    "dots3_note_text": (dict(num_key_value_heads=4), "its attention requires as many kv heads as query heads"),
    "mamba2": (dict(num_heads=8, head_dim=16), "hidden_size x expand must equal num_heads x head_dim"),
    "helium": (dict(head_dim=16), "its o_proj is hidden x hidden: the heads must span hidden_size exactly"),
    "zaya": (dict(num_experts_per_tok=1), "ZAYA routes each token to one expert only"),
}
# types whose config only validates at the class's own size (their layer pattern, vision adapter or tied
# shared blocks are sized with it): read at full size, which the meta device builds as cheaply
FULL_SIZE = {
    "dots3_note": "the vision adapter's width must equal the text hidden size",
    "zamba": "the shared transformer blocks' tying and layer pattern follow the class's 76 layers",
    "zamba2": "layers_block_type and hybrid_layer_ids are fixed at the class's 54 layers",
}
# types whose config cannot be built at all offline (each with the reason)
UNBUILDABLE = {
    "gemma4_assistant": "Gemma4AssistantConfig() fails its own check (hidden_size_per_layer_input must be 0, "
    "its default is 256)",
}
# multimodal checkpoints planned as their text decoder and frozen towers: the towers are counted in the total
# (ModelArch.frozen_tower_params), and the text model (what trains, what a token runs) is the rest
TEXT_ONLY = {"gemma3": ("model.vision_tower.", "model.multi_modal_projector.")}

PLANNED = {
    "cohere",
    "cohere2",
    "cwm",
    "deepseek_v2",
    "deepseek_v3",
    "ernie4_5",
    "exaone",
    "exaone4",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "glm",
    "glm4",
    "glm4_moe",
    "gpt_oss",
    "granite",
    "granitemoe",
    "granitemoeshared",
    "helium",
    "hunyuan_v1_dense",
    "internlm3",
    "iquestcoder",
    "llama",
    "ministral",
    "ministral3",
    "mistral",
    "mixtral",
    "olmoe",
    "olmo2",
    "olmo3",
    "phi3",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "seed_oss",
    "smollm3",
    "vaultgemma",
}


def _shrink(defaults: dict) -> dict:
    kwargs = {k: v for k, v in SMALL.items() if k in defaults}
    for k in TOKEN_IDS:  # token ids past the small vocabulary would not index the embedding
        value = defaults.get(k)
        if isinstance(value, int) and value >= SMALL["vocab_size"]:
            kwargs[k] = 1
        elif isinstance(value, list):
            kwargs[k] = [1]
    kinds = defaults.get("layer_types")
    if isinstance(kinds, list) and kinds and "num_hidden_layers" in kwargs:
        # keep one layer of each of the first two kinds (a sliding and a full layer, a mamba and an attention)
        other = next((t for t in kinds if t != kinds[0]), kinds[0])
        kwargs["layer_types"] = [kinds[0], other]
    return kwargs


def small_config(model_type: str, *, switches: dict | None = None, tie: bool | None = None):
    """The type's config at SMALL size; `switches` set on the text config where it has those keys, `tie`
    as the top-level tie_word_embeddings (a multimodal model ties by its top-level config)."""
    cls = CONFIG_MAPPING[model_type]
    if model_type in FULL_SIZE:
        return cls()
    defaults = cls().to_dict()
    kwargs = _shrink(defaults)
    text = defaults.get("text_config")
    if isinstance(text, dict):
        kwargs["text_config"] = _shrink(text)
    target = kwargs["text_config"] if isinstance(text, dict) else kwargs
    target.update({k: v for k, v in (switches or {}).items() if k in (text if isinstance(text, dict) else defaults)})
    if tie is not None:
        kwargs["tie_word_embeddings"] = tie
    extra, _ = OVERRIDES.get(model_type, ({}, ""))
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(kwargs.get(key), dict):
            kwargs[key] = {**kwargs[key], **value}
        else:
            kwargs[key] = value
    return cls(**kwargs)


def meta_model(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def real_count(model, *, leave_out: tuple[str, ...] = ()) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith(leave_out))


def real_lora_count(model, *, targets: list[str], r: int, leave_out: tuple[str, ...] = ()) -> int:
    """What peft adds for these target names: r x (in + out) per nn.Linear of the decoder layers so named."""
    return sum(
        r * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and ".layers." in name
        and name.rsplit(".", 1)[-1] in targets
        and not name.startswith(leave_out)
    )


def read(tmp_path, config):
    folder = tmp_path / "model"
    folder.mkdir()
    config.to_json_file(str(folder / "config.json"))
    return resolve_model(ModelSection(name=str(folder)), base_dir=tmp_path)


@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_planned_exactly_or_refused_by_name(tmp_path, model_type):
    if model_type in UNBUILDABLE:
        pytest.skip(UNBUILDABLE[model_type])
    config = small_config(model_type)
    try:
        arch = read(tmp_path, config)
    except RecipeError as err:
        text = err.render()
        assert model_type not in PLANNED, text
        assert repr(config.model_type) in text, text  # names the type (gpt-sw3's config is GPT-2's)
        assert err.hint and err.key == "model.name", text  # and says what to do
        return
    assert model_type in PLANNED, f"{model_type} is planned: add it to PLANNED"
    p = count_params(arch)
    model, towers = meta_model(config), TEXT_ONLY.get(model_type, ())
    assert p.total == real_count(model) and p.text_model == real_count(model, leave_out=towers)
    # the LoRA targets the planner writes into the resolved recipe are the model's linear modules, and
    # the adapter it plans is the one peft builds on them
    lora = lora_param_count(arch, r=8, targets=arch.lora_targets, dora=False)
    assert lora == real_lora_count(model, targets=arch.lora_targets, r=8, leave_out=towers) > 0
    if arch.num_experts > 1:
        h, i = arch.hidden_size, expert_size(arch)
        one = 3 * h * i + ((2 * i + h) if arch.expert_bias else 0)
        unrouted = moe_layer_count(arch) * (arch.num_experts - arch.experts_per_token) * one
        assert p.total - p.active == unrouted > 0  # every MoE type here has MoE layers at this size
    else:
        assert p.active == p.text_model


# the config switches that add parameters in some families and not in others (each family's attention
# decides whether attention_bias reaches o_proj); flipped together with the embedding tying
SWITCHES = dict(
    attention_bias=True, mlp_bias=True, qkv_bias=False, attention_out_bias=True, use_qk_norm=True, use_bias=True
)


@pytest.mark.parametrize("model_type", sorted(PLANNED - set(FULL_SIZE)))
def test_biases_qk_norms_and_tying_switched_on_are_counted(tmp_path, model_type):
    tied = small_config(model_type).tie_word_embeddings
    config = small_config(model_type, switches=SWITCHES, tie=not tied)
    arch = read(tmp_path, config)
    assert arch.tied_embeddings is not tied
    model, towers = meta_model(config), TEXT_ONLY.get(model_type, ())
    params = count_params(arch)
    assert params.total == real_count(model) and params.text_model == real_count(model, leave_out=towers)


@pytest.mark.parametrize("model_type", ["olmo2", "cohere2", "phi3", "qwen3_next"])
def test_finetune_plan_cli_plans_new_families_and_refuses_without_a_traceback(tmp_path, model_type):
    import json
    import subprocess
    import sys

    import yaml

    from tests.helpers.paths import ROOT

    config = small_config(model_type)
    (tmp_path / "model").mkdir()
    config.to_json_file(str(tmp_path / "model" / "config.json"))
    recipe = {
        "model": {"name": "model"},
        "data": {"path": "train.jsonl", "max_length": 256},
        "adapter": {"type": "lora"},
        "hardware": "server-8xh100",
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    proc = subprocess.run(
        [sys.executable, "-m", "finetune.cli", "plan", "recipe.yaml", "--json"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    if model_type not in PLANNED:
        assert proc.returncode != 0, proc.stdout
        assert f"model_type {model_type!r} is not supported by the planner" in proc.stderr, proc.stderr
        assert "linear-attention" in proc.stderr and "no registry entry stands in" in proc.stderr, proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["fits"] and plan["total_params"] == real_count(meta_model(config))


WINDOWED = sorted(t for t in PLANNED if "layer_types" in CONFIG_MAPPING[t]().get_text_config().to_dict())


@pytest.mark.parametrize("model_type", WINDOWED)
def test_sliding_layers_follow_the_config_class_rule_when_layer_types_is_left_out(tmp_path, model_type):
    """A config.json written before layer_types existed: the planner's rule for which layers slide is the
    one the config class fills layer_types with (8 layers, so every pattern repeats)."""
    import json

    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    text = defaults.get("text_config")
    kwargs = {k: v for k, v in _shrink(text or defaults).items() if k != "layer_types"}
    kwargs.update(num_hidden_layers=8, sliding_window=32, use_sliding_window=True, max_window_layers=3)
    kwargs = {k: v for k, v in kwargs.items() if k in (text or defaults)}
    config = cls(**({"text_config": kwargs} if text else kwargs))
    kinds = config.get_text_config().layer_types
    saved = json.loads(config.to_json_string())
    saved.get("text_config", saved).pop("layer_types")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(saved))
    arch = resolve_model(ModelSection(name=str(tmp_path / "model")), base_dir=tmp_path)
    assert arch.sliding_layers == kinds.count("sliding_attention")
    assert arch.sliding_window == (32 if arch.sliding_layers else None)


# what sizes a mixture of experts: save_pretrained leaves out each of these that equals its class's default
EXPERT_KEYS = (
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "n_shared_experts",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "first_k_dense_replace",
    "num_experts_per_tok",
)
MOE_TYPES = sorted(
    {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss", "olmoe", "glm4_moe"}
    | {"granitemoe", "granitemoeshared"}
)


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_expert_sizes_a_config_leaves_to_its_class_are_the_class_defaults(tmp_path, model_type):
    """A config.json that names no expert count (its class default, so save_pretrained leaves it out) is
    planned with the class's experts, not as a dense model (Family.defaults)."""
    cls = CONFIG_MAPPING[model_type]
    kwargs = {k: v for k, v in _shrink(cls().to_dict()).items() if k not in EXPERT_KEYS}
    config = cls(**kwargs)
    arch = read(tmp_path, config)
    assert arch.num_experts == (getattr(config, "num_local_experts", None) or config.num_experts) > 1
    assert count_params(arch).total == real_count(meta_model(config))

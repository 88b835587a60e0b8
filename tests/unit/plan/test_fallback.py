"""Models whose layers finetune's varlen kernel does not run (logit soft-capping, sinks, attention dropout) and those
it runs with a window (sliding-window layers): the config reader sees both, the planner plans the first over the
masked packed row (sdpa; eager for soft-capping, which sdpa does not compute) for memory and executed attention
FLOPs, says so, and plans the second as the kernel's bands; its rules match the runtime's on real transformers
layers, and a soft-capped layer computes what transformers' own eager attention computes."""

from __future__ import annotations

import dataclasses
import json

import pytest

from finetune.plan import attention_kind, job_from_recipe, plan_job, plan_on, varlen_fallback_layers
from finetune.plan.memory import activation_bytes, attention_matrix_bytes, eager_backward_bytes
from finetune.plan.timing import flops_per_token, job_model_flops_per_token
from finetune.plan.workload import executed_attention_positions, sliding_layer_count
from finetune.recipe import load_recipe
from finetune.registry import get_model, resolve_model
from finetune.registry.derive import arch_from_config
from tests.helpers.calibration_rows import preset_for
from tests.helpers.paths import ROOT

H100 = preset_for("NVIDIA H100 80GB HBM3", gpus_per_node=1)
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
)


def _derive(tmp_path, cfg: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return arch_from_config(path, key="probe")


@pytest.mark.parametrize(
    "cfg, window, sliding, softcap",
    [
        # absent keys take the config class's defaults
        (dict(model_type="gemma2", num_hidden_layers=42), 4096, 21, 50.0),
        (
            dict(model_type="gemma2", num_hidden_layers=4, attn_logit_softcapping=None, sliding_window=None),
            None,
            0,
            None,
        ),
        (dict(model_type="gemma3_text", num_hidden_layers=48, sliding_window=1024), 1024, 40, None),
        (
            dict(model_type="gemma3_text", num_hidden_layers=62, sliding_window=1024, sliding_window_pattern=6),
            1024,
            52,
            None,
        ),
        (dict(model_type="mistral", num_hidden_layers=32), 4096, 32, None),
        (dict(model_type="mistral", num_hidden_layers=32, sliding_window=None), None, 0, None),
        (dict(model_type="qwen2", num_hidden_layers=32, sliding_window=4096), None, 0, None),
        (dict(model_type="qwen2", num_hidden_layers=32, use_sliding_window=True, sliding_window=2048), 2048, 4, None),
        (dict(model_type="llama", num_hidden_layers=16), None, 0, None),
    ],
)
def test_config_reader_resolves_windows_and_softcap_like_transformers(tmp_path, cfg, window, sliding, softcap):
    arch = _derive(tmp_path, {**SMALL, **cfg})
    assert (arch.sliding_window, arch.sliding_layers, arch.attn_logit_softcap) == (window, sliding, softcap)


def test_registry_gemma_and_mistral_entries_match_their_published_configs():
    # google/gemma-2-9b, gemma-2-27b, gemma-3-12b-pt, gemma-3-27b-pt; mistralai's "sliding_window": null
    expected = {
        "gemma-2-9b": (4096, 21, 50.0),
        "gemma-2-27b": (4096, 23, 50.0),
        "gemma-3-12b": (1024, 40, None),
        "gemma-3-27b": (1024, 52, None),
        "mistral-7b-v0.3": (None, 0, None),
        "mistral-small-24b": (None, 0, None),
    }
    for key, want in expected.items():
        arch = get_model(key)
        assert (arch.sliding_window, arch.sliding_layers, arch.attn_logit_softcap) == want, key
    assert varlen_fallback_layers(get_model("gemma-2-9b")) == 42  # soft-capping is on every layer
    assert varlen_fallback_layers(get_model("gemma-3-12b")) == 0  # its windows run on the kernel
    assert varlen_fallback_layers(get_model("mistral-7b-v0.3")) == 0
    assert varlen_fallback_layers(get_model("llama-3.1-8b")) == 0


def test_attention_kind_falls_back_for_such_models():
    assert attention_kind("varlen", packed=True, arch=get_model("gemma-2-9b")) == "eager"  # soft-capping
    assert attention_kind("varlen", packed=True, arch=get_model("gemma-3-12b")) == "varlen"  # windows included
    assert attention_kind("varlen", packed=True, arch=get_model("llama-3.1-8b")) == "varlen"
    assert attention_kind("flash_attention_2", packed=True, arch=get_model("gemma-2-9b")) == "flash"


def _recipe(model: str, *, micro: int = 4, seq: int = 2048, attn: str = "auto"):
    return load_recipe(
        {
            "model": {"name": model, "arch": model, "attn_implementation": attn},
            "method": {"type": "sft"},
            "adapter": {"type": "lora", "r": 16},
            "data": {"path": "train.jsonl", "max_length": seq, "packing": True},
            "train": {
                "global_batch_size": 32,
                "micro_batch_size": micro,
                "activation_checkpointing": "off",
                "liger": "off",
            },
            "distributed": {"strategy": "ddp"},
            "hardware": "auto",
        }
    )


def test_fallback_executes_the_whole_packed_square_and_keeps_its_mask():
    preset = H100
    # auto picks transformers' eager attention for Gemma-2 (soft-capping); asking for varlen gets the same
    auto = job_from_recipe(_recipe("gemma-2-9b"), arch=get_model("gemma-2-9b"), preset=preset)
    assert auto.attention == "eager"
    gemma = job_from_recipe(_recipe("gemma-2-9b", attn="varlen"), arch=get_model("gemma-2-9b"), preset=preset)
    assert gemma.attention == "eager" and gemma.varlen_layers == 0
    arch = gemma.arch
    width = arch.num_attention_heads * arch.head_dim
    # every layer computes the 8192 x 8192 square of the packed row: 4 x the per-sequence figure
    assert executed_attention_positions(gemma, micro_batch=4) == arch.num_layers * 4 * 2048
    extra = flops_per_token(gemma, checkpointing=False, micro_batch=4) - flops_per_token(gemma, checkpointing=False)
    assert extra == pytest.approx(12 * width * arch.num_layers * (4 * 2048 - 2048))
    # the MFU numerator is the useful figure, unchanged
    assert flops_per_token(gemma, checkpointing=False) == pytest.approx(job_model_flops_per_token(gemma))
    # eager also keeps the scores: the fp32 softmax, its bf16 copy and soft-capping's tanh output (the trace below)
    heads = arch.num_attention_heads
    assert attention_matrix_bytes(gemma, micro_batch=4) == 8192**2 * (2 + heads * (4 + 2 + 2))
    # and the layer in its backward makes score-sized gradients once more: the probabilities' (in place of the
    # probabilities), its fp32 cast and softmax's fp32 input gradient, the tanh's (the memory profile of row 309)
    assert eager_backward_bytes(gemma, micro_batch=4) == 8192**2 * heads * (4 + 4 + 2)
    assert activation_bytes(gemma, micro_batch=4, checkpointing=True) - activation_bytes(
        dataclasses.replace(gemma, arch=arch.model_copy(update={"attn_logit_softcap": None})),
        micro_batch=4,
        checkpointing=True,
    ) == pytest.approx(8192**2 * heads * 2 * 2)  # the tanh's output kept, and its gradient
    # Gemma-3: every layer on the varlen kernel, no mask; the 8 global layers compute their examples' triangles, the
    # 40 local ones the band of their 1,024-token window (examples as long as the row: 1024 - 1024^2 / (2 x 2048))
    g3 = job_from_recipe(_recipe("gemma-3-12b", micro=2), arch=get_model("gemma-3-12b"), preset=preset)
    assert g3.attention == "varlen"
    assert executed_attention_positions(g3, micro_batch=2) == 8 * 2048 / 2 + 40 * (1024 - 1024**2 / 4096)
    assert attention_matrix_bytes(g3, micro_batch=2) == 0 == eager_backward_bytes(g3, micro_batch=2)
    # the band is cheaper than the masked square the sliding layers ran before (the legacy rows' job)
    legacy = g3.__class__(**{**g3.__dict__, "attention": "sdpa", "varlen_layers": 8})
    assert plan_job(g3).tokens_per_second > plan_job(legacy).tokens_per_second
    # a model the kernel serves keeps the per-sequence figure
    llama = job_from_recipe(_recipe("llama-3.1-8b"), arch=get_model("llama-3.1-8b"), preset=preset)
    assert executed_attention_positions(llama, micro_batch=4) == 32 * 2048 / 2  # the causal triangle
    assert (
        plan_job(gemma).tokens_per_second
        < plan_job(gemma.__class__(**{**gemma.__dict__, "attention": "varlen"})).tokens_per_second
    )


def test_attention_sinks_take_eager_attention_and_refuse_sdpa():
    """GPT-OSS's sinks (a learned logit per head in the softmax): auto and varlen plan the model's eager
    attention on every layer; sdpa, which transformers refuses for it, is refused naming the key."""
    from finetune.errors import RecipeError

    arch = get_model("llama-3.1-8b").model_copy(update={"attention_sinks": True})
    for attn in ("auto", "varlen"):
        job = job_from_recipe(_recipe("llama-3.1-8b", attn=attn), arch=arch, preset=H100)
        assert (job.attention, job.varlen_layers) == ("eager", 0), attn
    assert varlen_fallback_layers(arch) == arch.num_layers
    # their eager attention keeps its softmax in the compute dtype only (no fp32 copy): a + heads x a
    job = job_from_recipe(_recipe("llama-3.1-8b"), arch=arch, preset=H100)
    assert attention_matrix_bytes(job, micro_batch=4) == 8192**2 * 2 * (1 + arch.num_attention_heads)
    assert eager_backward_bytes(job, micro_batch=4) == 8192**2 * 2 * arch.num_attention_heads  # not measured
    with pytest.raises(RecipeError) as refused:
        job_from_recipe(_recipe("llama-3.1-8b", attn="sdpa"), arch=arch, preset=H100)
    assert refused.value.key == "model.attn_implementation" and "sinks" in str(refused.value)


def test_attention_dropout_sends_every_layer_to_sdpa():
    """The varlen kernel has no dropout (train/attention.py falls back for it): a config's attention_dropout
    (Granite-3 MoE: 0.1) plans the masked packed row on every layer, and the warning says why."""
    arch = get_model("llama-3.1-8b").model_copy(update={"attention_dropout": 0.1})
    assert varlen_fallback_layers(arch) == arch.num_layers
    job = job_from_recipe(_recipe("llama-3.1-8b"), arch=arch, preset=H100)
    assert (job.attention, job.varlen_layers) == ("sdpa", 0)
    result = plan_on(_recipe("llama-3.1-8b"), arch=arch, preset=H100, source="auto")
    (warning,) = [w for w in result.warnings if "varlen" in w]
    assert "attention dropout (0.1" in warning and "32 of 32 layers" in warning
    assert "model.attention_dropout: 0" in warning


def test_recipe_attention_dropout_overrides_the_config_for_the_planner():
    """model.attention_dropout replaces config.json's (training loads the config with it, train/model.py
    base_config): Granite-3 MoE's 0.1 turned off plans every layer on the varlen kernel again."""
    granite = ROOT / "tests" / "data" / "hub_configs" / "granite-3.1-3b-a800m"
    raw = _recipe("llama-3.1-8b").model_dump(mode="json", exclude_unset=True)
    results = {}
    for dropout in (None, 0.0):
        raw["model"] = {"name": str(granite)} | ({} if dropout is None else {"attention_dropout": dropout})
        recipe = load_recipe(raw)
        arch = resolve_model(recipe.model)
        job = job_from_recipe(recipe, arch=arch, preset=H100)
        results[dropout] = (arch, job, plan_on(recipe, arch=arch, preset=H100, source="auto"))
    arch, job, as_shipped = results[None]
    assert arch.attention_dropout == 0.1 and (job.attention, job.varlen_layers) == ("sdpa", 0)
    arch, job, off = results[0.0]
    assert arch.attention_dropout == 0.0 and job.attention == "varlen" and varlen_fallback_layers(arch) == 0
    assert not [w for w in off.warnings if "varlen" in w]
    assert off.tokens_per_second > as_shipped.tokens_per_second


def test_plan_warns_what_the_fallback_costs():
    recipe = _recipe("gemma-2-9b", attn="varlen")
    result = plan_on(recipe, arch=get_model("gemma-2-9b"), preset=H100, source="auto")
    (warning,) = [w for w in result.warnings if "varlen" in w]
    assert "soft-capping (50)" in warning and "42 of 42 layers" in warning and "8192 x 8192" in warning
    assert "GiB of mask" in warning and "of the step's FLOPs" in warning
    assert "masked packed row on 42 of 42 layers" in result.kernels
    llama = plan_on(_recipe("llama-3.1-8b"), arch=get_model("llama-3.1-8b"), preset=H100, source="auto")
    assert not [w for w in llama.warnings if "varlen" in w]
    # Gemma-3's windows run on the kernel: no fallback warning, the kernels line says so
    gemma3 = plan_on(_recipe("gemma-3-12b"), arch=get_model("gemma-3-12b"), preset=H100, source="auto")
    assert not [w for w in gemma3.warnings if "varlen" in w]
    assert "varlen flash attention on packed rows, 40 of 48 layers within their 1,024-token window" in gemma3.kernels


@pytest.mark.parametrize(
    "cfg",
    [
        dict(model_type="gemma2", num_hidden_layers=4),
        dict(model_type="mistral", num_hidden_layers=3, sliding_window=64),
        dict(model_type="gemma3_text", num_hidden_layers=6, sliding_window=32),
        dict(model_type="llama", num_hidden_layers=3),
        dict(model_type="gpt_oss", num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2),
        # every other family whose config can slide (registry/families.py: Family.slides)
        dict(model_type="ministral", num_hidden_layers=3, sliding_window=64),
        dict(model_type="cwm", num_hidden_layers=4, sliding_window=64),
        dict(model_type="smollm3", num_hidden_layers=4, use_sliding_window=True, sliding_window=64, pad_token_id=0),
        dict(model_type="qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2),
        dict(model_type="qwen3", num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2),
        dict(model_type="vaultgemma", num_hidden_layers=4, sliding_window=64),
        dict(model_type="olmo3", num_hidden_layers=4, sliding_window=64),
        dict(model_type="exaone4", num_hidden_layers=4, sliding_window=64, sliding_window_pattern=4),
        dict(model_type="cohere2", num_hidden_layers=4, sliding_window=64),
        dict(model_type="phi3", num_hidden_layers=3, sliding_window=64, pad_token_id=0),
        dict(model_type="mixtral", num_hidden_layers=3, sliding_window=64, num_local_experts=4, num_experts_per_tok=2),
        dict(
            model_type="qwen3_moe",
            num_hidden_layers=4,
            use_sliding_window=True,
            sliding_window=64,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),
        # the window only in the mask: the attention function never sees it (ModelArch.window_in_mask_only)
        dict(
            model_type="qwen2_moe",
            num_hidden_layers=4,
            use_sliding_window=True,
            sliding_window=64,
            max_window_layers=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
    ],
    ids=lambda cfg: cfg["model_type"],
)
def test_planner_rule_matches_the_runtime_rule_on_real_layers(tmp_path, cfg):
    """Count the layers whose attention call the runtime (train/attention.py's layer_falls_back) sends
    to sdpa, on a real transformers model run through a registered attention function."""
    torch = pytest.importorskip("torch")
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

    from finetune.train.attention import layer_falls_back, layer_window

    seen: list[bool] = []
    windowed: list[bool] = []

    def probe(module, query, key, value, attention_mask, **kwargs):
        seen.append(layer_falls_back(kwargs))
        windowed.append(layer_window(kwargs) is not None)
        return query.transpose(1, 2).contiguous(), None

    AttentionInterface.register("finetune_probe", probe)
    full = {**SMALL, **cfg}
    (tmp_path / "config.json").write_text(json.dumps(full))
    config = AutoConfig.from_pretrained(tmp_path)
    config._attn_implementation = "finetune_probe"
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert len(seen) == full["num_hidden_layers"]
    arch = _derive(tmp_path, full)
    assert sum(seen) == varlen_fallback_layers(arch)
    if arch.window_in_mask_only:  # the planner keeps such a model off the flash kernels (the test below)
        assert sum(windowed) == 0 and sliding_layer_count(arch) > 0
    else:
        assert sum(windowed) == sliding_layer_count(arch)


def test_a_window_only_in_the_mask_keeps_the_model_off_the_flash_kernels(tmp_path):
    """Qwen2-MoE with use_sliding_window applies its window through transformers' mask alone, which the varlen and
    flash kernels do not read: auto plans sdpa, and asking for a flash kernel is refused by name."""
    from finetune.errors import RecipeError
    from finetune.plan import attention_implementation

    full = {
        **SMALL,
        "model_type": "qwen2_moe",
        "num_hidden_layers": 4,
        "use_sliding_window": True,
        "sliding_window": 64,
        "max_window_layers": 4,
    }
    arch = _derive(tmp_path, full)
    assert arch.window_in_mask_only and arch.sliding_layers == 2
    assert attention_implementation(_recipe("llama-3.1-8b"), H100, arch=arch) == "sdpa"
    for kernel in ("varlen", "flash_attention_2"):
        with pytest.raises(RecipeError) as err:
            attention_implementation(_recipe("llama-3.1-8b", attn=kernel), H100, arch=arch)
        assert err.value.key == "model.attn_implementation" and "would train without the window" in str(err.value)
    # without the switch its layers do not slide, and auto keeps the varlen kernel
    plain = _derive(tmp_path, {**full, "use_sliding_window": False})
    assert attention_implementation(_recipe("llama-3.1-8b"), H100, arch=plain) == "varlen"


def test_a_torch_without_varlen_windows_plans_the_sliding_layers_over_the_masked_row(monkeypatch):
    """torch before 2.11 has no window on its varlen kernel, where the run sends the sliding layers to sdpa over the
    masked packed row and keeps the full ones on the kernel: the planner reads torch's version (finetune.kernels) and
    plans the same, says why, and leaves models without windows on the kernel."""
    import importlib

    from finetune.kernels import torch_runs_varlen_windows
    from finetune.plan.fallback import attention_fallback_warning

    assert torch_runs_varlen_windows("2.11.0+cu130") and torch_runs_varlen_windows("2.13.0")
    assert not torch_runs_varlen_windows("2.10.0") and not torch_runs_varlen_windows("1.13.1")
    gemma, llama = get_model("gemma-3-12b"), get_model("llama-3.1-8b")
    assert varlen_fallback_layers(gemma, windows=False) == sliding_layer_count(gemma) == 40
    assert varlen_fallback_layers(llama, windows=False) == 0
    on_kernel = job_from_recipe(_recipe("gemma-3-12b"), arch=gemma, preset=H100)  # this machine's torch 2.13
    assert on_kernel.attention == "varlen" and on_kernel.varlen_windows
    # a machine whose torch is 2.10: the version the planner reads there
    planner = importlib.import_module("finetune.plan")  # the module (`finetune.plan` is also the function)
    monkeypatch.setattr(planner, "torch_runs_varlen_windows", lambda: torch_runs_varlen_windows("2.10.0"))
    job = job_from_recipe(_recipe("gemma-3-12b"), arch=gemma, preset=H100)
    assert job.attention == "sdpa" and job.varlen_layers == 8 and not job.varlen_windows
    assert job_from_recipe(_recipe("llama-3.1-8b"), arch=llama, preset=H100).attention == "varlen"
    # the masked row's blocks are computed and its mask is kept: slower and larger than on the kernel
    plan = plan_job(job)
    assert plan_job(on_kernel).tokens_per_second > 1.05 * plan.tokens_per_second
    assert executed_attention_positions(job, micro_batch=4) > executed_attention_positions(on_kernel, micro_batch=4)
    assert attention_matrix_bytes(job, micro_batch=4) > 0 == attention_matrix_bytes(on_kernel, micro_batch=4)
    warning = attention_fallback_warning(job, plan)
    assert "40 of 48 layers use sdpa" in warning and "older than 2.11" in warning, warning
    assert "sdpa attention with a masked packed row on 40 of 48 layers" in plan.kernels


@pytest.mark.parametrize(
    "key", ["gemma-2-9b", "gemma-3-12b", "gemma-3-27b", "mistral-7b-v0.3", "llama-3.1-8b", "qwen2.5-7b"]
)
def test_random_models_are_the_registry_models(tmp_path, key):
    """The config.json scripts/make_random_model.py writes (registry.hfconfig), read back by the planner's config
    reader and by transformers, has the registry's windows and soft-capping (not the config classes' defaults)."""
    from transformers import AutoConfig

    from finetune.registry.hfconfig import hf_config

    arch = get_model(key)
    cfg = hf_config(arch)
    read = _derive(tmp_path, cfg)
    assert (read.sliding_window, read.sliding_layers, read.attn_logit_softcap) == (
        arch.sliding_window,
        arch.sliding_layers,
        arch.attn_logit_softcap,
    )
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert getattr(loaded, "sliding_window", None) == arch.sliding_window
    assert getattr(loaded, "attn_logit_softcapping", None) == arch.attn_logit_softcap


@pytest.mark.parametrize("packed", [False, True])
def test_a_soft_capped_layer_computes_what_transformers_eager_attention_does(tmp_path, packed):
    """Gemma-2 through finetune's varlen attention function (on CPU its fallback path): the same logits as
    transformers' own eager attention, which applies the soft-capping that sdpa does not have."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.train.attention import register, skip_packed_row_masks, skipped_packed_row_masks

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                **SMALL,
                "model_type": "gemma2",
                "num_hidden_layers": 2,
                "attn_logit_softcapping": 5.0,
                "sliding_window": 4,
            }
        )
    )
    torch.manual_seed(0)
    eager_config = AutoConfig.from_pretrained(tmp_path)
    eager_config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(eager_config).float().eval()
    ids = torch.randint(0, 256, (1, 12))
    kwargs = {"position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])} if packed else {}
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False, **kwargs).logits
        model.config._attn_implementation = register()
        for layer in model.model.layers:
            layer.self_attn.config._attn_implementation = model.config._attn_implementation
        got = model(input_ids=ids, use_cache=False, **kwargs).logits
        assert torch.allclose(got, expected, atol=1e-5)
        if packed:  # with the example bounds, transformers builds no mask: each layer builds its own from them
            skip_packed_row_masks(model)
            masks: list = []
            for layer in model.model.layers:
                layer.register_forward_pre_hook(lambda m, a, kw: masks.append(kw["attention_mask"]), with_kwargs=True)
            cu = torch.tensor([0, 5, 12], dtype=torch.int32)
            bounds = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
            got = model(input_ids=ids, use_cache=False, **kwargs, **bounds).logits
            assert masks == [None, None] and skipped_packed_row_masks()
            assert torch.allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("softcap,kept", [(50.0, 4 + 2 + 2), (None, 4 + 2)])
def test_eager_attention_keeps_these_bytes_per_score(softcap, kept):
    """What Gemma-2's eager attention (transformers' own) saves for its backward per score element in bf16, traced
    with saved-tensor hooks on a CPU: the fp32 softmax and its bf16 cast, and the tanh output of soft-capping
    (memory.attention_matrix_bytes)."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma2Config

    config = Gemma2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        attn_logit_softcapping=softcap,
        final_logit_softcapping=None,
        query_pre_attn_scalar=16,
    )
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    tokens, heads = 128, config.num_attention_heads
    scores: dict[int, int] = {}

    def pack(t):
        if t.numel() == heads * tokens * tokens:  # a score tensor of every head (the mask has one)
            scores[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=torch.randint(0, 128, (1, tokens)))
    assert sum(scores.values()) / (heads * tokens * tokens) == kept

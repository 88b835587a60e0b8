"""adapter.fused_lora (finetune/train/fused_lora.py): the tiny model with peft's LoRA Linear and with the
fused one gives the same outputs and gradients (with dropout too), alone and with the linears that read one
input grouped (adapter.fused_lora_groups), falls back to peft's forward where it must, and saves an adapter
plain peft loads."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.paths import TINY_MODEL


def _peft(fused: bool, *, dropout: float = 0.0, dora: bool = False, groups: bool = False, base=None):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.train.fused_lora import FusedLoraLinear, group_shared_inputs

    base = base() if base else AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear", init_lora_weights=False, use_dora=dora
    )
    if fused:
        config._register_custom_module({torch.nn.Linear: FusedLoraLinear})
    torch.manual_seed(0)  # the same adapter initialisation for both
    model = get_peft_model(base, config)
    if groups:
        assert group_shared_inputs(model) == 2 * 2  # q/k/v and gate/up in each of the two layers
    return model


def _calls(model, ids, names: tuple[str, ...]) -> dict[str, int]:
    """How many times the forward ran each of these operators (autograd functions by their class name)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(input_ids=ids)
    counts = {e.key: e.count for e in prof.key_averages()}
    return {name: counts.get(name, 0) for name in names}


def _step(model, ids, *, seed: int = 1):
    model.train()
    model.zero_grad()
    torch.manual_seed(seed)  # the same dropout masks for both
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fused_lora_gives_peft_outputs_and_gradients(dropout):
    from finetune.train.fused_lora import FusedLoraLinear

    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    plain, fused = _peft(False, dropout=dropout), _peft(True, dropout=dropout)
    layers = [m for m in fused.modules() if isinstance(m, FusedLoraLinear)]
    assert len(layers) == 2 * 7  # every targeted projection of both decoder layers

    def addmms(model) -> int:  # the fused path's in-place GEMM with the add and scale in it
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(input_ids=ids)
        return sum(e.count for e in prof.key_averages() if e.key == "aten::addmm_")

    assert addmms(fused) - addmms(plain) == len(layers)
    logits, grads = _step(plain, ids)
    f_logits, f_grads = _step(fused, ids)
    torch.testing.assert_close(f_logits, logits, rtol=1e-5, atol=1e-5)
    assert f_grads.keys() == grads.keys() and any("lora_B" in n for n in grads)
    for name, grad in grads.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(f_grads[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


def _assert_same(got: dict, want: dict, *, rtol: float = 1e-4):
    assert got.keys() == want.keys() and any("lora_A" in n for n in want)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=rtol, atol=1e-5 * float(grad.abs().max()), msg=name)


def _tiny_qwen2():
    """A Qwen2 decoder (biases on q/k/v) of the tiny model's shape, random weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from finetune.tiny import MODEL_SHAPE

    torch.manual_seed(5)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, **MODEL_SHAPE)).float()


@pytest.mark.parametrize("base", [None, _tiny_qwen2], ids=["llama", "qwen2-biases"])
def test_grouped_linears_give_peft_outputs_and_gradients(base):
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    plain, grouped = _peft(False, base=base), _peft(True, groups=True, base=base)
    # per layer: one group function for q/k/v, one for gate/up; o_proj and down_proj alone
    assert _calls(grouped, ids, ("_FusedLoraGroup", "_FusedLora")) == {"_FusedLoraGroup": 4, "_FusedLora": 4}
    logits, grads = _step(plain, ids)
    g_logits, g_grads = _step(grouped, ids)
    torch.testing.assert_close(g_logits, logits, rtol=1e-5, atol=1e-5)
    _assert_same(g_grads, grads)
    q_proj = grouped.base_model.model.model.layers[0].self_attn.q_proj
    assert (q_proj.base_layer.bias is not None) is bool(base)  # Qwen2's q/k/v biases went through the group


def test_grouped_linears_under_activation_checkpointing():
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(4))
    want = _step(_peft(False), ids)[1]
    for reentrant in (False, True):
        model = _peft(True, groups=True)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.enable_input_require_grads()
        _assert_same(_step(model, ids)[1], want)


def test_groups_step_aside_for_dropout_and_disabled_adapters():
    ids = torch.randint(3, 60, (1, 8), generator=torch.Generator().manual_seed(1))
    grouped = _peft(True, dropout=0.1, groups=True)  # each adapter its own dropout mask: no group runs
    assert _calls(grouped, ids, ("_FusedLoraGroup",)) == {"_FusedLoraGroup": 0}
    assert not grouped.base_model.model.model.layers[0].self_attn.q_proj._shared_input_group.enabled
    _assert_same(_step(grouped, ids)[1], _step(_peft(False, dropout=0.1), ids)[1])
    grouped, plain = _peft(True, groups=True), _peft(False)
    with grouped.disable_adapter(), plain.disable_adapter():  # a DPO reference pass: the base model alone
        torch.testing.assert_close(grouped(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_a_member_called_with_another_input_turns_its_group_off():
    """Cross-attention: q reads the decoder's states, k and v the encoder's. The group computes k and v
    from q's input first; k's call with its own input finds that out, and every module runs alone."""
    from peft import LoraConfig, get_peft_model

    from finetune.train.fused_lora import FusedLoraLinear, group_shared_inputs

    class CrossAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x, memory):
            return self.q_proj(x) + self.k_proj(memory) * self.v_proj(memory)

    torch.manual_seed(0)
    plain = CrossAttention()
    grouped = CrossAttention()
    grouped.load_state_dict(plain.state_dict())
    config = dict(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    custom = LoraConfig(**config)
    custom._register_custom_module({torch.nn.Linear: FusedLoraLinear})
    torch.manual_seed(1)
    plain = get_peft_model(plain, LoraConfig(**config))
    torch.manual_seed(1)
    grouped = get_peft_model(grouped, custom)
    assert group_shared_inputs(grouped) == 1
    x, memory = torch.randn(3, 8), torch.randn(3, 8)
    for _ in range(2):
        torch.testing.assert_close(grouped(x, memory), plain(x, memory))
    assert not grouped.base_model.model.q_proj._shared_input_group.enabled


def test_under_bf16_autocast_it_is_as_close_to_fp32_as_peft_is():
    """As finetune trains: bf16 base weights, fp32 adapters, bf16 autocast, peft's input cast off
    (adapter.cast_adapter_inputs). Against the same model in fp32, the fused layer's gradients are as
    close as peft's own bf16 gradients (each ~1-4% off at bf16's precision; they round differently, as
    the fused backward adds inside a GEMM)."""
    from peft.helpers import disable_input_dtype_casting

    ids = torch.randint(3, 60, (2, 16), generator=torch.Generator().manual_seed(3))
    reference = _step(_peft(False), ids)[1]
    errors = {}
    for fused in (False, True, "groups"):
        model = _peft(bool(fused), groups=fused == "groups")
        model.base_model.model.to(torch.bfloat16)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()  # peft's autocast_adapter_dtype: the adapters train in fp32
        with disable_input_dtype_casting(model), torch.autocast("cpu", dtype=torch.bfloat16):
            grads = _step(model, ids)[1]
        assert grads.keys() == reference.keys()
        assert all(g.dtype == torch.float32 for g in grads.values())
        errors[fused] = {n: float((grads[n] - g).norm() / g.norm()) for n, g in reference.items()}
    mean = {f: sum(e.values()) / len(e) for f, e in errors.items()}
    for fused in (True, "groups"):
        for name, err in errors[fused].items():
            assert err <= 2 * errors[False][name] + 0.01, (fused, name, err, errors[False][name])
        assert mean[fused] <= 1.3 * mean[False], mean


def test_what_it_does_not_fuse_runs_peft_forward():
    plain, fused = _peft(False, dora=True), _peft(True, dora=True)
    ids = torch.randint(3, 60, (1, 8), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_step(fused, ids)[0], _step(plain, ids)[0])  # DoRA: peft's variant path
    with fused.disable_adapter(), plain.disable_adapter():  # the base model alone
        torch.testing.assert_close(fused(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_the_saved_adapter_is_plain_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    fused = _peft(True)
    fused.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert not any("custom" in key for key in saved)
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path)
    ids = torch.randint(3, 60, (1, 8), generator=torch.Generator().manual_seed(2))
    fused.eval()
    torch.testing.assert_close(loaded(input_ids=ids).logits, fused(input_ids=ids).logits)


@pytest.mark.parametrize(("adapter", "fused"), [("lora", True), ("lora", False), ("qlora", True)])
def test_the_recipe_switch_registers_the_fused_layer_for_plain_lora_only(adapter, fused):
    from finetune.recipe import load_recipe
    from finetune.train.fused_lora import FusedLoraLinear
    from finetune.train.model import lora_config
    from tests.helpers.recipes import tiny_recipe

    section = {"type": adapter, "fused_lora": fused} | ({"compute_dtype": "float32"} if adapter == "qlora" else {})
    config = lora_config(load_recipe(tiny_recipe(adapter=section)))
    registered = (config._custom_modules or {}).get(torch.nn.Linear)
    assert (registered is FusedLoraLinear) is (fused and adapter == "lora")


@pytest.mark.slow
def test_grouped_linears_under_regional_compile():
    """train.compile: regions compiles each decoder layer (accelerate's regional compilation): the group's
    hand-over from q_proj to k_proj and v_proj is traced with it, and the results are peft's. Dynamo's trace and
    AOT autograd's graphs (aot_eager) are what the group meets; inductor's CPU code generation would add a minute
    of C++ compiling that tests torch, not the group."""
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    grouped = _peft(True, groups=True)
    for layer in grouped.base_model.model.model.layers:
        layer.compile(backend="aot_eager")
    logits, grads = _step(_peft(False), ids)
    g_logits, g_grads = _step(grouped, ids)
    torch.testing.assert_close(g_logits, logits, rtol=1e-5, atol=1e-5)
    _assert_same(g_grads, grads)
    assert grouped.base_model.model.model.layers[0].self_attn.q_proj._shared_input_group.enabled

"""DoRA's extra saved activations, measured on a real peft model on CPU against the planner's terms.

Saved-tensor hooks record every tensor autograd keeps during one decoder layer's forward; those still
alive after the forward (weak references, parameters left out) are what the backward holds. The
difference between two token counts, per token, is compared between LoRA and DoRA, and between DoRA
without and with lora dropout; what does not grow with the tokens is the per-layer part."""

from __future__ import annotations

import pytest

from finetune.plan.memory import (
    activation_bytes_per_token_layer,
    dora_backward_bytes_per_feature,
    dora_bytes_per_token_layer,
    dora_dropout_weight_bytes,
)
from finetune.plan.workload import ALL_LINEAR, Job
from finetune.registry.schema import HardwarePreset, ModelArch
from tests.helpers.saved_tensors import backward_peak_bytes, per_token_bytes, retained_bytes

torch = pytest.importorskip("torch")
H, INTER = 256, 640


def _model(*, dora: bool, dropout: float = 0.0, fp32_adapters: bool = True, targets: tuple[str, ...] = ALL_LINEAR):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    return get_peft_model(
        LlamaForCausalLM(cfg).to(torch.bfloat16),
        LoraConfig(r=16, lora_alpha=32, target_modules=list(targets), use_dora=dora, lora_dropout=dropout),
        autocast_adapter_dtype=fp32_adapters,  # peft's default: fp32 adapters, each input cast to fp32
    )


def test_dora_keeps_two_compute_dtype_outputs_per_targeted_module():
    per_token = {}
    for dora in (False, True):
        per_token[dora] = per_token_bytes(lambda dora=dora: _model(dora=dora))
    measured = per_token[True] - per_token[False]
    # out_features of q, k, v, o, gate, up, down: 256 + 128 + 128 + 256 + 640 + 640 + 256 = 2304;
    # base_result and lora_result in bf16 for each: 2 x 2 B x 2304 = 9216 B per token per layer
    planned = dora_bytes_per_token_layer(_job(dora=True))
    assert planned == 2 * 2 * 2304 == 9216
    assert measured == pytest.approx(planned, rel=0.02)


@pytest.mark.parametrize("fp32_adapters", [True, False], ids=["fp32-adapters", "bf16-adapters"])
def test_a_dora_modules_backward_holds_its_output_gradients_in_the_promoted_dtype(fp32_adapters):
    """memory.dora_backward_bytes: the peak of the tensors one peft DoRA Linear's backward holds at once, beyond a LoRA
    Linear's, per token and out-feature (memory.dora_backward_bytes_per_feature: 16 bytes with fp32 adapters, 4 with
    bf16 ones)."""
    from peft import LoraConfig, get_peft_model
    from peft.helpers import disable_input_dtype_casting

    tokens, fin, fout = 2048, 64, 512

    def peak(dora: bool) -> int:
        torch.manual_seed(0)
        model = get_peft_model(
            torch.nn.Sequential(torch.nn.Linear(fin, fout, bias=False)).to(torch.bfloat16),
            LoraConfig(r=8, lora_alpha=16, target_modules=["0"], use_dora=dora),
            autocast_adapter_dtype=fp32_adapters,
        )
        x = torch.randn(tokens, fin, dtype=torch.bfloat16, requires_grad=True)
        with disable_input_dtype_casting(model), torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        return backward_peak_bytes(y, torch.randn_like(y))

    planned = dora_backward_bytes_per_feature(promoted=4 if fp32_adapters else 2, act=2)
    assert planned == (16 if fp32_adapters else 4)
    assert (peak(True) - peak(False)) / (tokens * fout) == pytest.approx(planned, abs=0.1)


@pytest.mark.parametrize("fp32_adapters", [True, False], ids=["fp32-adapters-casts", "bf16-adapters"])
def test_dora_with_dropout_keeps_masks_own_inputs_and_with_casts_a_weight_copy(fp32_adapters):
    """With lora dropout peft's DoRA recomputes the base output on the dropped-out input: per token each module
    keeps dropout's mask and its own dropped-out input (bf16 adapters: no longer the shared norm outputs), and per
    layer, where it casts the input to fp32, a bf16 copy of every targeted weight."""
    small, large = 256, 512

    def kept(dropout: float) -> tuple[float, float]:
        """(bytes per token, bytes that do not grow with the tokens)."""
        at = {t: retained_bytes(_model(dora=True, dropout=dropout, fp32_adapters=fp32_adapters), tokens=t)
              for t in (small, large)}  # fmt: skip
        per_token = (at[large] - at[small]) / (large - small)
        return per_token, at[large] - per_token * large

    (token_without, fixed_without), (token_with, fixed_with) = kept(0.0), kept(0.1)
    without, with_dropout = _job(dora=True), _job(dora=True, lora_dropout=0.1)
    planned_token = activation_bytes_per_token_layer(
        with_dropout, casts=fp32_adapters
    ) - activation_bytes_per_token_layer(without, casts=fp32_adapters)
    planned_fixed = dora_dropout_weight_bytes(with_dropout, casts=fp32_adapters)
    assert token_with - token_without == pytest.approx(planned_token, rel=0.02)
    assert fixed_with - fixed_without == pytest.approx(planned_fixed, rel=0.02, abs=4096)
    # q, k, v, o, gate, up, down: 256x256 + 2 x 256x128 + 256x256 + 3 x 256x640 weights, 2 bytes each
    assert planned_fixed == (2 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 640) if fp32_adapters else 0)


def _job(**fields) -> Job:
    arch = ModelArch(
        key="t",
        family="llama",
        hidden_size=H,
        num_layers=1,
        num_attention_heads=4,
        num_kv_heads=2,
        intermediate_size=INTER,
        vocab_size=1000,
        decoder_layer_class="LlamaDecoderLayer",
    )
    preset = HardwarePreset(
        name="t",
        gpu_model="cpu",
        vendor="cpu",
        gpu_memory_gib=8,
        gpus_per_node=1,
        intra_node_bandwidth_gbps=1,
        host_ram_gib=8,
        peak_bf16_tflops=1,
    )
    return Job(arch=arch, preset=preset, **fields)


def test_a_cross_entropy_over_the_chosen_logits_is_planned():
    """ORPO's SFT term and SimPO's cpo_alpha > 0: TRL copies the chosen half's logits (shifted, contiguous) and
    keeps the loss's log-softmax, on top of the full logits every non-fused preference trainer holds."""
    from finetune.plan import job_from_recipe
    from finetune.plan.memory import LOGITS_BYTES_PER_ELEMENT, NLL_BYTES_PER_ELEMENT, logits_bytes
    from finetune.recipe import load_recipe
    from finetune.registry import get_model, get_preset

    def job(method: dict):
        raw = {"model": {"name": "llama-3.1-8b", "arch": "llama-3.1-8b"}, "method": method}
        raw["data"] = {"path": "t.jsonl", "format": "preference"}
        recipe = load_recipe(raw)
        return job_from_recipe(recipe, arch=get_model("llama-3.1-8b"), preset=get_preset("server-8xh100"))

    plain = logits_bytes(job({"type": "simpo", "cpo_alpha": 0.0}), micro_batch=2)
    for method in ({"type": "simpo", "cpo_alpha": 1.0}, {"type": "orpo"}):
        with_nll = logits_bytes(job(method), micro_batch=2)
        assert with_nll / plain == pytest.approx(1 + NLL_BYTES_PER_ELEMENT / 2 / LOGITS_BYTES_PER_ELEMENT)


@pytest.mark.parametrize(
    ("strategy", "adapter", "kind"),
    [
        ("ddp", "lora", "plain"),
        ("ddp", "full", "plain"),
        ("zero2", "lora", "plain"),  # the adapter's flat buffers are megabytes, its parameters never gathered
        ("zero2", "qlora", "plain"),
        ("zero2", "full", "sharded"),  # a full fine-tune's flat gradient and fp32 buffers come and go every step
        ("zero3", "lora", "sharded"),  # gathered parameters come and go every layer
        ("fsdp2", "lora", "sharded"),
        ("fsdp2", "full", "sharded"),
    ],
)
def test_the_allocators_reserve_follows_the_blocks_that_come_and_go(strategy, adapter, kind):
    from finetune.plan.memory import ALLOCATOR_RESERVE_BYTES, allocator_reserve_bytes
    from tests.helpers.recipes import shape_job

    job = shape_job("llama-3.1-8b", adapter)
    assert allocator_reserve_bytes(job, strategy) == ALLOCATOR_RESERVE_BYTES[kind]


def test_a_small_plain_rank_keeps_a_reserve_in_proportion_to_its_tensors():
    """A DDP rank's cached blocks are its own transients: at most PLAIN_RESERVE_SHARE of the allocation (DDP rows
    under 30 GiB kept a median 0.12 GiB), the whole plain reserve from 20 GiB on; the sharded tiers' gathered
    parameters and flat buffers do not shrink with the run."""
    from finetune.plan.memory import ALLOCATOR_RESERVE_BYTES, PLAIN_RESERVE_SHARE, allocator_reserve_bytes
    from finetune.plan.types import GIB
    from tests.helpers.recipes import shape_job

    job = shape_job("llama-3.2-1b", "qlora")
    assert allocator_reserve_bytes(job, "ddp", allocated=2 * GIB) == pytest.approx(PLAIN_RESERVE_SHARE * 2 * GIB)
    assert allocator_reserve_bytes(job, "ddp", allocated=40 * GIB) == ALLOCATOR_RESERVE_BYTES["plain"]
    assert allocator_reserve_bytes(job, "zero3", allocated=2 * GIB) == ALLOCATOR_RESERVE_BYTES["sharded"]

"""Each offered optimizer's state as the library allocates it (plan/memory.optimizer_bytes), hand-computed
from torch's AdamW, bitsandbytes' Optimizer2State and transformers' Adafactor; and a real Adafactor's
state on a tiny model against the planner's count."""

from __future__ import annotations

import pytest

from finetune.plan.memory import (
    ALLOCATOR_RESERVE_BYTES,
    FRAGMENTATION,
    allocator_reserve_bytes,
    footprint,
    state_bytes,
)
from finetune.plan.optimizer import (
    PAGED_MIN_ELEMENTS,
    optimizer_bytes,
    optimizer_step_transient_bytes,
    paged_state_bytes,
)
from finetune.plan.workload import adapter_tensors, count_params, model_tensors, numel
from finetune.registry import get_model
from tests.helpers.recipes import shape_job

SQUARE, MLP, EXPERTS, NORM = (4096, 4096), (14336, 4096), (8, 28672, 4096), (4096,)


def _job(arch: str, adapter: str, preset: str, **train):
    return shape_job(arch, adapter, preset, global_batch=8, **{f"train__{k}": v for k, v in train.items()})


def test_adamw_keeps_two_moments_like_the_parameter():
    n = 4096 * 4096
    assert optimizer_bytes("adamw", [(1, SQUARE)], param_bytes=4, flat=False) == 8 * n
    assert optimizer_bytes("adamw_torch_fused", [(2, SQUARE)], param_bytes=2, flat=False) == 2 * 4 * n


def test_bitsandbytes_8bit_states_and_their_block_absmax():
    n = 4096 * 4096
    # uint8 state1 + state2, an fp32 absmax per 256-block for each: 2n + 2 x 4 x n/256
    for name in ("adamw_8bit", "paged_adamw_8bit"):
        assert optimizer_bytes(name, [(1, SQUARE)], param_bytes=4, flat=False) == 2 * n + 8 * n // 256
    # under min_8bit_size (4096 elements) bitsandbytes keeps fp32 states
    assert optimizer_bytes("adamw_8bit", [(1, (4095,))], param_bytes=2, flat=False) == 8 * 4095
    # the 32-bit paged variant: fp32 moments even for a bf16 parameter
    assert optimizer_bytes("paged_adamw_32bit", [(1, SQUARE)], param_bytes=2, flat=False) == 8 * n


def test_paged_optimizers_page_the_moments_of_large_tensors_only():
    """bitsandbytes pages state1 and state2 of a tensor of 1e5 elements or more (get_state_buffer), not the block
    absmax; an unpaged optimizer pages nothing; DeepSpeed's flat partition is one tensor."""
    n = 4096 * 4096
    assert paged_state_bytes("paged_adamw_8bit", [(3, SQUARE)], flat=False) == 3 * 2 * n
    assert paged_state_bytes("paged_adamw_32bit", [(1, SQUARE)], flat=False) == 8 * n
    small = (PAGED_MIN_ELEMENTS - 1,)
    assert paged_state_bytes("paged_adamw_8bit", [(100, small)], flat=False) == 0
    assert paged_state_bytes("paged_adamw_8bit", [(100, small)], flat=True) == 2 * 100 * numel(small)
    for name in ("adamw", "adamw_8bit", "adafactor"):
        assert paged_state_bytes(name, [(1, SQUARE)], flat=False) == 0


def test_the_paged_and_8bit_optimizers_are_the_recipe_s_bitsandbytes_ones():
    """One list of offered optimizers (recipe.schema.BNB_OPTIMIZERS): the paged ones whose moments the planner pages
    are those the CPU plan unpages (plan.UNPAGED), the 8-bit ones among bitsandbytes'."""
    from finetune.plan import UNPAGED
    from finetune.plan.optimizer import EIGHT_BIT_OPTIMIZERS, PAGED_STATE_BYTES
    from finetune.recipe.schema import BNB_OPTIMIZERS

    assert set(PAGED_STATE_BYTES) == set(UNPAGED) <= set(BNB_OPTIMIZERS)
    assert set(EIGHT_BIT_OPTIMIZERS) <= set(BNB_OPTIMIZERS)


def test_the_trainer_keeps_an_embedding_s_8bit_states_in_32_bits_outside_deepspeed():
    """transformers' Trainer registers an optim_bits 32 override for nn.Embedding weights with bitsandbytes' 8-bit
    optimizers; DeepSpeed steps flat partitions, which the override never reaches."""
    import inspect

    from transformers import Trainer

    source = inspect.getsource(Trainer.create_optimizer)
    assert "register_module_override" in source and '"optim_bits": 32' in source  # the rule this planner models
    n = 128256 * 2048
    for name in ("adamw_8bit", "paged_adamw_8bit"):
        assert optimizer_bytes(name, [(1, (128256, 2048))], param_bytes=2, flat=False, embedding=True) == 8 * n
        assert optimizer_bytes(name, [(1, (128256, 2048))], param_bytes=4, flat=True, embedding=True) == (
            2 * n + 8 * n // 256
        )
    assert paged_state_bytes("paged_adamw_8bit", [(1, (128256, 2048))], flat=False, embedding=True) == 8 * n
    assert optimizer_bytes("adamw", [(1, (128256, 2048))], param_bytes=4, flat=False, embedding=True) == 8 * n
    full = _job("llama-3.2-1b", "full", "server-8xh100", optimizer="adamw_8bit")
    assert state_bytes(full, "ddp").optimizer - state_bytes(full, "zero2").optimizer == pytest.approx(
        6 * n - 8 * n // 256
    )


def test_adafactor_factors_matrices_and_not_vectors_or_deepspeed_partitions():
    # rows (shape[:-1]) + columns (shape[:-2] + shape[-1:]) in fp32, no first moment
    assert optimizer_bytes("adafactor", [(1, MLP)], param_bytes=2, flat=False) == 4 * (14336 + 4096)
    assert optimizer_bytes("adafactor", [(1, EXPERTS)], param_bytes=4, flat=False) == 4 * (8 * 28672 + 8 * 4096)
    assert optimizer_bytes("adafactor", [(1, NORM)], param_bytes=4, flat=False) == 4 * 4096
    assert optimizer_bytes("adafactor", [(1, MLP)], param_bytes=4, flat=True) == 4 * 14336 * 4096


def test_model_tensors_cover_every_parameter():
    for arch in ("llama-3.1-8b", "qwen2.5-7b", "mixtral-8x7b", "gemma-2-9b"):
        a = get_model(arch)
        assert sum(n * numel(s) for n, s in model_tensors(a)) == count_params(a).total


def test_adafactor_full_fine_tune_states_by_strategy():
    j = _job("llama-3.2-1b", "full", "workstation-1x4090", optimizer="adafactor")
    n = count_params(j.arch).total
    # DDP/FSDP2 see the model's 2-D tensors: a few MB instead of Adam's 4 (DDP bf16) or 8 bytes/param
    assert state_bytes(j, "ddp").optimizer < 0.01 * n
    assert state_bytes(j, "fsdp2").optimizer < 0.01 * n
    # ZeRO hands Adafactor one flat fp32 partition: a full second moment, 4 bytes/param
    assert state_bytes(j, "zero3").optimizer == 4 * n
    # an offloaded optimizer is DeepSpeed's CPU AdamW whatever the recipe names (compile resolves it so)
    adamw = _job("llama-3.2-1b", "full", "workstation-1x4090")
    assert state_bytes(j, "zero3-offload").optimizer == state_bytes(adamw, "zero3-offload").optimizer


def test_adafactor_step_temporaries_count_only_beyond_the_freed_activations():
    j = _job("llama-3.2-1b", "full", "workstation-1x4090", optimizer="adafactor")
    embed = 128256 * 2048  # the largest tensor: 3 fp32 copies while it is stepped
    assert optimizer_step_transient_bytes(j, flat=False, shard=1) == 12 * embed
    adamw = _job("llama-3.2-1b", "full", "workstation-1x4090")
    assert optimizer_step_transient_bytes(adamw, flat=False, shard=1) == 0
    # DeepSpeed steps this rank's flat partition as one tensor
    n = count_params(j.arch).total
    assert optimizer_step_transient_bytes(j, flat=True, shard=8) == 12 * n / 8
    m = footprint(j, strategy="ddp", micro_batch=1, checkpointing=True).memory
    freed = m.activations + m.logits
    assert 12 * embed > freed  # at micro-batch 1 with checkpointing the step is the peak
    parts = m.weights + m.trainable + m.gradients + m.optimizer + freed + m.comm_buffers
    step = 12 * embed - freed
    reserve = allocator_reserve_bytes(j, "ddp", allocated=parts + step)
    assert m.overhead == pytest.approx(reserve + FRAGMENTATION * parts + step)
    # at micro-batch 16 without checkpointing the activations are larger: nothing is added
    m = footprint(j, strategy="ddp", micro_batch=16, checkpointing=False).memory
    parts = m.weights + m.trainable + m.gradients + m.optimizer + m.activations + m.logits + m.comm_buffers
    assert m.overhead == pytest.approx(ALLOCATOR_RESERVE_BYTES["plain"] + FRAGMENTATION * parts)


def test_lora_adafactor_state_is_per_adapter_matrix():
    j = _job("llama-3.1-8b", "lora", "workstation-1x4090", optimizer="adafactor")
    expected = sum(n * 4 * (s[0] + s[1]) for n, s in adapter_tensors(j))
    assert state_bytes(j, "ddp").optimizer == expected


@pytest.mark.slow
def test_a_real_adafactor_keeps_what_the_planner_counts():
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.optimization import Adafactor

    from finetune.registry.schema import ModelArch

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    opt = Adafactor(model.parameters(), lr=1e-3, scale_parameter=False, relative_step=False)
    model(input_ids=torch.randint(0, 512, (1, 16)), labels=torch.randint(0, 512, (1, 16))).loss.backward()
    opt.step()
    kept = sum(
        t.numel() * t.element_size()
        for st in opt.state.values()
        for t in st.values()
        if torch.is_tensor(t) and t.dim() > 0
    )  # and a 0-dim fp32 RMS per tensor
    arch = ModelArch(
        key="t",
        family="llama",
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        intermediate_size=160,
        vocab_size=512,
        decoder_layer_class="LlamaDecoderLayer",
    )
    # the planner lumps the norms into one vector: the same bytes (both unfactored, fp32)
    assert kept == optimizer_bytes("adafactor", model_tensors(arch), param_bytes=2, flat=False)


def test_bitsandbytes_is_never_handed_a_tensor_past_its_32_bit_element_count():
    """bitsandbytes' kernels count elements in a C int (plan/optimizer.BNB_MAX_ELEMENTS; the GPU test shows the
    failure): ZeRO-2's flat partition of a full 7B on one GPU is 7.6B elements, so the planner leaves zero2 out
    there and refuses it pinned; over four GPUs each partition is 1.9B and it stays; ZeRO-3's sub-groups, DDP's
    per-parameter tensors and DeepSpeed's own CPU Adam under offload never reach the limit; torch's AdamW has none."""
    from finetune.plan.choose import bnb_tensor_too_large, not_applicable
    from tests.helpers.calibration_rows import preset_for

    one, four = (preset_for("NVIDIA H200", gpus_per_node=n) for n in (1, 4))
    job = _job("qwen2.5-7b", "full", one, optimizer="adamw_8bit")
    assert "7.6B elements" in bnb_tensor_too_large(job, "zero2")
    assert "model.dtype float32 keeps them under ddp" in not_applicable(job, "ddp")  # not zero2, ruled out here
    for fine in ("ddp", "zero3", "zero3-optim-offload", "zero3-offload"):
        assert not bnb_tensor_too_large(job, fine), fine
    assert not bnb_tensor_too_large(_job("qwen2.5-7b", "full", four, optimizer="adamw_8bit"), "zero2")
    assert not bnb_tensor_too_large(_job("qwen2.5-7b", "full", one, optimizer="adamw"), "zero2")
    assert bnb_tensor_too_large(_job("qwen2.5-7b", "full", one, optimizer="paged_adamw_32bit"), "zero2")

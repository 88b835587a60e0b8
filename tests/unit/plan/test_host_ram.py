"""The host RAM the planner gives a node (finetune.plan.memory.host_bytes). Loading: FSDP2's sharded load
(finetune/train/sharded_load.py) holds one checkpoint tensor per rank at a time; so does any load of a
checkpoint stored in the dtype the model loads in (transformers hands out views of the mapped file: page
cache), while a converted or randomly built model is a real copy in each process that materializes it. The
70B runs that loaded sharded on H100s (calibration rows) used less than planned. Training: the offload
tiers' pinned buffers, rounded to powers of two by torch's pinned allocator (the calibration test holds the
planned figure against every row's measured PSS)."""

from __future__ import annotations

import json

import pytest

from finetune.plan import job_from_recipe, plan_on
from finetune.plan.memory import largest_tensor_bytes
from finetune.plan.types import GIB
from finetune.plan.workload import count_params
from finetune.recipe import load_recipe
from finetune.registry import get_model
from tests.helpers.calibration_rows import predict, preset_for
from tests.helpers.paths import ROOT

PRESET = preset_for("NVIDIA H100 80GB HBM3", gpus_per_node=8)
ARCH = get_model("llama-3.3-70b")
# the same architecture with a checkpoint of unknown dtype: its load is planned as a converted copy
UNKNOWN_DTYPE = ARCH.model_copy(update={"checkpoint_dtype": None})


def _recipe(**sections):
    raw = {
        "model": {"name": "llama-3.3-70b", "arch": "llama-3.3-70b"},
        "adapter": {"type": "lora"},
        "data": {"path": "t.jsonl", "packing": True, "max_length": 4096},
        "train": {"global_batch_size": 64, "micro_batch_size": 2, "activation_checkpointing": "on"},
        "hardware": "auto",
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return load_recipe(raw)


def _host(recipe, strategy: str, *, arch=UNKNOWN_DTYPE, preset=PRESET) -> float:
    plan = plan_on(recipe, arch=arch, preset=preset, source="test")
    (candidate,) = [c for c in plan.candidates if c.strategy == strategy]
    return candidate.host_ram_bytes


def test_fsdp2_loading_sharded_plans_one_tensor_per_rank_not_the_model():
    model = count_params(ARCH).total * 2
    sharded = _host(_recipe(), "fsdp2")
    whole = _host(_recipe(distributed={"sharded_load": False}), "fsdp2")
    print(f"70B LoRA on 8 GPUs, host RAM per node: sharded {sharded / GIB:.1f} GiB, whole {whole / GIB:.1f} GiB")
    assert whole - sharded == pytest.approx(
        model - 8 * largest_tensor_bytes(job_from_recipe(_recipe(), arch=UNKNOWN_DTYPE, preset=PRESET))
    )
    assert sharded < 0.4 * model < whole
    # ZeRO-3 loads the accelerate/DeepSpeed way whatever the switch says
    assert _host(_recipe(), "zero3") == _host(_recipe(distributed={"sharded_load": False}), "zero3")


def test_a_recipe_the_sharded_load_cannot_serve_is_planned_loading_whole():
    dora = _recipe(adapter={"type": "lora", "dora": True})
    assert not job_from_recipe(dora, arch=ARCH, preset=PRESET).sharded_load
    assert job_from_recipe(_recipe(), arch=ARCH, preset=PRESET).sharded_load
    assert job_from_recipe(_recipe(adapter={"type": "full"}), arch=ARCH, preset=PRESET).sharded_load
    full_dpo = _recipe(
        adapter={"type": "full"}, method={"type": "dpo"}, data={"format": "preference", "packing": False}
    )
    assert not job_from_recipe(full_dpo, arch=ARCH, preset=PRESET).sharded_load  # TRL copies it as the reference


@pytest.mark.parametrize("name", ["lora70b-preempt", "qlora70b-fsdp2-2gpu"])
def test_the_70b_runs_that_loaded_sharded_used_less_host_ram_than_planned(name):
    rows = json.loads((ROOT / "tests" / "data" / "gpu_calibration.json").read_text())
    (row,) = [r for r in rows if r["name"] == name]
    plan = predict(row)
    planned = plan.host_ram_gib
    print(f"{name}: node PSS {row['host_pss_node_gib']} GiB, planned {planned:.1f} GiB")
    assert row["host_pss_node_gib"] < planned < 4 * row["host_pss_node_gib"]


def test_a_checkpoint_stored_in_the_load_dtype_is_planned_as_page_cache_not_a_copy():
    """Llama 3.3 is published in bf16 and loads in bf16: DDP's ranks and FSDP's whole load map the same
    files, each process holding one tensor it moves; a float32 load of it converts, a copy per process."""
    mapped, converted = _recipe(), _recipe(model={"dtype": "float32"})
    job = job_from_recipe(mapped, arch=ARCH, preset=PRESET)
    assert not job.load_copies and job_from_recipe(converted, arch=ARCH, preset=PRESET).load_copies
    assert job_from_recipe(_recipe(model={"init": "random"}), arch=ARCH, preset=PRESET).load_copies
    whole = {"distributed": {"sharded_load": False}}
    assert _host(_recipe(**whole), "fsdp2", arch=ARCH) == _host(mapped, "fsdp2", arch=ARCH)
    assert _host(_recipe(**whole), "fsdp2", arch=UNKNOWN_DTYPE) > _host(mapped, "fsdp2", arch=ARCH) + 100 * GIB


def test_qlora_70b_on_one_gpu_is_not_refused_for_the_host_ram_of_a_workstation():
    """bitsandbytes quantizes on the GPU tensor by tensor (device_map): a 64 GiB workstation loads a 70B
    QLoRA; the planner used to ask for the whole bf16 model (143 GiB) of host RAM and refuse it."""
    preset = preset_for("NVIDIA H100 80GB HBM3", gpus_per_node=1).model_copy(update={"host_ram_gib": 64})
    recipe = _recipe(adapter={"type": "qlora"}, train={"global_batch_size": 8, "micro_batch_size": 1})
    for arch in (ARCH, UNKNOWN_DTYPE):  # converted per tensor on its way to the GPU, whatever the dtype
        plan = plan_on(recipe, arch=arch, preset=preset, source="test")
        assert plan.fits and plan.host_ram_gib < 16, (plan.host_ram_gib, plan.why)


def test_pinned_allocations_round_up_to_a_power_of_two():
    from finetune.plan.memory import pinned_rounding_bytes, pinned_size

    assert [pinned_size(n) for n in (1, 4096, 4097, 50_331_648)] == [1, 4096, 8192, 67_108_864]
    # Llama 3.2 3B's MLP weight (8192 x 3072) in fp32, split over 2 ranks: a 48 MiB shard pinned as 64 MiB
    assert pinned_rounding_bytes([(3, (8192, 3072))], shard=2, dtype_bytes=4) == 3 * 16 * 2**20
    assert pinned_rounding_bytes([(1, (3072,))], shard=2, dtype_bytes=4) == 0  # norms: too small to count


LOAD_PROBE = """
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM

def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) * 1024

with torch.device("meta"):  # imports the modeling code (its own allocations are not the weights')
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]), dtype=torch.bfloat16)
before = anon()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[2]))
size = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"anon": anon() - before, "size": size}))
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_transformers_maps_a_checkpoint_in_the_load_dtype_and_copies_a_converted_one(tmp_path, dtype):
    """What loading_host_bytes assumes, on the real loader: a bf16 checkpoint loaded in bf16 adds almost no
    anonymous memory (its tensors are views of the mapped file); loaded in float32 it adds a full copy."""
    import subprocess
    import sys

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    out = subprocess.run(
        [sys.executable, "-c", LOAD_PROBE, str(tmp_path / "model"), dtype],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{dtype}: {got['anon'] / 2**20:.0f} MiB anonymous for a {got['size'] / 2**20:.0f} MiB model")
    if dtype == "bfloat16":
        assert got["anon"] < 0.25 * got["size"]
    else:
        assert got["anon"] > 0.9 * got["size"]


def test_zero_infinity_swap_buffers_hold_the_largest_parameter_even_an_moe_s_fused_experts(tmp_path):
    """DeepSpeed stages whole parameters in `buffer_count` pinned buffers of the compiled `buffer_size` (a
    smaller buffer and it refuses to start); Mixtral's fused experts (8 x 2 x 14336 x 4096) outweigh its
    embedding 7x. The ds_config.json and the host plan use the same size."""
    from finetune.compile.deepspeed import ds_config
    from finetune.plan.memory import NVME_PARAM_BUFFERS, nvme_param_buffer_elements, nvme_swap_buffer_bytes
    from finetune.plan.workload import expert_size
    from finetune.registry import get_preset

    mixtral = get_model("mixtral-8x7b")
    experts = mixtral.num_experts * 2 * expert_size(mixtral) * mixtral.hidden_size
    assert nvme_param_buffer_elements(mixtral) == experts > 7 * mixtral.vocab_size * mixtral.hidden_size
    recipe = load_recipe(
        {
            "model": {"name": "mixtral-8x7b"},
            "adapter": {"type": "lora"},
            "data": {"path": "t.jsonl", "packing": True, "max_length": 2048},
            "distributed": {"strategy": "zero3-nvme", "nvme_path": str(tmp_path)},
            "hardware": "server-8xh100",
        }
    )
    preset = get_preset("server-8xh100")
    plan = plan_on(recipe, arch=mixtral, preset=preset, source="server-8xh100")
    param = ds_config(recipe, plan, arch=mixtral, preset=preset)["zero_optimization"]["offload_param"]
    assert (param["buffer_count"], param["buffer_size"]) == (NVME_PARAM_BUFFERS, experts)
    job = job_from_recipe(recipe, arch=mixtral, preset=preset)
    pinned = nvme_swap_buffer_bytes(job, strategy="zero3-nvme", trainable_params=plan.trainable_params)
    assert pinned > NVME_PARAM_BUFFERS * experts * 2  # bf16 parameter buffers, plus the optimizer's


def test_a_paged_optimizer_s_moments_are_host_ram_while_training():
    """bitsandbytes' paged moments live in CUDA managed memory, mapped into the process: full Llama-3.2-1B with
    paged_adamw_8bit under ZeRO-2 (row 308) held their 2.3 GiB as mapped pages on the host, full Llama-3.2-3B under
    DDP (row 372) its 8.1, the embedding's moments 32-bit there (transformers' Trainer's override, which DeepSpeed's
    flat partition never meets). Planned per node: each rank's share."""
    from finetune.plan.memory import paged_optimizer_bytes_per_rank, state_bytes
    from tests.helpers.recipes import shape_job

    for gpus, strategy in ((1, "zero2"), (2, "zero2"), (2, "ddp")):
        preset = preset_for("NVIDIA H200", gpus_per_node=gpus)
        train = {"train__global_batch_size": 8, "train__micro_batch_size": 2}
        paged = shape_job("llama-3.2-1b", "full", preset, train__optimizer="paged_adamw_8bit", **train)
        plain = shape_job("llama-3.2-1b", "full", preset, train__optimizer="adamw_8bit", **train)
        params = count_params(paged.arch).text_model
        embedding = paged.arch.vocab_size * paged.arch.hidden_size  # tied: the LM head is the same tensor
        if strategy == "ddp":  # uint8 state1 and state2; the embedding's fp32
            moments = 2 * (params - embedding) + 8 * embedding
        else:
            moments = 2 * params
        per_rank = paged_optimizer_bytes_per_rank(paged, strategy=strategy)
        assert per_rank == pytest.approx(moments / (gpus if strategy == "zero2" else 1), rel=0.01)
        assert state_bytes(plain, strategy).paged_optimizer == 0
        extra = host_bytes_training(paged, strategy=strategy) - host_bytes_training(plain, strategy=strategy)
        assert extra == pytest.approx(gpus * per_rank)


def host_bytes_training(job, *, strategy: str) -> float:
    from finetune.plan.memory import host_bytes, state_bytes

    return host_bytes(job, strategy=strategy, states=state_bytes(job, strategy)).training

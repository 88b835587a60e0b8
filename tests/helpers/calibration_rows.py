"""Rebuild the plan of one GPU calibration row (tests/data/gpu_calibration.json) on CPU.

A row made by scripts/gpu_validate.py carries `resolved`, the whole recipe.resolved.yaml of the run, and
`arch` (a registry key) or `model_config` (the model's config.json) when the model is not a registry
entry. The plan is rebuilt from that recipe as it ran (every pin, the partial k-of-L checkpointing
included) on the preset `--hardware auto` synthesizes for the row's card and GPU count; only what does
not exist on this machine is replaced: the model path (by the registry key, or a folder holding the row's
config.json) and nothing else. Rows measured before `finetune run` recorded data.example_tokens carry
it as `example_tokens` (scripts/calibration_lengths.py rebuilt their data and measured it the
same way); it goes into the recipe's data section.

Older rows carry a few fields instead of `resolved`; `legacy_recipe` rebuilds their recipe from those.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path

from finetune import strategies
from finetune.plan import job_from_recipe, plan_job
from finetune.plan.coverage import MEMORY_HIGH, MEMORY_LOW, SPEED_HIGH, SPEED_LOW
from finetune.plan.memory import (
    FRAGMENTATION,
    final_save_host_bytes,
    host_process_bytes,
    paged_optimizer_bytes_per_rank,
)
from finetune.plan.types import GIB, Plan
from finetune.plan.workload import varlen_fallback_layers
from finetune.recipe import load_recipe
from finetune.recipe.schema import DROPOUT_OFF_METHODS
from finetune.registry import get_model, resolve_model
from finetune.registry.detect import parse_nvidia_smi, synthesize_preset
from finetune.registry.families import LIGER_MODEL_TYPES
from finetune.registry.schema import HardwarePreset
from finetune.train.attention import KV_HEADS_REPEATED

# `nvidia-smi --query-gpu=name,memory.total --format=csv,noheader` on the measured cards
MEMORY_TOTAL = {"NVIDIA H100 80GB HBM3": "81559 MiB", "NVIDIA H200": "143771 MiB"}
MODEL_CONFIGS = Path(tempfile.gettempdir()) / "finetune-calibration-configs"


def preset_for(card: str, *, gpus_per_node: int, nodes: int = 1, ram_gib: float = 1024) -> HardwarePreset:
    """What `--hardware auto` synthesized on the GPU machine (with `ram_gib` of host RAM). Hybrid rows ran as
    loopback "nodes" of one host (scripts/gpu_validate.py's preset: a 25 GB/s ethernet "fabric" between them)."""
    smi = "\n".join([f"{card}, {MEMORY_TOTAL[card]}"] * gpus_per_node)
    preset = synthesize_preset(parse_nvidia_smi(smi), ram_gib=ram_gib)
    if nodes > 1:
        preset = preset.model_copy(
            update={"nodes": nodes, "inter_node_fabric": "ethernet", "inter_node_bandwidth_gbps": 25}
        )
    return preset


def _model_dir(row: dict) -> Path:
    """A folder holding the row's config.json, named like the model folder on the GPU machine (the
    planner's key for a local model is its folder name), under a folder named by the config's digest: rows of
    one model name whose configs differ (written by two transformers versions) never share a file."""
    name = Path(row["resolved"]["model"]["name"]).name or row["name"]
    text = json.dumps(row["model_config"], indent=1, sort_keys=True)
    folder = MODEL_CONFIGS / hashlib.sha256(text.encode()).hexdigest()[:16] / name
    config = folder / "config.json"
    if not config.exists():
        # written whole under another name and renamed: the other test worker may be reading it
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".config.json.{os.getpid()}"
        partial.write_text(text)
        os.replace(partial, config)
    return folder


def _measured_lengths(row: dict, data: dict) -> None:
    """The data lengths measured from the run's data afterwards (module docstring) into its recipe's data section."""
    for measured in ("example_tokens", "sequence_tokens"):
        if row.get(measured) is not None and data.get(measured) is None:
            data[measured] = row[measured]


def resolved_recipe(row: dict):
    """The run's resolved recipe with its model pointed at something that exists here."""
    raw = copy.deepcopy(row["resolved"])
    _measured_lengths(row, raw["data"])
    if row.get("arch"):
        raw["model"].update(name=row["arch"], arch=row["arch"])
        family = get_model(row["arch"]).family
    elif row.get("model_config"):
        raw["model"].update(name=str(_model_dir(row)), arch=None)
        family = row["model_config"].get("model_type")
    else:
        raise ValueError(f"row {row['name']!r} has `resolved` but neither `arch` nor `model_config`")
    # compiled before adapter.fused_lora existed (it was off by default until every row below had run): peft's layer
    raw["adapter"].setdefault("fused_lora", False)
    raw["adapter"].setdefault("fused_lora_groups", False)  # the same: every row before it ran each linear alone
    # the same: every row before model.cudnn_long_examples ran its long examples on the varlen kernel
    raw["model"].setdefault("cudnn_long_examples", False)
    if raw["train"].get("liger") == "on" and family not in LIGER_MODEL_TYPES:
        # compiled before the planner knew which model types Liger patches: the run trained without it
        raw["train"]["liger"] = "off"
    return load_recipe(raw, allow_resolved=True)


def legacy_recipe(row: dict):
    """A row without `resolved`: its recipe from the fields the older rows kept (LoRA r16 on the
    registry's targets, no DoRA, checkpointing on or off)."""
    dpo = row["method"] == "dpo"
    raw = {
        # rows measured before finetune chose varlen attention and skipped peft's input casts carry neither key
        "model": {
            "name": row["arch"],
            "arch": row["arch"],
            "dtype": "bfloat16",
            "attn_implementation": row.get("attn_implementation", "sdpa"),
            "cudnn_long_examples": False,  # measured before it existed
        },
        "method": {"type": row["method"]},
        "adapter": {
            "type": row["adapter"],
            "r": 16,
            "alpha": 32,
            "dropout": row.get("lora_dropout", 0.0),
            "cast_adapter_inputs": row.get("cast_adapter_inputs", True),
            "fused_lora": False,  # measured before finetune had its fused LoRA layer
        },
        # SFT packs padding-free; DPO pads chosen/rejected (pairs filling max_length)
        "data": {
            "path": "train.jsonl",
            "max_length": row["seq_len"],
            "packing": not dpo,
            "format": "preference" if dpo else "messages",
        },
        "train": {
            "global_batch_size": row["micro_batch_size"] * row["gradient_accumulation_steps"] * row["world_size"],
            "micro_batch_size": row["micro_batch_size"],
            "activation_checkpointing": "on" if row["activation_checkpointing"] else "off",
            "liger": "on" if row.get("liger") else "off",
        },
        "distributed": {
            "strategy": row["strategy"],
            **({"nvme_path": "/tmp/nvme-swap"} if strategies.info(row["strategy"]).offload == "nvme" else {}),
        },
        "hardware": "auto",
    }
    _measured_lengths(row, raw["data"])
    return load_recipe(raw)


def row_preset(row: dict) -> HardwarePreset:
    """The row's `--hardware auto` preset, with its host's time a kernel where the run's machine was probed
    (finetune/hostprobe.py, `host_s_per_kernel`)."""
    if "resolved" in row:
        section = row["resolved"]["resolved"]
        preset = preset_for(row["card"], gpus_per_node=section["gpus_per_node"], nodes=section["num_nodes"])
    else:
        nodes = row.get("nodes", 1)
        preset = preset_for(row["card"], gpus_per_node=row["world_size"] // nodes, nodes=nodes)
    return preset.model_copy(update={"host_s_per_kernel": row.get("host_s_per_kernel")})


# rows of the cuDNN path (model.cudnn_long_examples) that ran before its short examples' q, k, v were copies
CUDNN_SHORT_VIEWS = "views"
# rows of packed sliding-window models whose sliding layers ran sdpa over the masked row, before the varlen kernel
# took their window (the full layers ran the varlen kernel)
SLIDING_ON_SDPA = "sdpa"
# rows of packed varlen runs whose model held transformers' packed-row masks (before train/attention.py skipped them)
PACKED_ROW_MASKS_BUILT = "built"
# rows of full fine-tunes under FSDP2 whose final save wrote the gathered fp32 masters as they were (before
# train/saved_dtype.py cast them to model.dtype)
FINAL_SAVE_FP32_MASTERS = "fp32 masters"


def _as_ran(job, row: dict):
    """The job as the row's run executed it, where that differs from what today's code runs for its recipe."""
    if row.get("sliding_attention") == SLIDING_ON_SDPA and job.packed and job.attention == "varlen":
        # as a torch without varlen windows runs them (the planner's rule for one)
        fallback = varlen_fallback_layers(job.arch, windows=False)
        job = dataclasses.replace(
            job, attention="sdpa", varlen_layers=job.arch.num_layers - fallback, varlen_windows=False
        )
    if job.method in DROPOUT_OFF_METHODS and (row.get("resolved") or {}).get("adapter", {}).get("dropout"):
        # compiled before the dropout was: peft's nn.Dropout modules, set to p = 0 by TRL (no mask, no copy), kept
        # the fused LoRA groups off (train/fused_lora.py turns a group off where a member has a dropout module)
        job = dataclasses.replace(job, fused_lora_groups=False)
    return dataclasses.replace(
        job,
        varlen_repeats_kv=row.get("kv_heads") == KV_HEADS_REPEATED,
        cudnn_keeps_row_inputs=row.get("cudnn_short_inputs") == CUDNN_SHORT_VIEWS,
        builds_packed_row_mask=row.get("packed_row_masks") == PACKED_ROW_MASKS_BUILT,
        final_save_casts=row.get("final_save") != FINAL_SAVE_FP32_MASTERS,
    )


def row_job(row: dict):
    """The planner's Job for the row's run as it ran, on the preset `--hardware auto` made for it."""
    preset = row_preset(row)
    if "resolved" in row:
        recipe = resolved_recipe(row)
        arch = resolve_model(recipe.model)
    else:
        recipe = legacy_recipe(row)
        arch = get_model(row["arch"])
    job = job_from_recipe(recipe, arch=arch, preset=preset)
    # the rank's host threads as launched; rows that do not say ran before finetune's launcher split the
    # cores for the offload tiers, on accelerate's one thread per GPU rank. kv_heads "repeated": the varlen
    # kernel got grouped key/value heads repeated (every varlen row before row 95); cudnn_short_inputs "views": the
    # cuDNN path kept the row's q, k, v beside its padded copies (rows 213-220); sliding_attention "sdpa": the sliding
    # layers ran masked sdpa (rows of sliding-window models before row 224); packed_row_masks "built": transformers
    # built the packed row's masks, which the varlen path skips since (train/attention.py packed_row_mask);
    # final_save "fp32 masters": the final save wrote FSDP2's gathered fp32 masters uncast (rows 6-67, run before
    # train/saved_dtype.py cast them; the raw results that record the saved dtypes say F32)
    return dataclasses.replace(
        _as_ran(job, row),
        host_threads_per_rank=row.get("host_threads_per_rank") or 1,
        nvme_read_gbps=row.get("nvme_read_gbps"),  # the swap disk, where the run measured it
    )


def predict(row: dict) -> Plan:
    """The planner's plan for the row's run, on the preset `--hardware auto` made for it."""
    return plan_job(row_job(row))


def run_pins(row: dict, *, num_layers: int) -> dict:
    """What ran: strategy, micro-batch, accumulation, world size and how many layers were checkpointed."""
    if "resolved" in row:
        recipe, section = row["resolved"], row["resolved"]["resolved"]
        on = recipe["train"]["activation_checkpointing"] == "on"
        return {
            "strategy": recipe["distributed"]["strategy"],
            "micro_batch_size": recipe["train"]["micro_batch_size"],
            "gradient_accumulation_steps": section["gradient_accumulation_steps"],
            "world_size": section["world_size"],
            "checkpoint_layers": (section.get("checkpoint_layers") or num_layers) if on else 0,
        }
    return {
        "strategy": row["strategy"],
        "micro_batch_size": row["micro_batch_size"],
        "gradient_accumulation_steps": row["gradient_accumulation_steps"],
        "world_size": row["world_size"],
        "checkpoint_layers": num_layers if row["activation_checkpointing"] else 0,
    }


def plan_pins(plan: Plan) -> dict:
    return {
        "strategy": plan.strategy,
        "micro_batch_size": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "world_size": plan.world_size,
        "checkpoint_layers": plan.checkpoint_layers,
    }


def pin_mismatch(row: dict, plan: Plan) -> str:
    """'' when the plan reproduces the run's configuration, else what differs (then the comparison of
    memory and speed would be of another configuration and means nothing)."""
    ran, planned = run_pins(row, num_layers=plan.num_layers), plan_pins(plan)
    return "; ".join(f"{k}: ran {ran[k]}, planned {planned[k]}" for k in ran if ran[k] != planned[k])


def speed_figures(row: dict, plan: Plan) -> str:
    measured = row["steady_tokens_per_second"]
    return (
        f"measured {measured:,.0f} tokens/s, predicted {plan.tokens_per_second:,.0f} "
        f"(ratio {plan.tokens_per_second / measured:.3f})"
    )


def allocator_visible_gib(row: dict, plan: Plan) -> float:
    """The planned peak as torch's allocator can see it: without a paged optimizer's moments in CUDA managed memory
    (plan/memory.py paged_optimizer_bytes_per_rank), with their fragmentation share, which a row's max reserved leaves
    out. The plan itself counts them on the GPU, where they live while resident."""
    paged = paged_optimizer_bytes_per_rank(row_job(row), strategy=plan.strategy)
    return plan.per_gpu_memory_gib - (1 + FRAGMENTATION) * paged / GIB


def memory_figures(row: dict, plan: Plan) -> str:
    measured = row["measured_max_reserved_gib"]
    visible = allocator_visible_gib(row, plan)
    paged = f" ({visible:.2f} beside the paged optimizer states)" if visible != plan.per_gpu_memory_gib else ""
    return (
        f"measured {measured:.2f} GiB, predicted {plan.per_gpu_memory_gib:.2f}{paged} (ratio {visible / measured:.3f})"
    )


def speed_miss(row: dict, plan: Plan) -> str:
    """'' when the predicted steady tokens/s is within the bound, else the figures."""
    ratio = plan.tokens_per_second / row["steady_tokens_per_second"]
    return "" if SPEED_LOW <= ratio <= SPEED_HIGH else speed_figures(row, plan)


def memory_miss(row: dict, plan: Plan) -> str:
    """'' when the predicted peak is within the bound of the measured max reserved, else the figures."""
    ratio = allocator_visible_gib(row, plan) / row["measured_max_reserved_gib"]
    return "" if MEMORY_LOW <= ratio <= MEMORY_HIGH else memory_figures(row, plan)


# host RAM while training (the node's proportional set size sampled after loading and at logged steps)
# against the plan's host_ram_training_gib: the same -5% / +15% bound, plus an allowance per process for
# the planner's round per-rank baselines (plan/memory.py host_process_bytes: 3 GiB for DDP and DeepSpeed,
# 3.75 and 5 for FSDP2's adapter and full ranks) against the spread a rank measured (1.5-2.7 GiB for DDP)
HOST_PROCESS_ALLOWANCE_GIB = 1.5


def host_figures(row: dict, plan: Plan) -> str:
    measured = row["host_pss_node_gib"]
    return (
        f"measured {measured:.2f} GiB of host RAM on the node while training, predicted "
        f"{plan.host_ram_training_gib:.2f} (ratio {plan.host_ram_training_gib / measured:.3f})"
    )


def host_miss(row: dict, plan: Plan) -> str:
    """'' when the planned host RAM while training is within the bound of the measured PSS, else the figures."""
    measured, planned = row["host_pss_node_gib"], plan.host_ram_training_gib
    allowance = HOST_PROCESS_ALLOWANCE_GIB * plan.gpus_per_node
    ok = MEMORY_LOW * measured <= planned <= MEMORY_HIGH * measured + allowance
    return "" if ok else host_figures(row, plan)


# rank 0's host RAM at the final save under FSDP2 (plan/memory.py final_save_host_bytes), where it gathers the whole
# model: a full fine-tune, or an adapter whose save writes frozen weights, without offload (whose host states would
# add theirs), saved (not `finetune plan --measure`). Adapter rows from before adapters gathered their trained
# parameters alone are left out: today's code does not gather their model
def gathers_at_final_save(row: dict) -> bool:
    if not (
        "resolved" in row
        and strategies.info(row["strategy"]).backend == "fsdp"
        and not strategies.offloads(row["strategy"])
        and not row["resolved"]["resolved"].get("measure")
        and row.get("host_rss_peak_gib")
    ):
        return False
    return row.get("adapter") == "full" or row_job(row).save_gathers_model


def save_figures(row: dict) -> str:
    planned = rank0_save_gib(row)
    return (
        f"rank 0 peaked at {row['host_rss_peak_gib']:.2f} GiB of host RSS, planned {planned:.2f} at the final save "
        f"(ratio {planned / row['host_rss_peak_gib']:.3f})"
    )


def rank0_save_gib(row: dict) -> float:
    """What the plan puts on rank 0's host at the final save: its process and the gathered model."""
    job = row_job(row)
    strategy = row["strategy"]
    return (host_process_bytes(job, strategy=strategy) + final_save_host_bytes(job, strategy=strategy)) / GIB


def save_miss(row: dict) -> str:
    """'' when rank 0's planned host RAM at the final save is within the host bound of its measured peak RSS."""
    measured, planned = row["host_rss_peak_gib"], rank0_save_gib(row)
    ok = MEMORY_LOW * measured <= planned <= MEMORY_HIGH * measured + HOST_PROCESS_ALLOWANCE_GIB
    return "" if ok else save_figures(row)

"""Time the host's cost of a decoder layer for two families, with Liger's kernels and without, on this GPU machine.

finetune/hostprobe.py times a Llama layer (LoRA on every linear, Liger's kernels where installed) and divides by the
kernels the planner counts for it: one figure a kernel for the whole step. Liger's kernels are Triton launches,
whose Python launcher costs the host more than an aten op's launch; a Gemma-3 layer runs twice as many of them
(four norms and the q/k norms where Llama has two norms) at about the same count of kernels. This script runs the
probe's measurement (two depths, the difference per layer) on Llama and Gemma-3 layers of the probe's widths, with
Liger and without, and prints for each the seconds a layer, the kernels the planner counts for it and the Liger
launches in it (plan/host_time.py), so that the host's time a kernel and a Triton launch's extra can be solved
from the four cases.

    python3 scripts/host_launch_costs.py --out host-launch-costs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from finetune import hostprobe
from finetune.plan.host_time import kernels_per_micro_batch, liger_launches_per_micro_batch
from finetune.plan.workload import ALL_LINEAR, Job
from finetune.registry import get_preset
from finetune.registry.derive import arch_from_config

FAMILIES = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    "gemma3_text": {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "head_dim": 64,
        "query_pre_attn_scalar": 64,
        "sliding_window": 512,
    },
}


def config(family: str, layers: int) -> dict:
    return {**hostprobe.probe_config(layers), **FAMILIES[family]}


def build(family: str, layers: int, *, liger: bool, device):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.train.trainers import liger_kernel_config

    raw = config(family, layers)
    cfg = AutoConfig.for_model(raw.pop("model_type"), **{k: v for k, v in raw.items() if k != "architectures"})
    model = AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=torch.bfloat16)
    model.config.use_cache = False
    if liger:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model, **liger_kernel_config(family))
    lora = LoraConfig(
        r=hostprobe.PROBE_LORA_R,
        lora_alpha=2 * hostprobe.PROBE_LORA_R,
        lora_dropout=0.0,
        target_modules=list(ALL_LINEAR),
    )
    return get_peft_model(model, lora)


def planned(family: str, *, liger: bool) -> tuple[float, float]:
    """(kernels, Liger launches) the planner counts a layer: the two depths' difference."""
    counts = []
    with tempfile.TemporaryDirectory() as folder:
        for layers in hostprobe.PROBE_DEPTHS:
            path = Path(folder) / f"{family}-{layers}.json"
            path.write_text(json.dumps(config(family, layers)))
            arch = arch_from_config(path, key=f"{family}-{layers}")
            job = Job(
                arch=arch,
                preset=get_preset("server-8xh100"),
                adapter="lora",
                lora_r=hostprobe.PROBE_LORA_R,
                liger=liger,
            )
            counts.append(
                (
                    kernels_per_micro_batch(job, strategy="ddp", checkpointed_layers=0),
                    liger_launches_per_micro_batch(job, checkpointed_layers=0),
                )
            )
    span = hostprobe.PROBE_DEPTHS[1] - hostprobe.PROBE_DEPTHS[0]
    return (counts[1][0] - counts[0][0]) / span, (counts[1][1] - counts[0][1]) / span


def measure(family: str, *, liger: bool, device) -> float:
    runs = []
    for layers in hostprobe.PROBE_DEPTHS:
        torch.manual_seed(0)
        run = hostprobe._micro_batch(build(family, layers, liger=liger, device=device), device)
        for _ in range(hostprobe.PROBE_WARMUP):
            run()
        runs.append(run)
    it = hostprobe.PROBE_ITERATIONS
    diffs = [
        hostprobe._timed(runs[1], device, it) - hostprobe._timed(runs[0], device, it)
        for _ in range(hostprobe.PROBE_REPEATS)
    ]
    return statistics.median(diffs) / (hostprobe.PROBE_DEPTHS[1] - hostprobe.PROBE_DEPTHS[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    cases = []
    for round_ in range(2):  # twice: the host's speed drifts
        for family in FAMILIES:
            for liger in (True, False):
                kernels, launches = planned(family, liger=liger)
                seconds = measure(family, liger=liger, device=device)
                cases.append(
                    {
                        "round": round_,
                        "family": family,
                        "liger": liger,
                        "seconds_per_layer": seconds,
                        "planned_kernels_per_layer": kernels,
                        "planned_liger_launches_per_layer": launches,
                        "s_per_planned_kernel": seconds / kernels,
                    }
                )
                print(json.dumps(cases[-1]), flush=True)
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    Path(args.out).write_text(json.dumps({**report, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()

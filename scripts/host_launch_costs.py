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
from pathlib import Path

import torch

from finetune import hostprobe
from finetune.plan.host_time import kernels_per_micro_batch, liger_launches_per_micro_batch
from finetune.plan.workload import ALL_LINEAR

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
    """(kernels, Liger launches) the planner counts a layer (hostprobe.planned_per_layer)."""

    def count(layers: int) -> dict:
        return config(family, layers)

    kernels = hostprobe.planned_per_layer(
        lambda job: kernels_per_micro_batch(job, strategy="ddp", checkpointed_layers=0), liger=liger, config=count
    )
    launches = hostprobe.planned_per_layer(
        lambda job: liger_launches_per_micro_batch(job, checkpointed_layers=0), liger=liger, config=count
    )
    return kernels, launches


def measure(family: str, *, liger: bool, device) -> float:
    """A layer's host seconds, as finetune/hostprobe.py times its own."""
    return hostprobe.seconds_per_layer(lambda layers: build(family, layers, liger=liger, device=device), device)


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

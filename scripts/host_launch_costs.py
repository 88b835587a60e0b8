"""Time the host's cost of a decoder layer for several families, with Liger's kernels and without, on this GPU machine.

finetune/hostprobe.py times the run's own family's layer (LoRA on its adapter targets, Liger's kernels where installed)
and divides by the kernels the planner counts for it. Liger's kernels are Triton launches, whose Python launcher costs
the host more than an aten op's launch; a Gemma-3 layer runs twice as many of them (four norms and the q/k norms where
Llama has two norms) at about the same count of kernels. This script runs the probe (two depths, the difference per
layer) on each family's layer, with Liger and without, twice, and prints for each the seconds a layer, the kernels the
planner counts for it and the Liger launches in it (plan/host_time.py): how a family's host time a planned kernel
differs from Llama's on one host. With --adapters lora qlora each case runs again with the base in 4 bits, as a QLoRA
run loads it: what bitsandbytes' path costs the host beyond the kernels the planner counts for it.

    python3 scripts/host_launch_costs.py --out host-launch-costs.json [--configs a/config.json b/config.json]
        [--adapters lora qlora] [--liger on]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from finetune import hostprobe
from finetune.plan.host_time import kernels_per_micro_batch, liger_launches_per_micro_batch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = [ROOT / "tests" / "data" / "hub_configs" / "gemma-3-1b" / "config.json"]


def planned(model: dict | None, *, liger: bool, adapter: str) -> tuple[float, float]:
    """(kernels, Liger launches) the planner counts a layer (hostprobe.planned_per_layer)."""

    def config(layers: int) -> dict:
        return hostprobe.probe_config(layers, model)

    kernels = hostprobe.planned_per_layer(
        lambda job: kernels_per_micro_batch(job, strategy="ddp", checkpointed_layers=0),
        liger=liger,
        config=config,
        adapter=adapter,
    )
    launches = hostprobe.planned_per_layer(
        lambda job: liger_launches_per_micro_batch(job, checkpointed_layers=0),
        liger=liger,
        config=config,
        adapter=adapter,
    )
    return kernels, launches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", nargs="*", default=[str(p) for p in DEFAULT_CONFIGS], help="besides Llama's")
    parser.add_argument("--adapters", nargs="+", choices=("lora", "qlora"), default=["lora"])
    parser.add_argument("--liger", choices=("on", "off", "both"), default="both")
    args = parser.parse_args()
    device = torch.device("cuda")
    models = [None, *(json.loads(Path(p).read_text()) for p in args.configs)]
    ligers = {"on": (True,), "off": (False,), "both": (True, False)}[args.liger]
    cases = []
    for round_ in range(2):  # twice: the host's speed drifts
        for model in models:
            family = hostprobe.probe_config(2, model)["model_type"]
            for adapter in args.adapters:
                for liger in ligers:
                    kernels, launches = planned(model, liger=liger, adapter=adapter)
                    seconds = hostprobe.seconds_per_layer(
                        lambda layers, model=model, liger=liger, adapter=adapter: hostprobe.build_probe_model(
                            layers, liger=liger, device=device, model=model, adapter=adapter
                        ),
                        device,
                    )
                    cases.append(
                        {
                            "round": round_,
                            "family": family,
                            "adapter": adapter,
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

"""Time the host's cost of a decoder layer for several families, with Liger's kernels and without, on this GPU machine.

finetune/hostprobe.py times the run's own layer with its settings (Liger's kernels as the run has them)
and divides by the kernels the planner counts for it. Liger's kernels are Triton launches, whose Python launcher costs
the host more than an aten op's launch; a Gemma-3 layer runs twice as many of them (four norms and the q/k norms where
Llama has two norms) at about the same count of kernels. This script runs the probe (two depths, the difference per
layer) on each family's layer, with Liger and without, twice, and prints for each the seconds a layer, the kernels the
planner counts for it and the Liger launches in it (plan/host_time.py): how a family's host time a planned kernel
differs from Llama's on one host. With --layers each case runs again with each of those layer settings
(hostprobe.ProbeLayer as JSON: a 4-bit base, the run's targets, dropout, checkpointing, a packed row): what each
setting costs the host beyond the kernels the planner counts for it.

    python3 scripts/host_launch_costs.py --out host-launch-costs.json [--configs a/config.json b/config.json]
        [--layers '{}' '{"adapter": "qlora", "checkpointing": true}'] [--liger on]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

import torch

from finetune import hostprobe
from finetune.plan.host_time import liger_launches_per_micro_batch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = [ROOT / "tests" / "data" / "hub_configs" / "gemma-3-1b" / "config.json"]


def liger_launches(model: dict | None, *, liger: bool, layer: hostprobe.ProbeLayer) -> float:
    """The Liger launches the planner counts in a layer (hostprobe.planned_per_layer)."""
    return hostprobe.planned_per_layer(
        lambda job, checkpointed: liger_launches_per_micro_batch(job, checkpointed_layers=checkpointed),
        liger=liger,
        config=lambda layers: hostprobe.probe_config(layers, model),
        layer=layer,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", nargs="*", default=[str(p) for p in DEFAULT_CONFIGS], help="besides Llama's")
    parser.add_argument("--layers", nargs="+", default=["{}"], help="hostprobe.ProbeLayer settings, each as JSON")
    parser.add_argument("--liger", choices=("on", "off", "both"), default="both")
    args = parser.parse_args()
    device = torch.device("cuda")
    models = [None, *(json.loads(Path(p).read_text()) for p in args.configs)]
    ligers = {"on": (True,), "off": (False,), "both": (True, False)}[args.liger]
    cases = []
    for round_ in range(2):  # twice: the host's speed drifts
        for model in models:
            family = hostprobe.probe_config(2, model)["model_type"]
            for layer in map(hostprobe.ProbeLayer.from_json, args.layers):
                for liger in ligers:
                    case = {"round": round_, "family": family, "layer": asdict(layer), "liger": liger}
                    try:
                        probe = hostprobe.measure("cuda", model=model, layer=replace(layer, liger=liger))
                    except Exception as exc:  # one setting's failure is a finding; the others still run
                        case["error"] = repr(exc)
                    else:
                        case |= {
                            "liger": probe.liger,
                            "seconds_per_layer": probe.seconds_per_layer,
                            "repeats_seconds_per_layer": probe.repeats_seconds_per_layer,
                            "planned_kernels_per_layer": probe.kernels_per_layer,
                            "planned_liger_launches_per_layer": liger_launches(model, liger=probe.liger, layer=layer),
                            "s_per_planned_kernel": probe.s_per_kernel,
                        }
                    cases.append(case)
                    print(json.dumps(case), flush=True)
                    write(args.out, device, cases)  # what ran survives a timeout


def write(out: str, device, cases: list[dict]) -> None:
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    Path(out).write_text(json.dumps({**report, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()

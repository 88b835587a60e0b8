"""Look inside the host probe's timing of a layer (finetune/hostprobe.py) on a GPU: the probe's micro-batch timed at
each model depth (is a layer's host time at the run's depth what the probe's two depths say?), again with the
garbage collector's objects frozen and with it off, and torch.profiler's operator table at each depth (calls and
self CPU a layer, to set beside a run's profile).

    python scripts/probe_layer_profile.py --out DIR [--config config.json] [--layer JSON] [--depths 2 10 28]
        [--liger on|off] [--profile]

Writes DIR/timings.json (seconds a micro-batch at each depth, three ways) and, with --profile, DIR/profile.json
(per operator: calls and self CPU microseconds at each depth) and DIR/profile-<depth>.txt (the tables).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from finetune import hostprobe  # noqa: E402

TIMED_ROUNDS = 3  # the median of this many timings of PROBE_ITERATIONS micro-batches


def micro_batches(depths, *, model: dict | None, layer: hostprobe.ProbeLayer, device) -> dict:
    """The probe's micro-batch callable at each depth, warmed up as the probe warms it (Liger's kernels as the probe
    chooses them: hostprobe.probe_liger)."""
    import torch

    liger = hostprobe.probe_liger(device, model, layer)
    runs = {}
    for depth in depths:
        torch.manual_seed(0)  # as hostprobe.layer_timings builds each depth
        net = hostprobe.build_probe_model(depth, liger=liger, device=device, model=model, layer=layer)
        runs[depth] = hostprobe.warmed_micro_batch(net, device, layer)
    return runs


def timings(runs: dict, device) -> dict:
    def each() -> dict:
        return {
            depth: statistics.median(
                hostprobe.timed(run, device, hostprobe.PROBE_ITERATIONS) for _ in range(TIMED_ROUNDS)
            )
            for depth, run in runs.items()
        }

    out = {"collector_on": each()}
    gc.freeze()  # what a rank does once its model is loaded (finetune/train/collector.py)
    out["collector_frozen"] = each()
    gc.disable()
    out["collector_off"] = each()
    gc.enable()
    gc.unfreeze()
    return out


def profile(runs: dict, device, out: Path) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    ops = {}
    for depth, run in runs.items():
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(hostprobe.PROBE_ITERATIONS):
                run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        table = prof.key_averages()
        ops[depth] = {e.key: {"calls": e.count, "self_cpu_us": e.self_cpu_time_total} for e in table}
        (out / f"profile-{depth}.txt").write_text(
            table.table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=90)
        )
    return {"iterations": hostprobe.PROBE_ITERATIONS, "ops": ops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", help="the model's config.json (default: the probe's Llama layer)")
    parser.add_argument("--layer", default="{}", help="hostprobe.ProbeLayer settings as JSON")
    parser.add_argument("--depths", type=int, nargs="+", default=list(hostprobe.PROBE_DEPTHS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--liger", choices=["on", "off"], help="Liger's kernels (default: the layer's; on)")
    parser.add_argument("--profile", action="store_true", help="also torch.profiler's table at each depth")
    args = parser.parse_args()
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    model = json.loads(Path(args.config).read_text(encoding="utf-8")) if args.config else None
    layer = hostprobe.ProbeLayer.from_json(args.layer)
    if args.liger:
        layer = replace(layer, liger=args.liger == "on")
    device = torch.device(args.device)
    runs = micro_batches(args.depths, model=model, layer=layer, device=device)
    result = {
        "config": args.config,
        "layer": json.loads(layer.to_json()),
        "liger": hostprobe.probe_liger(device, model, layer),
        "seconds_per_micro_batch": timings(runs, device),
    }
    (args.out / "timings.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.profile:
        (args.out / "profile.json").write_text(json.dumps(profile(runs, device, args.out)) + "\n")
    print(json.dumps(result["seconds_per_micro_batch"]))


if __name__ == "__main__":
    main()

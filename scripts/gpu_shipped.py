"""Train the SHIPPED recipes (e.g. recipes/llama70b-lora.yaml) on the GPU machine and record plan vs measurement.

Each recipe runs as shipped except what this machine cannot have: the model is the same architecture
with random weights (scripts/make_random_model.py, written shard by shard), the data is the learnable
synthetic task of gpu_validate.py in the recipe's own format, the hardware is `auto` (the GPUs the run
is given through CUDA_VISIBLE_DEVICES), nothing is pushed by the run itself, and the number of steps
and the global batch are set on the command line (a 70B step at the shipped global batch of 64 x 4096
tokens takes over a minute on 4 GPUs). Rows go to the same results JSON as gpu_validate.py.

    python scripts/gpu_shipped.py lora70b qlora70b-1gpu+qlora70b-fsdp2-2gpu lora70b-preempt --out $OUT/v.json
    python scripts/gpu_shipped.py lora70b --push-merge --merge-dir /dev/shm/merged
    python scripts/gpu_shipped.py --push-merge-of /tmp/validation/lora70b/run --out merge.json

A run group "a+b" starts its runs at the same time on disjoint GPUs (numbered in order).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_validate as gv  # noqa: E402

from finetune import rundir  # noqa: E402
from finetune.recipe.load import _load_raw  # noqa: E402

ROOT = gv.ROOT
# name -> (shipped recipe, registry architecture of its model, GPUs, extra recipe settings)
SHIPPED: dict[str, tuple[str, str, int, dict]] = {
    "lora70b": ("recipes/llama70b-lora.yaml", "llama-3.3-70b", 4, {}),
    "lora70b-preempt": ("recipes/llama70b-lora.yaml", "llama-3.3-70b", 4, {}),
    # the same with every rank loading through accelerate (rank 0 reads the model and sends it), not its shard
    "lora70b-preempt-whole": (
        "recipes/llama70b-lora.yaml",
        "llama-3.3-70b",
        4,
        {"distributed": {"sharded_load": False}},
    ),
    "qlora70b-1gpu": ("recipes/llama70b-qlora.yaml", "llama-3.3-70b", 1, {}),
    "qlora70b-fsdp2-2gpu": ("recipes/llama70b-qlora.yaml", "llama-3.3-70b", 2, {"distributed": {"strategy": "fsdp2"}}),
    "dpo70b": ("recipes/llama70b-dpo-lora.yaml", "llama-3.3-70b", 4, {}),
    "dpo70b-pairs": ("recipes/llama70b-dpo-lora.yaml", "llama-3.3-70b", 4, {"data": {"packing": True}}),
    "lora70b-hybrid-2x2": (
        "recipes/llama70b-lora.yaml",
        "llama-3.3-70b",
        4,
        {"distributed": {"strategy": "fsdp2-hybrid"}},
    ),
    # hybrid shard replicates the model across "nodes": on 2-GPU nodes of 80 GB cards the bf16 70B does
    # not fit (the planner refuses it), the 4-bit one does
    "qlora70b-hybrid-2x2": (
        "recipes/llama70b-qlora.yaml",
        "llama-3.3-70b",
        4,
        {"distributed": {"strategy": "fsdp2-hybrid"}},
    ),
    # issue "70B for real", run 6: the 405B QLoRA recipe on 4 H200s, its weights built shard by shard from
    # random values (model.init: random through finetune/train/sharded_load.py): no checkpoint is written
    "qlora405b-random-4gpu": (
        "recipes/llama405b-qlora.yaml",
        "llama-3.1-405b",
        4,
        {"model": {"init": "random"}, "distributed": {"strategy": "fsdp2"}},
    ),
    # a CPU smoke test of this script itself (and of its preemption sequence)
    "quickstart-cpu": ("recipes/quickstart.yaml", "tiny-llama", 1, {}),
    "quickstart-cpu-preempt": ("recipes/quickstart.yaml", "tiny-llama", 1, {}),
}
PREEMPT_AT_STEP = 6


def shipped_recipe(name: str, *, model_dir: Path, data: Path, steps: int, batch: int) -> dict:
    path, _, _, extra = SHIPPED[name]
    raw = _load_raw(ROOT / path)  # extends resolved, nothing else changed
    source = raw["data"]["sources"][0] if "sources" in raw["data"] else dict(raw["data"])
    for key in ("path", "format", "columns", "split", "subset"):  # the one-source shorthand
        raw["data"].pop(key, None)
    raw["model"]["name"] = str(model_dir)
    raw["data"]["sources"] = [{"path": str(data), "format": source.get("format", "messages")}]
    raw["data"].pop("eval_sources", None)
    raw["data"].pop("task_eval", None)  # a greedy-generation eval on files of the recipe's own folder
    if raw["data"].get("eval_fraction") is None:
        raw["data"]["eval_fraction"] = 0.005  # the shipped DPO recipe evaluates on a Hub split
    raw["data"]["max_too_long_fraction"] = 0.5
    raw["hardware"] = "auto"
    raw.pop("hub", None)  # the push is made (and checked) separately against the local fake Hub
    raw["train"] = {**raw.get("train", {}), "max_steps": steps, "global_batch_size": batch, "logging_steps": 1}
    raw["train"].pop("epochs", None)
    raw["logging"] = {"report_to": ["none"]}
    return gv.merge(raw, extra)


def start(name: str, *, gpus: list[int], args, resume: str = "never") -> tuple[subprocess.Popen, Path, float]:
    path, arch, _, extra = SHIPPED[name]
    model_dir = gv.ensure_model(arch, config_only=extra.get("model", {}).get("init") == "random")
    work = gv.WORK / name
    work.mkdir(parents=True, exist_ok=True)
    recipe = shipped_recipe(name, model_dir=model_dir, data=work / "data.jsonl", steps=args.steps, batch=args.batch)
    method = recipe.get("method", "sft")
    fmt = gv.data_format(method if isinstance(method, str) else method.get("type", "sft"))
    if not (work / "data.jsonl").exists():
        gv.write_data(work / "data.jsonl", fmt=fmt, seq=recipe["data"].get("max_length", 2048))
    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
    run_dir = work / "run"
    if name.endswith("-2x2"):
        return None, run_dir, time.time()  # started by gv.run_two_nodes in run_group
    cmd = gv.finetune_cmd("run", str(work / "recipe.yaml"), "--output", str(run_dir), "--resume", resume)
    print(f"\n=== {name} on GPUs {gpus}: {' '.join(cmd)}", flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True), run_dir, time.time()


def row_for(name: str, run_dir: Path, *, code: int, started: float) -> dict:
    path, arch, gpus, _ = SHIPPED[name]
    row = {
        "name": name,
        "recipe": path,
        "arch": arch,
        "gpus": gpus,
        "exit_code": code,
        "wall_s": round(time.time() - started, 1),
        "date": time.strftime("%Y-%m-%d"),
    }
    if (run_dir / rundir.PLAN_JSON).exists():
        try:
            row.update(gv.collect(run_dir))
            row["adapter"] = yaml.safe_load((run_dir / rundir.RESOLVED_RECIPE).read_text())["adapter"]["type"]
            begins = [r.get("train_begin_unix") for r in row.get("ranks", []) if r.get("train_begin_unix")]
            if begins:
                row["load_s"] = round(min(begins) - started, 1)  # launch to the first rank's first step
            gv.add_mfu(row, run_dir=run_dir)
        except Exception as exc:  # keep the other runs' results
            row["collect_error"] = repr(exc)
    return row


def preempt(name: str, args, results: list[dict]) -> dict:
    """SIGTERM to the launcher during step PREEMPT_AT_STEP (as a scheduler would), then rerun to the end;
    the resumed losses are compared with the uninterrupted run's row (the name before -preempt). Each
    launch's time to its first logged step is recorded (the resumed one pays the load again)."""
    gpus = list(range(SHIPPED[name][2]))
    proc, run_dir, started = start(name, gpus=gpus, args=args)
    first_step_s = None
    while proc.poll() is None and max(gv_losses(run_dir), default=0) < PREEMPT_AT_STEP:
        if first_step_s is None and gv_losses(run_dir):
            first_step_s = round(time.time() - started, 1)
        time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    first = proc.wait()
    saved = sorted(p.name for p in (run_dir / rundir.CHECKPOINTS).glob("checkpoint-*"))
    shutil.copy(run_dir / rundir.METRICS, run_dir.parent / "first-half-metrics.jsonl")
    logged = max(gv_losses(run_dir), default=0)
    proc, _, resumed = start(name, gpus=gpus, args=args, resume="auto")
    resumed_step_s = None
    while proc.poll() is None:
        if resumed_step_s is None and len(gv_losses(run_dir)) > logged:
            resumed_step_s = round(time.time() - resumed, 1)
        time.sleep(2)
    code = proc.wait()
    row = row_for(name, run_dir, code=code, started=started)
    row.pop("load_s", None)  # the memory files are the resumed launch's
    row.update(
        preempt_exit_code=first,
        checkpoints_after_signal=saved,
        first_launch_to_first_step_s=first_step_s,
        resumed_launch_to_first_step_s=resumed_step_s,
    )
    uninterrupted = name.split("-preempt")[0]
    reference = next((r for r in results if r["name"] == uninterrupted and r.get("loss_by_step")), None)
    if reference and row.get("loss_by_step"):
        ref = dict(map(tuple, reference["loss_by_step"]))
        diffs = [abs(loss - ref[step]) for step, loss in row["loss_by_step"] if step in ref]
        row["max_abs_loss_diff_vs_uninterrupted"] = max(diffs) if diffs else None
    return row


def gv_losses(run_dir: Path) -> list[int]:
    return [r["step"] for r in rundir.read_metrics(run_dir) if r.get("loss") is not None]


def push_and_merge(args, run_dir: Path) -> dict:
    """`finetune push` to the local fake Hub, then `finetune merge` with its host RAM sampled."""
    from tests.helpers.fakehub import FakeHub  # the repository root is on sys.path (above)

    out: dict = {"name": "lora70b-push-merge"}
    hub = FakeHub().start()
    try:
        env = {
            **os.environ,
            "HF_ENDPOINT": hub.url,
            "HF_TOKEN": "hf_validation",
            "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_OFFLINE": "0",
        }
        t = time.time()
        proc = subprocess.run(
            gv.finetune_cmd("push", str(run_dir), "--repo", "validation/llama70b-lora"),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        files = hub.files("validation/llama70b-lora") if proc.returncode == 0 else {}
        out.update(
            push_exit_code=proc.returncode,
            push_s=round(time.time() - t, 1),
            pushed={k: len(v) for k, v in files.items()},
            push_tail=(proc.stdout + proc.stderr)[-800:],
        )
    finally:
        hub.stop()
    merge_dir = Path(args.merge_dir)
    shutil.rmtree(merge_dir, ignore_errors=True)
    t = time.time()
    proc = subprocess.Popen(
        gv.finetune_cmd("merge", str(run_dir), "-o", str(merge_dir), "--max-shard-size", "2GB"),
        cwd=ROOT,
        start_new_session=True,
    )
    peak = {"RssAnon": 0, "RssFile": 0}
    deadline = t + args.merge_timeout
    while proc.poll() is None and time.time() < deadline:
        for pid in [proc.pid, *children(proc.pid)]:
            for key, kib in status_kib(pid).items():
                peak[key] = max(peak[key], kib)
        time.sleep(0.5)
    finished = proc.poll() is not None
    if not finished:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    written = list(merge_dir.parent.glob(f".{merge_dir.name}.partial-*/*.safetensors")) + list(
        merge_dir.glob("*.safetensors")
    )
    nbytes = sum(p.stat().st_size for p in written)
    seconds = time.time() - t
    out.update(
        merge_exit_code=proc.returncode,
        merge_finished=finished,
        merge_s=round(seconds, 1),
        merge_bytes_written=nbytes,
        merge_gb_per_s=round(nbytes / 1e9 / seconds, 3),
        merge_peak_rss_anon_gib=round(peak["RssAnon"] / 2**20, 2),
        merge_peak_rss_file_gib=round(peak["RssFile"] / 2**20, 2),
        merge_dir=str(merge_dir),
    )
    return out


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def status_kib(pid: int) -> dict[str, int]:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in lines) if k in ("RssAnon", "RssFile")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("groups", nargs="*", help="run names, 'a+b' for runs side by side")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default="validation.json")
    parser.add_argument("--push-merge", action="store_true", help="after lora70b: push to a fake Hub, merge")
    parser.add_argument("--merge-dir", default="/dev/shm/merged")
    parser.add_argument("--merge-timeout", type=float, default=300)
    parser.add_argument("--push-merge-of", type=Path, help="only push and merge this finished run directory")
    parser.add_argument(
        "--reference",
        type=Path,
        action="append",
        default=[],
        help="results JSON holding the uninterrupted run a -preempt run is compared with",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(out.read_text()) if out.exists() else []
    references = []  # a results list, or a results file of docs/results/ ({"rows": [...]})
    for path in args.reference:
        if path.exists():
            loaded = json.loads(path.read_text())
            references += loaded["rows"] if isinstance(loaded, dict) else loaded

    def save(row: dict) -> None:
        results.append(row)
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k not in ("ranks", "loss_by_step")}), flush=True)

    if args.push_merge_of:
        save(push_and_merge(args, args.push_merge_of))
        return
    for group in args.groups:
        names = group.split("+")
        if len(names) == 1 and "-preempt" in names[0]:
            save(preempt(names[0], args, results + references))
            continue
        started, first_gpu = [], 0
        for name in names:
            gpus = list(range(first_gpu, first_gpu + SHIPPED[name][2]))
            first_gpu += len(gpus)
            if name.endswith("-2x2"):
                work = gv.WORK / name
                start(name, gpus=gpus, args=args)
                t = time.time()
                code = gv.run_two_nodes(work, work / "run", [], gpus_per_node=2)
                save(row_for(name, work / "run", code=code, started=t))
                continue
            started.append((name, *start(name, gpus=gpus, args=args)))
        for name, proc, run_dir, t in started:
            save(row_for(name, run_dir, code=proc.wait(), started=t))
            if name == "lora70b" and args.push_merge and (run_dir / "adapter_model.safetensors").exists():
                save(push_and_merge(args, run_dir))


if __name__ == "__main__":
    main()

"""Run real-shape fine-tunes through `finetune run` on the GPU machine and record plan vs measurement.

Each run: a real architecture with random weights (scripts/make_random_model.py), a learnable
synthetic task (answer a line of words in capitals, so the loss must fall), a recipe written
next to its data, then `python -m finetune.cli run` exactly as a user would. Afterwards it reads
the run directory (finetune/rundir.py): the plan (prediction), every rank's memory file (measured peaks),
the summary and the metrics, and appends one row per run to the results JSON. MFU uses the planner's
FLOPs formula and the card's preset peak, so it is the quantity `finetune plan` predicts.

    python scripts/gpu_validate.py lora8b qlora8b dpo8b --out $OUT/validation.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from finetune import rundir  # noqa: E402
from finetune.measurement import steady_tokens_per_second  # noqa: E402
from finetune.plan import mfu, recipe_flops_per_token  # noqa: E402
from finetune.recipe import load_recipe  # noqa: E402
from finetune.recipe.schema import METHOD_FORMATS  # noqa: E402
from finetune.registry import resolve_model  # noqa: E402
from finetune.registry.detect import host_ram_gib, peak_bf16_tflops, query_gpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("FINETUNE_MODELS", "/tmp/models"))
WORK = Path(os.environ.get("FINETUNE_VALIDATION_DIR", "/tmp/validation"))

# name -> (arch, recipe overrides). GPUs come from --hardware auto (the machine's own).
RUNS: dict[str, tuple[str, dict]] = {
    # a CPU smoke test of this script itself
    "tiny-cpu": (
        "tiny-llama",
        {"hardware": "cpu", "model": {"dtype": "float32"}, "train": {"precision": "fp32", "lr": 2e-3}},
    ),
    "lora8b": ("llama-3.1-8b", {"adapter": {"type": "lora", "r": 16, "alpha": 32}}),
    "qlora8b": ("llama-3.1-8b", {"adapter": {"type": "qlora", "r": 16, "alpha": 32}}),
    "dpo8b": (
        "llama-3.1-8b",
        {"method": {"type": "dpo", "beta": 0.1}, "adapter": {"type": "lora", "r": 16, "alpha": 32}},
    ),
    "full3b-fsdp2": (
        "llama-3.2-3b",
        {"adapter": {"type": "full"}, "train": {"lr": 1e-5}, "distributed": {"strategy": "fsdp2"}},
    ),
    "lora8b-fsdp2": ("llama-3.1-8b", {"adapter": {"type": "lora"}, "distributed": {"strategy": "fsdp2"}}),
    "qlora8b-fsdp2": ("llama-3.1-8b", {"adapter": {"type": "qlora"}, "distributed": {"strategy": "fsdp2"}}),
    "lora8b-zero3": ("llama-3.1-8b", {"adapter": {"type": "lora"}, "distributed": {"strategy": "zero3"}}),
    "qlora8b-zero3": ("llama-3.1-8b", {"adapter": {"type": "qlora"}, "distributed": {"strategy": "zero3"}}),
    "lora3b-zero3-offload": ("llama-3.2-3b", {"distributed": {"strategy": "zero3-offload"}}),
    # 8B shape: ZeRO-3 full, and LoRA/full with CPU and NVMe (ZeRO-Infinity) offload
    "full8b-zero3": (
        "llama-3.1-8b",
        {"adapter": {"type": "full"}, "train": {"lr": 1e-5}, "distributed": {"strategy": "zero3"}},
    ),
    "lora8b-zero3-offload": ("llama-3.1-8b", {"distributed": {"strategy": "zero3-offload"}}),
    "full8b-zero3-offload": (
        "llama-3.1-8b",
        {"adapter": {"type": "full"}, "train": {"lr": 1e-5}, "distributed": {"strategy": "zero3-offload"}},
    ),
    "lora8b-zero3-nvme": ("llama-3.1-8b", {"distributed": {"strategy": "zero3-nvme", "nvme_path": "/tmp/nvme-swap"}}),
    "full8b-zero3-nvme": (
        "llama-3.1-8b",
        {
            "adapter": {"type": "full"},
            "train": {"lr": 1e-5},
            "distributed": {"strategy": "zero3-nvme", "nvme_path": "/tmp/nvme-swap"},
        },
    ),
    "lora3b-zero3-nvme": ("llama-3.2-3b", {"distributed": {"strategy": "zero3-nvme", "nvme_path": "/tmp/nvme-swap"}}),
    "full3b-zero3": (
        "llama-3.2-3b",
        {"adapter": {"type": "full"}, "train": {"lr": 1e-5}, "distributed": {"strategy": "zero3"}},
    ),
    # the tiers between "everything on the GPU" and "parameters and optimizer offloaded"
    "full3b-zero2": (
        "llama-3.2-3b",
        {"adapter": {"type": "full"}, "train": {"lr": 1e-5}, "distributed": {"strategy": "zero2"}},
    ),
    "full3b-zero3-optim-offload": (
        "llama-3.2-3b",
        {"adapter": {"type": "full"}, "train": {"lr": 1e-5}, "distributed": {"strategy": "zero3-optim-offload"}},
    ),
    "full3b-fsdp2-offload": (
        "llama-3.2-3b",
        {"adapter": {"type": "full"}, "train": {"lr": 1e-5}, "distributed": {"strategy": "fsdp2-offload"}},
    ),
    # hybrid shard: two launcher processes as two "nodes" of 2 GPUs on a 4-GPU machine (shard inside a
    # node, replicate across). With 1 GPU per node there is nothing to shard inside a node and the
    # planner refuses fsdp2-hybrid (test_hybrid_needs_two_gpus_per_node).
    "lora3b-hybrid-2x2": ("llama-3.2-3b", {"distributed": {"strategy": "fsdp2-hybrid"}}),
    # an FSDP2 checkpoint written on 2 GPUs, resumed on 1 (see run_portable)
    "lora3b-fsdp2-2to1": ("llama-3.2-3b", {"distributed": {"strategy": "fsdp2"}}),
    "lora3b-fsdp2-1to2": ("llama-3.2-3b", {"distributed": {"strategy": "fsdp2"}}),
}


def gpu_preset(path: Path, *, nodes: int, gpus_per_node: int) -> Path:
    """A user preset file for this machine's card, split into `nodes` nodes."""
    name, memory_gib = query_gpus()[0]  # what --hardware auto sees (CUDA_VISIBLE_DEVICES honoured)
    path.write_text(
        yaml.safe_dump(
            {
                "name": f"loopback-{nodes}x{gpus_per_node}",
                "gpu_model": name,
                "gpu_memory_gib": memory_gib,
                "gpus_per_node": gpus_per_node,
                "nodes": nodes,
                "intra_node_link": "nvlink",
                "intra_node_bandwidth_gbps": 300,
                "inter_node_fabric": "ethernet" if nodes > 1 else "none",
                "inter_node_bandwidth_gbps": 25 if nodes > 1 else 0,
                "host_ram_gib": round(host_ram_gib() / nodes, 1),  # loopback "nodes" share this host's RAM
                "peak_bf16_tflops": peak_bf16_tflops(name),
            }
        )
    )
    return path


def finetune_cmd(*args: str) -> list[str]:
    """`finetune ARGS...` as this interpreter runs it (the GPU machine has no console script on PATH)."""
    return [sys.executable, "-m", "finetune.cli", *args]


def run_until(cmd: list[str], deadline_s: float | None) -> int:
    """Run `cmd`; past `deadline_s` kill its whole process group (launcher and ranks) and return 124,
    so the partial run's figures (memory/rank-K.json is rewritten at every logged step) are still
    collected."""
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        return proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"stopped after {deadline_s:.0f} s (--run-timeout)", flush=True)
        return 124


def run_two_nodes(work: Path, run_dir: Path, extra: list[str], *, gpus_per_node: int) -> int:
    """Node ranks 0 and 1, `gpus_per_node` GPUs each (GPUs 0.. and then the next ones), rendezvous on
    127.0.0.1."""
    preset = gpu_preset(work / "preset.yaml", nodes=2, gpus_per_node=gpus_per_node)
    procs = []
    for rank in (0, 1):
        gpus = range(rank * gpus_per_node, (rank + 1) * gpus_per_node)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus)}
        cmd = finetune_cmd(
            "run",
            str(work / "recipe.yaml"),
            "--hardware",
            str(preset),
            "--output",
            str(run_dir) + (f"-node{rank}" if rank else ""),
            "--resume",
            "never",
            "--node-rank",
            str(rank),
            "--main-address",
            "127.0.0.1",
            "--main-port",
            "29533",
            *extra,
        )
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env))
    return max(p.wait() for p in procs)


def run_portable(work: Path, run_dir: Path, extra: list[str], steps: int, *, first: int, then: int) -> int:
    """Save at the halfway step on `first` GPUs, then resume on `then` GPUs and finish."""
    presets = {n: gpu_preset(work / f"preset{n}.yaml", nodes=1, gpus_per_node=n) for n in {first, then}}
    half = steps // 2
    base = finetune_cmd(
        "run",
        str(work / "recipe.yaml"),
        "--output",
        str(run_dir),
        "--set",
        f"output.save_every={half}",
        "--set",
        "train.global_batch_size=8",
        *extra,
    )
    gpus = lambda n: {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(n))}  # noqa: E731
    code = subprocess.run(
        base + ["--hardware", str(presets[first]), "--resume", "never", "--set", f"train.max_steps={half}"],
        cwd=ROOT,
        env=gpus(first),
    ).returncode
    if code:
        return code
    # the resumed run rewrites metrics.jsonl from the checkpoint's step on; keep the first half's rows
    shutil.copy(run_dir / rundir.METRICS, run_dir.parent / "first-half-metrics.jsonl")
    return subprocess.run(
        base + ["--hardware", str(presets[then]), "--resume", "auto", "--set", f"train.max_steps={steps}"],
        cwd=ROOT,
        env=gpus(then),
    ).returncode


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 8))) for _ in range(n))


def write_data(path: Path, *, fmt: str, seq: int, n: int = 4000, seed: int = 0, long_examples: bool = False) -> None:
    """Examples of up to about a third of `seq` tokens (character-level tokenizer: ~6 per word x 2), or,
    with `long_examples`, examples that fill most of `seq` (long-context data: each packed row is about
    one example, the attention cost the planner assumes)."""
    rng = random.Random(seed)
    # preference pairs fill max_length (prompt + one answer ~ 12 tokens a word): the planner's
    # worst case is what a calibration point must measure; SFT rows are packed to max_length anyway.
    # The rejected answer is shorter than the chosen one, as in real pairs, so each pair is padded and
    # the attention gets the mask the planner plans for (equal lengths would let sdpa drop it)
    preference = fmt == "preference"
    fill = preference or long_examples
    most, least = (seq // 13, seq // 15) if fill else (max(4, seq // 40), max(1, seq // 120))
    with path.open("w") as f:
        for _ in range(n):
            text = words(rng, rng.randint(least, most))
            if preference:
                row = {
                    "prompt": [{"role": "user", "content": text}],
                    "chosen": [{"role": "assistant", "content": text.upper()}],
                    "rejected": [
                        {"role": "assistant", "content": text[::-1][: rng.randint(len(text) // 2, len(text))]}
                    ],
                }
            elif fmt == "text":
                row = {"text": f"{text} {text.upper()}"}
            else:
                row = {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": text.upper()}]}
            f.write(json.dumps(row) + "\n")


def base_recipe(model_dir: Path, data: Path, *, steps: int, seq: int, batch: int) -> dict:
    return {
        "model": {"name": str(model_dir), "dtype": "bfloat16"},  # attention: finetune's default (auto)
        "method": {"type": "sft"},
        "adapter": {"type": "lora"},
        "data": {
            "path": str(data),
            "format": "messages",
            "max_length": seq,
            "packing": True,
            "max_too_long_fraction": 0.5,
        },
        "train": {"max_steps": steps, "lr": 2e-4, "global_batch_size": batch, "logging_steps": 5, "warmup_ratio": 0.1},
        "hardware": "auto",
        "output": {"save_every": steps // 2, "keep": 1},
        "logging": {"report_to": ["none"]},
    }


def data_format(method: str) -> str:
    """The synthetic data's format for `method`: the first it trains on (messages for SFT, preference pairs for
    DPO, KTO, ORPO, SimPO and reward models, raw text for pretraining)."""
    return METHOD_FORMATS[method][0]


def run_recipe(model_dir: Path, data: Path, override: dict, *, steps: int, seq: int, batch: int) -> dict:
    """The recipe a named run trains: base_recipe with its settings over it, on its method's data format."""
    recipe = merge(base_recipe(model_dir, data, steps=steps, seq=seq, batch=batch), override)
    fmt = data_format(recipe["method"]["type"])
    recipe["data"]["format"] = fmt
    if fmt == "preference":
        # padded pairs unless the run's settings ask for padding-free ones (data.packing: true)
        recipe["data"]["packing"] = bool(override.get("data", {}).get("packing", False))
    return recipe


def merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def model_folder_name(arch: str) -> str:
    """The folder under FINETUNE_MODELS a random checkpoint of `arch` (a registry key or a config.json
    path: a file named config.json, e.g. tests/data/hub_configs/MODEL/config.json, by its folder) is written to."""
    path = Path(arch)
    return path.parent.name if path.name == "config.json" else path.name.removesuffix(".json")


def ensure_model(arch: str, *, config_only: bool = False) -> Path:
    """The random-weight checkpoint of `arch` (a registry key or a config.json path), written on first use
    (`config_only`: its config and tokenizer, for model.init: random runs); runs started side by side that
    need the same model wait for one writer (a lock file)."""
    import fcntl

    if arch == "tiny-llama":
        return ROOT / "data" / "tiny-llama"
    out = MODELS / (model_folder_name(arch) + ("-config" if config_only else ""))
    MODELS.mkdir(parents=True, exist_ok=True)
    with open(MODELS / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").exists():
            source = str(ROOT / arch) if arch.endswith(".json") else arch
            argv = [sys.executable, str(ROOT / "scripts" / "make_random_model.py"), source, str(out)]
            subprocess.run(argv + (["--config-only"] if config_only else []), check=True)
    return out


def load_matrix(path: Path) -> dict[str, dict]:
    """Named runs of a matrix file (see scripts/calibration_matrix.yaml): arch, gpus, seq, batch, steps and
    the recipe settings that differ from base_recipe."""
    spec = yaml.safe_load(path.read_text())
    defaults = spec.get("defaults", {})
    return {name: merge(defaults, run) for name, run in spec["runs"].items()}


def collect(run_dir: Path) -> dict:
    plan = json.loads((run_dir / rundir.PLAN_JSON).read_text())
    summary = rundir.read_summary(run_dir)
    # every node's ranks: run_two_nodes gives node K > 0 the run folder RUN_DIR-nodeK
    nodes = [run_dir, *sorted(run_dir.parent.glob(f"{run_dir.name}-node*"))]
    ranks = [json.loads(p.read_text()) for d in nodes for p in sorted((d / rundir.MEMORY_DIR).glob("rank-*.json"))]
    metrics = rundir.read_metrics(run_dir)
    losses = [m["loss"] for m in metrics if m.get("loss") is not None]
    reserved = max((r.get("gpu_max_reserved_gib", 0) for r in ranks), default=0)
    resolved = yaml.safe_load((run_dir / rundir.RESOLVED_RECIPE).read_text())
    # the model's config.json when the registry has no entry of the same numbers (the calibration test
    # plans such a row from this config; a registry model is planned from the row's `arch`)
    from finetune.registry import list_models
    from finetune.registry.derive import arch_from_config

    config = Path(resolved["model"]["name"]) / "config.json"
    model_config = None
    if config.is_file():
        generic = {"key", "hub_ids", "license", "notes", "chat_template"}
        derived = arch_from_config(config, key=config.parent.name).model_dump(exclude=generic)
        known = {a.key: a.model_dump(exclude=generic) for a in list_models()}
        if known.get(resolved["model"].get("arch")) != derived:
            model_config = json.loads(config.read_text())
    return {
        # the whole recipe.resolved.yaml (every pin the planner made): tests/helpers/calibration_rows.py
        # rebuilds the run's plan from it
        "resolved": resolved,
        **({"model_config": model_config} if model_config is not None else {}),
        # what ran, as compile resolved it (the calibration test rebuilds the plan from these)
        "attn_implementation": resolved["model"]["attn_implementation"],
        "liger": resolved["train"]["liger"] == "on",
        "cast_adapter_inputs": resolved["adapter"]["cast_adapter_inputs"],
        "card": ranks[0].get("gpu_name") if ranks else None,
        "strategy": plan["strategy"],
        "world_size": plan["world_size"],
        "micro_batch_size": plan["micro_batch_size"],
        "gradient_accumulation_steps": plan["gradient_accumulation_steps"],
        "activation_checkpointing": plan["activation_checkpointing"],
        "seq_len": plan["seq_len"],
        "predicted_gib": plan["per_gpu_memory_gib"],
        "predicted_tokens_per_s": plan["tokens_per_second"],
        # an NVMe plan: the swap disk's read bandwidth the plan measured (registry/disk.py) and used
        "nvme_read_gbps": plan.get("nvme_read_gbps") or None,
        # a host-bound plan's probe of this machine's host on the run's own layer (finetune/hostprobe.py), which its
        # step time used: the row's host figure for the calibration test
        "host_s_per_kernel": plan.get("host_s_per_kernel") or None,
        "ranks": ranks,
        "measured_max_allocated_gib": max((r.get("gpu_max_allocated_gib", 0) for r in ranks), default=0),
        "measured_max_reserved_gib": reserved,
        "host_rss_peak_gib": max((r["host_rss_peak_gib"] for r in ranks), default=0),
        # the same before the final save (gathering a sharded model for it may be the run's host peak)
        "host_rss_peak_before_save_gib": max((r.get("host_rss_peak_before_save_gib", 0) for r in ranks), default=0)
        or None,
        # PSS sums to the host's real use (RSS counts shared pages once per rank); one host here, even
        # when its GPUs played two nodes
        "host_pss_node_gib": round(sum(r.get("host_pss_sampled_peak_gib", 0) for r in ranks), 2) or None,
        # its anonymous part: without the mapped checkpoint's page cache, which the planner leaves out
        "host_pss_anon_node_gib": round(sum(r.get("host_pss_anon_sampled_peak_gib", 0) for r in ranks), 2) or None,
        # the same at the logged steps only (finetune/train/memory_report.py): loading's leftovers told apart
        "host_pss_steps_node_gib": round(sum(r.get("host_pss_steps_peak_gib", 0) for r in ranks), 2) or None,
        "prediction_over_measured": round(plan["per_gpu_memory_gib"] / reserved, 3) if reserved else None,
        "tokens_per_second": summary.get(rundir.SUMMARY_TOKENS_PER_S),
        "steady_tokens_per_second": steady_tokens_per_second(metrics),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "steps": summary.get(rundir.SUMMARY_STEPS),
        "loss_by_step": [[m["step"], round(m["loss"], 4)] for m in metrics if m.get("loss") is not None],
        "resumed_from": summary.get("resumed_from"),
        "model_load_s": summary.get("model_load_s"),  # rank 0 from_pretrained; load_s adds launch and wrapping
        # the offload tiers' host optimizer threads (the planner's host_threads_per_rank)
        "host_threads_per_rank": ranks[0].get("host_threads") if ranks else None,
        # how the varlen kernel got grouped key/value heads (the planner's Job.varlen_repeats_kv)
        "kv_heads": ranks[0].get("kv_heads") if ranks else None,
        # "skipped": transformers built no packed-row mask (the planner's Job.builds_packed_row_mask)
        "packed_row_masks": ranks[0].get("packed_row_masks") if ranks else None,
        "checkpoints": sorted(p.name for p in (run_dir / rundir.CHECKPOINTS).glob("checkpoint-*")),
        "adapter_bytes": (run_dir / "adapter_model.safetensors").stat().st_size
        if (run_dir / "adapter_model.safetensors").exists()
        else None,
        # a full fine-tune's saved model: its bytes and tensor dtypes (under FSDP2 the gathered state dict
        # holds the fp32 parameters accelerate upcast; whether the files keep them is what this records)
        **saved_model_figures(run_dir),
    }


def saved_model_figures(run_dir: Path) -> dict:
    """{'saved_model_bytes', 'saved_model_dtypes'} of RUN_DIR's model*.safetensors, {} for an adapter run."""
    from safetensors import safe_open

    files = sorted(run_dir.glob("model*.safetensors"))
    if not files:
        return {}
    dtypes: dict[str, int] = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                dtype = str(f.get_slice(key).get_dtype())
                dtypes[dtype] = dtypes.get(dtype, 0) + 1
    return {"saved_model_bytes": sum(p.stat().st_size for p in files), "saved_model_dtypes": dtypes}


def add_mfu(row: dict, *, run_dir: Path) -> None:
    """mfu / steady_mfu per GPU against the dense bf16 peak, with the planner's formula and peak
    (finetune/plan/timing.py), so measured and planned MFU compare."""
    resolved = load_recipe(run_dir / rundir.RESOLVED_RECIPE, allow_resolved=True)
    flops = recipe_flops_per_token(resolved, arch=resolve_model(resolved.model))
    peak = peak_bf16_tflops(row.get("card") or "")
    for key in ("tokens_per_second", "steady_tokens_per_second"):
        if row.get(key):
            row[key.replace("tokens_per_second", "mfu")] = round(
                mfu(tokens_per_second=row[key], flops_per_token=flops, peak_tflops=peak, gpus=row["world_size"]), 4
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", help=f"names of RUNS ({', '.join(sorted(RUNS))}) or of --matrix")
    parser.add_argument("--matrix", type=Path, help="a YAML file of more named runs")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", default="validation.json")
    parser.add_argument(
        "--run-timeout",
        type=float,
        default=None,
        help="seconds before a (single-launch) run is stopped and its partial figures kept",
    )
    args = parser.parse_args()

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(out.read_text()) if out.exists() else []
    matrix = load_matrix(args.matrix) if args.matrix else {}
    unknown = [n for n in args.runs if n not in RUNS and n not in matrix]
    if unknown:
        parser.error(f"unknown runs {unknown}")
    for name in args.runs:
        entry = matrix.get(name, {})
        arch, override = (entry["arch"], entry.get("recipe", {})) if entry else RUNS[name]
        steps, seq, batch = entry.get("steps", args.steps), entry.get("seq", args.seq), entry.get("batch", args.batch)
        model_dir = ensure_model(arch)
        work = WORK / name
        work.mkdir(parents=True, exist_ok=True)
        data = work / "data.jsonl"
        write_data(
            data,
            fmt=data_format(override.get("method", {}).get("type", "sft")),
            seq=seq,
            n=entry.get("examples", 4000),
            long_examples=entry.get("long_examples", False),
        )
        recipe = run_recipe(model_dir, data, override, steps=steps, seq=seq, batch=batch)
        (work / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
        run_dir = work / "run"
        start, started_at = time.perf_counter(), time.time()
        overrides = sum((["--set", s] for s in args.overrides), [])
        if entry.get("final_save", True):
            cmd = finetune_cmd(
                "run", str(work / "recipe.yaml"), "--output", str(run_dir), "--resume", "never", *overrides
            )
        else:  # the same launch and trainer without the final save (minutes for a full 14B's ~170 GB)
            shutil.rmtree(run_dir, ignore_errors=True)
            cmd = finetune_cmd(
                "plan",
                str(work / "recipe.yaml"),
                "--hardware",
                "auto",
                "--measure",
                "--steps",
                str(steps),
                "--keep",
                str(run_dir),
                *overrides,
            )
        print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
        if name.endswith("-2x2"):  # a 4-GPU machine as two nodes of 2 GPUs
            code = run_two_nodes(work, run_dir, overrides, gpus_per_node=2)
        elif name.endswith(("-2to1", "-1to2")):
            first, then = (2, 1) if name.endswith("-2to1") else (1, 2)
            code = run_portable(work, run_dir, overrides, steps, first=first, then=then)
        else:
            code = run_until(cmd, args.run_timeout)
        row = {
            "name": name,
            "arch": arch,
            "adapter": recipe["adapter"]["type"],
            "method": recipe["method"]["type"],
            "exit_code": code,
            "wall_s": round(time.perf_counter() - start, 1),
            "date": time.strftime("%Y-%m-%d"),
        }
        if (run_dir / rundir.SUMMARY).exists():  # wall_s minus this = the launcher's exit after training
            row["summary_written_at_s"] = round((run_dir / rundir.SUMMARY).stat().st_mtime - started_at, 1)
        if (run_dir / rundir.PLAN_JSON).exists():
            try:
                row.update(collect(run_dir))
                add_mfu(row, run_dir=run_dir)
            except Exception as exc:  # keep the other runs' results
                row["collect_error"] = repr(exc)
        # logging.profile_steps: the operator table and the idle/busy summary; memory_profile_step: the peak's
        # breakdown and the allocator's snapshot
        for suffix in (".txt", ".json", ".memory.json", ".memory.pickle.gz"):
            table = run_dir / (rundir.profile_stem(0) + suffix)
            if table.is_file():
                shutil.copy(table, out.parent / f"profile-{name}-rank0{suffix}")
        results.append(row)
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k != "ranks"}), flush=True)

    print("\nname            card                      strategy  mb  ckpt  predicted  reserved  alloc  tok/s  loss")
    for r in results:
        print(
            f"{r['name']:15} {str(r.get('card'))[:25]:25} {r.get('strategy', '-'):9} "
            f"{r.get('micro_batch_size', '-')!s:3} "
            f"{r.get('activation_checkpointing', '-')!s:5} {r.get('predicted_gib', 0):9.1f} "
            f"{r.get('measured_max_reserved_gib', 0):9.1f} {r.get('measured_max_allocated_gib', 0):6.1f} "
            f"{r.get('tokens_per_second') or 0:6.0f}  {r.get('first_loss')} -> {r.get('last_loss')}  "
            f"rc={r['exit_code']}"
        )


if __name__ == "__main__":
    main()

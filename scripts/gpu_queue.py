"""Run a list of GPU jobs on one machine, each on its own GPUs, side by side, within a time budget.

A GPU machine is lent by the minute, and most calibration runs need one GPU of four: this packs them.
Jobs start in list order (first come, first served) with backfilling: while the first waiting job
cannot start (its GPUs are taken, or the jobs it waits for are still running), a later one may, if it
fits in the free GPUs and its estimate says it ends before the waiting job can start. A job can wait
for others (`after`), and never starts if one of them failed; a fallback (`instead_of: NAME`) waits for
NAME and starts only if NAME failed (e.g. the same run the slower, proven way); a job with `gpus: 0` runs on the CPU
(e.g. a merge). Each job's output goes to LOGS/<name>.log and the
queue's state to STATE (rewritten at every change), so a poll can copy both away while the queue runs.
No job starts whose estimate would take it past --budget seconds; the ones left unrun are listed in
STATE.

    python scripts/gpu_queue.py scripts/gpu_session.yaml --results /tmp/results --budget 1500

The jobs file: `jobs:` a list of {name, gpus, cmd, est_s, after: [names], instead_of: name, env: {..},
uses: [paths], exclusive: true|false}, and
`scratch:` a list of folders. `{results}` in cmd is replaced by the results folder. A path a job `uses`
inside a scratch folder (e.g. a model written to /dev/shm) is deleted when the last job using it ends,
so the RAM-backed disk holds only the models still needed. An `exclusive` job runs alone on the machine:
the offload tiers' step time is the host's memory bandwidth and cores, which a job beside it (writing a
70B checkpoint, tokenizing) takes a share of.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_validate import load_matrix, model_folder_name  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("jobs", type=Path)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument(
        "--budget", type=float, required=True, help="seconds: no job starts that its estimate says would end later"
    )
    parser.add_argument("--gpus", type=int, default=None, help="default: all the machine has")
    parser.add_argument("--only", nargs="*", help="run only these job names (and nothing they wait for)")
    args = parser.parse_args()

    spec = yaml.safe_load(args.jobs.read_text())
    matrix = load_matrix(Path(spec["matrix"])) if "matrix" in spec else {}
    jobs, scratch = [expand(j, spec, matrix) for j in spec["jobs"]], [str(p) for p in spec.get("scratch", [])]
    if args.only:
        jobs = [j for j in jobs if j["name"] in args.only]
    total = args.gpus if args.gpus is not None else gpu_count()
    logs = args.results / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    state_path = args.results / "queue.json"
    t0 = time.time()
    free = list(range(total))
    waiting = [dict(j, est_s=float(j.get("est_s", 120))) for j in jobs if j.get("gpus", 1) <= total]
    skipped = [j["name"] for j in jobs if j.get("gpus", 1) > total]
    running: dict[str, dict] = {}
    done: dict[str, dict] = {}
    failed_inputs: dict[str, str] = {}  # job -> the job it waited for, which failed: it never starts
    not_needed: list[str] = []  # fallbacks whose job succeeded: never started

    def write_state() -> None:
        state = {
            "elapsed_s": round(time.time() - t0, 1),
            "free_gpus": free,
            "running": {n: {k: j[k] for k in ("gpus_used", "started_s")} for n, j in running.items()},
            "done": done,
            "waiting": [j["name"] for j in waiting],
            "too_big": skipped,
            "input_failed": failed_inputs,
            "not_needed": not_needed,
        }
        state_path.write_text(json.dumps(state, indent=1) + "\n")

    def waits_for(job: dict) -> list[str]:
        return [*job.get("after", []), *([job["instead_of"]] if "instead_of" in job else [])]

    def ready(job: dict) -> bool:
        return all(a in done for a in waits_for(job))

    def start(job: dict) -> None:
        need = job.get("gpus", 1)
        gpus = [free.pop(0) for _ in range(need)]
        env = {**os.environ, **{k: str(v) for k, v in job.get("env", {}).items()}}
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))  # none for a CPU job: it must not take a GPU
        cmd = job["cmd"].replace("{results}", str(args.results))
        log = (logs / f"{job['name']}.log").open("w")
        log.write(f"$ CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '')} {cmd}\n")
        log.flush()
        proc = subprocess.Popen(
            ["bash", "-c", cmd], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        running[job["name"]] = dict(job, proc=proc, gpus_used=gpus, started_s=round(time.time() - t0, 1), log=log)
        waiting.remove(job)

    def head_start_time(head: dict) -> float:
        """When the waiting head job's GPUs are expected free, from the running jobs' estimates."""
        now = time.time() - t0
        if head.get("exclusive"):  # it waits for every running job
            return max([now, *(j["started_s"] + j["est_s"] for j in running.values())])
        avail, ends = len(free), sorted((j["started_s"] + j["est_s"], len(j["gpus_used"])) for j in running.values())
        for end, n in ends:
            if avail >= head.get("gpus", 1):
                break
            avail += n
            now = max(now, end)
        return now

    def reap() -> None:
        """Record the jobs that ended, free their GPUs, and delete the scratch paths nobody still uses."""
        for name, job in list(running.items()):
            code = job["proc"].poll()
            if code is None:
                continue
            job["log"].close()
            free.extend(job["gpus_used"])
            free.sort()
            done[name] = {
                "exit_code": code,
                "gpus": job["gpus_used"],
                "started_s": job["started_s"],
                "ended_s": round(time.time() - t0, 1),
            }
            del running[name]
            for path in job.get("uses", []):
                if any(str(path).startswith(d) for d in scratch) and not any(
                    path in j.get("uses", []) for j in [*waiting, *running.values()]
                ):
                    shutil.rmtree(path, ignore_errors=True)

    try:
        while waiting or running:
            reap()
            for job in list(waiting):  # a job whose input failed would only fail too (or measure nothing)
                bad = [a for a in job.get("after", []) if a in done and done[a]["exit_code"] != 0]
                bad += [a for a in job.get("after", []) if a in failed_inputs]
                if bad:
                    failed_inputs[job["name"]] = bad[0]
                    waiting.remove(job)
                elif job.get("instead_of") in done and done[job["instead_of"]]["exit_code"] == 0:
                    not_needed.append(job["name"])  # what it stands in for succeeded
                    waiting.remove(job)
            if time.time() - t0 > args.budget:
                break  # no new job; the running ones finish
            pending = {j["name"] for j in waiting} | set(running) | set(done)
            if not running and not any(
                time.time() - t0 + j["est_s"] <= args.budget and all(a in pending for a in waits_for(j))
                for j in waiting
            ):
                break  # what still waits can never start within the budget
            head_blocked_at = None
            for job in list(waiting):
                if time.time() - t0 + job["est_s"] > args.budget:
                    continue  # would not end within the budget
                if not ready(job):
                    if head_blocked_at is None and all(a in running or a in done for a in waits_for(job)):
                        # the head waits for inputs already running: later jobs may only use the time
                        # until those end and its GPUs are free, or they would delay it
                        inputs_end = [
                            running[a]["started_s"] + running[a]["est_s"] for a in waits_for(job) if a in running
                        ]
                        head_blocked_at = max([head_start_time(job), *inputs_end])
                    continue
                if running and (job.get("exclusive") or any(j.get("exclusive") for j in running.values())):
                    head_blocked_at = head_blocked_at or head_start_time(job)
                    continue  # an exclusive job (host-bound timing) shares the host with nothing
                fits = job.get("gpus", 1) <= len(free)
                if head_blocked_at is None:
                    if fits:
                        start(job)
                        continue
                    head_blocked_at = head_start_time(job)
                elif fits and time.time() - t0 + job["est_s"] <= head_blocked_at:
                    start(job)
            write_state()
            time.sleep(2)
        while running:  # past the budget: let the started jobs end
            reap()
            write_state()
            time.sleep(2)
    finally:
        for job in running.values():
            os.killpg(job["proc"].pid, signal.SIGKILL)
        write_state()
    print(json.dumps({"done": done, "not_started": [j["name"] for j in waiting]}, indent=1))


def expand(job: dict, spec: dict, matrix: dict[str, dict]) -> dict:
    """`{run: NAME}` stands for gpu_validate.py's run NAME of the jobs file's `matrix:` (loaded), on its
    GPUs, with its model and work folders (under the jobs file's `env`) as the paths it uses."""
    if "run" not in job:
        return job
    name, env = job["run"], {**spec.get("env", {}), **job.get("env", {})}  # a job's own env overrides the file's
    entry = matrix[name]
    uses = [
        f"{env['FINETUNE_MODELS']}/{model_folder_name(entry['arch'])}",
        f"{env['FINETUNE_VALIDATION_DIR']}/{name}",
    ]
    return {
        "name": name,
        "gpus": entry["gpus"],
        "est_s": entry["est_s"],
        "exclusive": bool(entry.get("exclusive", False)),
        "env": env,
        "uses": uses,
        "cmd": (f"python3 scripts/gpu_validate.py {name} --matrix {spec['matrix']} --out {{results}}/rows/{name}.json"),
        **{k: v for k, v in job.items() if k not in ("run", "env")},
    }


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    return len([line for line in out.splitlines() if line.startswith("GPU ")])


if __name__ == "__main__":
    main()

"""A stand-in rank entry point: `python -m tests.helpers.dist_probe RESOLVED_RECIPE [--wait-signal]`.

It joins the process group exactly as the trainer does (accelerate's Accelerator, which reads
what `accelerate launch` exported), all-reduces its rank, and writes what it saw to
RUN_DIR/probe/rank<K>.json. With --wait-signal it reports ready and waits for SIGTERM/SIGUSR1,
records the signal and exits with EXIT_PREEMPTED, like a rank that checkpointed.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path


def main() -> int:
    resolved = Path(sys.argv[1])
    out = resolved.parent / "probe"
    out.mkdir(exist_ok=True)
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    acc = Accelerator()
    state = acc.state
    total = torch.tensor([float(state.process_index + 1)])
    if dist.is_initialized():
        dist.all_reduce(total)
    record = {
        "rank": state.process_index,
        "world_size": state.num_processes,
        "local_rank": state.local_process_index,
        "node_rank": int(os.environ.get("GROUP_RANK", -1)),
        "distributed_type": str(state.distributed_type),
        "backend": state.backend,
        "allreduce_sum": total.item(),
        "argv": sys.argv[1:],
        "pid": os.getpid(),
        "env": {k: os.environ.get(k) for k in ("ACCELERATE_USE_CPU", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PROBE_MARK")},
    }
    path = out / f"rank{state.process_index}.json"
    if "--wait-signal" in sys.argv:
        got = []
        signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
        signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
        (out / f"ready{state.process_index}").write_text(str(os.getpid()))
        deadline = time.monotonic() + 120
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        record["signal"] = signal.Signals(got[0]).name if got else None
        path.write_text(json.dumps(record))
        if got:
            acc.state.destroy_process_group()  # as the trainer's ranks leave after a preemption checkpoint
        return 75 if got else 1
    path.write_text(json.dumps(record))
    acc.state.destroy_process_group()  # gloo aborts at exit without it (the trainer does the same)
    return 0


if __name__ == "__main__":
    sys.exit(main())

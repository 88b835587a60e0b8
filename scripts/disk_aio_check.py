"""Read bandwidth of swap directories as finetune's probe measures it and as DeepSpeed's async_io reads them.

The planner times ZeRO-Infinity's parameter reads with registry/disk.py's probe; this script, on a machine with
DeepSpeed's async_io op, reads the same kind of file through DeepSpeed's own aio handle with the compiled
ds_config.json's aio settings, so the probe can be checked against the reader it stands for:

    python scripts/disk_aio_check.py /tmp/nvme-swap /dev/shm/nvme-swap --out $OUT/disk.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from finetune.registry.disk import (  # noqa: E402
    AIO_SETTINGS,
    MIB,
    probe_dir,
    probe_file,
    read_gbps,
)


def deepspeed_read_gbps(directory: Path, size: int) -> float:
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from finetune.compat.deepspeed_arch_list import make_arch_list_readable

    make_arch_list_readable()  # as a run does before DeepSpeed JIT-builds its ops

    handle = AsyncIOBuilder().load().aio_handle(**AIO_SETTINGS)  # as ds_config.json's `aio` configures it
    with probe_file(directory, size) as name:
        buffer = torch.empty(size, dtype=torch.uint8).pin_memory()
        start = time.perf_counter()
        handle.sync_pread(buffer, name)
        return size / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--gib", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    size = args.gib * 1024 * MIB
    rows = []
    for path in args.paths:
        directory = probe_dir(path)
        assert directory is not None, path
        row = {
            "path": path,
            "probe_gbps": read_gbps(path, size),
            "probe_one_reader_gbps": read_gbps(path, size, 1),
            "deepspeed_aio_gbps": deepspeed_read_gbps(directory, size),
            "deepspeed_aio_again_gbps": deepspeed_read_gbps(directory, size),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

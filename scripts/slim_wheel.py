"""Rewrite a wheel without the native libraries one GPU machine cannot load, so that it fits the device carry.

    python scripts/slim_wheel.py WHEEL KEEP_REGEX

bitsandbytes ships one library per CUDA and ROCm version (~43 MB); the GPU machine's torch is built for one
CUDA, so the others are dead weight. Files under the package whose name matches `libbitsandbytes_*` and not
KEEP_REGEX are dropped, and their lines leave the wheel's RECORD (pip reads it to uninstall).
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path


def slim(wheel: Path, keep: str) -> tuple[int, int]:
    pattern = re.compile(keep)
    out = wheel.with_suffix(".slim")
    dropped = set()
    with zipfile.ZipFile(wheel) as src:
        names = src.namelist()
        for name in names:
            base = name.rsplit("/", 1)[-1]
            if base.startswith("libbitsandbytes_") and not pattern.search(base):
                dropped.add(name)
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
            for name in names:
                if name in dropped:
                    continue
                data = src.read(name)
                if name.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(line for line in lines if line.split(",", 1)[0] not in dropped).encode()
                dst.writestr(src.getinfo(name), data)
    before = wheel.stat().st_size
    out.replace(wheel)
    return before, wheel.stat().st_size


if __name__ == "__main__":
    size_before, size_after = slim(Path(sys.argv[1]), sys.argv[2])
    print(f"{sys.argv[1]}: {size_before / 2**20:.1f} -> {size_after / 2**20:.1f} MiB")

"""DeepSpeed's JIT op builder cannot read arch-specific entries in TORCH_CUDA_ARCH_LIST.

deepspeed <= 0.19.8, `CUDAOpBuilder.compute_capability_args` in deepspeed/ops/op_builder/builder.py
sorts the list's entries with `int(part.split('+')[0]) for part in cc.split('.')`, so PyTorch's own
spelling of Hopper/Blackwell arch-specific targets ("9.0a", "10.0f") raises
`ValueError: invalid literal for int() with base 10: '0a'`. CUDA images for Hopper commonly export
TORCH_CUDA_ARCH_LIST=9.0a (the H200 machine of our validation runs did), and ZeRO-Infinity's NVMe
offload JIT-builds the async_io op when the model is first partitioned, so every zero3-nvme run on
such a machine stopped there.

The workaround changes this rank's environment only, before DeepSpeed builds anything: the
suffixes are dropped ("9.0a" -> "9.0"), which compiles generic sm_90 code (runs on every Hopper
card; DeepSpeed's async_io and CPU Adam ops use no arch-specific instructions). No DeepSpeed code is
replaced. Versions after 0.19.8 are left alone: if they still fail, the error says so and this
module's version bound is the one line to move.
"""

from __future__ import annotations

import os
import re
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

LAST_AFFECTED = Version("0.19.8")
_ARCH_SUFFIX = re.compile(r"^(\d+\.\d+)[a-z]+")


def affected() -> bool:
    try:
        return Version(version("deepspeed")) <= LAST_AFFECTED
    except PackageNotFoundError:
        return False


def readable_arch_list(value: str) -> str | None:
    """`value` with arch-specific suffixes dropped (duplicates removed, order and +PTX kept),
    or None when DeepSpeed can already read it."""
    entries = [e for e in re.split(r"[;\s]+", value.strip()) if e]
    cleaned = []
    for entry in entries:
        entry = _ARCH_SUFFIX.sub(r"\1", entry)
        if entry not in cleaned:
            cleaned.append(entry)
    return None if cleaned == entries else ";".join(cleaned)


def make_arch_list_readable(environ=os.environ) -> str | None:
    """Rewrite TORCH_CUDA_ARCH_LIST in `environ` when the installed DeepSpeed cannot read it;
    returns a line saying what changed, or None."""
    value = environ.get("TORCH_CUDA_ARCH_LIST")
    if not value or not affected():
        return None
    cleaned = readable_arch_list(value)
    if cleaned is None:
        return None
    environ["TORCH_CUDA_ARCH_LIST"] = cleaned
    return (
        f"TORCH_CUDA_ARCH_LIST={value!r} -> {cleaned!r} for DeepSpeed's op builder, which cannot "
        f"read arch-specific suffixes (deepspeed <= {LAST_AFFECTED})"
    )

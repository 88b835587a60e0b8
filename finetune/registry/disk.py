"""How fast this machine reads its ZeRO-Infinity swap directory, measured the way DeepSpeed reads it.

ZeRO-3 with NVMe offload reads every parameter from the swap files for the forward and again for the
backward, so a step takes about weights x 2 / disk bandwidth, and the disk is the one figure of such a run
that no GPU name tells. DeepSpeed's async_io reads with O_DIRECT (the page cache plays no part) in blocks of
AIO_BLOCK_BYTES with AIO_QUEUE_DEPTH requests in flight from one submitting thread (the compiled
ds_config.json's `aio`). The probe writes a file in the swap directory (its parent before DeepSpeed makes it),
reads it back with O_DIRECT, one block in flight per reader thread, and removes it: about a second on a local
NVMe.

Readers: AIO_QUEUE_DEPTH on a disk, where libaio keeps that many requests in flight. On a RAM filesystem
(tmpfs) libaio has no asynchronous path: each request is copied inside the submitting call, so DeepSpeed reads
on one thread, and so does the probe (GPU check, scripts/disk_aio_check.py on an H200 host: ext4 probe 1.59
GB/s, DeepSpeed 1.95-2.15; tmpfs probe 25.8 with 8 readers, 5.6 with one, DeepSpeed 3.6-3.9).
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

MIB = 1 << 20
# DeepSpeed's async_io settings for the swap files (its documented defaults), which the compiled ds_config.json
# states and the probe reads with
AIO_BLOCK_BYTES = MIB
AIO_QUEUE_DEPTH = 8
AIO_SETTINGS = {  # ds_config.json's `aio`, the arguments of DeepSpeed's aio_handle
    "block_size": AIO_BLOCK_BYTES,
    "queue_depth": AIO_QUEUE_DEPTH,
    "intra_op_parallelism": 1,  # one submitting thread (see probe_readers)
    "single_submit": False,
    "overlap_events": True,
}
PROBE_BYTES = 1024 * MIB  # larger than the write caches of most drives' controllers
PROBE_PREFIX = ".finetune-disk-probe-"
RAM_FILESYSTEMS = ("tmpfs", "ramfs")  # no asynchronous I/O: libaio copies each request in the submitting call


def nearest_existing(path: str | os.PathLike) -> Path:
    """`path`, or its nearest ancestor that exists: what a run creates below it lands on that filesystem."""
    p = Path(path).expanduser().absolute()
    return next(c for c in (p, *p.parents) if c.exists())


def probe_dir(path: str | os.PathLike) -> Path | None:
    """Where the probe may write its file: the swap directory, or its parent when DeepSpeed has yet to make it;
    None further up (a plan does not write into / or /mnt for a swap path that names nothing there yet)."""
    p = Path(path).expanduser().absolute()
    return next((c for c in (p, p.parent) if c.is_dir()), None)


def filesystem_type(path: str | os.PathLike) -> str | None:
    """The type of the filesystem holding `path` (the longest mount point above it in /proc/self/mounts)."""
    target = nearest_existing(path)
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    best, kind = -1, None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = Path(fields[1].replace("\\040", " "))
        if (mount == target or mount in target.parents) and len(mount.parts) > best:
            best, kind = len(mount.parts), fields[2]
    return kind


def probe_readers(kind: str | None) -> int:
    """Blocks DeepSpeed keeps in flight on a filesystem of this type (filesystem_type): its queue depth, one on a
    RAM filesystem."""
    return 1 if kind in RAM_FILESYSTEMS else AIO_QUEUE_DEPTH


@lru_cache(maxsize=8)
def read_gbps(path: str, size: int = PROBE_BYTES, readers: int | None = None) -> float | None:
    """Sequential O_DIRECT read bandwidth (GB/s) of the filesystem holding `path` with `readers` blocks in
    flight (default: as DeepSpeed reads there, probe_readers); None when it cannot be measured (neither the
    directory nor its parent exists and is writable, too little free space, or a filesystem without O_DIRECT,
    from which DeepSpeed's async_io cannot read either). Measured once per path and process."""
    directory = probe_dir(path)
    if directory is None or not os.access(directory, os.W_OK) or not hasattr(os, "O_DIRECT"):
        return None
    stats = os.statvfs(directory)
    size = min(size, stats.f_bavail * stats.f_frsize // 4) // AIO_BLOCK_BYTES * AIO_BLOCK_BYTES
    if size < 64 * MIB:
        return None
    try:
        with probe_file(directory, size) as name:
            return _direct_read_gbps(name, size, readers or probe_readers(filesystem_type(directory)))
    except OSError:
        return None


@contextmanager
def probe_file(directory: Path, size: int) -> Iterator[str]:
    """A file of `size` bytes (random, whole AIO blocks) written to disk in `directory`; removed on exit."""
    fd, name = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=directory)
    try:
        block = os.urandom(AIO_BLOCK_BYTES)
        with os.fdopen(fd, "wb", buffering=0) as out:
            for _ in range(size // AIO_BLOCK_BYTES):
                out.write(block)
            os.fsync(out.fileno())
        yield name
    finally:
        Path(name).unlink(missing_ok=True)


def _direct_read_gbps(name: str, size: int, readers: int) -> float | None:
    """GB/s reading `name` (size bytes) with O_DIRECT, one block in flight per reader; None if a read fails."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return None
    blocks = size // AIO_BLOCK_BYTES
    errors: list[OSError] = []

    def reader(first: int) -> None:
        buffer = mmap.mmap(-1, AIO_BLOCK_BYTES)  # page-aligned, as O_DIRECT requires
        try:
            for index in range(first, blocks, readers):
                os.preadv(fd, [buffer], index * AIO_BLOCK_BYTES)
        except OSError as exc:
            errors.append(exc)
        finally:
            buffer.close()

    try:
        threads = [threading.Thread(target=reader, args=(i,)) for i in range(readers)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
    if errors or elapsed <= 0:
        return None
    return size / elapsed / 1e9

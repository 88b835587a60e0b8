"""Who may write into a run directory: ownership, the model's and data's own directories, and one run
at a time.

- finetune writes only into directories it created (they carry rundir.OWNER) or empty ones. A non-empty
  directory without the marker is refused (exit 2): finetune never overwrites or deletes what it did not
  write. The output can never be, or contain, the model's directory or a data file.
- A run holds RUN_DIR/.finetune-nodeK.lock while it uses the directory: an O_EXCL file with pid, host and
  a heartbeat (its mtime, refreshed every LOCK_HEARTBEAT_S). A second run refuses, naming the first one's
  pid and host. A lock whose process is gone (kill -9 on this host), or whose heartbeat stopped
  LOCK_STALE_S ago (another node sharing the filesystem), is taken over with a note.

Torch-free: runs in the `finetune` process before anything is written.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from finetune import rundir
from finetune.data.sources import LOCAL_SUFFIXES
from finetune.errors import FinetuneError, RecipeError
from finetune.recipe.load import recipe_dir
from finetune.recipe.paths import anchored, model_path

LOCK_HEARTBEAT_S = 30.0
LOCK_STALE_S = 180.0  # no heartbeat for this long: the holder (on another node) is gone
LEGACY_HEADER = "# Written by `finetune compile`"  # run dirs made before the ownership marker


def is_owned(run_dir: Path) -> bool:
    run_dir = Path(run_dir)
    if (run_dir / rundir.OWNER).is_file():
        return True
    try:
        return (run_dir / rundir.RESOLVED_RECIPE).read_text(encoding="utf-8").startswith(LEGACY_HEADER)
    except (OSError, UnicodeDecodeError):
        return False


def _inside(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


def protected_paths(recipe) -> list[tuple[str, Path]]:
    """(recipe key, path) of what a run reads and must never write into: a local model directory and
    local data files."""
    base = recipe_dir(recipe)
    out: list[tuple[str, Path]] = []
    model = Path(model_path(recipe))  # resolved when it is a local directory
    if model.is_dir():
        out.append(("model.name", model))
    d = recipe.data
    named = [(f"data.sources[{i}].path", s.path) for i, s in enumerate(d.sources)]
    named += [(f"data.eval_sources[{i}].path", s.path) for i, s in enumerate(d.eval_sources)]
    if d.task_eval is not None:
        named.append(("data.task_eval.path", d.task_eval.path))
    for key, raw in named:
        path = anchored(raw, base)
        if path.exists() or path.suffix in LOCAL_SUFFIXES:
            out.append((key, path.resolve()))
    return out


def check_output_dir(run_dir: Path, recipe) -> None:
    """Refuse (exit 2) an output directory finetune must not write into."""
    run_dir = Path(run_dir).resolve()
    for key, path in protected_paths(recipe):
        what = "the model's directory" if key == "model.name" else "a data file"
        if (
            _inside(path, run_dir)
            or (key == "model.name" and _inside(run_dir, path))
            or (key != "model.name" and run_dir == path.parent)
        ):
            raise RecipeError(
                f"the output directory {run_dir} would hold or overwrite {what} ({path})",
                key="output.dir",
                hint="pass --output (or output.dir) naming a directory of its own, e.g. runs/my-run",
            )
    blocker = next((p for p in run_dir.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise RecipeError(
            f"the output {run_dir} lies under {blocker}, which is a file",
            key="output.dir",
            hint="pass --output naming a directory path",
        )
    if run_dir.exists() and not run_dir.is_dir():
        raise RecipeError(
            f"the output {run_dir} is a file, not a directory",
            key="output.dir",
            hint="pass --output naming a new or finetune-made directory",
        )
    if run_dir.is_dir() and any(run_dir.iterdir()) and not is_owned(run_dir):
        shown = ", ".join(sorted(p.name for p in run_dir.iterdir())[:5])
        raise RecipeError(
            f"the output directory {run_dir} is not empty ({shown}, ...) and was not made by "
            f"finetune (no {rundir.OWNER}); nothing in it was touched",
            key="output.dir",
            hint="pass --output naming a new or empty directory (finetune never writes into "
            "or deletes from a directory it did not create)",
        )


def claim(run_dir: Path) -> None:
    """Mark RUN_DIR as finetune's (after every check passed)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    marker = run_dir / rundir.OWNER
    if not marker.exists():
        from finetune.compile.files import json_text, write_atomic

        write_atomic(
            marker, json_text({"created_by": "finetune", "created_at": time.time(), "host": socket.gethostname()})
        )


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (field 22 of /proc/PID/stat), so a reused pid is not mistaken
    for the holder; None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"
        return "?"
    return stat.rpartition(")")[2].split()[19]


class RunLock:
    """RUN_DIR/.finetune-nodeK.lock for the lifetime of a run (a context manager)."""

    def __init__(self, run_dir: Path, *, node_rank: int = 0):
        self.path = Path(run_dir) / rundir.lock_file(node_rank)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.note: str | None = None

    def _holder(self) -> dict | None:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # being written, or cut short by a crash

    def _stale(self, holder: dict) -> str | None:
        """Why the holder is gone, or None while it may still be running."""
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return "released"
        if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
            start = _process_start(holder["pid"])
            if start is None or (holder.get("start") not in (None, "?") and start not in ("?", holder["start"])):
                return f"its process {holder['pid']} on {holder['host']} is gone"
            return None
        if age > LOCK_STALE_S:
            return f"no heartbeat from {holder.get('host', '?')} for {age:.0f} s"
        return None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "start": _process_start(os.getpid()),
            "since": time.time(),
        }
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue
                why = self._stale(holder)
                if why is None:
                    raise FinetuneError(
                        f"another run is using {self.path.parent}: pid {holder.get('pid', '?')} on host "
                        f"{holder.get('host', '?')} holds {self.path.name}",
                        hint="wait for it to finish (or stop it), or pass another --output; if that "
                        f"process is gone for good, delete {self.path}",
                    ) from None
                self.note = f"took over {self.path.name}: {why}"
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as fh:
                json.dump(me, fh)
            self._thread = threading.Thread(target=self._beat, daemon=True)
            self._thread.start()
            return self
        raise FinetuneError(f"cannot take {self.path}: it keeps changing", hint="retry in a moment")

    def _beat(self) -> None:
        while not self._stop.wait(LOCK_HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        holder = self._holder()
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

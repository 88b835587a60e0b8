"""Hostile-user probe: hundreds of careless or malicious attempts against the real CLI, checking that

  1. nothing is lost: every file that existed before an attempt (the user's files, the model, the data,
     a finished run's outputs) is still there, byte for byte, unless the attempt was meant to change it;
  2. no traceback is printed (FINETUNE_DEBUG unset);
  3. every non-zero exit names the problem and a fix (a `fix:` line), and none is an "internal error".

    python scripts/probe_hostile.py [--quick] [--only SUBSTRING] [--json OUT]

Most attempts fail before anything is launched, so they run in this process through finetune.cli.main
(`validate`, `run --dry-run`, or a `run` refused before launch). --full adds attempts that train the
tiny model in a subprocess (reruns, a lock held by a live run, Ctrl-C, kill -9). tests/e2e/test_hostile_probe.py
runs a fast subset (`quick_attempts()`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "data" / "tiny-llama"
TRAIN = ROOT / "data" / "quickstart" / "train.jsonl"


@dataclass
class Attempt:
    name: str
    setup: Callable[[Path], list[str]]  # builds files under a fresh directory, returns the CLI argv
    may_change: bool = False  # a successful run may rewrite the run directory it owns
    trains: bool = False  # launches real training (subprocess; --full only)
    expect: tuple[int, ...] | None = None  # exit codes this attempt must end with, when known


@dataclass
class Outcome:
    name: str
    code: int
    lost: list[str] = field(default_factory=list)
    traceback: bool = False
    no_fix: bool = False
    internal: bool = False
    unexpected: bool = False
    tail: str = ""

    @property
    def ok(self) -> bool:
        return not (self.lost or self.traceback or self.no_fix or self.internal or self.unexpected)


def base_recipe(tmp: Path, **sections) -> dict:
    data = tmp / "train.jsonl"
    if not data.exists():
        shutil.copy(TRAIN, data)
    recipe = {
        "model": {"name": str(TINY), "dtype": "float32"},
        "adapter": {"type": "lora", "r": 8, "alpha": 16},
        "data": {"sources": [{"path": str(data), "max_samples": 32}], "max_length": 32},
        "train": {
            "max_steps": 2,
            "lr": 3e-3,
            "global_batch_size": 8,
            "micro_batch_size": 8,
            "precision": "fp32",
            "warmup_ratio": 0.0,
            "seed": 7,
        },
        "hardware": "cpu",
        "logging": {"report_to": ["none"]},
    }
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value} if isinstance(value, dict) else value
    return recipe


def write(tmp: Path, recipe: dict | str, name: str = "recipe.yaml") -> Path:
    path = tmp / name
    path.write_text(recipe if isinstance(recipe, str) else yaml.safe_dump(recipe))
    return path


def validate(recipe: dict | str) -> Callable[[Path], list[str]]:
    return lambda tmp: [
        "validate",
        str(write(tmp, recipe if isinstance(recipe, str) else _merge(base_recipe(tmp), recipe))),
    ]


def dry_run(recipe: dict, *extra: str, output: str | None = None) -> Callable[[Path], list[str]]:
    def setup(tmp: Path) -> list[str]:
        out = output.format(tmp=tmp, tiny=TINY) if output else str(tmp / "run")
        return ["run", str(write(tmp, _merge(base_recipe(tmp), recipe))), "--output", out, "--dry-run", *extra]

    return setup


def _merge(base: dict, change: dict) -> dict:
    out = dict(base)
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        elif value is _DELETE:
            out.pop(key, None)
        else:
            out[key] = value
    return out


_DELETE = object()

# --- recipe attempts: hostile values for every kind of key ---
HOSTILE_VALUES = [True, "60", -1, 0, 1e30, 2**70, None, [], {}, "", "x" * 500, "0x10", ".nan", -0.5, "∞"]
KEYS = [
    ("train", "max_steps"),
    ("train", "epochs"),
    ("train", "lr"),
    ("train", "global_batch_size"),
    ("train", "micro_batch_size"),
    ("train", "seed"),
    ("train", "warmup_ratio"),
    ("train", "scheduler"),
    ("train", "precision"),
    ("adapter", "r"),
    ("adapter", "alpha"),
    ("adapter", "type"),
    ("data", "max_length"),
    ("output", "save_every"),
    ("output", "keep"),
    ("model", "dtype"),
    ("distributed", "strategy"),
    ("distributed", "timeout_minutes"),
    ("hub", "repo"),
    ("logging", "report_to"),
]


def recipe_attempts() -> list[Attempt]:
    out = []
    for i, (section, key) in enumerate(KEYS):
        for j, value in enumerate(HOSTILE_VALUES):
            if (i + j) % 2:  # every key meets half the values, every value meets half the keys
                continue
            out.append(Attempt(f"recipe {section}.{key}={value!r:.20}", validate({section: {key: value}})))
    aliases = {
        "learning_rate": ("train", 1e-4),
        "num_train_epochs": ("train", 1),
        "per_device_train_batch_size": ("train", 2),
        "rank": ("adapter", 8),
        "lora_alpha": ("adapter", 16),
        "max_seq_length": ("data", 128),
        "output_dir": ("output", "x"),
        "gradient_checkpointing": ("train", True),
        "model_name_or_path": ("model", "x"),
        "save_steps": ("output", 5),
    }
    for alias, (section, value) in aliases.items():
        out.append(Attempt(f"alias {section}.{alias}", validate({section: {alias: value}})))
    head = f"model: {{name: {TINY}}}\ndata: {{path: {TRAIN}, max_samples: 8}}\n"
    texts = {
        "duplicate section": head + "train: {lr: 0.001}\ntrain: {max_steps: 3}\n",
        "duplicate key": head + "train:\n  lr: 0.001\n  lr: 0.002\n",
        "tab indentation": head + "train:\n\tlr: 0.001\n",
        "unclosed bracket": head + "train: {lr: 0.001\n",
        "top-level list": "- model\n- data\n",
        "empty recipe": "",
        "only a comment": "# nothing\n",
        "binary garbage": "\x00\x01\x02 :: {{{",
        "unknown section": head + "trainer: {lr: 1}\n",
        "extends missing": "extends: nowhere.yaml\n" + head,
        "extends itself": "extends: recipe.yaml\n" + head,
        "section as scalar": head + "train: 5\n",
        "data as list": f"model: {{name: {TINY}}}\ndata: [{TRAIN}]\n",
        "hex steps": head + "train: {max_steps: 0x10, global_batch_size: 8}\n",
        "sexagesimal": head + "train: {max_steps: 1:30, global_batch_size: 8}\n",
        "anchors bomb": head + "a: &a [x, x, x, x]\nb: &b [*a, *a, *a, *a]\nc: [*b, *b, *b, *b]\n",
    }
    for name, text in texts.items():
        out.append(Attempt(f"yaml {name}", validate(text)))
    return out


# --- data attempts: files a careless user or an attacker might point at ---
def _data(
    name: str, content: bytes | None, *, fmt: str = "messages", kind: str = "file"
) -> Callable[[Path], list[str]]:
    def setup(tmp: Path) -> list[str]:
        path = tmp / name
        if kind == "dir":
            path.mkdir()
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "symlink-loop":
            os.symlink(path, path)
        elif kind == "missing":
            pass
        else:
            path.write_bytes(content or b"")
        recipe = base_recipe(
            tmp,
            data={"sources": [{"path": str(path), "format": fmt}]},
            train={"global_batch_size": 1, "micro_batch_size": 1},
        )
        return ["validate", str(write(tmp, recipe))]

    return setup


def data_attempts() -> list[Attempt]:
    msg = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    cases = {
        "non-utf8.jsonl": (b'{"text": "caf\xe9"}\n', "text", "file"),
        "deep.json": (b"[" * 200_000 + b"]" * 200_000, "text", "file"),
        "deep.jsonl": (b'{"text": ' + b"[" * 200_000 + b"]" * 200_000 + b"}\n", "text", "file"),
        "x.jsonl": (None, "messages", "dir"),
        "corrupt.parquet": (b"PAR1" + bytes(range(256)) * 2, "text", "file"),
        "quote.csv": (b'text\n"unterminated\n', "text", "file"),
        "empty.jsonl": (b"", "messages", "file"),
        "blank.jsonl": (b"\n\n  \n", "messages", "file"),
        "list-rows.jsonl": (b"[1, 2]\n", "messages", "file"),
        "string-rows.jsonl": (b'"just text"\n', "messages", "file"),
        "no-assistant.jsonl": (
            json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode() + b"\n",
            "messages",
            "file",
        ),
        "bad-role.jsonl": (
            json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode() + b"\n",
            "messages",
            "file",
        ),
        "missing-column.jsonl": (b'{"prompt": "a"}\n', "prompt_completion", "file"),
        "null-content.jsonl": (
            json.dumps({"messages": [{"role": "assistant", "content": None}]}).encode() + b"\n",
            "messages",
            "file",
        ),
        "truncated.jsonl": (msg.encode()[:-5] + b"\n", "messages", "file"),
        "bom.jsonl": (b"\xef\xbb\xbf" + msg.encode() + b"\n", "messages", "file"),
        "nul-bytes.jsonl": (b"\x00" * 64 + b"\n", "messages", "file"),
        "fifo.jsonl": (None, "messages", "fifo"),
        "loop.jsonl": (None, "messages", "symlink-loop"),
        "missing.jsonl": (None, "messages", "missing"),
        "data.txt": (b"hello\n", "text", "file"),
        "huge-row.jsonl": (json.dumps({"text": "word " * 2_000_000}).encode() + b"\n", "text", "file"),
        "csv-no-header.csv": (b"", "text", "file"),
        "number-text.jsonl": (b'{"text": 5}\n', "text", "file"),
    }
    return [
        Attempt(f"data {name}", _data(name, content, fmt=fmt, kind=kind))
        for name, (content, fmt, kind) in cases.items()
    ]


# --- output directory attempts ---
def _foreign(tmp: Path) -> list[str]:
    user = tmp / "mine"
    (user / "checkpoints" / "checkpoint-500").mkdir(parents=True)
    for name in (
        "config.json",
        "model.safetensors",
        "metrics.jsonl",
        "summary.json",
        "checkpoints/checkpoint-500/optimizer.pt",
    ):
        (user / name).write_text(name)
    return ["run", str(write(tmp, base_recipe(tmp))), "--output", str(user)]


def _model_copy(tmp: Path, output: str) -> list[str]:
    model = tmp / "model"
    shutil.copytree(TINY, model)
    target = {"model": model, "parent": tmp, "inside": model / "runs" / "x"}[output]
    return ["run", str(write(tmp, base_recipe(tmp, model={"name": str(model)}))), "--output", str(target)]


def _stale_lock(tmp: Path, host: str | None = None, fresh: bool = True) -> list[str]:
    import socket

    run = tmp / "run"
    run.mkdir()
    (run / ".finetune-run.json").write_text("{}")
    (run / ".finetune-node0.lock").write_text(
        json.dumps({"pid": os.getpid() if host else 2**22 + 3, "host": host or socket.gethostname()})
    )
    if not fresh:
        old = time.time() - 3600
        os.utime(run / ".finetune-node0.lock", (old, old))
    return ["run", str(write(tmp, base_recipe(tmp))), "--output", str(run), "--dry-run"]


def _under_a_file(tmp: Path) -> list[str]:
    (tmp / "afile").write_text("x")
    return ["run", str(write(tmp, base_recipe(tmp))), "--output", str(tmp / "afile" / "run"), "--dry-run"]


def _compile_into(tmp: Path) -> list[str]:
    (tmp / "notes").mkdir()
    (tmp / "notes" / "todo.txt").write_text("mine")
    return ["compile", str(write(tmp, base_recipe(tmp))), "-o", str(tmp / "notes")]


def _resume_path(what: str) -> Callable[[Path], list[str]]:
    def setup(tmp: Path) -> list[str]:
        ckpt = tmp / "run" / "checkpoints" / "checkpoint-3"
        ckpt.mkdir(parents=True)
        (tmp / "run" / ".finetune-run.json").write_text("{}")
        if what == "garbage marker":
            (ckpt / "finetune_complete.json").write_text("{not json")
        target = {"missing": str(tmp / "nope"), "garbage marker": str(ckpt), "a file": str(tmp / "recipe.yaml")}
        return ["run", str(write(tmp, base_recipe(tmp))), "--output", str(tmp / "run"), "--resume", target[what]]

    return setup


def _finished_garbage(tmp: Path) -> list[str]:
    run = tmp / "run"
    run.mkdir()
    (run / ".finetune-run.json").write_text("{}")
    (run / "finished.json").write_text("[1, 2")
    (run / "summary.json").write_text("{}")
    return ["run", str(write(tmp, base_recipe(tmp))), "--output", str(run), "--dry-run"]


def _cli(*argv: str) -> Callable[[Path], list[str]]:
    return lambda tmp: [a.format(tmp=tmp, recipe=str(write(tmp, base_recipe(tmp)))) for a in argv]


def output_attempts() -> list[Attempt]:
    return [
        Attempt("output foreign dir", _foreign, expect=(2,)),
        Attempt("output = model dir", lambda t: _model_copy(t, "model"), expect=(2,)),
        Attempt("output = model's parent", lambda t: _model_copy(t, "parent"), expect=(2,)),
        Attempt("output inside model dir", lambda t: _model_copy(t, "inside"), expect=(2,)),
        Attempt("output = data dir", dry_run({}, output="{tmp}"), expect=(2,)),
        Attempt("output = a file", dry_run({}, output="{tmp}/train.jsonl"), expect=(2,)),
        Attempt("output under a file", _under_a_file, expect=(2,)),
        Attempt("output = /", dry_run({}, output="/"), expect=(2,)),
        Attempt("compile into a foreign dir", _compile_into, expect=(2,)),
        Attempt("lock of a dead process", _stale_lock, expect=(0,)),
        Attempt("lock of a live run on another host", lambda t: _stale_lock(t, host="node-7"), expect=(2,)),
        Attempt("lock with a stopped heartbeat", lambda t: _stale_lock(t, host="node-7", fresh=False), expect=(0,)),
        Attempt("garbage finished.json", _finished_garbage, expect=(0,)),
        Attempt("resume from a missing path", _resume_path("missing"), expect=(2,)),
        Attempt("resume from a garbage marker", _resume_path("garbage marker"), expect=(2,)),
        Attempt("resume from a file", _resume_path("a file"), expect=(2,)),
        Attempt("cli --set without =", _cli("validate", "{recipe}", "--set", "train.lr")),
        Attempt("cli --set empty key", _cli("validate", "{recipe}", "--set", ".=1")),
        Attempt("cli --set into a scalar", _cli("validate", "{recipe}", "--set", "train.lr.x=1")),
        Attempt("cli --set unknown", _cli("validate", "{recipe}", "--set", "train.bogus=1")),
        Attempt("cli unknown hardware", _cli("plan", "{recipe}", "--hardware", "nope-9000")),
        Attempt("cli hardware file missing", _cli("plan", "{recipe}", "--hardware", "{tmp}/none.yaml")),
        Attempt("cli recipe missing", _cli("validate", "{tmp}/none.yaml")),
        Attempt("cli recipe is a dir", _cli("validate", "{tmp}")),
        Attempt("cli unknown command", _cli("frobnicate")),
        Attempt("cli merge missing run", _cli("merge", "{tmp}/none", "-o", "{tmp}/out")),
        Attempt(
            "cli node rank single node", _cli("run", "{recipe}", "--output", "{tmp}/r", "--node-rank", "3", "--dry-run")
        ),
        Attempt(
            "cli gpu preset, no gpu", _cli("run", "{recipe}", "--output", "{tmp}/r", "--hardware", "workstation-1x4090")
        ),
        Attempt(
            "cwd is /",
            lambda t: [
                "@cwd=/",
                "validate",
                str(write(t, base_recipe(t, data={"sources": [{"path": str(t / "train.jsonl")}]}))),
            ],
        ),
    ]


# --- attempts that train (subprocess) ---
def _env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FINETUNE_DEBUG"}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=str(ROOT),
        FINETUNE_CACHE_DIR=str(tmp / "cache"),
    )
    return env


def _cli_proc(tmp: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "finetune.cli", *argv],
        cwd=tmp,
        env=_env(tmp),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _finished_run(tmp: Path, **sections) -> tuple[Path, Path]:
    recipe = write(tmp, base_recipe(tmp, **sections))
    done = _cli_proc(tmp, "run", str(recipe), "--output", str(tmp / "run"))
    if done.returncode != 0:
        raise RuntimeError(f"the setup run failed: {done.stderr[-2000:]}")
    return recipe, tmp / "run"


def training_attempts() -> list[Attempt]:
    def rerun(*extra):
        def setup(tmp):
            recipe, run = _finished_run(tmp, output={"save_every": 1})
            return ["@subprocess", "run", str(recipe), "--output", str(run), *extra]

        return setup

    def signal_run(sig: int, times: int):
        def setup(tmp):
            recipe = write(tmp, base_recipe(tmp, train={"max_steps": 400}))
            return ["@signal", str(sig), str(times), "run", str(recipe), "--output", str(tmp / "run")]

        return setup

    return [
        Attempt("train: identical rerun", rerun(), trains=True, expect=(0,)),
        Attempt("train: changed lr rerun", rerun("--set", "train.lr=0.01"), trains=True, expect=(2,)),
        Attempt(
            "train: replaced data rerun",
            lambda t: (
                rerun()(t),
                (t / "train.jsonl").write_text("\n".join(reversed(TRAIN.read_text().splitlines())) + "\n"),
            )[0],
            trains=True,
            expect=(2,),
        ),
        Attempt("train: longer rerun", rerun("--set", "train.max_steps=3"), trains=True, may_change=True, expect=(0,)),
        Attempt("train: Ctrl-C", signal_run(signal.SIGINT, 1), trains=True, expect=(130,)),
        Attempt("train: Ctrl-C twice", signal_run(signal.SIGINT, 2), trains=True, expect=(130,)),
        Attempt("train: SIGHUP", signal_run(signal.SIGHUP, 1), trains=True, expect=(75,)),
        Attempt("train: SIGTERM", signal_run(signal.SIGTERM, 1), trains=True, expect=(75,)),
    ]


def all_attempts(*, full: bool) -> list[Attempt]:
    attempts = recipe_attempts() + data_attempts() + output_attempts()
    return attempts + (training_attempts() if full else [])


def quick_attempts() -> list[Attempt]:
    """A fast, representative subset: every 8th recipe attempt, and every data and output attempt."""
    return recipe_attempts()[::8] + data_attempts()[::2] + output_attempts()[::2]


# --- running ---
def snapshot(root: Path) -> dict[str, str]:
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if (
            path.is_file()
            and not path.is_symlink()
            and "cache" not in rel.parts
            and not (path.name.startswith(".finetune-node") and path.suffix == ".lock")
        ):  # a lock is no data
            out[str(rel)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _in_process(argv: list[str], cwd: Path) -> tuple[int, str]:
    import logging

    from finetune.cli import main

    buf = io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    # a library's log handler made under an earlier (now closed) captured stderr would print a
    # "--- Logging error ---" traceback: an artifact of running many commands in one process
    raise_exceptions, logging.raiseExceptions = logging.raiseExceptions, False
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        os.chdir(here)
        logging.raiseExceptions = raise_exceptions
    return code, buf.getvalue()


def _with_signal(argv: list[str], tmp: Path) -> tuple[int, str]:
    sig, times, argv = int(argv[0]), int(argv[1]), argv[2:]
    proc = subprocess.Popen(
        [sys.executable, "-m", "finetune.cli", *argv],
        cwd=tmp,
        env=_env(tmp),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    metrics = tmp / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= 1:
            break
        time.sleep(0.05)
    for _ in range(times):
        proc.send_signal(sig)
        time.sleep(0.5)
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


def run_attempt(attempt: Attempt, root: Path) -> Outcome:
    tmp = Path(tempfile.mkdtemp(prefix="probe-", dir=root))
    argv = attempt.setup(tmp)
    before = snapshot(tmp)
    before.update({f"<model>/{k}": v for k, v in _model_hashes().items()})
    cwd = tmp
    if argv[0] == "@cwd=/":
        cwd, argv = Path("/"), argv[1:]
    if argv[0] == "@subprocess":
        done = _cli_proc(tmp, *argv[1:])
        code, out = done.returncode, done.stdout + done.stderr
    elif argv[0] == "@signal":
        code, out = _with_signal(argv[1:], tmp)
    else:
        code, out = _in_process(argv, cwd)
    after = snapshot(tmp)
    after.update({f"<model>/{k}": v for k, v in _model_hashes().items()})
    lost = [] if attempt.may_change else [k for k, v in before.items() if after.get(k) != v]
    outcome = Outcome(
        attempt.name,
        code,
        lost=lost,
        traceback="Traceback (most recent call last)" in out,
        internal="internal error" in out,
        tail=out[-1500:],
    )
    outcome.no_fix = code != 0 and "fix:" not in out
    outcome.unexpected = attempt.expect is not None and code not in attempt.expect
    shutil.rmtree(tmp, ignore_errors=True)
    return outcome


def _model_hashes() -> dict[str, str]:
    return {p.name: str(p.stat().st_mtime_ns) + ":" + str(p.stat().st_size) for p in sorted(TINY.iterdir())}


def probe(attempts: list[Attempt], *, root: Path | None = None, verbose: bool = True) -> list[Outcome]:
    os.environ.pop("FINETUNE_DEBUG", None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    root = Path(root or tempfile.mkdtemp(prefix="finetune-probe-"))
    os.environ.setdefault("FINETUNE_CACHE_DIR", str(root / "tokcache"))
    outcomes = []
    for attempt in attempts:
        outcome = run_attempt(attempt, root)
        outcomes.append(outcome)
        if verbose:
            flags = [f for f in ("lost", "traceback", "no_fix", "internal", "unexpected") if getattr(outcome, f)]
            print(
                f"{'ok ' if outcome.ok else 'BAD'} exit {outcome.code:>3}  {attempt.name}"
                + (f"  [{', '.join(flags)}]" if flags else ""),
                flush=True,
            )
            if not outcome.ok:
                print("    " + outcome.tail.replace("\n", "\n    ")[-1200:], flush=True)
    return outcomes


def report(outcomes: list[Outcome]) -> dict:
    nonzero = [o for o in outcomes if o.code != 0]
    return {
        "attempts": len(outcomes),
        "data_lost": sum(bool(o.lost) for o in outcomes),
        "tracebacks": sum(o.traceback for o in outcomes),
        "internal_errors": sum(o.internal for o in outcomes),
        "nonzero_exits": len(nonzero),
        "nonzero_without_fix": sum(o.no_fix for o in outcomes),
        "unexpected_exit_codes": sum(o.unexpected for o in outcomes),
        "bad": [o.name for o in outcomes if not o.ok],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="add the attempts that train (subprocesses)")
    parser.add_argument("--quick", action="store_true", help="the fast subset the test suite runs")
    parser.add_argument("--only", default=None, help="attempts whose name contains this")
    parser.add_argument("--json", default=None, help="write the summary here")
    args = parser.parse_args(argv)
    attempts = quick_attempts() if args.quick else all_attempts(full=args.full)
    if args.only:
        attempts = [a for a in attempts if args.only in a.name]
    summary = report(probe(attempts))
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if not summary["bad"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())

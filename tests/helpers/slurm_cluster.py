"""A one-node Slurm cluster on localhost for tests: slurmctld + slurmd from Debian's slurm-wlm, run
from a generated slurm.conf in a temporary directory (no system configuration is touched).

Authentication: auth/none + cred/none when the installed Slurm ships those plugins (Debian's 22.05
does), otherwise munge: a munged started with its own key and socket in the same directory.
Every reason this cannot work (not root, no apt-get, the install failed, a daemon did not come up)
is returned as a string for pytest.skip, with the daemon's log tail.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel")
APT_TIMEOUT_S = 600
PARTITION = "debug"


def ensure_installed() -> str | None:
    """None when the Slurm binaries are there (installing slurm-wlm with apt-get as root if missing),
    else why not."""
    if all(shutil.which(b) for b in DAEMONS):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "slurm-wlm is not installed, and it cannot be installed here (needs root and apt-get)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "slurm-wlm"]):
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S)
            if proc.returncode != 0:
                return f"`{' '.join(cmd)}` failed: {(proc.stdout + proc.stderr)[-800:]}"
    except subprocess.TimeoutExpired:
        return f"installing slurm-wlm took more than {APT_TIMEOUT_S} s"
    if not all(shutil.which(b) for b in DAEMONS):
        return "slurm-wlm was installed but its commands are not on PATH"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plugin_dir() -> str | None:
    # Debian: /usr/lib/<triplet>/slurm-wlm; source builds: /usr/lib/slurm, /usr/local/lib/slurm
    found = [
        p
        for pattern in (
            "/usr/lib*/*/slurm*/auth_munge.so",
            "/usr/lib*/slurm*/auth_munge.so",
            "/usr/local/lib*/slurm*/auth_munge.so",
        )
        for p in glob.glob(pattern)
    ]
    return str(Path(found[0]).parent) if found else None


class Cluster:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}
        self.node = socket.gethostname().split(".")[0]

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> str | None:
        """Start the daemons; None when the node is idle and takes jobs, else why not."""
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        plugins = _plugin_dir()
        if plugins and Path(plugins, "auth_none.so").is_file() and Path(plugins, "cred_none.so").is_file():
            auth = ["AuthType=auth/none", "CredType=cred/none"]
        else:
            why = self._start_munge()
            if why:
                return why
            auth = ["AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.root / 'munge.socket'}"]
        cpus = os.cpu_count() or 1
        conf = [
            "ClusterName=finetune-test",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            *auth,
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "SchedulerType=sched/builtin",
            "JobRequeue=1",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=2000 State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]
        (self.root / "slurm.conf").write_text("\n".join(conf) + "\n")
        conf_path = str(self.root / "slurm.conf")
        for daemon in ("slurmctld", "slurmd"):
            out = open(self.root / f"{daemon}.out", "wb")
            self.procs.append(
                subprocess.Popen(
                    [daemon, "-D", "-f", conf_path],
                    env=self.env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                break
            state = self.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip()
            if state == "idle":
                return None
            time.sleep(1)
        return "the Slurm daemons did not come up:\n" + self.log_tail()

    def _start_munge(self) -> str | None:
        if not (shutil.which("munged") and shutil.which("mungekey")):
            return "this Slurm has no auth/none plugin and munge is not installed"
        key = self.root / "munge.key"
        subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=False, capture_output=True)
        os.chmod(key, 0o600)
        proc = subprocess.run(
            [
                "munged",
                "--force",
                f"--key-file={key}",
                f"--socket={self.root / 'munge.socket'}",
                f"--pid-file={self.root / 'munged.pid'}",
                f"--log-file={self.root / 'munged.log'}",
                f"--seed-file={self.root / 'munge.seed'}",
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            return f"munged did not start: {proc.stderr[-500:]}"
        return None

    def stop(self) -> None:
        if shutil.which("scancel"):
            self.run("scancel", "--user=root", check=False)
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        pid = self.root / "munged.pid"
        if pid.is_file():
            try:
                os.kill(int(pid.read_text().strip()), 15)
            except (ValueError, OSError):
                pass

    # -- helpers for tests -----------------------------------------------------------------
    def run(self, *cmd: str, check: bool = True, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(cmd), env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=60, check=check, cwd=cwd
        )

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as key -> value."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait(self, condition, *, timeout: float, what: str, every: float = 0.5):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            time.sleep(every)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out"):
            path = self.root / name
            if path.is_file():
                out.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

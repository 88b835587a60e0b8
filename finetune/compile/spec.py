"""LaunchSpec: what `compile` hands to the launcher, and how a node's argv is built.

The spec is also written to RUN_DIR/launch.json so `launch(RUN_DIR)` needs nothing else.
Pure Python: no torch, no accelerate import (the argv names `accelerate launch`; the
launcher runs it with the current interpreter).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from finetune.errors import FinetuneError
from finetune.rundir import JOB_SBATCH, LAUNCH_JSON, LAUNCH_SH

DEFAULT_MAIN_PORT = 29500
# Stand-ins written into per-node commands until the user says where node 0 is.
MAIN_ADDRESS_PLACEHOLDER = "${MAIN_ADDRESS}"
MAIN_PORT_PLACEHOLDER = "${MAIN_PORT}"


@dataclass
class LaunchSpec:
    run_dir: str
    strategy: str
    device: str  # "cuda" | "cpu"
    num_nodes: int
    procs_per_node: int
    world_size: int
    main_port: int  # rendezvous port on node 0 (multi-node); single node picks a free one
    module: str  # the per-rank entry point, `python -m MODULE RESOLVED_RECIPE`
    module_args: list[str]
    config_file: str  # RUN_DIR/accelerate.yaml
    env: dict[str, str] = field(default_factory=dict)  # always set for the launched processes
    # preset settings (NCCL, ...): the caller's environment wins, so a cluster's own
    # NCCL_* (e.g. NCCL_NVLS_ENABLE=0) is kept
    env_defaults: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # name -> absolute path written
    summary: str = ""

    @property
    def multi_node(self) -> bool:
        return self.num_nodes > 1

    def argv(
        self,
        *,
        node_rank: int = 0,
        main_address: str | None = None,
        main_port: int | None = None,
        extra_args: list[str] | tuple = (),
    ) -> list[str]:
        """`accelerate launch ...` for one node; placeholders where the address is unknown."""
        if not 0 <= node_rank < self.num_nodes:
            raise FinetuneError(
                f"node rank {node_rank} is out of range for {self.num_nodes} node(s)",
                hint=f"use a rank between 0 and {self.num_nodes - 1}",
            )
        argv = [
            "accelerate",
            "launch",
            "--config_file",
            self.config_file,
            "--num_processes",
            str(self.world_size),
            "--num_machines",
            str(self.num_nodes),
            "--machine_rank",
            str(node_rank),
        ]
        if self.multi_node:
            port = main_port if main_port is not None else self.main_port
            argv += ["--main_process_ip", main_address or MAIN_ADDRESS_PLACEHOLDER, "--main_process_port", str(port)]
        elif self.world_size > 1:
            # 0 = accelerate picks a free port, so two runs on one machine do not collide
            argv += ["--main_process_port", str(main_port if main_port is not None else 0)]
        if self.device == "cpu" and self.world_size > 1:
            # accelerate's MULTI_CPU config alone starts ONE process unless mpirun is set up;
            # --multi_gpu selects its torchrun launcher, and ACCELERATE_USE_CPU=1 (in env)
            # makes each rank pick gloo on CPU.
            argv.append("--multi_gpu")
        argv += ["-m", self.module, *self.module_args, *extra_args]
        return argv

    def node_argv(self) -> list[list[str]]:
        """Per-node commands with the main address left as a placeholder."""
        return [self.argv(node_rank=k) for k in range(self.num_nodes)]

    def node_instructions(self) -> str:
        """What to run where, for a multi-node run (printed instead of launching)."""
        lines = [
            f"{self.summary}",
            "",
            f"Run one launcher per node ({self.num_nodes} nodes, {self.procs_per_node} "
            f"processes each); node 0 hosts the rendezvous on port {self.main_port}.",
            "MAIN_ADDRESS is node 0's hostname or IP, reachable from every node.",
            "",
        ]
        launch_sh = self.files.get(LAUNCH_SH)
        for k in range(self.num_nodes):
            lines.append(f"# node {k}")
            if launch_sh:
                lines.append(f"NODE_RANK={k} MAIN_ADDRESS=<node-0-host> bash {shlex.quote(launch_sh)}")
            lines.append(
                f"python -m finetune.launch {shlex.quote(self.run_dir)} --node-rank {k} --main-address <node-0-host>"
            )
            lines.append("")
        if JOB_SBATCH in self.files:
            lines.append(f"Slurm: sbatch {shlex.quote(self.files[JOB_SBATCH])}")
        return "\n".join(lines).rstrip() + "\n"

    def to_json(self) -> dict:
        data = asdict(self)
        data["node_argv"] = self.node_argv()  # for readers; recomputed on load
        return data

    @classmethod
    def from_json(cls, data: dict) -> LaunchSpec:
        data = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**data)

    @classmethod
    def load(cls, run_dir: str | Path) -> LaunchSpec:
        path = Path(run_dir) / LAUNCH_JSON
        try:
            return cls.from_json(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise FinetuneError(
                "no compiled launch here", file=str(path), hint="run `finetune compile RECIPE -o RUN_DIR` first"
            ) from None
        except (ValueError, TypeError) as exc:
            raise FinetuneError(
                f"unreadable launch spec: {exc}", file=str(path), hint="recompile the run directory"
            ) from None

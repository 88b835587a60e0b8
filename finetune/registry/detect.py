"""`--hardware auto`: describe the local machine without importing torch.

GPUs come from `nvidia-smi --query-gpu=name,memory.total --format=csv,noheader`; the bandwidths and
peak FLOP/s are borrowed from the registry preset with the same GPU model (the numbers nvidia-smi
cannot tell us), or conservative PCIe defaults for a GPU we have no preset for. No GPU -> `cpu`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

from finetune.registry.schema import HardwarePreset


def query_gpus() -> list[tuple[str, float]]:
    """[(name, memory GiB)] of the local NVIDIA GPUs this process may use; [] when there is no nvidia-smi
    or no GPU. nvidia-smi lists every GPU of the host, so CUDA_VISIBLE_DEVICES narrows the list the way
    CUDA does: `CUDA_VISIBLE_DEVICES=0,1 finetune run ...` on a 4-GPU host plans and launches 2 ranks."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in out.strip().splitlines():
        index, _, rest = line.partition(",")
        uuid, _, name_mem = rest.partition(",")
        for name, gib in parse_nvidia_smi(name_mem):
            rows.append((index.strip(), uuid.strip(), name, gib))
    return visible_gpus(rows, os.environ.get("CUDA_VISIBLE_DEVICES"))


def visible_gpus(rows: list[tuple[str, str, str, float]], visible: str | None) -> list[tuple[str, float]]:
    """The (name, GiB) of `rows` = [(index, uuid, name, GiB)] that CUDA_VISIBLE_DEVICES=`visible` exposes,
    in its order. Like CUDA: indices or (prefixes of) GPU UUIDs, the list ends at the first entry that
    names no GPU, an empty value hides every GPU. MIG instances cannot be told apart from nvidia-smi's
    GPU list, so a value naming them leaves the list unfiltered."""
    if visible is None or "MIG-" in visible:
        return [(name, gib) for _, _, name, gib in rows]
    chosen = []
    for token in (t.strip() for t in visible.split(",")):
        match = next(
            (r for r in rows if token and (token == r[0] or (token.startswith("GPU-") and r[1].startswith(token)))),
            None,
        )
        if match is None:
            break
        chosen.append((match[2], match[3]))
    return chosen


def parse_nvidia_smi(text: str) -> list[tuple[str, float]]:
    """Parse lines like `NVIDIA H100 80GB HBM3, 81559 MiB`."""
    gpus = []
    for line in text.strip().splitlines():
        name, _, mem = line.rpartition(",")
        mem = mem.strip()
        try:
            value = float(mem.split()[0])
        except (ValueError, IndexError):
            continue
        unit = mem.split()[1].lower() if len(mem.split()) > 1 else "mib"
        gib = value / 1024 if unit.startswith("mi") else value
        gpus.append((name.strip(), gib))
    return gpus


def _meminfo_gib(field: str) -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return None


def host_ram_gib() -> float:
    total = _meminfo_gib("MemTotal")
    return 16.0 if total is None else total


def available_ram_gib() -> float | None:
    """What the kernel can give new allocations now without swapping (MemAvailable), None where unknown. Files on a
    RAM disk are not in it: they hold their memory until deleted."""
    return _meminfo_gib("MemAvailable")


def _nvme_path() -> str | None:
    for path in ("/local_nvme", "/mnt/nvme"):
        if os.path.isdir(path) and os.access(path, os.W_OK):
            return path
    return None


# GPU name token -> the preset whose per-GPU numbers (link, peak, PCIe) we borrow
_KNOWN = {
    "h100": "server-8xh100",
    "h200": "server-8xh200",
    "b200": "server-8xb200",
    "4090": "workstation-1x4090",
    "5090": "workstation-1x5090",
    "rtxpro6000": "workstation-4xrtxpro6000",
}


UNKNOWN_GPU_PEAK_TFLOPS = 100.0  # a GPU we have no preset for: slow estimates, never optimistic
# GPUs that NVLink does not join (an unknown card, or cards of different models): NCCL over PCIe through host
# memory, the low end of what the PCIe presets measure (10-20 GB/s)
PCIE_HOST_PATH_GBPS = 10


def _normalize(name: str) -> str:
    return name.lower().replace("nvidia", "").replace("geforce", "").replace(" ", "")


def _borrowed_preset(gpu_name: str) -> HardwarePreset | None:
    """The registry preset whose per-GPU figures apply to `gpu_name` (None: unknown, or a PCIe card of
    an SXM model, to which none of the NVLink numbers apply)."""
    from finetune.registry import get_preset

    norm = _normalize(gpu_name)
    match = next((get_preset(preset) for token, preset in _KNOWN.items() if token in norm), None)
    if match is not None and "pcie" in norm and match.intra_node_link == "nvlink":
        return None
    return match


def peak_bf16_tflops(gpu_name: str) -> float:
    """The dense bf16 peak `--hardware auto` plans with for a card of this name (nvidia-smi's or
    torch.cuda.get_device_name()'s): the figure every MFU is quoted against."""
    match = _borrowed_preset(gpu_name)
    return match.peak_bf16_tflops if match is not None else UNKNOWN_GPU_PEAK_TFLOPS


def synthesize_preset(
    gpus: list[tuple[str, float]], *, ram_gib: float, nvme: str | None = None, cpu_cores: int | None = None
) -> HardwarePreset:
    """A one-node preset for the detected GPUs (pure: testable without a GPU)."""
    from finetune.registry import get_preset

    if not gpus:
        cpu = on_cores(get_preset("cpu"), cpu_cores)
        usable = max(1.0, round(ram_gib * 0.8, 1))
        return cpu.model_copy(update={"name": "cpu", "gpu_memory_gib": usable, "host_ram_gib": round(ram_gib, 1)})
    count = len(gpus)
    # every rank waits for the slowest GPU at each collective, and the plan must fit the smallest: a node of
    # mixed cards is planned as `count` of its slowest card with the smallest card's memory
    name = min((n for n, _ in gpus), key=peak_bf16_tflops)
    mem = min(m for _, m in gpus)
    counts = Counter(n for n, _ in gpus)
    mixed = len(counts) > 1
    match = _borrowed_preset(name)
    # nvidia-smi's total includes a driver reserve we do not get to use
    usable = round(mem - 0.5, 1)
    description = f"detected: {count} x {name}"
    if mixed:
        listed = ", ".join(f"{counts[kind]} x {kind}" for kind in sorted(counts))
        description = (
            f"detected: {listed}; planned as {count} x {name} with {usable:g} GiB each (the slowest, the smallest)"
        )
    base = dict(
        name=f"auto-{count}x{_normalize(name) or 'gpu'}" + ("-mixed" if mixed else ""),
        description=description,
        gpu_model=name,
        vendor="nvidia",
        gpu_memory_gib=usable,
        gpus_per_node=count,
        nodes=1,
        inter_node_fabric="none",
        inter_node_bandwidth_gbps=0,
        host_ram_gib=round(ram_gib, 1),
        nvme_path=nvme,
        nvme_bandwidth_gbps=5.0 if nvme else 0,
        nvme_capacity_gib=None,
        host_cpu_cores=cpu_cores,
    )
    if match is not None:
        base.update(
            # NVLink joins cards of one model only
            intra_node_link=("pcie" if mixed else match.intra_node_link) if count > 1 else "none",
            intra_node_bandwidth_gbps=PCIE_HOST_PATH_GBPS
            if mixed and match.intra_node_link != "pcie"
            else match.intra_node_bandwidth_gbps,
            peak_bf16_tflops=match.peak_bf16_tflops,
            peak_fp32_tflops=match.peak_fp32_tflops,
            gpu_memory_bandwidth_gbps=match.gpu_memory_bandwidth_gbps,
            host_to_device_bandwidth_gbps=match.host_to_device_bandwidth_gbps,
            nccl_env={
                k: v for k, v in match.nccl_env.items() if not k.startswith("NCCL_IB") and k != "NCCL_SOCKET_IFNAME"
            },
        )
        if nvme and match.nvme_path:
            base["nvme_bandwidth_gbps"] = match.nvme_bandwidth_gbps
    else:
        # unknown GPU: assume PCIe without peer-to-peer and a modest peak (slow estimates, never optimistic)
        base.update(
            intra_node_link="pcie" if count > 1 else "none",
            intra_node_bandwidth_gbps=PCIE_HOST_PATH_GBPS,
            peak_bf16_tflops=UNKNOWN_GPU_PEAK_TFLOPS,
            host_to_device_bandwidth_gbps=16,
        )
    return HardwarePreset(**base)


def detect_preset() -> HardwarePreset:
    return synthesize_preset(query_gpus(), ram_gib=host_ram_gib(), nvme=_nvme_path(), cpu_cores=usable_cores())


# fp32 FLOPs one core can issue per second: two 8-lane AVX2 FMA units (32 FLOP a cycle) at ~3 GHz. A peak, as
# the GPU presets' are; what a training step reaches of it is the planner's CPU efficiency.
CPU_FLOPS_PER_CORE = 96e9


def usable_cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def on_cores(cpu: HardwarePreset, cores: int | None) -> HardwarePreset:
    """The CPU preset for a host of `cores` cores: their peak, not a workstation's."""
    if not cores:
        return cpu
    return cpu.model_copy(update={"host_cpu_cores": cores, "peak_bf16_tflops": cores * CPU_FLOPS_PER_CORE / 1e12})

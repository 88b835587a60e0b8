"""`finetune env`: the machine and the stack, copy-paste ready for a bug report.

Versions come from installed package metadata (importlib.metadata), so a broken install still gets a
report. torch is imported only to ask for CUDA and the GPUs it sees. Environment variables are shown by
name for the settings that change behaviour; a variable whose name says it holds a secret is shown as
`set`, never with its value.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

from finetune.plan.types import GIB

STACK = (
    "finetune",
    "torch",
    "transformers",
    "trl",
    "peft",
    "accelerate",
    "datasets",
    "tokenizers",
    "safetensors",
    "huggingface_hub",
    "deepspeed",
    "bitsandbytes",
    "liger-kernel",
    "lm_eval",
    "tensorboard",
    "wandb",
    "mlflow",
    "trackio",
    "pydantic",
)
# settings worth seeing in a report (values shown unless the name looks secret)
ENV_PREFIXES = (
    "CUDA_",
    "NCCL_",
    "HF_",
    "TRANSFORMERS_",
    "ACCELERATE_",
    "WANDB_",
    "MLFLOW_",
    "TRACKIO_",
    "FINETUNE_",
    "SLURM_JOB_ID",
    "OMP_NUM_THREADS",
    "PYTORCH_",
)
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASS", "AUTH", "CREDENTIAL")


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def stack_versions() -> dict[str, str]:
    """{package: version} of the training stack that is installed (for summary.json and the card)."""
    names = ("finetune", "torch", "transformers", "trl", "peft", "accelerate", "datasets", "deepspeed", "bitsandbytes")
    return {name: v for name in names if (v := package_version(name))}


def is_secret(name: str) -> bool:
    upper = name.upper()
    return any(word in upper for word in SECRET_WORDS)


def relevant_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    out = {}
    for name in sorted(environ):
        if name.startswith(ENV_PREFIXES):
            out[name] = "set (value hidden)" if is_secret(name) else environ[name]
    return out


def torch_report() -> dict:
    """CUDA as torch sees it; {} without torch."""
    try:
        import torch
    except ImportError:
        return {}
    info: dict = {"cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if info["cuda_available"]:
        info["gpus"] = [
            f"{torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / GIB:.1f} GiB)"
            for i in range(torch.cuda.device_count())
        ]
        info["bf16_supported"] = torch.cuda.is_bf16_supported()
    return info


def auto_hardware() -> str:
    """What `--hardware auto` plans for on this machine, in one line."""
    from finetune.registry.detect import detect_preset

    p = detect_preset()
    if p.name == "cpu":
        return f"cpu ({p.host_ram_gib:g} GiB host RAM, {p.gpu_memory_gib:g} GiB usable for training)"
    return (
        f"{p.name}: {p.gpus_per_node} x {p.gpu_model}, {p.gpu_memory_gib:g} GiB usable per GPU, "
        f"link {p.intra_node_link}, peak {p.peak_bf16_tflops:g} TFLOP/s bf16, "
        f"host RAM {p.host_ram_gib:g} GiB" + (f", NVMe {p.nvme_path}" if p.nvme_path else "")
    )


def collect() -> dict:
    from finetune.registry.detect import query_gpus

    return {
        "python": f"{sys.version.split()[0]} ({sys.executable})",
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "packages": {name: package_version(name) for name in STACK},
        "nvidia_smi_gpus": [f"{name} ({gib:.1f} GiB)" for name, gib in query_gpus()],
        "torch": torch_report(),
        "hardware_auto": auto_hardware(),
        "environment": relevant_env(),
    }


def render(report: dict) -> str:
    lines = [
        "finetune environment (paste this into a bug report)",
        "",
        f"- python: {report['python']}",
        f"- platform: {report['platform']}",
        f"- CPU cores: {report['cpus']}",
    ]
    for name, version in report["packages"].items():
        lines.append(f"- {name}: {version or 'not installed'}")
    t = report["torch"]
    if t:
        lines.append(
            f"- CUDA available to torch: {t['cuda_available']} (torch built for CUDA "
            f"{t['torch_cuda'] or 'none: CPU build'})"
        )
        for gpu in t.get("gpus", []):
            lines.append(f"  - GPU: {gpu}")
        if "bf16_supported" in t:
            lines.append(f"  - bf16 supported: {t['bf16_supported']}")
    lines.append(f"- nvidia-smi GPUs: {', '.join(report['nvidia_smi_gpus']) or 'none'}")
    lines.append(f"- --hardware auto: {report['hardware_auto']}")
    env = report["environment"]
    lines.append("- environment:" + ("" if env else " no CUDA_/NCCL_/HF_/... settings"))
    lines += [f"  - {k}={v}" for k, v in env.items()]
    return "\n".join(lines)

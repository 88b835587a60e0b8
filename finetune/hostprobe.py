"""This machine's host time a launched kernel, measured: the figure the planner's host floor multiplies its kernel
count by (finetune/plan/host_time.py).

PyTorch runs eagerly, so a micro-batch whose GPU work is short takes as long as the host's Python needs to launch
its kernels, and hosts differ: the calibration rows' hosts took 31 to 63 us a kernel. The probe times the same
code path on a model so small that its GPU work is negligible: the run's own architecture (its config.json, or the
registry's for a `model.arch` key: registry/hfconfig.py) at PROBE_SHAPE's widths, in bf16 with LoRA on the
architecture's adapter targets (fp32 adapters under bf16 autocast, as the Trainer runs them), Liger's kernels where
liger-kernel is installed and patches the family, one forward and backward a micro-batch, at two depths. The
difference of the two depths' times over the difference of the kernels the planner counts for them
(plan/host_time.kernels_per_micro_batch) is the host's time a kernel; the fixed cost of a micro-batch (collate, the
Trainer's Python) cancels. A few seconds on a GPU.

The figure is the family's, not the host's alone: a layer's Python (its modules' calls, autograd's nodes, the
launches of Liger's Triton kernels) differs by family beyond the kernels the planner counts: on the H200 hosts a
Gemma-3 layer took 1.11-1.18x a Llama layer's host time a planned kernel in the same call, Mistral's 0.95-1.08x
(docs/validation.md, thirty-third session).

    python -m finetune.hostprobe                        # a Llama layer's figure, as JSON
    python -m finetune.hostprobe --config config.json   # that model's layer's
    python -m finetune.hostprobe --adapter qlora        # the base in 4 bits: a measurement (the planner probes
                                                        # LoRA layers; scripts/host_launch_costs.py compares them)

Planning for this machine (`--hardware auto`) runs it in a child process when the plan is host-bound
(measured_s_per_kernel; the planner itself never imports torch).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

PROBE_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
}
# the widths PROBE_SHAPE does not name, where a family's config has them: a head, and the experts' widths
PROBE_OPTIONAL_WIDTHS = {"head_dim": 64, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 512}
# config.json keys a probe model leaves out: a checkpoint's quantization, remote code, a multimodal wrapper's towers
PROBE_DROPPED_KEYS = ("quantization_config", "auto_map", "architectures", "vision_config", "audio_config")
# a checkpoint's special tokens lie beyond the probe's vocabulary
PROBE_TOKEN_IDS = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
PROBE_DEPTHS = (2, 10)  # layers: the difference isolates the per-layer launches from the fixed ones
PROBE_TOKENS = 256  # one row a micro-batch: GPU work of microseconds a kernel
PROBE_LORA_R = 16
PROBE_WARMUP = 5
PROBE_ITERATIONS = 10
PROBE_REPEATS = 5  # the median of this many differences between the two depths


@dataclass(frozen=True)
class HostProbe:
    s_per_kernel: float  # the host's time a launched kernel
    family: str  # the probe layer's model_type
    adapter: str  # lora, or qlora: the base's linears in 4 bits as the run loads them
    liger: bool  # whether Liger's kernels ran (the planner counts fewer, larger launches with them)
    seconds_per_layer: float  # a layer's forward and backward, measured
    kernels_per_layer: float  # as the planner counts them
    device_name: str
    torch_version: str


def planned_kernels_per_layer(*, liger: bool, model: dict | None = None, adapter: str = "lora") -> float:
    """The kernels the planner counts for one of the probe model's layers (`model`: a config.json, Llama's by
    default; `adapter` on its architecture's adapter targets, DDP, nothing checkpointed): the difference between the
    two probe depths' counts."""
    from finetune.plan.host_time import kernels_per_micro_batch

    return planned_per_layer(
        lambda job: kernels_per_micro_batch(job, strategy="ddp", checkpointed_layers=0),
        liger=liger,
        config=lambda layers: probe_config(layers, model),
        adapter=adapter,
    )


def planned_per_layer(
    count: Callable, *, liger: bool, config: Callable[[int], dict] | None = None, adapter: str = "lora"
) -> float:
    """What `count(job)` gives for one layer of the probe model (`config(layers)`: probe_config by default): the
    difference between the two probe depths' figures over the layers between them."""
    from finetune.plan.workload import Job
    from finetune.registry import get_preset
    from finetune.registry.families import LIGER_MODEL_TYPES

    config = config or probe_config
    counts = []
    for layers in PROBE_DEPTHS:
        arch = probe_arch(config(layers))
        # the preset does not enter the count
        job = Job(
            arch=arch,
            preset=get_preset("server-8xh100"),
            adapter=adapter,
            lora_r=PROBE_LORA_R,
            lora_targets=tuple(arch.lora_targets),
            liger=liger and arch.family in LIGER_MODEL_TYPES,
        )
        counts.append(count(job))
    return (counts[1] - counts[0]) / (PROBE_DEPTHS[1] - PROBE_DEPTHS[0])


def probe_arch(shape: dict):
    """The planner's ModelArch of a probe model's config.json (`shape`), read as it reads a model's."""
    from finetune.registry.derive import arch_from_config

    with tempfile.TemporaryDirectory(prefix="finetune-hostprobe-") as folder:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(shape), encoding="utf-8")
        return arch_from_config(path, key=f"hostprobe-{shape['num_hidden_layers']}")


def probe_config(layers: int, model: dict | None = None) -> dict:
    """The probe model's config.json at `layers` deep: `model` (a config.json; a multimodal one's text decoder) at
    PROBE_SHAPE's widths with its family's layer otherwise as it is (its norms, biases, windows, experts' count),
    the layers' attention types repeating its own from the first; a Llama layer without `model`."""
    if model is None:
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "num_hidden_layers": layers,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "dtype": "bfloat16",
            **PROBE_SHAPE,
        }
    from transformers import AutoConfig

    from finetune.registry.derive import text_config

    text = {k: v for k, v in text_config(model).items() if k not in PROBE_DROPPED_KEYS}
    types = text.get("layer_types")
    if isinstance(types, list) and types:
        text["layer_types"] = [types[i % len(types)] for i in range(layers)]
    heads, kv_heads = text.get("num_attention_heads"), text.get("num_key_value_heads")
    text.update(PROBE_SHAPE, num_hidden_layers=layers, dtype="bfloat16", **PROBE_TOKEN_IDS)
    if kv_heads is not None and kv_heads == heads:  # ungrouped heads (multi-head, latent attention) stay ungrouped
        text["num_key_value_heads"] = PROBE_SHAPE["num_attention_heads"]
    # through the family's config class: the widths it defaults (a head_dim config.json leaves out) are set too
    config = AutoConfig.for_model(**text)
    for key, width in PROBE_OPTIONAL_WIDTHS.items():
        if getattr(config, key, None):
            setattr(config, key, width)
    return config.to_dict()


def build_probe_model(layers: int, *, liger: bool, device, model: dict | None = None, adapter: str = "lora"):
    """The probe model at `layers` deep on `device` (probe_config), Liger's kernels applied with `liger`, LoRA on its
    adapter targets; with `adapter` qlora its random weights saved and loaded again in 4 bits, as the run loads a
    QLoRA base (train/model.py four_bit_config, the recipe's defaults)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = probe_config(layers, model)
    config = AutoConfig.for_model(**shape)
    network = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if adapter == "qlora":
        from finetune.recipe.schema import AdapterSection
        from finetune.train.model import four_bit_config

        with tempfile.TemporaryDirectory(prefix="finetune-hostprobe-") as folder:
            network.save_pretrained(folder)
            network = AutoModelForCausalLM.from_pretrained(
                folder,
                dtype=torch.bfloat16,
                quantization_config=four_bit_config(AdapterSection(type="qlora")),
                device_map={"": device},
            )
    else:
        network = network.to(device=device)
    network.config.use_cache = False
    if liger:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        from finetune.train.trainers import liger_kernel_config

        # what transformers' Trainer calls for use_liger_kernel, with the run's kernel choices
        _apply_liger_kernel_to_instance(model=network, **liger_kernel_config(config.model_type))
    targets = list(probe_arch(shape).lora_targets)
    lora = LoraConfig(r=PROBE_LORA_R, lora_alpha=2 * PROBE_LORA_R, lora_dropout=0.0, target_modules=targets)
    return get_peft_model(network, lora)


def _micro_batch(model, device):
    """One forward and backward of `model` on a row of PROBE_TOKENS tokens, as a callable."""
    import torch

    tokens = torch.randint(0, PROBE_SHAPE["vocab_size"], (1, PROBE_TOKENS), device=device)
    trained = [p for p in model.parameters() if p.requires_grad]

    def run() -> None:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        for p in trained:
            p.grad = None

    return run


def _timed(run, device, iterations: int) -> float:
    """Seconds a call of `run`, over `iterations` calls from an idle GPU to an idle GPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iterations


def seconds_per_layer(
    build: Callable, device, *, iterations: int = PROBE_ITERATIONS, repeats: int = PROBE_REPEATS
) -> float:
    """A layer's forward and backward on `device`: the models `build(layers)` makes at the two probe depths, timed in
    turn `repeats` times, the median of the differences over the layers between them."""
    import torch

    runs = []
    for layers in PROBE_DEPTHS:
        torch.manual_seed(0)
        run = _micro_batch(build(layers), device)
        for _ in range(PROBE_WARMUP):  # kernels compiled (Liger's Triton), cuBLAS's plans chosen, caches filled
            run()
        runs.append(run)
    differences = [_timed(runs[1], device, iterations) - _timed(runs[0], device, iterations) for _ in range(repeats)]
    return statistics.median(differences) / (PROBE_DEPTHS[1] - PROBE_DEPTHS[0])


def measure(
    device_name: str = "cuda",
    *,
    model: dict | None = None,
    adapter: str = "lora",
    iterations: int = PROBE_ITERATIONS,
    repeats: int = PROBE_REPEATS,
) -> HostProbe:
    """Time the probe on `device_name` (cuda: the current GPU; cpu only exercises the code, its figure is the
    CPU's compute, not a launch cost), of `model`'s layer (a config.json; Llama's by default) with `adapter` (lora;
    qlora: its base in 4 bits, for scripts/host_launch_costs.py). The two depths are timed in turn, `repeats`
    times, and the median of the differences kept: a host whose speed drifts (clocks, a neighbour's load) moves both
    of a pair alike."""
    import torch

    from finetune.registry.families import LIGER_MODEL_TYPES, liger_installed

    family = probe_config(PROBE_DEPTHS[0], model)["model_type"]
    device = torch.device(device_name)
    liger = device.type == "cuda" and liger_installed() and family in LIGER_MODEL_TYPES
    per_layer = seconds_per_layer(
        lambda layers: build_probe_model(layers, liger=liger, device=device, model=model, adapter=adapter),
        device,
        iterations=iterations,
        repeats=repeats,
    )
    kernels = planned_kernels_per_layer(liger=liger, model=model, adapter=adapter)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return HostProbe(
        s_per_kernel=per_layer / kernels,
        family=family,
        adapter=adapter,
        liger=liger,
        seconds_per_layer=per_layer,
        kernels_per_layer=kernels,
        device_name=name,
        torch_version=torch.__version__,
    )


PROBE_TIMEOUT_S = 180  # imports, two tiny models and their timings take 10-30 s on a GPU machine


@lru_cache(maxsize=8)
def measured_s_per_kernel(config: str | None = None) -> float | None:
    """This machine's host time a kernel of the model whose config.json's text is `config` (a Llama layer's
    without), timed on its first visible GPU in a child process (torch stays out of the planner's process), the
    config on its standard input; None when it cannot be measured (no GPU there, the probe failed or timed out).
    Once per process and model."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "finetune.hostprobe", *(["--config", "-"] if config else [])],
            input=config or "",
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
        if done.returncode != 0:
            return None
        figure = json.loads(done.stdout.strip().splitlines()[-1])["s_per_kernel"]
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError):
        return None
    return float(figure) if figure > 0 else None


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m finetune.hostprobe", description=__doc__.splitlines()[0])
    parser.add_argument("device", nargs="?", default="cuda")
    parser.add_argument("--config", help="the run's model's config.json, - for standard input (default: a Llama layer)")
    parser.add_argument("--adapter", choices=("lora", "qlora"), default="lora", help="qlora: the base in 4 bits")
    args = parser.parse_args(argv)
    model = None
    if args.config == "-":
        model = json.loads(sys.stdin.read())
    elif args.config:
        model = json.loads(Path(args.config).read_text(encoding="utf-8"))
    print(json.dumps(asdict(measure(args.device, model=model, adapter=args.adapter))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

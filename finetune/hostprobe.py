"""This machine's host time a launched kernel, measured: the figure the planner's host floor multiplies its kernel
count by (finetune/plan/host_time.py).

PyTorch runs eagerly, so a micro-batch whose GPU work is short takes as long as the host's Python needs to launch
its kernels, and hosts differ: the calibration rows' hosts took 31 to 63 us a kernel. The probe times the same
code path on a model so small that its GPU work is negligible: the run's own architecture (its config.json, or the
registry's for a `model.arch` key: registry/hfconfig.py) at PROBE_SHAPE's widths, in bf16, with the run's layer
settings (ProbeLayer: its adapter and targets through finetune's own LoRA config, a 4-bit base loaded as the run
loads it, lora dropout, checkpointing, a packed row on finetune's varlen attention), fp32 adapters under bf16
autocast as the Trainer runs them, Liger's kernels where the run has them (train.liger), liger-kernel is installed
and patches the family, one forward and backward a micro-batch, at two depths. The difference of the two depths'
times over the difference of the kernels the planner counts for them with the same settings
(plan/host_time.kernels_per_micro_batch) is the host's time a kernel; the fixed cost of a micro-batch (collate,
the Trainer's Python) cancels. A few seconds on a GPU.

The figure is the family's, not the host's alone: a layer's Python (its modules' calls, autograd's nodes, the
launches of Liger's Triton kernels) differs by family beyond the kernels the planner counts: on the H200 hosts a
Gemma-3 layer took 1.11-1.18x a Llama layer's host time a planned kernel in the same call, Mistral's 0.95-1.08x
(docs/validation.md, thirty-third session).

    python -m finetune.hostprobe                        # a LoRA Llama layer's figure, as JSON
    python -m finetune.hostprobe --config config.json   # that model's layer's
    python -m finetune.hostprobe --layer '{"adapter": "qlora", "checkpointing": true}'   # with those settings

Planning for this machine (`--hardware auto`) runs it in a child process when the plan is host-bound, with the
recipe's model and the chosen plan's layer settings (probe_layer, measured_s_per_kernel; the planner itself never
imports torch). scripts/host_launch_costs.py compares settings.
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
PROBE_EXAMPLES = 2  # a packed probe row holds this many examples of equal length


@dataclass(frozen=True)
class ProbeLayer:
    """The run's settings that change the host's work in a layer beyond its family's modules: the probe builds its
    layer with them and the planner counts that layer's kernels with them. The defaults: LoRA on the architecture's
    targets, no dropout, nothing checkpointed, one unpacked row."""

    adapter: str = "lora"  # full | lora | qlora (the base's linears in 4 bits, loaded as the run loads them)
    targets: tuple[str, ...] | None = None  # the adapter's target modules; None: the architecture's
    dropout: float = 0.0  # lora dropout, as trained (plan/workload.py Job.lora_dropout)
    dora: bool = False
    fused_lora: bool = False  # finetune's fused LoRA layer (train/fused_lora.py), as resolved for the run
    fused_lora_groups: bool = False
    cast_adapter_inputs: bool = False  # peft's fp32 cast of each adapter's input (finetune turns it off)
    checkpointing: bool = False  # every layer's forward recomputed in its backward (non-reentrant, as the Trainer's)
    packed: bool = False  # one row of PROBE_EXAMPLES examples with their bounds, on finetune's varlen attention
    liger: bool = True  # the run's Liger kernels (train.liger resolved): run where installed and they patch the family

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ProbeLayer:
        fields = json.loads(text or "{}")
        if fields.get("targets") is not None:
            fields["targets"] = tuple(fields["targets"])
        return cls(**fields)


PLAIN_LORA = ProbeLayer()  # the probe's layer without the run's settings

# a run that checkpoints at least this share of its layers is probed checkpointed (the probe's layers are all alike)
PROBE_CHECKPOINTED_SHARE = 0.5


def probe_layer(job, *, checkpointed_layers: int) -> ProbeLayer:
    """The probe's layer settings for a planned run (`job`: a plan/workload.py Job; `checkpointed_layers` of its
    layers recomputed, as the chosen plan has it)."""
    return ProbeLayer(
        adapter=job.adapter,
        targets=tuple(job.lora_targets),
        dropout=job.lora_dropout,
        dora=job.dora,
        fused_lora=job.fused_lora,
        fused_lora_groups=job.fused_lora_groups,
        cast_adapter_inputs=job.cast_adapter_inputs,
        checkpointing=checkpointed_layers >= PROBE_CHECKPOINTED_SHARE * job.arch.num_layers,
        packed=job.packed and job.attention == "varlen",
        liger=job.liger,
    )


@dataclass(frozen=True)
class HostProbe:
    s_per_kernel: float  # the host's time a launched kernel
    family: str  # the probe layer's model_type
    layer: dict  # its ProbeLayer settings
    liger: bool  # whether Liger's kernels ran (the planner counts fewer, larger launches with them)
    seconds_per_layer: float  # a layer's forward and backward, measured: the median of the repeats'
    repeats_seconds_per_layer: list[float]  # each repeat's (how steady the host was)
    kernels_per_layer: float  # as the planner counts them
    device_name: str
    torch_version: str


def planned_kernels_per_layer(*, liger: bool, model: dict | None = None, layer: ProbeLayer = PLAIN_LORA) -> float:
    """The kernels the planner counts for one of the probe model's layers (`model`: a config.json, Llama's by
    default; with `layer`'s settings, under DDP): the difference between the two probe depths' counts."""
    from finetune.plan.host_time import kernels_per_micro_batch

    return planned_per_layer(
        lambda job, checkpointed: kernels_per_micro_batch(job, strategy="ddp", checkpointed_layers=checkpointed),
        liger=liger,
        config=lambda layers: probe_config(layers, model),
        layer=layer,
    )


def planned_per_layer(
    count: Callable, *, liger: bool, config: Callable[[int], dict] | None = None, layer: ProbeLayer = PLAIN_LORA
) -> float:
    """What `count(job, checkpointed_layers)` gives for one layer of the probe model (`config(layers)`: probe_config
    by default) with `layer`'s settings: the difference between the two probe depths' figures over the layers
    between them."""
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
            adapter=layer.adapter,
            lora_r=PROBE_LORA_R,
            lora_targets=layer.targets or tuple(arch.lora_targets),
            lora_dropout=layer.dropout,
            dora=layer.dora,
            fused_lora=layer.fused_lora,
            fused_lora_groups=layer.fused_lora_groups,
            cast_adapter_inputs=layer.cast_adapter_inputs,
            packed=layer.packed,
            attention="varlen" if layer.packed else "sdpa",
            liger=liger and arch.family in LIGER_MODEL_TYPES,
        )
        counts.append(count(job, layers if layer.checkpointing else 0))
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


def adapter_section(layer: ProbeLayer):
    """The recipe's adapter section of the probe's layer (finetune's training code builds the adapter from it)."""
    from finetune.recipe.schema import AdapterSection

    return AdapterSection(
        type=layer.adapter,
        r=PROBE_LORA_R,
        alpha=2 * PROBE_LORA_R,
        dropout=layer.dropout,
        target_modules=list(layer.targets) if layer.targets else None,
        dora=layer.dora,
        fused_lora=layer.fused_lora,
        fused_lora_groups=layer.fused_lora_groups,
        cast_adapter_inputs=layer.cast_adapter_inputs,
    )


def build_probe_model(layers: int, *, liger: bool, device, model: dict | None = None, layer: ProbeLayer = PLAIN_LORA):
    """The probe model at `layers` deep on `device` (probe_config), Liger's kernels applied with `liger`, with
    `layer`'s settings: a 4-bit base's random weights saved and loaded again as the run loads a QLoRA base
    (train/model.py four_bit_config, the recipe's defaults), the adapter through finetune's LoRA config
    (train/model.py adapter_lora_config: its fused layer, its groups), every layer checkpointed as the Trainer
    turns it on, finetune's varlen attention for a packed row."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.train import attention as varlen

    shape = probe_config(layers, model)
    config = AutoConfig.for_model(**shape)
    attention = {"attn_implementation": varlen.register()} if layer.packed else {}
    network = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, **attention)
    section = adapter_section(layer)
    if section.quantizes_base:
        from finetune.train.model import four_bit_config

        with tempfile.TemporaryDirectory(prefix="finetune-hostprobe-") as folder:
            network.save_pretrained(folder)
            network = AutoModelForCausalLM.from_pretrained(
                folder,
                dtype=torch.bfloat16,
                quantization_config=four_bit_config(section),
                device_map={"": device},
                **attention,
            )
    else:
        network = network.to(device=device)
    network.config.use_cache = False
    if liger:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        from finetune.train.trainers import liger_kernel_config

        # what transformers' Trainer calls for use_liger_kernel, with the run's kernel choices
        _apply_liger_kernel_to_instance(model=network, **liger_kernel_config(config.model_type))
    if layer.checkpointing:
        from finetune.train.checkpointing import enable_checkpointing

        enable_checkpointing(network)
    if layer.packed:
        varlen.skip_packed_row_masks(network)
    if layer.adapter == "full":
        return network.train()
    from peft import get_peft_model

    from finetune.train.model import adapter_lora_config

    peft_model = get_peft_model(
        network, adapter_lora_config(section, network, default_targets=list(probe_arch(shape).lora_targets))
    )
    if section.groups_lora:
        from finetune.train.fused_lora import group_shared_inputs

        group_shared_inputs(peft_model)
    return peft_model.train()


def _micro_batch(model, device, layer: ProbeLayer = PLAIN_LORA):
    """One forward and backward of `model` on a row of PROBE_TOKENS tokens (with `layer.packed`: PROBE_EXAMPLES
    examples and their bounds, as TRL's padding-free collator passes them), as a callable. peft's fp32 cast of the
    adapters' inputs is off unless `layer` keeps it, as the run trains (train/model.py adapter_input_casting)."""
    import torch

    tokens = torch.randint(0, PROBE_SHAPE["vocab_size"], (1, PROBE_TOKENS), device=device)
    trained = [p for p in model.parameters() if p.requires_grad]
    bounds = {}
    if layer.packed:
        length = PROBE_TOKENS // PROBE_EXAMPLES
        cu = torch.arange(0, PROBE_TOKENS + 1, length, dtype=torch.int32, device=device)
        positions = torch.arange(length, device=device).repeat(PROBE_EXAMPLES)[None]
        bounds = {"position_ids": positions, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu}
        bounds |= {"max_length_q": length, "max_length_k": length}
    from finetune.train.model import section_input_casting

    section = adapter_section(layer)  # once: the timed call holds only what a run's micro-batch does

    def run() -> None:
        # the whole micro-batch, as the run trains inside it: a checkpointed layer's recompute is in the backward
        with section_input_casting(section, model, strategy="ddp", autocast=True):
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                loss = model(input_ids=tokens, labels=tokens, **bounds).loss
            loss.backward()
        for p in trained:
            p.grad = None

    return run


def warmed_micro_batch(model, device, layer: ProbeLayer = PLAIN_LORA):
    """_micro_batch, run PROBE_WARMUP times first: kernels compiled (Liger's Triton), cuBLAS's plans chosen, caches
    filled."""
    run = _micro_batch(model, device, layer)
    for _ in range(PROBE_WARMUP):
        run()
    return run


def timed(run, device, iterations: int) -> float:
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


def layer_timings(
    build: Callable,
    device,
    *,
    layer: ProbeLayer = PLAIN_LORA,
    iterations: int = PROBE_ITERATIONS,
    repeats: int = PROBE_REPEATS,
) -> list[float]:
    """A layer's forward and backward on `device`, `repeats` times: the models `build(layers)` makes at the two probe
    depths (with `layer`'s settings), timed in turn, each difference over the layers between them."""
    import torch

    runs = []
    for layers in PROBE_DEPTHS:
        torch.manual_seed(0)
        runs.append(warmed_micro_batch(build(layers), device, layer))
    layers_between = PROBE_DEPTHS[1] - PROBE_DEPTHS[0]
    return [
        (timed(runs[1], device, iterations) - timed(runs[0], device, iterations)) / layers_between
        for _ in range(repeats)
    ]


def probe_liger(device, model: dict | None, layer: ProbeLayer = PLAIN_LORA) -> bool:
    """Whether the probe of `model`'s layer (a config.json; Llama's by default) on `device` runs Liger's kernels: where
    the run has them (`layer.liger`), liger-kernel is installed and they patch the family, on a GPU. A run with
    train.liger off is timed without them: its layer's eager norms, RoPE and activation launch more, smaller kernels,
    which the planner counts, and a probe with Liger's fewer, costlier launches read twice too much a planned kernel
    for Gemma-3-1B without them (docs/validation.md, thirty-sixth session)."""
    from finetune.registry.families import LIGER_MODEL_TYPES, liger_installed

    if not (layer.liger and device.type == "cuda" and liger_installed()):
        return False
    return probe_config(PROBE_DEPTHS[0], model)["model_type"] in LIGER_MODEL_TYPES


def measure(
    device_name: str = "cuda",
    *,
    model: dict | None = None,
    layer: ProbeLayer = PLAIN_LORA,
    iterations: int = PROBE_ITERATIONS,
    repeats: int = PROBE_REPEATS,
) -> HostProbe:
    """Time the probe on `device_name` (cuda: the current GPU; cpu only exercises the code, its figure is the CPU's
    compute, not a launch cost), of `model`'s layer (a config.json; Llama's by default) with `layer`'s settings,
    Liger's kernels among them (probe_liger). The two depths are timed in turn, `repeats` times, and the median of
    the differences kept: a host whose speed drifts (clocks, a neighbour's load) moves both of a pair alike."""
    import torch

    family = probe_config(PROBE_DEPTHS[0], model)["model_type"]
    device = torch.device(device_name)
    liger = probe_liger(device, model, layer)
    timings = layer_timings(
        lambda layers: build_probe_model(layers, liger=liger, device=device, model=model, layer=layer),
        device,
        layer=layer,
        iterations=iterations,
        repeats=repeats,
    )
    per_layer = statistics.median(timings)
    kernels = planned_kernels_per_layer(liger=liger, model=model, layer=layer)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return HostProbe(
        s_per_kernel=per_layer / kernels,
        family=family,
        layer=asdict(layer),
        liger=liger,
        seconds_per_layer=per_layer,
        repeats_seconds_per_layer=timings,
        kernels_per_layer=kernels,
        device_name=name,
        torch_version=torch.__version__,
    )


PROBE_TIMEOUT_S = 180  # imports, two tiny models and their timings take 10-30 s on a GPU machine


@lru_cache(maxsize=8)
def measured_s_per_kernel(config: str | None = None, layer: ProbeLayer = PLAIN_LORA) -> float | None:
    """This machine's host time a kernel of the model whose config.json's text is `config` (a Llama layer's
    without) with `layer`'s settings, timed on its first visible GPU in a child process (torch stays out of the
    planner's process), the config on its standard input; None when it cannot be measured (no GPU there, the probe
    failed or timed out). Once per process, model and settings."""
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "finetune.hostprobe",
                *(["--config", "-"] if config else []),
                *(["--layer", layer.to_json()] if layer != PLAIN_LORA else []),
            ],
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
    parser.add_argument("--layer", default="{}", help="the layer's settings, a JSON object of ProbeLayer's fields")
    args = parser.parse_args(argv)
    model = None
    if args.config == "-":
        model = json.loads(sys.stdin.read())
    elif args.config:
        model = json.loads(Path(args.config).read_text(encoding="utf-8"))
    print(json.dumps(asdict(measure(args.device, model=model, layer=ProbeLayer.from_json(args.layer)))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

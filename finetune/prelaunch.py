"""Checks made in the `finetune` process before a run is launched, for problems that would otherwise
surface as an error inside a rank after minutes of loading: damaged weight files, a model directory
without tokenizer files, a chat template that raises, a model that needs remote code, a GPU preset on a
machine without GPUs, too little free disk for the outputs, and a ZeRO-Infinity swap directory that cannot
be written or has no room for the swapped states.

Torch-free: files are read as bytes and JSON, the template with jinja2 (as transformers renders it).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

from finetune.data.chat_template import read_chat_template
from finetune.errors import DataError, RecipeError
from finetune.plan.choose import HEADROOM
from finetune.plan.memory import keeps_fp32_master
from finetune.plan.types import GIB
from finetune.plan.workload import DTYPE_BYTES
from finetune.recipe.paths import model_path
from finetune.registry.detect import available_ram_gib
from finetune.registry.disk import RAM_FILESYSTEMS, filesystem_type, nearest_existing

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")
SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit
DISK_SLACK_BYTES = 16 * 1024 * 1024  # metrics, logs, tokenizer and config files next to the weights


def local_model_dir(recipe) -> Path | None:
    path = Path(model_path(recipe))
    return path if path.is_dir() else None


def check_safetensors(path: Path) -> None:
    """The header of a .safetensors file parses and its tensors fit in the file (a truncated or empty
    download fails here, not in from_pretrained inside every rank)."""
    size = path.stat().st_size
    fix = "download the model again (or point model.name at a complete copy)"
    if size < 8:
        raise RecipeError(
            f"{path.name} is {'empty' if size == 0 else 'truncated'} ({size} bytes)",
            file=str(path),
            key="model.name",
            hint=fix,
        )
    with path.open("rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        if length > min(SAFETENSORS_MAX_HEADER, size - 8):
            raise RecipeError(
                f"{path.name} is not a valid safetensors file (header length {length} for a {size}-byte file)",
                file=str(path),
                key="model.name",
                hint=fix,
            )
        try:
            header = json.loads(fh.read(length))
        except (ValueError, UnicodeDecodeError):
            raise RecipeError(
                f"{path.name} has an unreadable header", file=str(path), key="model.name", hint=fix
            ) from None
    ends = [
        t["data_offsets"][1]
        for k, t in header.items()
        if k != "__metadata__"
        and isinstance(t, dict)
        and isinstance(t.get("data_offsets"), list)
        and len(t["data_offsets"]) == 2
    ]
    if ends and 8 + length + max(ends) > size:
        raise RecipeError(
            f"{path.name} is truncated: its tensors need {8 + length + max(ends)} bytes, the file has {size}",
            file=str(path),
            key="model.name",
            hint=fix,
        )


def check_model_files(recipe) -> None:
    """A local model directory: weights readable, tokenizer files present, remote code allowed if needed."""
    model_dir = local_model_dir(recipe)
    if model_dir is None:
        return
    if not (model_dir / "config.json").is_file():
        raise RecipeError(
            f"{model_dir} has no config.json, so it is not a model directory",
            key="model.name",
            hint="point model.name at a directory saved with save_pretrained, or a Hub id",
        )
    safetensors = sorted(model_dir.glob("*.safetensors"))
    for weights in safetensors:
        check_safetensors(weights)
    if recipe.model.init == "pretrained" and not safetensors:
        pickled = any(model_dir.glob("*.bin"))
        if pickled and not recipe.model.allow_pickle:
            raise RecipeError(
                f"{model_dir} has only .bin (pickle) weights",
                key="model.allow_pickle",
                hint="set model.allow_pickle: true if you trust them, or convert them to safetensors",
            )
        if not pickled:
            raise RecipeError(
                f"{model_dir} has config.json but no weights (no *.safetensors or *.bin)",
                key="model.name",
                hint="copy the weights there, or set model.init: random for a throughput and memory trial "
                "with random weights",
            )
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise RecipeError(
            f"{model_dir} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)})",
            key="model.name",
            hint="copy the tokenizer files next to the weights "
            "(tokenizer.save_pretrained(DIR)), or use the original model",
        )
    check_remote_code(recipe, model_dir)


def check_remote_code(recipe, model_dir: Path) -> None:
    """A config whose model type transformers does not ship loads only with remote code."""
    if recipe.model.trust_remote_code:
        return
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        raise RecipeError(
            "config.json is not readable JSON",
            file=str(model_dir / "config.json"),
            key="model.name",
            hint="download the model again",
        ) from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(config, dict) or not config.get("auto_map") or not isinstance(model_type, str):
        return
    import importlib.util

    spec = importlib.util.find_spec("transformers")  # its location, without importing it (and torch)
    root = Path(spec.origin).parent / "models" if spec and spec.origin else None
    if root is not None and not (root / model_type.replace("-", "_")).is_dir():
        raise RecipeError(
            f"the model type {model_type!r} is not part of transformers: this model runs its own "
            f"Python code ({', '.join(config['auto_map'])})",
            key="model.trust_remote_code",
            hint="read that code, then set model.trust_remote_code: true if you trust it",
        )


def template_text(recipe) -> str | None:
    """The chat template the ranks will use: data.chat_template, else the local model's own."""
    text = read_chat_template(recipe)
    model_dir = local_model_dir(recipe)
    if text is not None or model_dir is None:
        return text
    if (model_dir / "chat_template.jinja").is_file():
        return (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    return template if isinstance(template, str) else None


def chat_renderer(text: str):
    """A function messages -> str rendering the chat template `text` as transformers does (sandboxed
    jinja2 with raise_exception, {% generation %} markers, trim_blocks and lstrip_blocks); keyword
    arguments go to the template (bos_token, add_generation_prompt, ...). None without jinja2."""
    try:
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None

    class Generation(Extension):
        """{% generation %}...{% endgeneration %} (transformers' assistant-mask markers): render the body."""

        tags = {"generation"}  # noqa: RUF012 (jinja2's Extension API)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, "jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(text)

    def render(messages, **kwargs) -> str:
        return template.render(messages=messages, **kwargs)

    return render


def check_chat_template(recipe, first: dict | None) -> None:
    """Render the chat template on the first conversation, as transformers does (sandboxed jinja2 with
    raise_exception), so a template that raises is reported with the file and row."""
    if not first or "messages" not in first:
        return
    text = template_text(recipe)
    if not text:
        return
    key = "data.chat_template" if recipe.data.chat_template else "model.name"
    try:
        render = chat_renderer(text)
        if render is None:
            return
        render(first["messages"], add_generation_prompt=False, bos_token="", eos_token="", pad_token="", unk_token="")
    except Exception as exc:  # jinja syntax errors, raise_exception, undefined filters: the template's fault
        raise DataError(
            f"row {first.get('_row', 1)}: the chat template fails on this conversation: {type(exc).__name__}: {exc}",
            file=first.get("_file"),
            key=key,
            hint="fix the template (data.chat_template: jinja text or a .jinja file), or the row it rejects",
        ) from None


def check_devices(spec) -> None:
    """A GPU preset needs local GPUs (checked only when this machine launches the ranks)."""
    if spec.device != "cuda":
        return
    from finetune.registry.detect import query_gpus

    if not query_gpus():
        raise RecipeError(
            f"the plan runs {spec.world_size} CUDA process(es) ({spec.strategy}), and this machine "
            f"has no NVIDIA GPU (nvidia-smi lists none)",
            key="hardware",
            hint="run on a GPU machine, or use --hardware cpu (or auto) here",
        )


# the packages transformers' flash attention implementations load (it imports them only inside from_pretrained)
ATTENTION_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def check_attention_package(resolved) -> None:
    """model.attn_implementation flash_attention_2/3 needs its package where the ranks run (checked only when this
    machine launches them): without it from_pretrained fails in every rank after the data is tokenized."""
    import importlib.util

    implementation = resolved.model.attn_implementation
    package = ATTENTION_PACKAGES.get(implementation)
    if package is None or importlib.util.find_spec(package) is not None:
        return
    raise RecipeError(
        f"{implementation} needs the {package} package, which is not installed here",
        key="model.attn_implementation",
        hint=f"install it (pip install {'flash-attn' if package == 'flash_attn' else 'flash-attn-3'}), or set "
        "model.attn_implementation: auto (finetune's varlen flash kernel from torch, no extra package)",
    )


def output_bytes(plan, recipe) -> tuple[int, int]:
    """(final save, one checkpoint) in bytes, from the planner's parameter counts: the final model is
    the trained weights (the adapter, or the whole model); a checkpoint adds fp32 Adam moments, and a full
    fine-tune's fp32 master weights where its strategy keeps them (FSDP2, DeepSpeed)."""
    total = float(getattr(plan, "total_params", 0) or 0)
    trainable = float(getattr(plan, "trainable_params", 0) or 0)
    weights = trainable * 4 if recipe.adapter.type != "full" else total * DTYPE_BYTES.get(recipe.model.dtype, 2)
    masters = recipe.adapter.type == "full" and keeps_fp32_master(getattr(plan, "strategy", None))
    return int(weights), int(weights + trainable * (8 + (4 if masters else 0)))


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(nearest_existing(path)).free


def check_disk(run_dir: Path, *, plan, recipe) -> None:
    """Refuse a launch whose outputs cannot fit on RUN_DIR's filesystem (exit 2, nothing written); on a RAM
    disk, also one whose outputs and the run's own host RAM at its peak exceed the memory the host has free."""
    final, ckpt = output_bytes(plan, recipe)
    need = final + (ckpt if recipe.output.save_every else 0) + DISK_SLACK_BYTES
    free = free_bytes(run_dir)
    if free < need:
        raise RecipeError(
            f"not enough free disk for this run's outputs in {run_dir}: {free / 2**20:.0f} MiB free, "
            f"about {need / 2**20:.0f} MiB needed (final weights"
            f"{' and a checkpoint' if recipe.output.save_every else ''} plus logs)",
            key="output.dir",
            hint="free disk space there, or pass --output on a disk with room",
        )
    kind = filesystem_type(run_dir)
    available = available_ram_gib()
    if kind not in RAM_FILESYSTEMS or available is None:
        return
    # a RAM disk's files take the host's memory, beside what the ranks hold at their peak (the final save's gather)
    host = float(getattr(plan, "host_ram_gib", 0) or 0) * GIB
    if need + host > HEADROOM * available * GIB:
        raise RecipeError(
            f"{run_dir} is in RAM ({kind}): this run's outputs (about {need / GIB:.1f} GiB) and its processes' host "
            f"RAM at their peak ({host / GIB:.1f} GiB, the final save included) need {(need + host) / GIB:.1f} GiB, "
            f"and the host has {available:.1f} GiB available ({HEADROOM:.0%} of it usable)",
            key="output.dir",
            hint="pass --output on a disk: a RAM disk's files hold the host's memory until they are deleted",
        )


def check_swap_disk(plan, recipe) -> None:
    """ZeRO-Infinity writes the model's states to distributed.nvme_path while partitioning it, after the model
    has loaded: refuse a launch whose swap directory cannot be made and written, or has less free disk than
    the plan swaps there (exit 2, nothing written)."""
    from finetune import strategies

    if strategies.info(plan.strategy).offload != "nvme":
        return
    path = Path(recipe.distributed.nvme_path).expanduser().absolute()
    parent = nearest_existing(path)  # DeepSpeed makes the rest
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        why = "is a file" if not parent.is_dir() else "is not writable by this user"
        raise RecipeError(
            f"distributed.nvme_path: {path} cannot be made ({parent} {why}); ZeRO-Infinity would fail there "
            "after loading the model",
            key="distributed.nvme_path",
            hint="point it at a writable directory on a local NVMe disk",
        )
    need = plan.chosen.nvme_bytes + DISK_SLACK_BYTES
    free = free_bytes(parent)
    if free < need:
        raise RecipeError(
            f"not enough free disk for ZeRO-Infinity's swap files in {path}: {free / GIB:.1f} GiB free, "
            f"{need / GIB:.1f} GiB needed (the parameters and optimizer states this node swaps there)",
            key="distributed.nvme_path",
            hint="free disk space there, or point distributed.nvme_path at a disk with room",
        )


def rescue_dir(run_dir: Path) -> Path:
    """Where a final save goes when RUN_DIR's disk is full ($FINETUNE_RESCUE_DIR, else the temp dir)."""
    import tempfile

    from finetune.rundir import RESCUE_ENV

    root = Path(os.environ.get(RESCUE_ENV) or tempfile.gettempdir())
    return root / f"finetune-rescue-{Path(run_dir).name}-{os.getpid()}"

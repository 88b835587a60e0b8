"""The launch files a peer config names (DeepSpeed JSON, accelerate YAML) and axolotl's FSDP keys ->
distributed.strategy, a name from finetune/strategies.py chosen by what the strategy does."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from finetune import strategies
from finetune.peers import Conversion, read_mapping
from finetune.peers.common import find_file, is_on, no_mixed_precision


def strategy_for(
    *,
    backend: str,
    stage: int = 0,
    offload_params: bool = False,
    offload_optimizer: bool = False,
    nvme: bool = False,
    hybrid: bool = False,
) -> str | None:
    """The finetune strategy (finetune/strategies.py) with these properties, or None when there is no such tier."""
    offload = "nvme" if nvme else "cpu" if (offload_params or offload_optimizer) else "none"
    for name in strategies.NAMES:
        s = strategies.info(name)
        if (s.backend, s.hybrid, s.offload, s.offload_params, s.offload_optimizer) != (
            backend,
            hybrid,
            offload,
            offload_params and offload != "none",
            offload_optimizer and offload != "none",
        ):
            continue
        if backend != "deepspeed" or s.zero_stage == stage:
            return name
    return None


def _pin(conv: Conversion, key: str, value: Any, name: str | None, *, what: str) -> None:
    """Pin distributed.strategy to `name`, or say which tier is missing (not material: a strategy moves states
    between GPUs, host and disk; the planner says where an offloaded optimizer runs as CPU Adam)."""
    if name is not None and strategies.offloads_quantized_weights(name, adapter=str(conv.get("adapter.type", ""))):
        # a peer's FSDP1 or ZeRO-3 parameter offload of QLoRA's 4-bit weights: finetune's tiers keep them on the
        # GPUs (sharded) and still offload the optimizer where the peer did and a tier does
        tier = strategies.info(name)
        kept = strategy_for(
            backend=tier.backend, stage=tier.zero_stage, offload_optimizer=tier.offload_optimizer, hybrid=tier.hybrid
        ) or strategy_for(backend=tier.backend, stage=tier.zero_stage, hybrid=tier.hybrid)
        conv.notes.append(
            f"{key}: parameter offload is not carried over under QLoRA ({strategies.QUANTIZED_OFFLOAD_REFUSAL}): "
            f"{kept} instead of {name}"
        )
        name, what = kept, what.replace("with parameter offload", "without parameter offload")
    if name is None:
        conv.drop(
            key,
            value,
            f"{what} has no tier here (finetune's: {', '.join(strategies.NAMES)}); leave "
            "distributed.strategy: auto and the planner picks one that fits",
            material=False,
        )
        return
    conv.set("distributed.strategy", name)
    conv.notes.append(f"{key}: {what} pinned as distributed.strategy {name}; set it to auto to let the planner choose")


# LLaMA-Factory's and the handbooks' stock DeepSpeed file names, read when the file itself is not here
# (their configs name it relative to the tool's own checkout)
_DS_NAMES = (
    (re.compile(r"z(ero)?_?3.*nvme"), (3, True, True, True)),
    (re.compile(r"z(ero)?_?3.*partial"), (3, False, True, False)),
    (re.compile(r"z(ero)?_?3.*offload_?params?\b"), (3, True, False, False)),
    (re.compile(r"z(ero)?_?3.*offload"), (3, True, True, False)),
    (re.compile(r"z(ero)?_?3"), (3, False, False, False)),
    (re.compile(r"z(ero)?_?2.*offload"), (2, False, True, False)),
    (re.compile(r"z(ero)?_?2"), (2, False, False, False)),
    (re.compile(r"z(ero)?_?1"), (1, False, False, False)),
    (re.compile(r"z(ero)?_?0"), (0, False, False, False)),
)


def _deepspeed_strategy(stage: int, *, params: bool, optimizer: bool, nvme: bool) -> tuple[str | None, str]:
    what = f"DeepSpeed ZeRO-{stage}" + (
        " with NVMe offload"
        if nvme
        else " with parameter offload"
        if params
        else " with optimizer offload"
        if optimizer
        else ""
    )
    if stage == 0:
        return "ddp", what
    if stage == 1 and not (params or optimizer):  # ZeRO-1 shards the optimizer; ZeRO-2 adds the gradients
        return "zero2", what
    if stage == 3 and params and not optimizer and not nvme:  # no params-only tier: the optimizer goes too
        return "zero3-offload", what + (
            " (read as parameters and optimizer offloaded: the optimizer step then runs on the host as DeepSpeed's "
            "CPU AdamW, in place of the config's optimizer on the GPUs)"
        )
    return strategy_for(
        backend="deepspeed", stage=stage, offload_params=params, offload_optimizer=optimizer, nvme=nvme
    ), what


def deepspeed_file(conv: Conversion, key: str) -> None:
    """A DeepSpeed JSON file (or an inline mapping) -> distributed.strategy."""
    value = conv.take(key)
    if value is not None:
        _deepspeed(conv, key, value, base=None)


def _deepspeed(conv: Conversion, key: str, value: Any, *, base: Path | None) -> None:
    if isinstance(value, dict):
        config = value
    else:
        path = find_file(conv, str(value), base=base)
        if path is None:
            known = next((v for pattern, v in _DS_NAMES if pattern.search(Path(str(value)).name.lower())), None)
            if known is None:
                conv.drop(
                    key,
                    value,
                    "DeepSpeed file not found; the planner picks the strategy (distributed.strategy: auto)",
                    material=False,
                )
                return
            stage, params, optimizer, nvme = known
            name, what = _deepspeed_strategy(stage, params=params, optimizer=optimizer, nvme=nvme)
            _pin(conv, key, value, name, what=f"{what} (from the file name; the file is not here)")
            return
        config = read_mapping(path, what="DeepSpeed config")
    zero = config.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0) or 0)
    devices = {k: (zero.get(k) or {}).get("device") or "none" for k in ("offload_optimizer", "offload_param")}
    nvme = "nvme" in devices.values()
    name, what = _deepspeed_strategy(
        stage,
        params=devices["offload_param"] != "none",
        optimizer=devices["offload_optimizer"] != "none",
        nvme=nvme,
    )
    _pin(conv, key, value, name, what=what)
    _deepspeed_optimizer(conv, key, config)
    nvme_path = (zero.get("offload_param") or zero.get("offload_optimizer") or {}).get("nvme_path")
    if name and nvme and nvme_path:
        conv.set("distributed.nvme_path", nvme_path)


# DeepSpeed's optimizer types that run AdamW (its Adam does unless adam_w_mode is false: engine.py)
DEEPSPEED_ADAMW = ("adam", "adamw")


def _deepspeed_optimizer(conv: Conversion, key: str, config: dict) -> None:
    """A DeepSpeed file's optimizer / scheduler block: under the HF Trainer it replaces the config's optim /
    lr_scheduler_type (its "auto" values are filled from the config). AdamW maps; anything else is reported."""
    block = config.get("optimizer")
    if isinstance(block, dict):
        kind = str(block.get("type", ""))
        params = block.get("params") or {}
        if kind.lower() in DEEPSPEED_ADAMW and params.get("adam_w_mode", True) is not False:
            before = conv.get("train.optimizer")
            conv.set("train.optimizer", "adamw")
            conv.notes.append(
                f"{key}: its optimizer block ({kind}) replaces the config's optimizer under DeepSpeed: train.optimizer "
                "adamw" + (f" instead of {before}" if before not in (None, "adamw") else "")
            )
        else:
            conv.drop(
                f"{key}.optimizer",
                block,
                f"DeepSpeed's {kind or 'untyped'} optimizer (it replaces the config's) is not offered; finetune runs "
                "train.optimizer (adamw, adamw_8bit, adafactor, ...): pick the nearest, or remove the block",
            )
    if isinstance(config.get("scheduler"), dict):
        conv.drop(
            f"{key}.scheduler",
            config["scheduler"],
            "DeepSpeed's scheduler block replaces the config's lr_scheduler there; set train.scheduler (and warmup) "
            "to the nearest schedule, or remove the block",
        )


def fsdp_strategy(conv: Conversion, key: str, config: dict, *, flags: list | None = None) -> None:
    """accelerate/axolotl FSDP settings (v1 `fsdp_*` keys or v2 bare keys, and axolotl's `fsdp:` list) ->
    distributed.strategy: fsdp2, fsdp2-offload or fsdp2-hybrid."""

    if not isinstance(config, dict):
        conv.drop(key, config, "must be a mapping of FSDP settings; the planner picks the strategy", material=False)
        config = {}

    def get(name: str) -> Any:
        return config.get(f"fsdp_{name}", config.get(name))

    words = {str(f).lower() for f in (flags or [])}
    sharding = str(get("sharding_strategy") or "").upper()
    hybrid = "HYBRID" in sharding or "hybrid_shard" in words
    offload = is_on(get("offload_params")) or "offload" in words
    if sharding in ("NO_SHARD", "SHARD_GRAD_OP") or words & {"shard_grad_op", "no_shard"}:
        conv.notes.append(f"{key}: FSDP {sharding or 'shard_grad_op'} is read as a full shard (fsdp2)")
    name = strategy_for(backend="fsdp", offload_params=offload, offload_optimizer=offload, hybrid=hybrid)
    what = "FSDP" + (" hybrid shard" if hybrid else "") + (" with parameter offload" if offload else "")
    _pin(conv, key, config or flags, name, what=what)
    if is_on(get("activation_checkpointing")):
        conv.set("train.activation_checkpointing", "on")


# model-parallel degrees the peers take (axolotl's top-level keys, accelerate's parallelism_config) -> what they
# split; 1 asks for nothing. finetune has data parallelism only (every strategy shards over the data ranks).
MODEL_PARALLEL = {
    "tensor_parallel_size": "tensor",
    "context_parallel_size": "context",
    "sequence_parallel_degree": "sequence",
    "expert_parallel_size": "expert",
    "parallelism_config_tp_size": "tensor",
    "parallelism_config_cp_size": "context",
    "parallelism_config_sp_size": "sequence",
}
# the model-parallel kinds whose group of GPUs trains on one batch (expert parallelism is carved out of the data ranks)
BATCH_SHARING = ("tensor", "context", "sequence")
# data-parallel layouts: the planner picks them (fsdp2-hybrid replicates across nodes)
DATA_PARALLEL = (
    "dp_shard_size",
    "dp_replicate_size",
    "parallelism_config_dp_shard_size",
    "parallelism_config_dp_replicate_size",
)


def parallel_sizes(conv: Conversion, sizes: dict[str, Any], *, where: str = "") -> None:
    """Model-parallel degrees above 1 are reported (material: they change what fits and how long sequences
    are split); data-parallel layouts are the planner's. `where` prefixes a nested key (accelerate files).
    Run after the global batch is read: the GPUs of one tensor/context/sequence group share each batch."""
    sharing = 1
    for name, value in sizes.items():
        if name not in MODEL_PARALLEL and name not in DATA_PARALLEL:
            continue
        if not where:
            conv.used.add(name)
        if value in (None, 1, "1"):
            continue
        if name in DATA_PARALLEL:
            conv.drop(
                where + name,
                value,
                "the planner lays out the data-parallel ranks (distributed.strategy: auto; fsdp2-hybrid "
                "replicates across nodes)",
                material=False,
            )
        else:
            conv.drop(
                where + name,
                value,
                f"{MODEL_PARALLEL[name]} parallelism is not offered: finetune shards over data-parallel ranks "
                "(distributed.strategy) and fits long sequences with activation checkpointing; remove it and "
                "let `finetune plan` pick, or lower data.max_length",
            )
            if MODEL_PARALLEL[name] in BATCH_SHARING and isinstance(value, int) and not isinstance(value, bool):
                sharing *= value
    _data_parallel_batch(conv, sharing)


def _data_parallel_batch(conv: Conversion, sharing: int) -> None:
    """The peer's global batch is micro x accumulation x its data-parallel ranks: its GPUs over the `sharing` ones
    of a tensor/context/sequence group, which all train on the same rows."""
    batch = conv.get("train.global_batch_size")
    if sharing <= 1 or not isinstance(batch, int):
        return
    if not conv.gpus:  # the one-GPU batch stands; the count to multiply it by is the data-parallel ranks'
        note = (
            f"train.global_batch_size is the batch of ONE data-parallel rank: the model-parallel degrees ({sharing}) "
            f"have that many GPUs share each batch, so multiply it by your GPU count / {sharing}, not by the GPU "
            "count, for the same effective batch (convert --gpus N does)"
        )
        if conv.one_gpu_batch_note is None:
            conv.notes.append(note)
        else:  # in place of the one-GPU note, which says to multiply by the GPU count
            conv.notes[conv.one_gpu_batch_note] = note
        return
    if conv.gpus % sharing:
        conv.notes.append(
            f"train.global_batch_size {batch} counts all {conv.gpus} GPUs; the model-parallel degrees ({sharing}) "
            "do not divide them, so set it to the batch the run trained on by hand"
        )
        return
    conv.set("train.global_batch_size", batch // sharing)
    conv.notes.append(
        f"train.global_batch_size {batch // sharing}: the {conv.gpus} GPUs are {conv.gpus // sharing} data-parallel "
        f"ranks, as the {sharing} GPUs of each model-parallel group share one batch"
    )


# accelerate's mixed_precision -> train.precision (fp8 has none: reported)
ACCELERATE_PRECISION = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


def _mixed_precision(conv: Conversion, key: str, config: dict, *, precision: str | None) -> None:
    """An accelerate file's mixed_precision (with fp8_config and downcast_bf16). transformers' TrainingArguments
    hands the Accelerator the training config's own bf16/fp16 when either is on (`precision`), over the file's
    value; only when both are off (`precision` None) does the file decide."""
    mode = str(config.get("mixed_precision") or "no").lower()
    if config.get("downcast_bf16") not in (None, False, "no", "false"):
        conv.drop(
            f"{key}.downcast_bf16",
            config["downcast_bf16"],
            "a TPU setting (XLA_DOWNCAST_BF16); on GPUs it does nothing",
            material=False,
        )
    if config.get("fp8_config"):
        conv.drop(f"{key}.fp8_config", config["fp8_config"], "fp8 settings (see mixed_precision)", material=False)
    if precision is not None:
        if mode not in ("no", precision):
            conv.drop(
                f"{key}.mixed_precision",
                mode,
                f"the training config's {precision} (TRL's bf16 is on unless fp16 is) sets the Accelerator's mixed "
                f"precision over the file's (transformers' TrainingArguments), so the peer trains in {precision}, "
                "as the recipe does",
                material=False,
            )
        return
    if mode == "no":
        no_mixed_precision(
            conv,
            dtype=conv.get("model.dtype") or "float32",
            why=f"{key}'s mixed_precision is no and the config's bf16 and fp16 are off",
        )
    elif mode in ACCELERATE_PRECISION:
        conv.set("train.precision", ACCELERATE_PRECISION[mode])
        if mode == "fp16" and not conv.get("model.dtype"):
            conv.set("model.dtype", "float16")  # as for a config's own fp16 (shared_keys)
        conv.notes.append(
            f"{key}: mixed_precision {mode} -> train.precision {mode} (the config's bf16 and fp16 are off, so the "
            "accelerate file decides)"
        )
    else:
        conv.drop(
            f"{key}.mixed_precision",
            mode,
            f"{mode} training (accelerate's Transformer Engine, MS-AMP or torchao for fp8) is not offered: finetune "
            "trains in bf16, fp16 or fp32 (train.precision); set train.precision: bf16 for the nearest",
        )


def accelerate_file(conv: Conversion, key: str, *, precision: str | None = "bf16") -> None:
    """An accelerate config file -> distributed.strategy (its DeepSpeed part through deepspeed_file), and its
    mixed precision where the training config leaves that to it (`precision` None; else the config's own)."""
    value = conv.take(key)
    if value is None:
        return
    named = {
        "zero2": "zero2",
        "zero3": "zero3",
        "zero3_offload": "zero3-offload",
        "fsdp2": "fsdp2",
        "fsdp": "fsdp2",
        "multi_gpu": "ddp",
        "ddp": "ddp",
    }
    if str(value) in named:  # TRL's shipped accelerate configs, named by their file stem
        conv.set("distributed.strategy", named[str(value)])
        return
    path = find_file(conv, str(value))
    if path is None:
        conv.drop(key, value, "accelerate file not found; the planner picks the strategy", material=False)
        return
    config = read_mapping(path, what="accelerate config")
    _mixed_precision(conv, key, config, precision=precision)
    kind = str(config.get("distributed_type", "")).upper()
    if kind == "DEEPSPEED":
        ds = config.get("deepspeed_config") or {}
        inline = {
            "zero_optimization": {
                "stage": ds.get("zero_stage", 0),
                "offload_optimizer": {"device": ds.get("offload_optimizer_device", "none")},
                "offload_param": {"device": ds.get("offload_param_device", "none")},
            }
        }
        _deepspeed(conv, key, ds.get("deepspeed_config_file") or inline, base=path.parent)
    elif kind == "FSDP":
        fsdp_strategy(conv, key, config.get("fsdp_config") or {})
    elif kind == "MULTI_GPU":
        conv.set("distributed.strategy", "ddp")
    if isinstance(config.get("parallelism_config"), dict):
        parallel_sizes(conv, config["parallelism_config"], where=f"{key}.parallelism_config.")
    if config.get("num_processes"):
        conv.notes.append(
            f"{key}: num_processes {config['num_processes']} is not carried over; pick the machine with "
            "--hardware (a preset), which sets the GPU count"
        )

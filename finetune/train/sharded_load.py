"""LoRA and QLoRA under FSDP2 loaded straight into each rank's shard: no rank ever holds the whole model.

Without this, a 70B under FSDP2 reaches its first step the slow way. For QLoRA, `from_pretrained` with a
BitsAndBytesConfig quantizes the whole model onto every rank's GPU (transformers does not load quantized
models on the meta device on non-main ranks) before accelerate shards it: 35 GB per GPU while loading. For
bf16 LoRA, accelerate's cpu_ram_efficient_loading has rank 0 read the whole model into host RAM and send
every full tensor to the other ranks: about 340 s on 4 H100s for a 70B, paid again on every resume. Here
each rank instead

1. builds the model on the meta device from its config (for QLoRA, transformers' bitsandbytes quantizer
   swaps nn.Linear for bnb Linear4bit (`preprocess_model`) and each 4-bit weight gets the packed shape
   bitsandbytes' own fake kernel computes) and injects the LoRA adapter with peft (initialised by peft,
   seeded by train.seed, identically on every rank);
2. shards it with `fully_shard` exactly as accelerate's `fsdp2_prepare_model` would (its wrap policy, the
   decoder layers, the embedding/tail groups, the root; the plugin's reshard, mixed-precision and offload
   settings; the hybrid mesh from accelerate's ParallelismConfig), its trainable weights in the dtype
   accelerate would give them;
3. allocates only its shards (`to_empty`) and fills them one tensor at a time from the safetensors
   shards, reading only its own rows. A 4-bit weight is the exception: it is read whole, quantized on the
   rank's device by bitsandbytes' Params4bit, and only this rank's rows of the packed storage are kept;
   its quant_state (absmax, small) stays on the Linear4bit module, where bitsandbytes recovers it after
   FSDP's all-gather (`fix_4bit_weight_quant_state_from_module`). With model.init: random no checkpoint is
   read: each tensor is initialised whole by the model's own `_init_weights`, alike on every rank
   (RandomSource), and then treated as a read one.

accelerate's `fsdp2_prepare_model` returns an FSDPModule unchanged, so the Trainer trains this model as
it trains the one it would have sharded itself; its FSDP plugin is only told that nothing is left to wrap
(`trainer_plugin_args`). The quant states are replicated: with double quantization about 3% of the 4-bit
bytes (the absmax of every 64 weights in 8 bits), as under the whole-model path.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

from finetune import strategies
from finetune.compile.accelerate import MIXED_PRECISION
from finetune.plan.types import GIB
from finetune.recipe.schema import Recipe

log = logging.getLogger("finetune.train")

ADAPTER = "default"  # peft's adapter name, the one TRL trains


def applies(recipe: Recipe) -> bool:
    """distributed.sharded_load on, trained under an FSDP2 strategy on GPUs: the case whose loading this
    module replaces (unless schema.sharded_load_blocker names a reason, which the caller warns of)."""
    r = recipe.resolved
    return (
        recipe.distributed.sharded_load
        and r is not None
        and r.device == "cuda"
        and strategies.is_fsdp(recipe.distributed.strategy)
    )


@dataclass
class LoadReport:
    """What one rank held on its device: its shard bytes, the replicated quant states, and the most bytes it
    held at once beyond them (one weight matrix being quantized)."""

    local_bytes: int = 0
    replicated_bytes: int = 0  # the quant states every rank keeps whole
    peak_transient_bytes: int = 0
    tensors: int = 0
    quantized: list[str] = field(default_factory=list)


@dataclass
class _Quantized:
    """A Linear4bit module and how its weight is quantized (the settings bnb's Params4bit carries)."""

    module: object
    dtype: object  # the model dtype: from_pretrained casts a weight to it before quantizing
    blocksize: int
    compress_statistics: bool
    quant_type: str
    quant_storage: object

    def param(self, data, **extra):
        """bitsandbytes' Params4bit of `data` with these settings."""
        from bitsandbytes.nn import Params4bit

        return Params4bit(
            data,
            requires_grad=False,
            blocksize=self.blocksize,
            compress_statistics=self.compress_statistics,
            quant_type=self.quant_type,
            quant_storage=self.quant_storage,
            **extra,
        )


def shard_plugin(recipe: Recipe):
    """accelerate's FSDP plugin as the Trainer's Accelerator builds it: from the FSDP_* variables that
    `accelerate launch` exported from accelerate.yaml, with the recipe's mixed precision."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    precision = MIXED_PRECISION[recipe.train.precision]
    if precision != "no":
        plugin.set_mixed_precision(precision)
    return plugin


def shard_mesh(recipe: Recipe, device_type: str):
    """(FSDP mesh, ParallelismConfig): hybrid shard's 2-D (replicate, shard) mesh built by accelerate's
    ParallelismConfig from the PARALLELISM_CONFIG_* variables, or (None, None): fully_shard's default mesh
    over every rank, which is what accelerate passes without a parallelism config. The Trainer must be given
    the same ParallelismConfig (TrainingArguments.parallelism_config) so its Accelerator reuses the mesh."""
    if not strategies.is_hybrid(recipe.distributed.strategy):
        return None, None
    from accelerate import ParallelismConfig

    pc = ParallelismConfig()
    mesh = pc.get_device_mesh(device_type)
    return mesh[tuple(pc.fsdp_dim_names)], pc


def checkpoint_index(path: str, *, revision: str | None) -> dict[str, str]:
    """{tensor name: safetensors file} of the base checkpoint (fetched as from_pretrained fetches it), or {}
    when it has no safetensors weights."""
    from safetensors import safe_open
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, cached_file
    from transformers.utils.hub import get_checkpoint_shard_files

    def find(name: str):
        return cached_file(path, name, revision=revision, _raise_exceptions_for_missing_entries=False)

    index = find(SAFE_WEIGHTS_INDEX_NAME)
    if index is not None:
        files, meta = get_checkpoint_shard_files(path, index, revision=revision)
        by_name = {f.rsplit("/", 1)[-1]: f for f in files}
        return {key: by_name[name] for key, name in meta["weight_map"].items()}
    single = find(SAFE_WEIGHTS_NAME)
    if single is None:
        return {}
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def build_meta(recipe: Recipe, *, config, device):
    """The model on the meta device (real buffers): for QLoRA, transformers' bnb Linear4bit swap with packed
    4-bit weights; for an adapter, peft's adapter initialised on the host; for a full fine-tune, every
    parameter trainable in the dtype accelerate would give it. Returns (model, {checkpoint key:
    _Quantized}, {checkpoint key: (module, attribute)} of every base parameter, named before peft renames
    them)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.train.model import build_from_config, freeze_towers, from_config_kwargs, lora_config, model_kwargs

    build = from_config_kwargs(model_kwargs(recipe))
    four_bit = recipe.adapter.type == "qlora"
    if four_bit:
        config, quantizer = _quantizer(recipe, config, device)
    model = build_from_config(AutoModelForCausalLM, config, build, empty=True)
    quantized = _swap_in_4bit(model, quantizer, dtype=build["dtype"], device=device) if four_bit else {}
    model.eval()  # as from_pretrained returns it
    targets = _meta_targets(model)
    if recipe.adapter.type == "full":
        freeze_towers(model)
        if MIXED_PRECISION[recipe.train.precision] != "no":
            # accelerate's FSDP2 preparation upcasts trainable parameters (not buffers) to fp32 master
            # weights (the mixed-precision policy casts them for compute); on the meta device it costs nothing
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(torch.float32)
        return model, quantized, targets
    peft_config = lora_config(recipe, model)
    model = get_peft_model(model, peft_config)
    _init_adapter(model, seed=recipe.train.seed, init=peft_config.init_lora_weights, bf16=four_bit)
    filled = {id(getattr(module, attr)) for module, attr in targets.values()}
    unknown = [n for n, p in model.named_parameters() if p.is_meta and id(p) not in filled]
    if unknown:  # to_empty would leave them uninitialised
        raise RuntimeError(f"sharded load: no source for the meta parameters {unknown[:3]}")
    return model, quantized, targets


def _quantizer(recipe: Recipe, config, device):
    """(config, transformers' bitsandbytes quantizer) as from_pretrained sets them up for the recipe's
    BitsAndBytesConfig; get_hf_quantizer writes quantization_config into the config, so into a copy."""
    from transformers.quantizers.auto import get_hf_quantizer

    from finetune.train.model import quantization_config

    quantizer, config, _ = get_hf_quantizer(
        copy.deepcopy(config), quantization_config(recipe), {"": device}, weights_only=True, user_agent={}
    )
    return config, quantizer


def _swap_in_4bit(model, quantizer, *, dtype, device) -> dict:
    """nn.Linear swapped for bnb Linear4bit by the quantizer, each weight a meta Params4bit of the packed
    shape FSDP will shard: {checkpoint key: _Quantized}."""
    import bitsandbytes as bnb
    import torch

    quantizer.preprocess_model(model=model, dtype=dtype, device_map={"": device}, checkpoint_files=None)
    quantized = {}
    for name, module in model.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        w = module.weight
        # bitsandbytes' fake (meta) kernel gives the packed storage's shape, the one FSDP shards
        packed, _ = torch.ops.bitsandbytes.quantize_4bit.default(
            torch.empty(w.shape, dtype=dtype, device="meta"), w.blocksize, w.quant_type, w.quant_storage
        )
        spec = _Quantized(module, dtype, w.blocksize, w.compress_statistics, w.quant_type, w.quant_storage)
        quantized[f"{name}.weight"] = spec
        module.weight = spec.param(packed, module=module, bnb_quantized=True)
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)  # config.quantization_config, is_loaded_in_4bit: what peft/TRL ask
    return quantized


def _init_adapter(model, *, seed: int, init, bf16: bool) -> None:
    """peft's own LoRA initialisation on host tensors (peft left them on the meta device with the base), in
    the dtype peft gives them (float32 when the base is bf16, what accelerate's FSDP2 upcast would give).
    With `bf16` (a 4-bit base): TRL's trainers cast a quantized model's trainable weights to bf16 in place;
    on a sharded model that cast would orphan FSDP's storage, so they are bf16 before sharding and TRL's
    cast is a no-op."""
    import torch
    from peft.tuners.lora import LoraLayer

    def each(module, fn) -> None:
        for name in module.adapter_layer_names:
            holder = getattr(module, name)
            if ADAPTER in holder:
                fn(holder)

    def empty(holder) -> None:  # lora_A/B are modules; an Embedding's lora_embedding_A/B are parameters
        item = holder[ADAPTER]
        if isinstance(item, torch.nn.Module):
            item.to_empty(device="cpu")
        else:
            holder[ADAPTER] = torch.nn.Parameter(torch.empty_like(item, device="cpu"), item.requires_grad)

    def to_bf16(holder) -> None:
        item = holder[ADAPTER]
        if isinstance(item, torch.nn.Module):
            item.to(torch.bfloat16)
        else:
            holder[ADAPTER] = torch.nn.Parameter(item.detach().to(torch.bfloat16), item.requires_grad)

    torch.manual_seed(seed)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            each(module, empty)
            module.reset_lora_parameters(ADAPTER, init)
            if bf16:
                each(module, to_bf16)


def trainer_plugin_args() -> dict:
    """FullyShardedDataParallelPlugin arguments for the Trainer's Accelerator (TrainingArguments.fsdp_plugin_args;
    everything not named here is read from the FSDP_* variables as before). The model arrives sharded and
    checkpoint-wrapped: accelerate's prepare would look its decoder-layer class up by name to wrap it again,
    and FSDP2 renamed that class (FSDPLlamaDecoderLayer), so there is nothing left for it to wrap."""
    return {"fsdp_version": 2, "auto_wrap_policy": "NO_WRAP", "activation_checkpointing": False}


def shard(model, *, plugin, mesh) -> None:
    """Activation checkpointing and fully_shard as accelerate's Accelerator applies them for FSDP2
    (accelerate/utils/fsdp_utils.py: fsdp2_apply_ac, then fsdp2_prepare_model's grouping): the modules its
    wrap policy picks (the decoder layers) checkpoint-wrapped when the plugin says so and sharded, the input
    embedding alone when untied, the final norm with the output embedding (and a tied input embedding) kept
    unsharded after forward, then the root."""
    from accelerate.utils import get_module_children_bottom_up
    from accelerate.utils.fsdp_utils import _find_final_norm, fsdp2_prepare_auto_wrap_policy
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, offload_wrapper
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    kwargs = {
        "reshard_after_forward": plugin.reshard_after_forward,
        "offload_policy": plugin.cpu_offload,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        "mesh": mesh,
    }
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    if policy is not None and plugin.activation_checkpointing:
        for name, layer in get_module_children_bottom_up(model, return_fqns=True)[:-1]:
            if policy(layer):
                wrapped = checkpoint_wrapper(layer, preserve_rng_state=False)
                if plugin.activation_checkpointing_offload:
                    wrapped = offload_wrapper(wrapped)
                model.set_submodule(name, wrapped)
    if policy is not None:
        for module in get_module_children_bottom_up(model)[:-1]:
            if policy(module) and not isinstance(module, FSDPModule):
                fully_shard(module, **kwargs)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and embed.weight is head.weight
    if not tied and not isinstance(embed, FSDPModule):
        fully_shard(embed, **kwargs)
    tail = [m for m in (_find_final_norm(model), *((embed,) if tied else ()), head) if m is not None]
    tail = [m for m in tail if not isinstance(m, FSDPModule)]
    if tail:
        fully_shard(tail, **{**kwargs, "reshard_after_forward": False})
    fully_shard(model, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})


def _rows(param) -> tuple[int, int]:
    """(first row, rows) of this rank's dim-0 shard of a DTensor parameter, from DTensor's own chunk metadata
    (FSDP2's torch.chunk split, uneven last shards and HSDP's replicate dimension included); all rows of a
    plain tensor."""
    if not hasattr(param, "to_local"):
        return 0, param.shape[0]
    (chunk,) = param.__create_chunk_list__()
    return int(chunk.offsets[0]), int(chunk.sizes[0])


def host_values(model) -> tuple[dict, dict]:
    """The unsharded values to_empty would discard: the adapter peft initialised, the buffers the config
    built (RoPE frequencies). Taken before sharding, when they are still whole."""
    params = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    return params, {n: b.detach().clone() for n, b in model.named_buffers()}


def materialize(
    model,
    *,
    source,
    quantized: dict,
    targets: dict,
    host: tuple,
    device,
    offload: bool,
    report: LoadReport,
) -> None:
    """Allocate this rank's shards and fill them: the adapter and buffers from their host values, the base
    one tensor at a time from `source` (the checkpoint, or random weights; see the module docstring). Shards
    are allocated on `device`, or in host RAM when FSDP offloads parameters (it pins them there), so the
    GPU never holds them all; buffers and quantization run on `device`."""
    import torch

    keep, buffers = host
    model.to_empty(device="cpu" if offload else device)
    with torch.no_grad():
        for name, value in keep.items():
            _copy_rows(model.get_parameter(name), value)
        for name, value in buffers.items():
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, value.to(device))
        for key, (module, attr) in targets.items():
            _load(key, getattr(module, attr), source=source, spec=quantized.get(key), device=device, report=report)
    report.local_bytes = sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())


def _meta_targets(model) -> dict:
    """{checkpoint key: (module, attribute)} of the base's meta parameters in module order (so the checkpoint
    is read layer by layer); a tied parameter once, under its first name (the one checkpoints keep)."""
    seen: set[int] = set()
    targets = {}
    for name, module in model.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            if p.is_meta and id(p) not in seen:
                seen.add(id(p))
                targets[f"{name}.{attr}"] = (module, attr)
    return targets


def _local(param):
    return param.to_local() if hasattr(param, "to_local") else param


def _copy_rows(param, full) -> None:
    local = _local(param)
    if local.numel() == 0:
        return
    start, n = _rows(param)
    local.copy_(full[start : start + n].to(local.device, local.dtype))


class CheckpointSource:
    """The base's tensors read from its safetensors files ({tensor name: file})."""

    def __init__(self, index: dict[str, str]):
        self.index = index

    def missing(self, keys) -> list[str]:
        return [key for key in keys if key not in self.index]

    def rows(self, key: str, start: int, n: int, *, device):
        """Rows start..start+n of the tensor, read without reading the rest (host RAM)."""
        from safetensors import safe_open

        with safe_open(self.index[key], framework="pt", device="cpu") as f:
            return f.get_slice(key)[start : start + n]

    def whole(self, key: str, *, device, dtype):
        from safetensors import safe_open

        with safe_open(self.index[key], framework="pt", device="cpu") as f:
            return f.get_tensor(key).to(device, dtype)


class RandomSource:
    """model.init: random without a checkpoint: each tensor initialised whole on the rank's device by the
    model's own `_init_weights` (transformers' per-module init: normal(0, initializer_range) for linear and
    embedding weights, the architecture's value for its norms), seeded by train.seed and the tensor's
    position, so every rank builds the same whole tensor and keeps its own rows. A 4-bit weight is
    initialised as the plain Linear it replaces, then quantized as a loaded one would be."""

    def __init__(self, base, templates: dict, seed: int):
        self.base, self.templates, self.seed = base, templates, seed
        self.order = {key: i for i, key in enumerate(templates)}

    def missing(self, keys) -> list[str]:
        return []

    def whole(self, key: str, *, device, dtype=None):
        """The whole tensor, initialised on `device` (in `dtype`, or its template's)."""
        import torch

        template, attr = self.templates.pop(key)
        module = template.to_empty(device=device)
        with torch.no_grad():
            for p in module.parameters(recurse=False):
                p.zero_()  # what _init_weights leaves alone (a type it does not know) is zero, not garbage
            torch.manual_seed(self.seed * 100_003 + self.order[key])
            self.base._init_weights(module)
        value = getattr(module, attr).detach()
        return value if dtype is None else value.to(dtype)

    def rows(self, key: str, start: int, n: int, *, device):
        return self.whole(key, device=device)[start : start + n]


def random_templates(targets: dict, quantized: dict) -> dict:
    """{key: (meta module, attribute)} to initialise each base tensor from, taken before peft and FSDP wrap
    the owners: a copy of the owning module, or for a 4-bit weight the nn.Linear it stands for."""
    import torch

    out = {}
    for key, (module, attr) in targets.items():
        spec = quantized.get(key)
        if spec is None:
            out[key] = (copy.deepcopy(module), attr)
        else:
            shape = (module.in_features, module.out_features)
            out[key] = (torch.nn.Linear(*shape, bias=False, device="meta", dtype=spec.dtype), "weight")
    return out


def _load(key: str, param, *, source, spec, device, report: LoadReport) -> None:
    local = _local(param)
    if spec is None:  # not quantized: only this rank's rows, copied into its shard
        start, n = _rows(param)
        local.copy_(source.rows(key, start, n, device=device).to(local.dtype))
        report.tensors += 1
        return
    full = source.whole(key, device=device, dtype=spec.dtype)
    # bitsandbytes' Params4bit quantizes on `.to(device)` exactly as from_pretrained's Bnb4bitQuantize does
    q = spec.param(full).to(device)
    held = full.numel() * full.element_size() + q.numel() * q.element_size()
    report.peak_transient_bytes = max(report.peak_transient_bytes, held)
    del full
    qs = spec.module.quant_state = q.quant_state  # replicated: every rank quantized the same whole weight
    for t in (qs.absmax, qs.state2.absmax if qs.state2 is not None else None):
        report.replicated_bytes += 0 if t is None else t.numel() * t.element_size()
    if local.numel():
        start, n = _rows(param)
        local.copy_(q.data[start : start + n])
    report.tensors += 1
    report.quantized.append(key)


def checkpoint(recipe: Recipe):
    """(config, {tensor name: file}) of the base, (config, None) for model.init: random (no weights are
    read), or (None, reason) when this path cannot read it: no safetensors weights, or weights that are
    already quantized."""
    from finetune.recipe.paths import model_path
    from finetune.train.model import base_config

    m = recipe.model
    config = base_config(recipe)
    if m.init == "random":
        return config, None
    if getattr(config, "quantization_config", None):
        return None, "the checkpoint is already quantized"
    index = checkpoint_index(model_path(recipe), revision=m.revision)
    if not index:
        return None, "the checkpoint has no safetensors weights"
    return config, index


def load_sharded(recipe: Recipe, *, config, index: dict | None, device, mesh=None, plugin=None):
    """(sharded peft model, LoadReport), or (None, reason) when the checkpoint lacks tensors the model has;
    nothing is allocated on the device before that is known. `index` None: random weights (RandomSource)."""
    import torch

    device = torch.device(device)
    model, quantized, targets = build_meta(recipe, config=config, device=device)
    if index is None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        source = RandomSource(base, random_templates(targets, quantized), recipe.train.seed)
    else:
        source = CheckpointSource(index)
    missing = source.missing(targets)
    if missing:
        return None, f"the checkpoint lacks {len(missing)} of the model's tensors, e.g. {missing[0]}"
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = plugin or shard_plugin(recipe)
    host = host_values(model)
    shard(model, plugin=plugin, mesh=mesh)
    report = LoadReport()
    offload = isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    materialize(
        model,
        source=source,
        quantized=quantized,
        targets=targets,
        host=host,
        device=device,
        offload=offload,
        report=report,
    )
    if device.type == "cpu":
        from finetune.compat.bnb_cpu_packing import keep_trainable_layout

        keep_trainable_layout(model)
    return model, report


def load_for_training(recipe: Recipe, *, args):
    """This rank's sharded model for the Trainer, or (None, reason) to load it whole instead. Under
    hybrid shard the Trainer is handed the ParallelismConfig whose mesh the model was sharded on."""
    from accelerate import PartialState

    config, index = checkpoint(recipe)
    if config is None:
        return None, index
    device = PartialState().device
    mesh, parallelism = shard_mesh(recipe, device.type)
    model, report = load_sharded(recipe, config=config, index=index, device=device, mesh=mesh)
    if model is None:
        return None, report
    args.fsdp_plugin_args = trainer_plugin_args()
    if parallelism is not None:
        args.parallelism_config = parallelism
    log.info(
        f"{recipe.adapter.type} model sharded while {'building random weights' if index is None else 'loading'}: "
        f"{report.local_bytes / GIB:.2f} GiB of weight shards and "
        f"{report.replicated_bytes / GIB:.2f} GiB of quant states on this rank, at most "
        f"{report.peak_transient_bytes / GIB:.2f} GiB more held for one tensor at a time"
    )
    return model, report

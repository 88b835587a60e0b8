"""Tokenizer, model (dtype, attention, QLoRA quantization) and the PEFT config, per rank."""

from __future__ import annotations

import logging

from finetune.data.chat_template import read_chat_template
from finetune.errors import RecipeError
from finetune.recipe.paths import model_path
from finetune.recipe.schema import PRECISION_DTYPE, AdapterSection, Recipe, dpo_reference, sharded_load_blocker

log = logging.getLogger("finetune.train")


def torch_dtype(name: str):
    """The torch dtype a recipe's dtype name stands for."""
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "uint8": torch.uint8}[name]


def load_tokenizer(recipe: Recipe):
    from transformers import AutoTokenizer

    m = recipe.model
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            model_path(recipe), revision=m.revision, trust_remote_code=m.trust_remote_code
        )
    except OSError as exc:
        raise RecipeError(
            f"cannot load the tokenizer: {exc}",
            key="model.name",
            hint="check the model id or directory; offline runs need the model in the local Hugging Face cache",
        ) from None
    template = read_chat_template(recipe)
    if template is not None:
        tokenizer.chat_template = template
    apply_token_overrides(recipe, tokenizer)
    if tokenizer.pad_token is None:
        # The EOS token pads; labels come from our own columns, so EOS is still learned.
        if tokenizer.eos_token is None:
            raise RecipeError(
                "the tokenizer has neither a pad nor an EOS token",
                key="model.name",
                hint="use a tokenizer that defines an EOS token",
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def apply_token_overrides(recipe: Recipe, tokenizer) -> None:
    """tokenizer.pad/eos/bos_token and added_tokens; tokens the vocabulary lacks are added as special."""
    tk = recipe.tokenizer
    special = {f"{name}_token": getattr(tk, f"{name}_token") for name in ("pad", "eos", "bos")}
    special = {k: v for k, v in special.items() if v}
    if special:
        tokenizer.add_special_tokens(special)
    if tk.added_tokens:
        tokenizer.add_tokens(list(tk.added_tokens), special_tokens=True)


def fit_embeddings(recipe: Recipe, model) -> None:
    """Grow the embeddings (and an untied LM head) to the tokenizer's vocabulary when tokens were added;
    new rows start at the mean of the old ones (transformers' mean_resizing), and the model config
    learns the overridden special-token ids."""
    tk = recipe.tokenizer
    if not tk.may_resize_embeddings:
        return
    tokenizer = load_tokenizer(recipe)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    for name in ("pad", "eos", "bos"):
        if getattr(tk, f"{name}_token"):
            token_id = getattr(tokenizer, f"{name}_token_id")
            setattr(model.config, f"{name}_token_id", token_id)
            if getattr(model, "generation_config", None) is not None:
                setattr(model.generation_config, f"{name}_token_id", token_id)


def quantization_config(recipe: Recipe):
    a = recipe.adapter
    if a.type == "lora" and a.load_in_8bit:
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_8bit=True)
    if a.type != "qlora":
        return None
    return four_bit_config(a)


def four_bit_config(adapter):
    """transformers' BitsAndBytesConfig for a QLoRA adapter section (its quant type, double quantization, compute
    and storage dtypes): what the run loads its base with, and what finetune/hostprobe.py's 4-bit probe does."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=adapter.quant_type,
        bnb_4bit_use_double_quant=adapter.double_quant,
        bnb_4bit_compute_dtype=torch_dtype(adapter.compute_dtype),
        bnb_4bit_quant_storage=torch_dtype(adapter.storage_dtype),
    )


def dequantizing_config(config):
    """transformers' config that loads a checkpoint published quantized as 16-bit weights (its quant_method in
    registry.derive.DEQUANTIZING_CONFIGS: gpt-oss's MXFP4 through Mxfp4Config(dequantize=True), DeepSeek's FP8
    through FineGrainedFP8Config(dequantize=True)), or None for a
    16/32-bit checkpoint. `config`: the checkpoint's, as AutoConfig reads it."""
    from finetune.registry.derive import DEQUANTIZING_CONFIGS, prequantized_method

    settings = config.to_dict()
    method = prequantized_method(settings, settings.get("text_config") or {})
    if method not in DEQUANTIZING_CONFIGS:
        return None
    import transformers

    return getattr(transformers, DEQUANTIZING_CONFIGS[method])(dequantize=True)


def dequantizing_kwargs(source, **config_kwargs) -> dict:
    """from_pretrained's quantization_config for a checkpoint published quantized that loads dequantized
    (`dequantizing_config`), {} for any other: for the loads outside training (merge, generate) that have a model
    path, not a recipe. `config_kwargs`: AutoConfig's (revision, trust_remote_code)."""
    from transformers import AutoConfig

    dequantized = dequantizing_config(AutoConfig.from_pretrained(source, **config_kwargs))
    return {"quantization_config": dequantized} if dequantized is not None else {}


def attn_implementation(chosen: str, *, cudnn_long_examples: bool = False) -> str:
    """The name transformers loads. compile resolves auto (finetune.plan.attention_implementation);
    an unresolved recipe (merge, eval of a bare recipe) gets sdpa. `cudnn_long_examples`: model.cudnn_long_examples,
    taken where this GPU runs cuDNN's attention faster (train/attention.py)."""
    if chosen == "auto":
        return "sdpa"
    if chosen == "varlen":
        from finetune.train import attention

        if attention.available():
            on_cudnn = cudnn_long_examples and attention.cudnn_runs_long_examples()
            return attention.register(long_examples_on_cudnn=on_cudnn)
        import warnings

        warnings.warn(
            "model.attn_implementation: varlen needs torch.nn.attention.varlen and a CUDA device; using sdpa",
            stacklevel=2,
        )
        return "sdpa"
    return chosen


def base_config(recipe: Recipe):
    """The base model's config as training builds it: model.rope_scaling merged into its RoPE parameters
    (transformers 5 calls them rope_parameters; the base's rope_theta stays; the peers' `type` key is read as
    rope_type) and model.attention_dropout set, where the recipe sets them. The planner reads the same
    overrides (finetune.registry.resolve_model)."""
    from transformers import AutoConfig

    m = recipe.model
    config = AutoConfig.from_pretrained(model_path(recipe), revision=m.revision, trust_remote_code=m.trust_remote_code)
    if m.rope_scaling:
        override = dict(m.rope_scaling)
        if "type" in override:
            override.setdefault("rope_type", override.pop("type"))
        params = dict(getattr(config, "rope_parameters", None) or {})
        params.update(override)
        config.rope_parameters = params
    if m.attention_dropout is not None:
        config.attention_dropout = m.attention_dropout
    return config


def overrides_config(recipe: Recipe) -> bool:
    """Whether the recipe changes the model's config (base_config), so loading must pass that config."""
    return bool(recipe.model.rope_scaling) or recipe.model.attention_dropout is not None


def model_kwargs(recipe: Recipe) -> dict:
    """from_pretrained keyword arguments (also used to reload the base for the after-training eval)."""
    m = recipe.model
    kwargs = dict(
        dtype=torch_dtype(m.dtype),
        revision=m.revision,
        trust_remote_code=m.trust_remote_code,
        attn_implementation=attn_implementation(m.attn_implementation, cudnn_long_examples=m.cudnn_long_examples),
    )
    if not m.allow_pickle:
        kwargs["use_safetensors"] = True
    quant = quantization_config(recipe)
    # whether a checkpoint is published quantized (it then loads as 16-bit weights, placed as a plain one's are)
    asks_dequantized = quant is None and recipe.model.init != "random"
    config = base_config(recipe) if overrides_config(recipe) or asks_dequantized else None  # read once
    if overrides_config(recipe):
        kwargs["config"] = config
    dequantized = dequantizing_config(config) if asks_dequantized else None
    if dequantized is not None:
        kwargs["quantization_config"] = dequantized
    if quant is not None:
        kwargs["quantization_config"] = quant
        resolved = recipe.resolved
        if resolved is not None and resolved.device == "cuda":
            from accelerate import PartialState
            from transformers.integrations import is_deepspeed_zero3_enabled

            # each rank quantizes onto its own GPU (not all onto GPU 0, TRL #3436). ZeRO-3 refuses a device_map;
            # bitsandbytes then quantizes onto the current device, which PartialState sets to the rank's.
            state = PartialState()
            if not is_deepspeed_zero3_enabled():
                kwargs["device_map"] = {"": state.local_process_index}
    return kwargs


def load_model(recipe: Recipe):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    kwargs = model_kwargs(recipe)
    auto = AutoModelForCausalLM
    if recipe.method.type == "reward":  # one score per sequence, on the same backbone
        auto, kwargs["num_labels"] = AutoModelForSequenceClassification, 1
    try:
        if recipe.model.init == "random":
            model = random_model(recipe, auto, kwargs)
        else:
            model = auto.from_pretrained(model_path(recipe), **kwargs)
    except OSError as exc:
        hint = (
            "it has only .bin (pickle) weights; set model.allow_pickle: true if you trust it"
            if "safetensors" in str(exc)
            else "check model.name and that the weights are available"
        )
        raise RecipeError(f"cannot load the model: {exc}", key="model.name", hint=hint) from None
    # QLoRA: peft's prepare_model_for_kbit_training is deliberately not called. It upcasts every
    # non-4-bit parameter (embeddings, lm_head, norms) to fp32: +4 GiB for a 128k vocabulary, fp32
    # activations after every norm, and a dtype mix that FSDP2/ZeRO-3 cannot shard with the bf16-stored
    # 4-bit weights. The QLoRA paper computes in bf16; peft freezes the base, and non-reentrant
    # checkpointing needs no input-grad hook.
    if recipe.adapter.type == "qlora" and recipe.resolved is not None and recipe.resolved.device == "cpu":
        from finetune.compat.bnb_cpu_packing import keep_trainable_layout

        keep_trainable_layout(model)
    freeze_towers(model)
    fit_embeddings(recipe, model)
    if recipe.method.type == "reward" and model.config.pad_token_id is None:
        # the score is read at each row's last non-pad token, which needs the pad id
        model.config.pad_token_id = load_tokenizer(recipe).pad_token_id
    return model


def load_training_model(recipe: Recipe, *, args):
    """The model the trainer trains. Under FSDP2 on GPUs it is built straight into each rank's shard, with
    its adapter if any (finetune/train/sharded_load.py); what that path does not cover, and everything
    else, loads whole (load_model), an adapter added by TRL."""
    from finetune.compat.moe_expert_count import name_the_expert_count
    from finetune.train import attention, sharded_load

    model = None
    if sharded_load.applies(recipe):
        why = sharded_load_blocker(recipe)
        if not why:
            model, why = sharded_load.load_for_training(recipe, args=args)
        if model is None:
            log.warning(
                f"{recipe.adapter.type} under FSDP2 loads the whole model, not each rank's shard, because {why}"
            )
    if model is None:
        model = load_model(recipe)
    name_the_expert_count(model)
    if model.config._attn_implementation == attention.NAME:
        attention.skip_packed_row_masks(model)
    return model


def reference_copy(recipe: Recipe):
    """The frozen reference model finetune loads itself for DPO/KTO with `reference: copy` on an adapter
    recipe, or None: the implicit reference (the base with the adapter disabled) needs none, and for a
    full fine-tune TRL builds the copy from the model's path."""
    if dpo_reference(recipe) == "copy" and recipe.adapter.type != "full":
        return load_model(recipe)
    return None


def carries_adapter(model) -> bool:
    """The model already has its LoRA adapter (finetune/train/sharded_load.py): the trainer must not add another."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def random_model(recipe: Recipe, auto, kwargs: dict):
    """model.init: random: the model built from its config.json with random weights seeded by train.seed.

    Under FSDP with accelerate's cpu_ram_efficient_loading (finetune's FSDP configs) only the main process
    builds real weights, which accelerate then broadcasts shard by shard as it does loaded ones; the other
    ranks build empty (meta) parameters with real buffers. Under ZeRO-3 transformers builds the model inside
    deepspeed.zero.Init, each rank materialising its own partition."""
    import torch
    from accelerate import PartialState
    from transformers.integrations import is_fsdp_enabled

    config = kwargs.get("config") or base_config(recipe)
    if dequantizing_config(config) is not None:
        # built in 16 bits from the config; a saved model must not claim the published checkpoint's quantization
        config.quantization_config = None
    if "num_labels" in kwargs:
        config.num_labels = kwargs["num_labels"]
    build = from_config_kwargs(kwargs)
    torch.manual_seed(recipe.train.seed)
    return build_from_config(auto, config, build, empty=is_fsdp_enabled() and not PartialState().is_main_process)


def from_config_kwargs(kwargs: dict) -> dict:
    """Of model_kwargs' from_pretrained arguments, those that building from a config takes too."""
    return {k: kwargs[k] for k in ("dtype", "attn_implementation", "trust_remote_code")}


def build_from_config(auto, config, build: dict, *, empty: bool):
    """`auto.from_config`, with meta parameters when `empty`. Under init_empty_weights transformers does not
    tie the input and output embeddings (lm_head gets a meta parameter of its own), while the main rank's
    real build and from_pretrained tie them; accelerate's FSDP2 wrapping then finds lm_head.weight on one
    rank and not on another and fails, so the empty build is tied here as from_pretrained would."""
    from contextlib import nullcontext

    from accelerate import init_empty_weights

    with init_empty_weights() if empty else nullcontext():
        model = auto.from_config(config, **build)
    if empty:
        model.tie_weights()
    return model


def text_towers(model) -> dict:
    """The modules a multimodal checkpoint holds beside its text decoder (Gemma-3: vision_tower and
    multi_modal_projector), by name in `model`; {} for a text model. finetune trains text only: they load with
    the model, frozen and without adapters (the planner counts them so: ModelArch.frozen_tower_params)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config") or config.get_text_config() is config:
        return {}
    decoder = model.get_decoder()
    name = next((n for n, m in model.named_modules() if m is decoder), None)
    if name is None:
        return {}
    parent_name = name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    prefix = f"{parent_name}." if parent_name else ""
    return {
        prefix + child_name: child
        for child_name, child in parent.named_children()
        if child is not decoder and next(child.parameters(), None) is not None
    }


def freeze_towers(model) -> None:
    """requires_grad off on a multimodal checkpoint's towers (text_towers): a full fine-tune trains the text
    model, and no optimizer state, fp32 master or gradient is kept for weights text never reaches."""
    towers = text_towers(model)
    for tower in towers.values():
        tower.requires_grad_(False)
    if towers:
        count = sum(p.numel() for t in towers.values() for p in t.parameters())
        log.info(f"text-only training: {', '.join(towers)} ({count / 1e6:,.0f}M parameters) frozen")


def lora_config(recipe: Recipe, model=None):
    """peft's LoraConfig for the recipe; given the model, its multimodal towers (text_towers) are excluded
    from the targets, which match module names by suffix (a vision tower has q_proj/k_proj/v_proj too)."""
    if recipe.adapter.type == "full":
        return None
    resolved = recipe.resolved.lora_targets if recipe.resolved and recipe.resolved.lora_targets else "all-linear"
    return adapter_lora_config(recipe.adapter, model, default_targets=resolved, reward=recipe.method.type == "reward")


def adapter_lora_config(a: AdapterSection, model=None, *, default_targets: list[str] | str, reward: bool = False):
    """peft's LoraConfig for an adapter section (lora_config; finetune/hostprobe.py builds its probe layer with it),
    `default_targets` where adapter.target_modules is unset; `reward`: a sequence-classification model."""
    import re

    from peft import LoraConfig

    targets = a.target_modules if a.target_modules is not None else default_targets
    config = LoraConfig(
        r=a.r,
        lora_alpha=a.alpha,
        lora_dropout=a.dropout,
        target_modules=targets,
        use_dora=a.dora,
        use_rslora=a.rslora,
        modules_to_save=list(a.modules_to_save or []) or None,
        # adapter.target_experts: the MoE layers' fused expert weights, which are parameters, not modules
        target_parameters=expert_targets(a.target_experts, model),
        # SEQ_CLS: peft also trains the new score head (modules_to_save)
        task_type="SEQ_CLS" if reward else "CAUSAL_LM",
    )
    towers = text_towers(model) if model is not None else {}
    if towers:  # peft matches a str by re.fullmatch against each module's full name
        config.exclude_modules = rf"({'|'.join(re.escape(name) for name in towers)})(\..*)?"
    if a.fuses_lora:
        from torch import nn

        from finetune.train.fused_lora import FusedLoraLinear

        config._register_custom_module({nn.Linear: FusedLoraLinear})
    if a.dora and a.quantizes_base:  # DoRA's fp32 magnitude would make the outputs fp32
        from finetune.train.quantized_dora import custom_modules

        config._register_custom_module(custom_modules())
    return config


def expert_targets(target_experts: bool | list[int], model) -> list[str] | None:
    """peft's target_parameters for adapter.target_experts: the fused expert weights of every MoE layer (true; peft
    matches a name's suffix), or those of the listed decoder layers, named `layers.N.<block>.experts.<weight>` as
    the model names them (the block is mlp, block_sparse_moe or feed_forward by family)."""
    import re

    from finetune.plan.workload import FUSED_EXPERT_WEIGHTS

    if target_experts is False:
        return None
    if target_experts is True:
        return list(FUSED_EXPERT_WEIGHTS)
    wanted, names = set(target_experts), set()
    for name, _ in model.named_parameters():
        found = re.search(r"(?:^|\.)(layers\.(\d+)\..+)$", name)
        if found and int(found.group(2)) in wanted and name.endswith(tuple("." + w for w in FUSED_EXPERT_WEIGHTS)):
            names.add(found.group(1))
    return sorted(names)


def adapter_input_casting(recipe: Recipe, model):
    """A context for training: peft's per-module fp32 cast of LoRA inputs off (adapter.cast_adapter_inputs).

    Only where peft casts (finetune.plan.memory.peft_casts_adapter_inputs: DDP/one device with bf16/fp16
    autocast, which runs the adapters' matmuls in the compute dtype anyway); DoRA keeps peft's cast (its
    norm math wants fp32)."""
    return section_input_casting(
        recipe.adapter,
        model,
        strategy=recipe.distributed.strategy,
        autocast=PRECISION_DTYPE[recipe.train.precision] is not None,
    )


def section_input_casting(a: AdapterSection, model, *, strategy: str, autocast: bool):
    """adapter_input_casting for an adapter section trained under `strategy` (finetune/hostprobe.py's too)."""
    from contextlib import nullcontext

    from finetune.plan.memory import peft_casts_adapter_inputs

    casts = peft_casts_adapter_inputs(adapter=a.type, strategy=strategy, autocast=autocast)
    if not casts or a.cast_adapter_inputs or a.dora:
        return nullcontext()
    from peft.helpers import disable_input_dtype_casting

    return disable_input_dtype_casting(model)

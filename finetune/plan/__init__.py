"""The planner: per-GPU memory and step time of every strategy, the choice, or a refusal.

plan(recipe, *, hardware=None) -> Plan           (pure arithmetic, no torch)
render_plan_table(plan) -> str                   (the CLI's table)
job_from_recipe(recipe, *, arch, preset) -> Job  (the numbers the planner works on)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

from finetune import strategies
from finetune.errors import RecipeError
from finetune.hostprobe import PLAIN_LORA, ProbeLayer, probe_layer
from finetune.kernels import CUDNN_MIN_EXAMPLE_TOKENS, card_runs_cudnn_long_examples, torch_runs_varlen_windows
from finetune.plan.choose import (
    CLEARLY_FASTER,
    HEADROOM,
    TIGHT_HEADROOM,
    best_for_strategy,
    bnb_tensor_too_large,
    clearly_faster,
    not_applicable,
    search,
    simplest_near_fastest,
    suggestions,
    usable_fraction,
)
from finetune.plan.coverage import basis_text
from finetune.plan.fallback import attention_fallback_warning
from finetune.plan.host_time import (
    FASTEST_HOST_S_PER_KERNEL,
    HOST_S_PER_KERNEL,
    host_seconds,
    kernels_per_micro_batch,
    zero3_module_uses,
)
from finetune.plan.lora_time import fused_lora_runs, shared_input_groups
from finetune.plan.memory import (
    AT_FINAL_SAVE,
    adapter_input_casts,
    dora_dropout_weight_bytes,
    fsdp_accumulated_gradients,
    peaks_at_final_save,
    steps_16bit_params,
    steps_16bit_weights,
    task_eval_fits,
    task_eval_peak,
    zero_model_state_bytes,
)
from finetune.plan.offload_time import nvme_read_gbps
from finetune.plan.render import render_plan_table
from finetune.plan.timing import (
    HOST_GPU_OVERLAP_P,
    allgather_time_s,
    allreduce_time_s,
    job_model_flops_per_token,
    mfu,
    model_flops_per_token,
    soft_max,
)
from finetune.plan.types import GIB, Candidate, MemoryBreakdown, Plan
from finetune.plan.unfused_time import unfused_seconds
from finetune.plan.workload import (
    ATTENTION_LINEARS,
    DTYPE_BYTES,
    Job,
    adapter_params,
    attention_span,
    batch_share,
    count_params,
    expert_adapter_layers,
    holds_a_micro_batch,
    long_examples_on_cudnn,
    mean_sequence_tokens,
    module_shapes,
    moe_layer_count,
    needs_model_eager,
    packed_row_fallback_layers,
    pads_rows,
    saved_modules,
    sliding_layer_count,
    trainable_params,
    varlen_fallback_layers,
)
from finetune.recipe.paths import anchored
from finetune.recipe.schema import (
    PACKED_EXAMPLE_METHODS,
    PRECISION_DTYPE,
    compute_dtype,
    dpo_reference,
    final_save_gathers_trained_only,
    loads_sharded,
    packs_examples,
    sharded_load_blocker,
    sync_each_batch_pin,
    trained_lora_dropout,
)
from finetune.registry.derive import DEQUANTIZING_CONFIGS
from finetune.registry.disk import AIO_BLOCK_BYTES, RAM_FILESYSTEMS, filesystem_type, probe_readers, read_gbps
from finetune.registry.schema import ModelArch

__all__ = [
    "plan",
    "plan_on",
    "lookup",
    "plan_job",
    "job_from_recipe",
    "render_plan_table",
    "Plan",
    "Candidate",
    "MemoryBreakdown",
    "Job",
    "zero_model_state_bytes",
    "allreduce_time_s",
    "allgather_time_s",
    "HEADROOM",
    "recipe_flops_per_token",
    "mfu",
    "varlen_fallback_layers",
]


# where transformers keeps the decoder layers: causal LMs, and the text model of a multimodal one
# (Gemma-3, Llama-4, Mistral-3 load as *ForConditionalGeneration)
DECODER_LAYER_PATHS = ("model.layers", "model.language_model.layers", "language_model.model.layers")


def _targets(recipe, arch) -> tuple[str, ...]:
    chosen = recipe.adapter.target_modules
    if chosen is None:
        return tuple(arch.lora_targets)
    if chosen == "all-linear":
        return tuple(module_shapes(arch))  # peft's all-linear: every nn.Linear of the layers
    if isinstance(chosen, str):  # a regex over full module names (peft's rule): try each at its usual paths

        def blocks(name: str) -> tuple[str, ...]:
            # an MoE layer's dense linears are its shared experts'
            return (
                ("self_attn", "cross_attn")
                if name in ATTENTION_LINEARS
                else ("mlp", "mlp.shared_expert", "mlp.shared_experts")
            )

        pattern = re.compile(chosen)
        matched = tuple(
            n
            for n in module_shapes(arch)
            if any(pattern.fullmatch(f"{layers}.0.{part}.{n}") for layers in DECODER_LAYER_PATHS for part in blocks(n))
        )
        if not matched:  # peft would refuse it only after loading the model
            raise RecipeError(
                f"the pattern {chosen!r} matches no linear module of {arch.key}",
                key="adapter.target_modules",
                hint=f"a regex over full names such as model.layers.0.self_attn.{next(iter(module_shapes(arch)))}, "
                "a list of module names, or all-linear",
            )
        return matched
    known = set(module_shapes(arch)) | {"embed_tokens"}
    names = tuple(name.rsplit(".", 1)[-1] for name in chosen)  # peft matches on the name's suffix
    if "lm_head" in names:
        # TRL's fused LM head multiplies by lm_head.weight directly: a LoRA there would never be applied
        raise RecipeError(
            "LoRA on lm_head is not applied by TRL's fused LM head (it reads lm_head.weight)",
            key="adapter.target_modules",
            hint="train the head in full with adapter.modules_to_save: [lm_head]",
        )
    unknown = [n for n in names if n not in known]
    if unknown:
        raise RecipeError(
            f"{', '.join(unknown)} is not a module of {arch.key} the planner knows",
            key="adapter.target_modules",
            hint=f"use names from: {', '.join(sorted(known))}, or all-linear",
        )
    return names


def expert_layers(recipe, arch) -> int:
    """How many MoE layers adapter.target_experts adapts on `arch` (workload.expert_adapter_layers); a dense model or
    a listed layer without routed experts is refused by the key."""
    chosen = recipe.adapter.target_experts
    if recipe.adapter.type == "full" or chosen is False:
        return 0
    if not moe_layer_count(arch):
        raise RecipeError(
            f"{arch.key} has no routed experts for adapter.target_experts to adapt (it is not a mixture-of-experts "
            "model)",
            key="adapter.target_experts",
            hint="remove adapter.target_experts; adapter.target_modules reaches the dense MLP's linears",
        )
    try:
        return expert_adapter_layers(arch, chosen)
    except ValueError as exc:
        raise RecipeError(
            str(exc), key="adapter.target_experts", hint="list MoE layers only, or true for all"
        ) from None


def recipe_flops_per_token(recipe, *, arch) -> float:
    """model_flops_per_token of `recipe` (its adapter, LoRA shape and its data's attention span) on `arch`: what
    the planner's MFU and the benchmarks' measured MFU divide by."""
    a = recipe.adapter
    trainable = (
        0
        if a.type == "full"
        else adapter_params(
            arch,
            r=a.r,
            targets=_targets(recipe, arch),
            dora=a.dora,
            experts=expert_layers(recipe, arch),
            modules_to_save=a.modules_to_save or (),
            active=True,
        )
    )
    data = recipe.data
    span = attention_span(
        seq_len=data.max_length,
        example_tokens=data.example_tokens if packs_examples(recipe) else None,
        sequence_mean=data.sequence_tokens.mean if data.sequence_tokens else None,
        sequence_std=data.sequence_tokens.std if data.sequence_tokens else 0.0,
    )
    return model_flops_per_token(arch, span=span, adapter=a.type, trainable_params=trainable)


# model.attn_implementation values that run only on a GPU
CUDA_ATTENTION = ("varlen", "flash_attention_2", "flash_attention_3")


def runs_flash_attention_3(preset) -> bool:
    """FlashAttention-3's kernels are written for Hopper (sm90): the H100/H200 family, told by the card's name."""
    return preset.vendor == "nvidia" and re.search(r"\b(GH200|H100|H200|H800|H20)\b", preset.gpu_model) is not None


def attention_implementation(recipe, preset, *, arch=None) -> str:
    """What train/model.py loads for model.attn_implementation. auto: PyTorch's varlen flash kernel for
    padding-free packed SFT rows and DPO pairs on NVIDIA GPUs (finetune/train/attention.py), sdpa otherwise; eager for
    an `arch` with attention logit soft-capping (Gemma-2) or attention sinks (GPT-OSS), which neither sdpa
    nor the varlen kernel computes (transformers' own eager attention is their reference implementation)."""
    chosen = recipe.model.attn_implementation
    eager_only = arch is not None and needs_model_eager(arch)
    if chosen == "sdpa" and arch is not None and arch.attention_sinks:
        raise RecipeError(
            f"{arch.key} has attention sinks (a learned logit per head in the softmax), which sdpa does not "
            f"compute; transformers refuses sdpa for it",
            key="model.attn_implementation",
            hint="set model.attn_implementation: auto (its eager attention) or eager",
        )
    if preset.vendor == "cpu" and chosen in CUDA_ATTENTION:
        raise RecipeError(
            f"{chosen} is a CUDA kernel; this run is on CPU, where "
            + ("finetune's varlen falls back to sdpa" if chosen == "varlen" else "it cannot run"),
            key="model.attn_implementation",
            hint="set model.attn_implementation: auto (sdpa on CPU)",
        )
    if chosen == "flash_attention_3" and not runs_flash_attention_3(preset):
        raise RecipeError(
            f"FlashAttention-3 runs on NVIDIA Hopper GPUs (H100, H200, H800, H20) only, not on {preset.gpu_model}",
            key="model.attn_implementation",
            hint="set model.attn_implementation: auto (PyTorch's varlen flash kernel for packed rows) or "
            "flash_attention_2",
        )
    mask_only_window = arch is not None and arch.window_in_mask_only and sliding_layer_count(arch) > 0
    if chosen in CUDA_ATTENTION and mask_only_window:  # the flash kernels read no mask
        raise RecipeError(
            f"{arch.key} applies its {arch.sliding_window}-token sliding window on {arch.sliding_layers} layers only "
            f"through transformers' attention mask, which {chosen} does not read: it would train without the window",
            key="model.attn_implementation",
            hint="set model.attn_implementation: auto (sdpa for this model) or sdpa",
        )
    half = DTYPE_BYTES[compute_dtype(recipe)] == 2  # the varlen kernel runs bf16/fp16 only
    if chosen == "varlen" and not half and preset.vendor != "cpu":
        raise RecipeError(
            "varlen runs 16-bit attention only; this run computes in float32 "
            "(train.precision: fp32 with float32 weights), so its packed rows would fall back to sdpa with a "
            "mask over each whole row",
            key="model.attn_implementation",
            hint="set train.precision: bf16 (or fp16), or model.attn_implementation: auto",
        )
    if chosen == "auto":
        if eager_only:
            return "eager"
        packed = recipe.data.packing and recipe.method.type in ("sft", "dpo")
        chosen = "varlen" if packed and preset.vendor == "nvidia" and half and not mask_only_window else "sdpa"
    return chosen


def attention_kind(implementation: str, *, packed: bool, arch=None, windows: bool = True) -> str:
    """The planner's attention memory model: flash (no mask, no repeated kv heads) | varlen (no mask, kv
    heads as they are: torch's varlen kernel takes grouped heads) | sdpa | eager.
    varlen falls back to sdpa on rows without example boundaries, and on packed rows of an `arch`
    whose logit soft-capping, attention sinks or attention dropout it does not run (`varlen_fallback_layers`):
    soft-capped and sink layers go to the model's own eager attention (sdpa computes neither), the others
    to sdpa. Sliding windows it runs where torch's kernel takes them (`windows`: kernels.torch_runs_varlen_windows)."""
    if implementation in ("eager", "sdpa"):
        return implementation
    if implementation == "varlen":
        if arch is not None and needs_model_eager(arch):
            return "eager"
        if not packed or (arch is not None and varlen_fallback_layers(arch, windows=windows)):
            return "sdpa"
        return "varlen"
    return "flash"


# tokens: rows that reach sdpa's masked (cuDNN) kernel are padded to a multiple of these (row_multiple)
MASKED_ROW_MULTIPLE = 512  # packed rows: micro-batch x max_length long, nearly full
# padded sequences, each as long as the micro-batch's longest example: whole 128-key tiles, because cuDNN's masked
# backward (torch 2.11 to 2.13 on H100/H200) returns NaN query gradients at a length of 64 mod 128 where a row's
# scores are all strongly negative (pytorch/pytorch#196678, huggingface/trl#7181: DPO and KTO runs going NaN); a
# multiple of 64 met it on Gemma-3-1B DPO (docs/validation.md, thirty-second session)
PADDED_ROW_MULTIPLE = 128
# packed rows on the varlen kernel where Liger's Triton kernels take the row's length as an argument (its RoPE's
# seq_len, its RMSNorm backward's row count): Triton compiles a kernel again the first time such an integer is
# divisible by 16 and once more when it is not, 0.5-0.6 s of host time in Liger's functions with the GPU idle
# (Qwen3-30B-A3B's step 6 profiled alone, docs/validation.md eighteenth session); rows of a multiple of 16 keep
# one specialization from the first step. A pad is at most 15 one-token examples a row.
LIGER_ROW_MULTIPLE = 16
# whose rows finetune pads: TRL's collators (pad_to_multiple_of, train/trainers.py and train/methods.py) and DPO's
# padding-free pairs row (train/dpo_pairs.py). ORPO's and CPO's collators take no multiple (cudnn_attention_off)
ROW_MULTIPLE_METHODS = ("sft", "pretrain", "dpo", "kto", "reward")


def row_multiple(job: Job) -> int | None:
    """The multiple of tokens the collator pads rows to where sdpa gets a mask over them on an NVIDIA GPU, else
    None. There sdpa runs cuDNN's attention, whose first call at each new row length costs 0.13-0.18 s forward +
    backward on an H200 (scripts/attention_rates.py --new-lengths; 2-38 ms at a length it has seen), and the
    length changes with nearly every micro-batch: packed rows (SFT/pretrain examples, DPO's padding-free pairs)
    whose layers the varlen kernel does not serve (attention dropout, sliding windows, or sdpa asked for; the
    block-diagonal mask) get MASKED_ROW_MULTIPLE, sequences padded to a micro-batch's longest (the padding mask)
    PADDED_ROW_MULTIPLE.
    Padded, a run meets a few lengths and pays for each once. The planner counts the padding at every
    micro-batch; the run pads one-sequence micro-batches of unpadded rows not at all (`pads_rows`).
    Packed rows that every layer runs on a kernel without a mask get LIGER_ROW_MULTIPLE where Liger's kernels run."""
    if job.preset.vendor != "nvidia" or job.method not in ROW_MULTIPLE_METHODS:
        return None
    if job.attention == "sdpa":
        return MASKED_ROW_MULTIPLE if job.packed else PADDED_ROW_MULTIPLE
    return LIGER_ROW_MULTIPLE if job.packed and job.liger else None


def cudnn_attention_off(job: Job) -> bool:
    """The run turns cuDNN's attention off (torch.backends.cuda.enable_cudnn_sdp): where sdpa masks padded rows on an
    NVIDIA GPU whose lengths the method's collator cannot round to PADDED_ROW_MULTIPLE (ORPO's and CPO's take no
    multiple), so a batch at 64 mod 128 tokens would meet cuDNN's NaN backward. sdpa's memory-efficient kernel takes
    those rows, at 2.2x cuDNN's masked kernel's time (Job.cudnn_attention, attention_time.EFFICIENT_KERNEL_SLOWDOWN)."""
    return job.preset.vendor == "nvidia" and job.attention == "sdpa" and job.method not in ROW_MULTIPLE_METHODS


def liger_enabled(recipe, preset, *, arch) -> bool:
    """train.liger: auto = on for NVIDIA GPUs when liger-kernel is installed where the run is compiled
    (the training machine for `finetune run`; a planning laptop without it plans without, which over-estimates
    memory and step time, and says so: liger_missing_warning) and patches `arch`'s model type. find_spec does
    not import it (planning stays torch-free)."""
    from finetune.registry.families import LIGER_MODEL_TYPES, liger_installed

    choice = recipe.train.liger
    if choice == "on" and preset.vendor == "cpu":
        raise RecipeError(
            "Liger's kernels are Triton GPU kernels; this run is on CPU",
            key="train.liger",
            hint="set train.liger: auto (or off)",
        )
    supported = arch.family in LIGER_MODEL_TYPES
    if choice == "on" and not supported:
        raise RecipeError(
            f"Liger has no kernels for model type {arch.family}: the run would train without them",
            key="train.liger",
            hint="set train.liger: auto (or off)",
        )
    if choice != "auto":
        return choice == "on"
    return supported and preset.vendor == "nvidia" and liger_installed()


# trainers that score tokens through TRL's chunked LM head (TRL 1.16's fused_lm_head); ORPO/CPO compute full
# logits (reward models have no vocabulary head, so the flag is moot for them)
FUSED_HEAD_METHODS = ("sft", "pretrain", "dpo", "kto", "reward")


def run_sequences(recipe) -> int | None:
    """Sequences the run trains over all ranks: train.max_steps x the global batch, else train.epochs (default 1)
    x the data's measured count (data.sequence_tokens.count); None when neither is known."""
    t = recipe.train
    if t.max_steps:
        return t.max_steps * t.global_batch_size
    measured = recipe.data.sequence_tokens
    if measured is None or not measured.count:
        return None
    # KTO trains each preference pair as two rows, the desirable and the undesirable (data.preference.unpair)
    unpaired = recipe.method.type == "kto" and all(s.format == "preference" for s in recipe.data.sources)
    return max(1, round((t.epochs or 1) * measured.count * (2 if unpaired else 1)))


def job_from_recipe(recipe, *, arch, preset) -> Job:
    """The recipe's workload as plain numbers (the planner's inner loop never touches pydantic)."""
    method = recipe.method.type
    adapter = recipe.adapter.type
    if arch.dequantized_from and recipe.adapter.quantizes_base:
        raise RecipeError(
            f"{arch.key}'s checkpoint is published in {arch.dequantized_from}, which finetune loads dequantized to "
            f"16 bits; bitsandbytes cannot quantize it again in the same load",
            key=recipe.adapter.quantization_key,
            hint="train LoRA on the dequantized weights (adapter.type: lora), or save a 16-bit copy once and point "
            "model.name at it for QLoRA",
        )
    lora_expert_layers = expert_layers(recipe, arch)
    reference = dpo_reference(recipe)
    added = recipe.tokenizer.new_token_count
    if added:  # tokenizer.added_tokens / special-token overrides grow the embeddings and the LM head
        arch = arch.model_copy(update={"vocab_size": arch.vocab_size + added})
    micro = recipe.train.micro_batch_size
    implementation = attention_implementation(recipe, preset, arch=arch)
    windows = torch_runs_varlen_windows()  # this torch's varlen kernel: the run's, where it runs here
    attention = attention_kind(implementation, packed=recipe.data.packing, arch=arch, windows=windows)
    fallback = varlen_fallback_layers(arch, windows=windows)
    served = arch.num_layers - fallback if implementation == "varlen" and recipe.data.packing else 0
    sequences = recipe.data.sequence_tokens  # packed examples: set only when each is a row of its own
    job = Job(
        arch=arch,
        preset=preset,
        adapter=adapter,
        method=method,
        reference=reference,
        task_eval=recipe.data.task_eval is not None,
        fused_lm_head=method in FUSED_HEAD_METHODS,
        nll_on_chosen=method == "orpo" or (method == "simpo" and bool(recipe.method.cpo_alpha)),
        lora_r=recipe.adapter.r,
        lora_targets=_targets(recipe, arch),
        lora_dropout=trained_lora_dropout(recipe),
        dora=recipe.adapter.dora,
        lora_expert_layers=lora_expert_layers,
        modules_to_save=tuple(recipe.adapter.modules_to_save or ()) if adapter != "full" else (),
        cast_adapter_inputs=recipe.adapter.cast_adapter_inputs,
        fused_lora=recipe.adapter.fuses_lora,
        fused_lora_groups=recipe.adapter.groups_lora,
        liger=liger_enabled(recipe, preset, arch=arch),
        double_quant=recipe.adapter.double_quant,
        weight_bytes=DTYPE_BYTES[recipe.model.dtype],
        int8_base=recipe.adapter.type == "lora" and recipe.adapter.load_in_8bit,
        act_bytes=DTYPE_BYTES[compute_dtype(recipe)],
        autocast=PRECISION_DTYPE[recipe.train.precision] is not None,
        optimizer=recipe.train.optimizer,
        clips_gradients=recipe.train.max_grad_norm > 0,
        seq_len=recipe.data.max_length,
        packed=recipe.data.packing,
        example_tokens=recipe.data.example_tokens if packs_examples(recipe) else None,
        sequence_tokens=sequences.mean if sequences else None,
        longest_sequence_tokens=sequences.longest if sequences else None,
        sequence_tokens_std=sequences.std if sequences else 0.0,
        run_sequences=run_sequences(recipe),
        attention=attention,
        varlen_layers=served if fallback else 0,
        varlen_windows=windows,
        cudnn_long_examples=implementation == "varlen"
        and recipe.model.cudnn_long_examples
        and card_runs_cudnn_long_examples(preset.gpu_model, preset.vendor),
        global_batch_size=recipe.train.global_batch_size,
        micro_batch=micro if isinstance(micro, int) else None,
        checkpointing=recipe.train.activation_checkpointing,
        checkpoint_layers=recipe.resolved.checkpoint_layers if recipe.resolved else None,
        strategy=recipe.distributed.strategy,
        sync_each_batch=sync_each_batch_pin(recipe),
        nvme_path=recipe.distributed.nvme_path or preset.nvme_path,
        # finetune's sharded load reads 16-bit tensors; a checkpoint loaded dequantized loads whole (sharded_load)
        sharded_load=loads_sharded(recipe) and not arch.dequantized_from,
        load_copies=recipe.model.init == "random" or arch.checkpoint_dtype != recipe.model.dtype,
        final_save=not (recipe.resolved and recipe.resolved.measure),
        save_gathers_model=not final_save_gathers_trained_only(recipe),
    )
    # a resolved recipe trains as compiled (one resolved before the keys existed did not pad, and ran cuDNN)
    if recipe.resolved:
        return replace(job, row_multiple=recipe.resolved.row_multiple, cudnn_attention=recipe.resolved.cudnn_attention)
    return replace(job, row_multiple=row_multiple(job), cudnn_attention=not cudnn_attention_off(job))


def lookup(recipe, *, hardware: str | None = None):
    """(arch, preset, hardware source) of `recipe` on `hardware` (a preset name, preset file, or auto;
    default recipe.hardware). Looked up once per command and passed down: `auto` runs nvidia-smi."""
    from finetune.recipe.load import recipe_dir
    from finetune.registry import get_preset, resolve_model

    base = recipe_dir(recipe)
    arch = resolve_model(recipe.model, base_dir=base)
    source = hardware or recipe.hardware
    preset = get_preset(source, base_dir=base)
    if source != preset.name and source != "auto":  # a preset file: remember where it is
        source = str(anchored(source, base).resolve())
    return arch, preset, source


def plan(recipe, *, hardware: str | None = None) -> Plan:
    """Plan `recipe` on `hardware` (a preset name, preset file, or auto; default recipe.hardware)."""
    arch, preset, source = lookup(recipe, hardware=hardware)
    return plan_on(recipe, arch=arch, preset=preset, source=source)


def plan_on(recipe, *, arch, preset, source: str) -> Plan:
    """Plan `recipe` on an architecture and preset already looked up (see `lookup`)."""
    from finetune.recipe.load import recipe_dir
    from finetune.registry import stand_in_warning

    warning = context_check(recipe, arch)
    stand_in = stand_in_warning(recipe.model, arch, base_dir=recipe_dir(recipe))
    job = job_from_recipe(recipe, arch=arch, preset=preset)

    def on_preset(other):
        """The recipe's job on another preset, for the hardware suggestions: its kernels are chosen there."""
        try:
            return job_from_recipe(recipe, arch=arch, preset=other)
        except RecipeError:  # the recipe pins what that hardware cannot run (FlashAttention-3 off Hopper, ...)
            return None

    result = plan_job(job, on_preset=on_preset)
    if source == "auto" and result.chosen.bottleneck == "host":
        layer = probe_layer(job, checkpointed_layers=result.checkpoint_layers)
        measured = with_measured_host(job, config=model_config_text(recipe, arch), layer=layer)
        if measured is not job:
            job = measured
            result = plan_job(job, on_preset=on_preset)
    swap_warning = ""
    if strategies.info(result.strategy).offload == "nvme":
        job, disk, swap_warning = swap_disk(job, local=source == "auto")
        if job.nvme_read_gbps:
            result = plan_job(job, on_preset=on_preset)
        result.disk = disk
    result.substitutions = substitutions(recipe, result, arch=arch)
    task_eval_check(job, result)
    warnings = (
        stand_in,
        warning,
        attention_fallback_warning(job, result),
        master_weights_warning(job, result, dtype=recipe.model.dtype),
        routed_experts_warning(job, dtype=recipe.model.dtype),
        fp32_compute_warning(job),
        liger_missing_warning(recipe, job, result),
        random_build_warning(recipe, job, result),
        pinned_strategy_warning(job, result),
        pinned_setting_warning(job, result),
        dora_dropout_warning(job, result),
        batch_change_warning(job, result),
        compile_warning(recipe),
        profiler_warning(recipe),
        swap_warning,
    )
    result.warnings = [w for w in warnings if w]
    result.hardware_source = source
    return result


def liger_missing_warning(recipe, job: Job, plan: Plan) -> str:
    """'' unless train.liger: auto planned an NVIDIA run of a model Liger patches without Liger because
    liger-kernel is not installed where the plan was made (liger_enabled): the run on a machine that has it
    is faster than this plan and keeps less memory."""
    from finetune.registry.families import LIGER_MODEL_TYPES

    if recipe.train.liger != "auto" or job.liger or job.preset.vendor != "nvidia":
        return ""
    if job.arch.family not in LIGER_MODEL_TYPES:
        return ""
    share = plan.checkpoint_layers / job.arch.num_layers  # the chosen count, already within the model's layers

    def step_unfused(j: Job) -> float:
        return plan.gradient_accumulation_steps * unfused_seconds(
            j, micro_batch=plan.micro_batch_size, checkpointed_share=share
        )

    # what Liger's kernels would save: not the SwiGLU's passes where finetune leaves them to transformers
    unfused = step_unfused(job) - step_unfused(replace(job, liger=True))
    return (
        f"planned without Liger's kernels: liger-kernel is not installed here (pip install 'finetune[gpu]' where "
        f"the run trains turns them on); that plan has {unfused:.2f} s of each {plan.step_time_s:.2f} s step in "
        f"unfused norm, RoPE and SwiGLU passes, and more activation memory, than the run with them (set "
        f"train.liger: on to plan with them; the run then needs liger-kernel)"
    )


# a model at least this large built at random on one host's CPU takes minutes (below: seconds to a minute or two)
RANDOM_BUILD_WARN_PARAMS = 10e9


def random_build_warning(recipe, job: Job, plan: Plan) -> str:
    """'' unless model.init: random builds a large model whole on the main rank's CPU under FSDP2
    (train/model.py: random_model) because the sharded load does not apply (schema.sharded_load_blocker)."""
    if recipe.model.init != "random" or not strategies.is_fsdp(plan.strategy) or job.sharded_load:
        return ""
    total = count_params(job.arch).total
    if total < RANDOM_BUILD_WARN_PARAMS:
        return ""
    why = sharded_load_blocker(recipe) or "distributed.sharded_load is off"
    return (
        f"model.init: random builds all {total / 1e9:.0f}B random weights on the main rank's CPU before FSDP2 "
        f"shards them, because {why}: that takes many minutes before the first step (a 70B DPO run had not "
        f"started training after 10 minutes on a 64-core host); the sharded load builds each rank's shard instead"
    )


def fp32_compute_warning(job: Job) -> str:
    """'' unless the run computes in float32 on a GPU: its matmuls run at the card's FP32 rate (PyTorch leaves
    TF32 off), which the plan times, and it is rarely what was meant."""
    p = job.preset
    if not job.computes_fp32 or p.vendor == "cpu":
        return ""
    return (
        f"this run computes in float32 (train.precision: fp32 with float32 weights): its matmuls run at "
        f"{job.peak_tflops:.0f} TFLOP/s per GPU, not the {p.peak_bf16_tflops:.0f} of bf16, as planned; set "
        f"train.precision: bf16 to keep float32 weights and compute in bf16"
    )


def model_config_text(recipe, arch) -> str:
    """The text of the config.json of the recipe's model where this machine has one (a local folder, the Hugging
    Face cache) and `model.arch` does not stand in for it, else the registry's for `arch` (registry/hfconfig.py):
    the model the host probe builds its layer of."""
    import json

    from finetune.recipe.load import recipe_dir
    from finetune.registry.derive import find_config_json
    from finetune.registry.hfconfig import hf_config

    found = find_config_json(
        recipe.model.name, base_dir=recipe_dir(recipe), revision=getattr(recipe.model, "revision", None)
    )
    if found is not None and not getattr(recipe.model, "arch", None):
        return found.read_text(encoding="utf-8")
    return json.dumps(hf_config(arch))


def with_measured_host(job: Job, *, config: str | None = None, layer: ProbeLayer = PLAIN_LORA) -> Job:
    """For a host-bound plan made for this machine: the job with this machine's host time a kernel of its model's
    layer (`config`: the text of its config.json; a Llama layer's without) with the run's layer settings (`layer`:
    hostprobe.probe_layer), timed on its GPU (finetune/hostprobe.py, a child process of 10-30 s, once per process,
    model and settings), instead of the slowest host measured; the job itself where it cannot be timed (no NVIDIA
    GPU here, or the probe failed)."""
    from finetune.hostprobe import measured_s_per_kernel

    if job.preset.vendor != "nvidia" or job.preset.host_s_per_kernel:
        return job
    measured = measured_s_per_kernel(config, layer)
    if measured is None:
        return job
    return replace(job, preset=job.preset.model_copy(update={"host_s_per_kernel": measured}))


def swap_disk(job: Job, *, local: bool) -> tuple[Job, str, str]:
    """For an NVMe plan: the job with its swap directory's read bandwidth, the plan's words for where that
    figure came from, and a warning ('' if none). Planning for this machine (`--hardware auto`) measures it
    (registry/disk.py: a second or two, only for a plan that swaps to disk); a named preset's figure describes
    that preset's disk."""
    path = job.nvme_path or "(none)"
    if local and job.nvme_path:
        measured = read_gbps(job.nvme_path)
        if measured:
            kind = filesystem_type(job.nvme_path)
            how = (
                f"O_DIRECT, {probe_readers(kind)} x {AIO_BLOCK_BYTES >> 20} MiB in flight, as DeepSpeed's async_io "
                "reads there"
            )
            warning = ""
            if kind in RAM_FILESYSTEMS:
                warning = (
                    f"distributed.nvme_path: {path} is in RAM ({kind}), which DeepSpeed "
                    f"reads on one thread ({measured:.1f} GB/s measured); zero3-offload keeps the same states in "
                    "host RAM and copies them to the GPU without the swap files: set distributed.strategy: "
                    "zero3-offload, or point nvme_path at a local NVMe disk"
                )
            return (
                replace(job, nvme_read_gbps=measured),
                f"swap {path} read at {measured:.2f} GB/s (measured: {how})",
                warning,
            )
    if job.preset.nvme_bandwidth_gbps:
        return job, f"swap {path} read at {job.preset.nvme_bandwidth_gbps:g} GB/s (preset {job.preset.name})", ""
    why = "could not be measured there" if local else "the preset gives no figure"
    fix = "set nvme_bandwidth_gbps in a preset file"
    return job, f"swap {path} read at {nvme_read_gbps(job):g} GB/s assumed ({why}; {fix})", ""


def pinned_strategy_warning(job: Job, plan: Plan) -> str:
    """'' unless distributed.strategy is pinned and another strategy fits the same setting and is modelled
    clearly faster (choose.CLEARLY_FASTER; a converted peer config often pins an offload tier the GPUs do
    not need). The planner's own preference among the others decides which one is named."""
    if job.strategy == "auto" or not plan.fits:
        return ""
    others = [c for c in plan.candidates if c.fits and c.strategy != plan.strategy]
    if not others:
        return ""
    best = simplest_near_fastest(others)
    if not clearly_faster(best.step_time_s, plan.step_time_s):
        return ""
    return (
        f"distributed.strategy: {plan.strategy} is pinned, but {best.strategy} fits too "
        f"({best.per_gpu_memory_gib:.1f} GiB per GPU) and is modelled {plan.step_time_s / best.step_time_s:.1f}x "
        f"faster ({best.step_time_s:.2f} against {plan.step_time_s:.2f} s/step); set distributed.strategy: auto "
        f"to let the planner choose, or {best.strategy}"
    )


# a global batch the plan changes by this factor or more (either way) is said as a warning, not only in the "why":
# the recipe's learning rate and step count were chosen for the batch it asked for
BATCH_CHANGE_WARNED = 1.25


def batch_change_warning(job: Job, plan: Plan) -> str:
    """'' unless the achievable global batch (micro-batch x accumulation x ranks) is far from train.global_batch_size:
    a pinned micro-batch times the GPUs exceeds it, or it leaves GPUs a fraction of a sequence (a converted peer
    config's batch is one GPU's: peers multiply by the GPU count)."""
    asked, got, world = job.global_batch_size, plan.global_batch_size, job.preset.world_size
    if not plan.fits or not asked or 1 / BATCH_CHANGE_WARNED < got / asked < BATCH_CHANGE_WARNED:
        return ""
    pinned = bool(job.micro_batch and job.micro_batch * world > asked)
    why = (
        f"the pinned train.micro_batch_size {job.micro_batch} x {world} ranks is the smallest batch it can be"
        if pinned
        else f"{asked} sequences do not spread evenly over {world} ranks"
    )
    keep = "unpin train.micro_batch_size (auto) to keep it, or " if pinned else ""
    return (
        f"train.global_batch_size {asked} becomes {got} on {world} GPU{'s' if world > 1 else ''} "
        f"({got / asked:.2g}x): {why}, and the recipe's learning rate and steps were chosen for {asked}; "
        f"{keep}set train.global_batch_size: {got} to accept it"
    )


def pinned_setting_warning(job: Job, plan: Plan) -> str:
    """'' unless train.micro_batch_size or train.activation_checkpointing is pinned and the same strategy, free
    to choose both, is modelled clearly faster (choose.CLEARLY_FASTER): converted peer configs pin them, often
    at micro-batch 1 or 2 with checkpointing on, where the host's launching (plan/host_time.py) or the
    recompute bounds the step."""
    pins = [
        k
        for k, pinned in (
            ("train.micro_batch_size", job.micro_batch is not None),
            ("train.activation_checkpointing", job.checkpointing != "auto"),
        )
        if pinned
    ]
    if not pins or not plan.fits:
        return ""
    free = best_for_strategy(replace(job, micro_batch=None, checkpointing="auto"), plan.strategy)
    if not free.fits or not clearly_faster(free.step_time_s, plan.step_time_s):
        return ""
    layers = job.arch.num_layers
    return (
        f"{' and '.join(pins)} {'are' if len(pins) > 1 else 'is'} pinned: micro-batch {plan.micro_batch_size} "
        f"{_checkpointing_words(plan.checkpoint_layers, layers)}; micro-batch {free.micro_batch_size} "
        f"{_checkpointing_words(free.checkpoint_layers, layers)} fits too under {plan.strategy} "
        f"({free.per_gpu_memory_gib:.1f} GiB per GPU, the same global batch) and is modelled "
        f"{plan.step_time_s / free.step_time_s:.1f}x faster; remove the pin{'s' if len(pins) > 1 else ''} to let "
        "the planner choose"
    )


def dora_dropout_warning(job: Job, plan: Plan) -> str:
    """'' unless DoRA trains with lora dropout and its strategy without the dropout is modelled clearly faster
    (choose.CLEARLY_FASTER): peft's DoRA then recomputes every adapted linear's base output on the dropped-out input
    (plan/dora_time.py), and where it casts the input to fp32 or dequantizes the base keeps a 16-bit copy of each
    adapted weight for the backward (memory.dora_dropout_weight_bytes). Peer configs carry lora_dropout 0.05 from
    LoRA recipes, where dropout costs little."""
    if not job.dora_recomputes_base or not plan.fits:
        return ""
    without = best_for_strategy(replace(job, lora_dropout=0.0), plan.strategy)
    if not without.fits or not clearly_faster(without.step_time_s, plan.step_time_s):
        return ""
    copies = dora_dropout_weight_bytes(job, casts=adapter_input_casts(job, plan.strategy)) * job.arch.num_layers
    kept = (
        f", and keeps a 16-bit copy of each adapted weight for the backward ({copies / GIB:.1f} GiB with no layer "
        f"checkpointed)"
        if copies
        else ""
    )
    return (
        f"adapter.dropout {job.lora_dropout:g} with DoRA: peft recomputes each adapted linear's base output on the "
        f"dropped-out input (a second matmul of every adapted weight, forward and backward){kept}; with "
        f"adapter.dropout: 0 {plan.strategy} is modelled {plan.step_time_s / without.step_time_s:.1f}x faster "
        f"({without.step_time_s:.2f} against {plan.step_time_s:.2f} s/step, {without.per_gpu_memory_gib:.1f} GiB "
        f"per GPU)"
    )


def routed_experts_warning(job: Job, *, dtype: str) -> str:
    """'' unless an adapter trains an MoE model: its routed experts get no LoRA (and under QLoRA stay 16-bit), which
    a recipe written for transformers 4 (where `all-linear` reached every expert's linears) would not expect."""
    if job.arch.num_experts <= 1 or job.adapter == "full" or job.lora_experts:
        return ""
    params = count_params(job.arch)
    routed = params.layers - params.layers_linear  # the fused experts (with the layers' norms: a rounding error)
    arch = job.arch
    reached = ["the attention"]
    if arch.shared_expert_intermediate_size:
        reached.append("the shared experts")
    if arch.moe_layers is not None and arch.moe_layers < arch.num_layers:
        reached.append("the dense layers' MLPs")
    said = (
        f"{arch.key}'s routed experts ({routed / 1e9:.1f}B of its {params.total / 1e9:.1f}B parameters) train no "
        f"LoRA: transformers 5 holds them as fused 3D parameters, not nn.Linear modules, so adapter.target_modules "
        f"can reach {', '.join(reached[:-1]) + ' and ' + reached[-1] if len(reached) > 1 else reached[0]} only "
        f"(this recipe: {trainable_params(job) / 1e6:.1f}M trainable); adapter.target_experts: true adds an "
        "adapter per expert (planned: more memory and time)"
    )
    if job.adapter == "qlora":
        said += f"; bitsandbytes quantizes nn.Linear weights only, so the experts load in {dtype} (planned so)"
    return said


def master_weights_warning(job: Job, plan: Plan, *, dtype: str) -> str:
    """'' unless the plan steps a full fine-tune's 16-bit weights without fp32 masters (memory.steps_16bit_weights):
    DDP pinned (it is never chosen for such a run: choose.not_applicable)."""
    if not plan.fits:
        return ""
    saved = saved_modules(job)
    if saved and steps_16bit_params(job, plan.strategy):
        modules = ", ".join(saved)
        return (
            f"{plan.strategy} steps the adapter.modules_to_save copies ({modules}) in {dtype} without fp32 master "
            f"copies (peft copies them in the model's dtype; only the LoRA weights are fp32): an AdamW update "
            f"smaller than half a {dtype} step of its weight rounds away; fsdp2, zero2 and zero3 keep fp32 masters "
            "of them"
        )
    if not steps_16bit_weights(job, plan.strategy):
        return ""
    fix = (
        "set distributed.strategy: zero2 (the parameters replicated as under ddp, with fp32 masters) or auto"
        if job.preset.world_size > 1
        else "set model.dtype: float32 (fp32 weights the optimizer steps, bf16 compute under autocast: 16 bytes "
        "a parameter and autocast's bf16 copies of the weights, instead of 12) or distributed.strategy: zero2 "
        "(DeepSpeed keeps fp32 masters on one GPU too)"
    )
    return (
        f"{plan.strategy} steps this full fine-tune's {dtype} weights without fp32 master copies: an AdamW update "
        f"smaller than half a {dtype} step of its weight rounds away (at lr 1e-5 most of them), so the run learns "
        f"far less per step than with masters; {fix}"
    )


def context_check(recipe, arch) -> str:
    """data.max_length against the positions the model was trained on (max_position_embeddings): beyond
    them RoPE meets angles it never saw and the model degrades silently, so a length past what the model's
    RoPE reaches is refused. The reach is factor x the original context of the RoPE scaling training runs:
    config.json's own (arch.rope_scaling) with model.rope_scaling merged over it, as train/model.py merges
    them. A length past max_position_embeddings that the scaling reaches is said as a warning (returned;
    '' when none)."""
    length, native = recipe.data.max_length, arch.max_position_embeddings
    if length <= native:
        return ""
    own = dict(arch.rope_scaling or {})
    override = dict(recipe.model.rope_scaling or {})
    if "type" in override:
        override.setdefault("rope_type", override.pop("type"))
    scaling = {**own, **override}
    # a config's factor without its original context is already in max_position_embeddings (Gemma-3's linear)
    if not override and "original_max_position_embeddings" not in own:
        scaling = {}
    whose = (
        "config.json's RoPE scaling with model.rope_scaling merged over it"
        if own and override
        else "model.rope_scaling"
        if override
        else "config.json's RoPE scaling"
    )
    if not scaling:
        factor = -(-length // native)
        raise RecipeError(
            f"{length} tokens are beyond {arch.key}'s max_position_embeddings {native}: the model "
            f"has never seen positions past {native}",
            key="data.max_length",
            hint=(
                f"set data.max_length to {native} or less, or extend the context with model.rope_scaling, "
                f"e.g. {{rope_type: yarn, factor: {factor}, original_max_position_embeddings: {native}}}"
            ),
        )
    factor = float(scaling.get("factor", 1.0))
    original = int(scaling.get("original_max_position_embeddings", native))
    reach = int(original * factor)
    if length > reach:
        raise RecipeError(
            f"{length} tokens are beyond what {whose} reaches: {scaling.get('rope_type', 'rope scaling')} "
            f"factor {factor:g} x {original} positions = {reach}",
            key="data.max_length",
            hint=f"raise model.rope_scaling.factor to {length / original:g} or more (the other RoPE keys stay "
            f"as they are), or lower data.max_length to {max(reach, native)}",
        )
    kind = scaling.get("rope_type", "rope scaling")
    return (
        f"data.max_length {length} is beyond {arch.key}'s max_position_embeddings {native}; positions "
        f"past {native} rely on {whose} ({kind}, factor {factor:g}, reach {reach}): check "
        f"the model on long inputs after training"
    )


def compile_warning(recipe) -> str:
    """'' unless the run compiles what the plan times as eager kernels: train.compile: regions (measured on 8B
    LoRA, one H200: 0.92x eager's steady tokens/s and 1.04x its reserved memory, after ~90 s of compiling;
    docs/benchmarks.md), or flex attention (compiled at its first call and again at new row lengths)."""
    said = []
    if recipe.train.compile == "regions":
        said.append(
            "train.compile: regions is planned as eager: on 8B LoRA (one H200) it ran at 0.92x eager's steady "
            "tokens/s with 1.04x its reserved memory, after ~90 s of compiling in the first steps"
        )
    if recipe.model.attn_implementation == "flex_attention":
        said.append(
            "model.attn_implementation: flex_attention is planned as flash attention; torch compiles its kernel at "
            "the first step and again at new row lengths, which the step time leaves out"
        )
    return "; ".join(said)


# host RAM the profiler's event buffers added per process in the calibration's profiled runs against the same
# setting unprofiled (tests/data/gpu_calibration.json rows 140-147, 162-163, 176, 185: one H200 process each); it
# grows with the operators the window records but not in proportion to the kernels (docs/validation.md), so it is
# said, not planned
PROFILER_HOST_GIB = (0.3, 3.0)


def profiler_warning(recipe) -> str:
    """'' unless logging.profile_steps: the profiled steps hold host RAM and time the plan leaves out."""
    if not recipe.logging.profile_steps:
        return ""
    low, high = PROFILER_HOST_GIB
    start, stop = recipe.logging.profile_steps
    return (
        f"logging.profile_steps [{start}, {stop}): the profiler's event buffers held {low:g}-{high:g} GiB more host "
        f"RAM per process in measured runs, which the host figure leaves out, and the profiled steps run slower "
        f"than the plan's step time"
    )


def task_eval_check(job: Job, result: Plan) -> None:
    """data.task_eval's second copy of the model on rank 0's GPU (memory.task_eval_peak), refused before anything
    loads where it cannot fit the card beside the trainer (a 70B model's 131 GiB copy never fits an 80 GB one)."""
    if not result.fits or result.memory is None or task_eval_fits(job, result.memory):
        return
    held, copy = task_eval_peak(job, result.memory)
    raise RecipeError(
        f"the exact-match eval generates with a whole copy of the model on one GPU ({copy / GIB:.1f} GiB) next to "
        f"the {held / GIB:.1f} GiB the trainer keeps there under {result.strategy}: {(held + copy) / GIB:.1f} GiB "
        f"against the card's {job.preset.gpu_memory_gib:g} GiB",
        key="data.task_eval",
        hint="remove data.task_eval (the trained run can be scored afterwards on a GPU the model fits alone: "
        "`finetune generate RUN_DIR --file PROMPTS`), or plan on GPUs with more memory",
    )


# what bitsandbytes steps on the CPU for a paged optimizer (bitsandbytes/optim/optimizer.py falls back with a warning)
UNPAGED = {"paged_adamw_8bit": "adamw_8bit", "paged_adamw_32bit": "bitsandbytes' unpaged 32-bit AdamW"}


def substitutions(recipe, result: Plan, *, arch: ModelArch) -> list[str]:
    """What the compiled run will use instead of what the recipe asked for (printed with the plan)."""
    out = []
    if arch.dequantized_from:
        loader = DEQUANTIZING_CONFIGS[arch.dequantized_from]
        out.append(
            f"model weights: the published {arch.dequantized_from} checkpoint -> {recipe.model.dtype}, dequantized "
            f"while loading (transformers' {loader}(dequantize=True)); trained, planned and saved as the 16-bit model"
        )
    if recipe.adapter.type != "full" and recipe.adapter.dropout and not trained_lora_dropout(recipe):
        out.append(
            f"adapter.dropout {recipe.adapter.dropout:g} -> 0: TRL's {recipe.method.type} trainer turns the model's "
            "dropout off (its disable_dropout, which finetune keeps), so the adapters train without it"
        )
    optimizer = recipe.train.optimizer
    if result.device == "cpu" and optimizer in UNPAGED:
        out.append(
            f"train.optimizer {optimizer} -> {UNPAGED[optimizer]}: bitsandbytes pages optimizer states "
            "between GPU memory and host RAM, and on the CPU it steps them unpaged (its states live in host RAM "
            "already)"
        )
    if result.fits and strategies.offloads_optimizer(result.strategy) and optimizer != "adamw":
        stepper = "DeepSpeed's CPU AdamW" if strategies.is_deepspeed(result.strategy) else "torch's AdamW on the CPU"
        out.append(
            f"train.optimizer {optimizer} -> {stepper}: under {result.strategy} the "
            f"optimizer states live in host RAM and are stepped there"
        )
    return out


def micro_batch_check(job: Job) -> None:
    """A method that trains micro-batches of at least 2 (recipe.schema.MIN_MICRO_BATCH) needs that many sequences
    per GPU a step: refused here, before a model loads, where TRL's trainer would refuse after."""
    if holds_a_micro_batch(job):
        return
    least, world = job.min_micro_batch, job.preset.world_size
    raise RecipeError(
        f"method {job.method} trains micro-batches of at least {least}: train.global_batch_size "
        f"{job.global_batch_size} over {world} GPUs gives each {batch_share(job)} sequence(s) a step",
        key="train.global_batch_size",
        hint=f"set train.global_batch_size: {least * world} or more (a multiple of {world})",
    )


def plan_job(job: Job, *, on_preset: Callable | None = None) -> Plan:
    """The plan of `job`; `on_preset` (see choose.suggestions) lets a job that does not fit suggest hardware."""
    micro_batch_check(job)
    p = job.preset
    chosen, candidates = search(job)
    world = p.world_size
    seqs = chosen.micro_batch_size * chosen.gradient_accumulation_steps * world
    tokens = seqs * mean_sequence_tokens(job) * job.sequences_per_sample  # real tokens, as a run counts them
    step = chosen.step_time_s
    rate = tokens / step if step > 0 else 0.0
    utilisation = mfu(
        tokens_per_second=rate,
        flops_per_token=job_model_flops_per_token(job),
        peak_tflops=p.peak_bf16_tflops,
        gpus=world,
    )
    plan = Plan(
        model=job.arch.key,
        hardware=p.name,
        adapter=job.adapter,
        method=job.method,
        strategy=chosen.strategy,
        fits=chosen.fits,
        micro_batch_size=chosen.micro_batch_size,
        gradient_accumulation_steps=chosen.gradient_accumulation_steps,
        activation_checkpointing=chosen.activation_checkpointing,
        checkpoint_layers=chosen.checkpoint_layers,
        num_layers=job.arch.num_layers,
        per_gpu_memory_gib=chosen.per_gpu_memory_gib,
        world_size=world,
        num_nodes=p.nodes,
        gpus_per_node=p.gpus_per_node,
        seq_len=job.seq_len,
        global_batch_size=seqs,
        tokens_per_step=round(tokens),
        step_time_s=step,
        tokens_per_second=rate,
        mfu=utilisation,
        why="",
        candidates=candidates,
        total_params=float(count_params(job.arch).total),
        active_params=float(count_params(job.arch).active),
        frozen_tower_params=float(count_params(job.arch).towers),
        trainable_params=float(trainable_params(job)),
        memory=chosen.memory,
        host_ram_gib=chosen.host_ram_bytes / GIB,
        host_ram_training_gib=chosen.host_ram_training_bytes / GIB,
        device="cpu" if p.vendor == "cpu" else "cuda",
    )
    plan.tight = chosen.tight
    plan.sync_each_batch = chosen.sync_each_batch
    plan.row_multiple = job.row_multiple if pads_rows(job, micro_batch=chosen.micro_batch_size) else None
    plan.cudnn_attention = job.cudnn_attention
    plan.kernels = _kernels(job, chosen.strategy, row_multiple=plan.row_multiple)
    plan.basis = basis_text(p, seq_len=job.seq_len)
    if strategies.info(chosen.strategy).offload == "nvme":
        plan.nvme_read_gbps = nvme_read_gbps(job)
    plan.host_s_per_kernel = job.preset.host_s_per_kernel or 0.0
    if chosen.fits:
        plan.why = _why(job, chosen, seqs, candidates)
    else:
        if job.strategy != "auto":
            plan.why = f"distributed.strategy {job.strategy} (pinned) does not fit: {chosen.reason}."
        else:
            plan.why = (
                f"no strategy fits; the closest, {chosen.strategy} at micro-batch "
                f"{chosen.micro_batch_size}, {chosen.reason}."
            )
        plan.suggestions = suggestions(job, candidates, on_preset=on_preset)
    return plan


def _kernels(job: Job, strategy: str, *, row_multiple: int | None) -> str:
    """The kernels line; `row_multiple`: the plan's (what the run pads at the chosen micro-batch)."""
    attention = {
        "varlen": "varlen flash attention on packed rows",
        "flash": "flash attention",
        "sdpa": "sdpa attention",
        "eager": "eager attention",
    }[job.attention]
    fallback = packed_row_fallback_layers(job)
    if fallback:
        attention = (
            f"{job.attention} attention with a masked packed row on {fallback} of {job.arch.num_layers} "
            f"layers (the varlen kernel does not run them)"
            + (", varlen flash on the rest" if job.varlen_layers else "")
        )
    if job.packed and job.example_tokens and job.attention in ("varlen", "flash"):
        attention += f" (examples of ~{job.example_tokens:,.0f} tokens, token-weighted: data.example_tokens)"
    sliding = sliding_layer_count(job.arch) if job.attention in ("varlen", "flash") else 0
    if sliding:
        window = job.arch.sliding_window or 0
        attention += f", {sliding} of {job.arch.num_layers} layers within their {window:,}-token window"
    if long_examples_on_cudnn(job):
        full = " in the full layers" if sliding else ""
        attention += (
            f" (examples of {CUDNN_MIN_EXAMPLE_TOKENS:,} tokens or more{full} on cuDNN's causal attention: "
            "model.cudnn_long_examples)"
        )
    if row_multiple:
        rows = "packed rows" if job.packed else "sequences"
        why = (
            "Triton compiles Liger's kernels per length class"
            if job.attention != "sdpa"
            else "cuDNN plans each new length, and its masked backward needs whole 128-key tiles"
        )
        attention += f" ({rows} padded to a multiple of {row_multiple} tokens: {why})"
    if not job.cudnn_attention:
        attention += (
            f" (cuDNN's attention off: {job.method}'s padded rows cannot be rounded to whole 128-key tiles, which "
            "its masked backward needs; the memory-efficient kernel runs them)"
        )
    if job.sequence_tokens:
        rows = ", a packed row each" if job.packed and job.method in PACKED_EXAMPLE_METHODS else ""
        attention += (
            f" (sequences of ~{job.sequence_tokens:,.0f} tokens{rows}, the longest {job.longest_sequence_tokens:,}: "
            "data.sequence_tokens)"
        )
    liger = "no Liger"
    if job.liger:
        liger = (
            "Liger RMSNorm/RoPE/SwiGLU"
            if job.liger_swiglu
            else "Liger RMSNorm/RoPE (transformers' SwiGLU and grouped_mm experts: Liger's would replace the experts)"
        )
    parts = [attention, liger]
    if adapter_input_casts(job, strategy):
        parts.append("peft's fp32 adapter-input casts")
    if fused_lora_runs(job, strategy):
        grouped = (
            " with the linears of one input as one (adapter.fused_lora_groups)" if shared_input_groups(job) else ""
        )
        parts.append(f"fused LoRA layers (adapter.fused_lora){grouped}")
    elif job.adapter == "lora" and not job.dora:
        parts.append("peft's LoRA layers")
    return ", ".join(parts)


def _why(job: Job, chosen: Candidate, achieved: int, candidates: list[Candidate]) -> str:
    p = job.preset
    limit = usable_fraction(chosen) * p.gpu_memory_gib
    if job.strategy != "auto":
        first = f"{chosen.strategy} is pinned by the recipe and fits"
    else:
        first = f"{chosen.strategy} is the fastest strategy that fits"
        level = strategies.offload_level(chosen.strategy)
        faster = [
            c
            for c in candidates
            if c.fits and c.step_time_s < chosen.step_time_s and strategies.offload_level(c.strategy) == level
        ]
        if faster:
            best = min(faster, key=lambda c: c.step_time_s)
            first = (
                f"{chosen.strategy} fits and is kept over {best.strategy} (modelled "
                f"{1 - best.step_time_s / chosen.step_time_s:.0%} faster): a later tier must be more "
                f"than {CLEARLY_FASTER:.0%} faster to be chosen"
            )
        elif any(c.fits and strategies.offloads(c.strategy) and c.step_time_s < chosen.step_time_s for c in candidates):
            first += (
                " with the least offloading; more of the model on the host is the last resort"
                if level
                else " without offloading, the last resort"
            )
    first += (
        f" ({chosen.per_gpu_memory_gib:.1f} of {limit:.1f} GiB usable per "
        f"{'process' if p.vendor == 'cpu' else 'GPU'}, {chosen.step_time_s:.2f} s/step, "
        f"{chosen.bottleneck}-bound"
    )
    if strategies.offloads(chosen.strategy):
        first += f", {chosen.host_ram_bytes / GIB:.0f} GiB host RAM per node"
    elif peaks_at_final_save(
        peak=chosen.host_ram_bytes, training=chosen.host_ram_training_bytes, saving=chosen.host_ram_saving_bytes
    ):
        first += f", {chosen.host_ram_bytes / GIB:.0f} GiB host RAM per node {AT_FINAL_SAVE}"
    first += ")."
    if chosen.tight:
        offloading = [c for c in candidates if c.fits and strategies.offloads(c.strategy)]
        first += (
            f" It fits only within {TIGHT_HEADROOM:.0%} of GPU memory, not the usual {HEADROOM:.0%}: "
            "kept on the GPUs rather than offloaded"
            + (
                f" ({min(c.step_time_s for c in offloading):.2f} s/step at best)"
                if offloading
                else " (no offload tier fits either)"
            )
            + "; the planner's peaks have not been more than 4% under a measured one, and a rank that runs "
            "out of memory re-plans and resumes."
        )
    ckpt = _checkpointing_words(chosen.checkpoint_layers, job.arch.num_layers)
    pinned = job.micro_batch is not None or job.checkpointing != "auto"
    second = (
        f" Micro-batch {chosen.micro_batch_size} {ckpt} "
        f"{'as pinned' if pinned else 'is the fastest setting that fits'}, "
        f"x {chosen.gradient_accumulation_steps} accumulation steps x {p.world_size} "
        f"rank{'s' if p.world_size > 1 else ''} = global batch {achieved}"
    )
    if achieved != job.global_batch_size:
        second += f" (train.global_batch_size {job.global_batch_size} rounded to the nearest achievable)"
    return first + second + "." + _host_why(job, chosen) + _sync_why(job, chosen) + _no_ddp_why(job) + _bnb_why(job)


def _host_why(job: Job, chosen: Candidate) -> str:
    """What host-bound means on a GPU (plan/host_time.py); on the cpu preset the host is the Trainer's own work."""
    if chosen.bottleneck != "host" or job.preset.vendor == "cpu":
        return ""
    kernels = kernels_per_micro_batch(job, strategy=chosen.strategy, checkpointed_layers=chosen.checkpoint_layers)
    hooks = ""
    if strategies.is_zero3(chosen.strategy):
        uses = zero3_module_uses(job, checkpointed_layers=chosen.checkpoint_layers)
        hooks = f" and runs ZeRO-3's hooks ({uses:,} gathers and releases of a module's parameters)"
    launches = (
        f" The host launches this setting's kernels (about {kernels:,.0f} a micro-batch){hooks} more slowly than "
        f"the GPU runs them, so the GPU waits ({chosen.compute_time_s:.2f} s/step of GPU work); a larger "
        f"micro-batch, where it fits, gives each launch more work."
    )
    if job.preset.host_s_per_kernel:
        return (
            f"{launches} This machine's host took {job.preset.host_s_per_kernel * 1e6:.0f} us a kernel, measured "
            "on its GPU with a tiny copy of this model's layer, with this run's adapter, checkpointing and packing "
            "(finetune.hostprobe)."
        )
    fastest_host = host_seconds(
        job,
        strategy=chosen.strategy,
        grad_accum=chosen.gradient_accumulation_steps,
        checkpointed_layers=chosen.checkpoint_layers,
        s_per_kernel=FASTEST_HOST_S_PER_KERNEL,
    )
    share = soft_max(chosen.compute_time_s, fastest_host, p=HOST_GPU_OVERLAP_P) / chosen.step_time_s
    return (
        f"{launches} The host's speed is the machine's: this plan takes {HOST_S_PER_KERNEL * 1e6:.0f} us a kernel, "
        f"the slowest host measured, and at {FASTEST_HOST_S_PER_KERNEL * 1e6:.0f} us, the fastest, the step would "
        f"take {share:.0%} of its time (planning on the machine itself, --hardware auto, times its host)."
    )


def _no_ddp_why(job: Job) -> str:
    """Why ddp is not among the candidates of a 16-bit full fine-tune (choose.not_applicable)."""
    if job.strategy != "auto" or not steps_16bit_weights(job, "ddp"):
        return ""
    reason = not_applicable(job, "ddp")
    return f" ddp is not considered: it {reason}." if reason else ""


def _bnb_why(job: Job) -> str:
    """Which strategies bitsandbytes' optimizer rules out here (choose.bnb_tensor_too_large), and why."""
    if job.strategy != "auto":
        return ""
    excluded = {s: why for s in strategies.NAMES if (why := bnb_tensor_too_large(job, s))}
    if not excluded:
        return ""
    first = next(iter(excluded))
    return f" {', '.join(excluded)} {'is' if len(excluded) == 1 else 'are'} not considered: {excluded[first]}."


def _checkpointing_words(k: int, layers: int) -> str:
    if not k:
        return "without activation checkpointing"
    if k == layers:
        return "with activation checkpointing"
    return f"with activation checkpointing on {k} of {layers} layers"


def _sync_why(job: Job, chosen: Candidate) -> str:
    """Why the gradients are reduce-scattered every micro-batch (accelerate's sync_each_batch), when they are."""
    if not chosen.sync_each_batch:
        return ""
    if job.sync_each_batch is not None:
        return " Gradients are reduce-scattered every micro-batch (distributed.sync_each_batch: true, as pinned)."
    held = fsdp_accumulated_gradients(job) / GIB
    # the same strategy and headroom under the Trainer's no_sync
    default = best_for_strategy(replace(job, sync_each_batch=False), chosen.strategy, headroom=usable_fraction(chosen))
    without = (
        f"its fastest setting that fits, micro-batch {default.micro_batch_size} "
        f"{_checkpointing_words(default.checkpoint_layers, job.arch.num_layers)}, takes "
        f"{default.step_time_s:.2f} s/step"
        if default.fits
        else "nothing of it fits"
    )
    return (
        f" Gradients are reduce-scattered every micro-batch (accelerate's sync_each_batch, "
        f"{chosen.gradient_accumulation_steps} reduce-scatters per step instead of 1): the Trainer's no_sync would "
        f"hold {held:.1f} GiB of unsharded gradients per GPU until a step's last micro-batch, and {without}."
    )

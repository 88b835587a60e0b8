"""Per-GPU, per-host and NVMe bytes of one training configuration. Pure arithmetic.

Model states (bytes per parameter), the mixed-precision AdamW accounting of the ZeRO paper
(Rajbhandari et al. 2020, K = 12): 2 (16-bit weights) + 2 (16-bit gradients) + 4 (fp32 master
weights) + 8 (fp32 Adam moments) = 16 bytes/param. FSDP2 with fp32 sharded params and a bf16
compute copy (4 + 4 grads + 8) lands on the same 16; a model loaded in fp32 has no separate master
(4 + 4 + 8). Optimizer states by optimizer (`optimizer_bytes`): torch AdamW 2 moments like the param;
bitsandbytes' 8-bit (paged or not) 1 byte each + fp32 block absmax (2.03 bytes/param); paged_adamw_32bit
fp32 moments (8); Adafactor fp32 row + column statistics per matrix (~0 bytes/param), 4 under DeepSpeed.
- full: every parameter trainable at 16 bytes/param (12 with 8-bit moments).
- lora: frozen base in the model dtype; LoRA params r x (in + out) per targeted module per layer,
  in fp32 (PEFT upcasts adapters) with fp32 grads and Adam moments: 4 + 4 + 8 bytes each.
- qlora: linear weights of the layers in NF4: 0.5 byte/param plus one absmax per 64-block (fp32:
  0.0625 byte/param; with double quantization an 8-bit absmax + an fp32 scale per 256 blocks:
  1/64 + 4/16384 = 0.0159 byte/param, i.e. ~0.127 bits); embeddings, lm_head and norms stay 16-bit.
  The block statistics are not sharded: every rank holds all of them under FSDP2 and ZeRO-3 too.

Activations per token per decoder layer (bytes, act = 2 for bf16), counted from the tensors a
Llama-style block saves for backward (checked by listing saved tensors with
torch.autograd.graph.saved_tensors_hooks on an 8B-shaped layer): autograd keeps an operand only when
the other one needs a gradient, so a frozen base saves less than a full fine-tune.
  2 RMSNorms, each: the fp32 upcast input (4*h) + the output the next linear/LoRA keeps (act*h), and for
  a full fine-tune with torch's RMSNorm also the pre-weight input its weight gradient needs (act*h);
  Gemma-2/3 add a post-norm on each branch (its input kept; its output only feeds the residual add), and
  Qwen3/Gemma-3 norm every query and key head before RoPE (the input kept: 4*(q+kv), Liger act*(q+kv));
  attention (fused kernel, no s x s scores): q, k, v, the output (act*(2q + 2kv)) and the fp32
  logsumexp; RoPE inputs are not kept (cos/sin need no gradient). With an explicit mask (sdpa on packed
  rows or padded batches) transformers repeats k/v to all heads (act*q each) and torch turns the boolean
  mask into a float bias of rows x len^2 x act in every layer, kept by the memory-efficient kernel
  (measured: 1-GPU LoRA 8B with one packed 8192-token row allocates ~2 GiB more than twice the
  4096-token row, 32 x (8192^2 - 2 x 4096^2) x 2 B = 2.0 GiB); eager (not measured) keeps the
  scores instead: rows x heads x len^2 x (act + fp32 softmax 4); and the one 4-D mask transformers builds a
  forward for a packed row or padded rows, held through the layers, even where the varlen kernel never reads it
  (shared_mask_bytes: len^2 booleans, 4 GiB at a 64k row);
  SwiGLU MLP: gate, up, silu(gate), product = 4*act*i (the product only where down_proj needs it);
  mixture-of-experts layers as transformers' grouped_mm experts keep them: finetune/plan/moe_memory.py.
  LoRA: the r-wide intermediate per targeted module; with dropout a dropped-out copy of its input and the
  mask (act*in + in on a GPU, whose mask is boolean; the input's dtype on CPU), the copy replacing the shared
  norm output / MLP product as the cast's does (scripts/dora_rates.py, per module on an H200: 3 bytes per input
  feature with bf16 adapters; tests/unit/plan/test_memory.py on CPU).
  Under DDP peft keeps the adapters in fp32 and casts each targeted module's input to fp32, which
  autocast casts back to a new bf16 copy that the adapter keeps: one act*in copy per module, replacing
  the shared norm output / MLP product. finetune turns that cast off (adapter.cast_adapter_inputs:
  false, train/run.py): autocast then casts the shared bf16 input once per matmul, nothing extra kept.
  QLoRA (TRL casts its adapters to bf16), DeepSpeed (its engine casts every parameter to bf16: params_16bit) and
  FSDP2 (bf16 compute params) have no cast. Under ZeRO-3 every frozen base linear keeps its input as well
  (linears_keep_inputs). Measured on H100/H200 (tests/data/
  gpu_calibration.json): 1-GPU LoRA 8B allocates ~1.1e6 B/token more than 1-GPU QLoRA beyond the weight
  difference (32 layers x 4096-token micro-batch), FSDP2/ZeRO-3 LoRA matches QLoRA's per-token cost.
With activation checkpointing (per decoder layer): only each layer's input (act*h per token per layer)
plus one layer's full activations while it is recomputed.
Loss head: TRL's fused LM head (add_fused_lm_head, trl/kernels/chunked_logprob.py) projects 4096-token
x 32768-vocab tiles, so the (tokens, vocab) logits never exist: it keeps a copy of the final hidden
states (act*h per token), its backward accumulates their gradient in fp32 (4*h) before casting it back
(act*h), and for a trainable lm_head an fp32 weight-gradient accumulator (+ its cast). Without the fused
head: tokens x vocab x 12 bytes: bf16 logits (2) + fp32 upcast for the loss (4) + fp32 log-softmax
saved for backward (4) + bf16 logits gradient (2), ~1.5 MB per token for a 128k vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from finetune import strategies
from finetune.kernels import cudnn_padded_length
from finetune.plan.moe_memory import mlp_bytes_per_token_layer, routed_backward_bytes_per_token
from finetune.plan.optimizer import optimizer_bytes, optimizer_step_transient_bytes, paged_state_bytes
from finetune.plan.types import GIB, MemoryBreakdown
from finetune.plan.workload import (
    NORM_OUTPUT_READERS,
    Job,
    Tensors,
    accumulation_steps,
    adapter_tensors,
    count_params,
    expert_lora_param_count,
    kernel_attention_widths,
    largest_parameter_elements,
    layer_kinds,
    long_examples_on_cudnn,
    lora_params,
    masked_row_layers,
    model_tensors,
    module_shapes,
    numel,
    packed_example_tokens,
    peak_sequence_tokens,
    peak_tokens_per_micro_batch,
    routed_expert_params,
    saved_module_params,
    saved_module_tensors,
    sliding_layer_count,
    stepped_tensors,
    trained_tensor_sizes,
)
from finetune.registry.schema import ModelArch
from finetune.strategies import ZERO3_SUB_GROUP_ELEMENTS, info, is_fsdp

# Device memory outside torch's caching allocator, which torch.cuda.max_memory_reserved (the planned peak, and what
# the calibration measures) does not show: the CUDA context with the kernel images of the libraries loaded, and NCCL's
# channel buffers where there are several ranks. The fit check's headroom (choose.HEADROOM) leaves room for them.
CUDA_CONTEXT_BYTES = 1.0 * GIB
NCCL_BYTES = 0.5 * GIB
# The caching allocator's reserve beyond what is allocated at the peak (cuBLAS and cuDNN workspaces, blocks freed and
# kept): the median of max reserved - max allocated over the calibration rows, 0.46 GiB for DDP's ranks (155 rows)
# and 2.0-2.8 under DeepSpeed and FSDP2 (114 rows), whose gathered parameters and flat gradient buffers come and go
# every layer (docs/validation.md, twenty-ninth session). An adapter under ZeRO-1/2 has neither (its parameters are
# not gathered, its flat buffers are the adapter's megabytes): 0.28-0.50 GiB kept on all five such rows
# (allocator_reserve_bytes).
ALLOCATOR_RESERVE_BYTES = {"plain": 0.5 * GIB, "sharded": 2.0 * GIB}
# A plain rank's cached blocks are its own transients (a layer's activations, the loss head's chunks), so a small run
# keeps little: DDP ranks allocating under 30 GiB kept a median 0.12 GiB beyond it (38 rows), 30-60 GiB 0.31 (51),
# above 60 0.59 (101). The plain reserve is at most this share of the allocation (0.5 GiB from 20 GiB on).
PLAIN_RESERVE_SHARE = 0.025
CPU_FIXED_BYTES = 0.5 * GIB  # the Python/torch process itself on the cpu preset
FRAGMENTATION = 0.05  # caching-allocator fragmentation, as a share of everything else
HOST_PER_PROCESS_BYTES = 3 * GIB  # python + torch + CUDA libraries per rank, host RAM
# FSDP2's ranks keep more anonymous host memory than DDP's and DeepSpeed's (measured, each rank's share of the
# node's PSS while training; the cause is not identified): 2.2-3.9 GiB an adapter rank, 3.5-5.1 a full-fine-tune rank
HOST_PER_FSDP_ADAPTER_RANK_BYTES = 3.75 * GIB
HOST_PER_FSDP_FULL_RANK_BYTES = 5 * GIB
# a DeepSpeed rank of a full fine-tune without offload, likewise: 2.1-4.0 GiB on the H200 machines, ZeRO-2 and ZeRO-3
# on one to four GPUs (the top ones, Gemma-3-4B's full SFT and DPO, full 3B DPO and pretraining on one H200, not
# explained by the strategy's state; an H100 machine's one-process runs held more, test_calibration's HOST_MISSES),
# where its adapter ranks measure 1.9-2.2 (HOST_PER_PROCESS_BYTES): planned near the top of the range (row 242's 4.03
# is 3% above it; higher would put the lowest rows above their bound)
HOST_PER_DEEPSPEED_FULL_RANK_BYTES = 3.9 * GIB
LOGITS_BYTES_PER_ELEMENT = 12
# Job.nll_on_chosen: TRL's cross_entropy_loss slices the chosen half's logits shifted by one and makes them
# contiguous (a 16-bit copy), and the loss keeps its 16-bit log-softmax for the backward; read from TRL's code
# (trl/experimental/cpo, orpo), not measured on a GPU
NLL_BYTES_PER_ELEMENT = 4
FUSED_HEAD_TOKENS, FUSED_HEAD_VOCAB = 4096, 32768  # trl/kernels/chunked_logprob.py tile shape
NF4_BYTES = 0.5
NF4_SCALE_BYTES = 4 / 64  # one fp32 absmax per 64-element block
NF4_DOUBLE_QUANT_SCALE_BYTES = 1 / 64 + 4 / (64 * 256)
# ZeRO-Infinity's pinned swap buffers (the compiled offload_param / offload_optimizer buffer_count): the
# parameter swapper stages whole parameters, each buffer holding the largest one (nvme_param_buffer_elements);
# the optimizer swapper's hold the largest sub-group of a rank's fp32 partition
NVME_PARAM_BUFFERS = 5
NVME_OPTIMIZER_BUFFERS = 4


def nvme_param_buffer_elements(arch: ModelArch) -> int:
    """Elements of one ZeRO-Infinity parameter swap buffer: the largest parameter tensor, at least DeepSpeed's
    default 1e8, in whole MiB of elements. A smaller buffer makes DeepSpeed refuse to start."""
    return -(-max(largest_parameter_elements(arch), 100_000_000) // 2**20) * 2**20


def nvme_swap_buffer_bytes(job: Job, *, strategy: str, trainable_params: float) -> float:
    """One rank's pinned ZeRO-Infinity swap buffers in host RAM: NVME_PARAM_BUFFERS of the largest parameter in
    the model's dtype, NVME_OPTIMIZER_BUFFERS fp32 buffers of its largest optimizer sub-group."""
    params = NVME_PARAM_BUFFERS * nvme_param_buffer_elements(job.arch) * job.weight_bytes
    partition = trainable_params / state_shard_degree(job, strategy)
    optimizer = NVME_OPTIMIZER_BUFFERS * 4 * min(partition, strategies.ZERO3_NVME_SUB_GROUP_ELEMENTS)
    return params + optimizer


def zero_model_state_bytes(params: float, *, stage: int, world: int, k: float = 12) -> float:
    """Per-GPU model-state bytes under ZeRO stage 0-3 (ZeRO paper, Figure 1 / Section 5).

    16-bit params and grads are 2 + 2 bytes/param, optimizer states K bytes/param (K = 12 for mixed
    precision Adam): stage 0 (DDP) (2+2+K)P; stage 1 shards the optimizer states: (2+2)P + KP/N;
    stage 2 also the gradients: 2P + (2+K)P/N; stage 3 everything: (2+2+K)P/N.
    """
    if stage == 0:
        return (4 + k) * params
    if stage == 1:
        return 4 * params + k * params / world
    if stage == 2:
        return 2 * params + (2 + k) * params / world
    if stage == 3:
        return (4 + k) * params / world
    raise ValueError(f"ZeRO stage must be 0-3, got {stage}")


def shard_degree(job: Job, strategy: str) -> int:
    """Over how many ranks the parameters are split (1: replicated)."""
    p = job.preset
    if not info(strategy).shards_params:
        return 1
    if job.int8_base:  # each rank quantizes the whole base onto its GPU (bitsandbytes' Int8Params): choose.py refuses
        return 1
    if info(strategy).hybrid:
        return p.gpus_per_node
    return p.world_size


def state_shard_degree(job: Job, strategy: str) -> int:
    """Over how many ranks gradients and optimizer states are split: ZeRO-2 splits them across every
    rank while replicating the parameters."""
    if info(strategy).zero_stage == 2:
        return job.preset.world_size
    return shard_degree(job, strategy)


def paged_optimizer_bytes_per_rank(job: Job, *, strategy: str, states: StateBytes | None = None) -> float:
    """A rank's optimizer moments in CUDA managed memory (a paged optimizer's: optimizer.paged_state_bytes): on its
    GPU while it steps, outside torch's allocator, and mapped into its host process."""
    states = states or state_bytes(job, strategy)
    return states.paged_optimizer / state_shard_degree(job, strategy)


def task_eval_peak(job: Job, memory: MemoryBreakdown) -> tuple[float, float]:
    """(bytes the trainer keeps on rank 0's GPU, bytes of the whole model copy) while data.task_eval generates
    (train/taskeval.py: the base before training where the run has several processes, the trained model after it):
    the weights, trainable copies, optimizer state and overhead stay; activations are gone."""
    copy = weight_bytes(job) + (4.0 * lora_params(job) if job.adapter != "full" else 0.0)
    return memory.weights + memory.trainable + memory.optimizer + memory.overhead, copy


def task_eval_fits(job: Job, memory: MemoryBreakdown) -> bool:
    """The task eval's copy fits beside what the trainer keeps (always, for a job without one, or on CPU)."""
    if not job.task_eval or job.preset.vendor == "cpu":
        return True
    return sum(task_eval_peak(job, memory)) <= job.preset.gpu_memory_gib * GIB


def weight_bytes(job: Job) -> float:
    """Bytes of the (base) model weights as stored for training."""
    params = count_params(job.arch)
    if job.int8_base:  # LLM.int8 quantizes the linear layers; embeddings, head and norms keep the dtype
        linear = params.layers_linear
        return linear + (params.total - linear) * job.weight_bytes
    if job.adapter != "qlora":
        return params.total * job.weight_bytes
    linear = params.layers_linear
    return linear * NF4_BYTES + replicated_weight_bytes(job) + (params.total - linear) * job.weight_bytes


def replicated_weight_bytes(job: Job) -> float:
    """Bytes of the base every rank keeps whole whatever the strategy: QLoRA's block statistics (absmax)
    are held by the 4-bit modules (bitsandbytes' quant_state), not by the parameters that FSDP2 and ZeRO-3
    shard or offload, so every rank has all of them (tests/unit/train/test_sharded_load.py
    test_each_rank_keeps_the_whole_weights_quant_state)."""
    if job.adapter != "qlora":
        return 0.0
    scale = NF4_DOUBLE_QUANT_SCALE_BYTES if job.double_quant else NF4_SCALE_BYTES
    return count_params(job.arch).layers_linear * scale


def unit_bytes(job: Job) -> tuple[float, float]:
    """(largest decoder layer, root unit) bytes as gathered by FSDP/ZeRO-3 for compute."""
    params = count_params(job.arch)
    layer: float = params.layer * job.weight_bytes
    if job.adapter == "qlora":
        layer = weight_bytes(job) / params.num_layers  # close enough: layers dominate
    return layer, params.root * job.weight_bytes


@dataclass(frozen=True)
class StateBytes:
    """Whole-model (unsharded) bytes of each model state."""

    weights: float  # base/bf16 weights (+ reference model copy for DPO)
    trainable: float  # fp32 master weights (full) or fp32 LoRA weights
    gradients: float
    optimizer: float
    trainable_params: int
    paged_optimizer: float = 0.0  # the part of `optimizer` in CUDA managed memory (optimizer.paged_state_bytes)


def keeps_fp32_master(strategy: str | None) -> bool:
    """Whether trainable 16-bit parameters get fp32 master copies. accelerate's FSDP2 path upcasts every
    trainable parameter to fp32 before sharding (fsdp2_prepare_model: params, grads and Adam states are
    fp32 shards; MixedPrecisionPolicy casts the gathered copy to bf16 for compute) and DeepSpeed keeps fp32
    partitions next to its 16-bit ones. DDP trains the parameters in the dtype they were loaded in: a bf16
    model gets bf16 gradients and torch's AdamW creates its moments like the parameter (bf16), no master."""
    return strategy is None or info(strategy).backend != "ddp"


def steps_16bit_weights(job: Job, strategy: str) -> bool:
    """A full fine-tune whose optimizer steps the 16-bit weights themselves (`keeps_fp32_master` is false:
    DDP on a bf16/fp16 model). An AdamW update smaller than half a 16-bit step of its weight rounds away: at
    lr 1e-5 one step changes ~16% of bf16 weights of std 0.02 (tests/unit/plan/test_master_weights.py), and
    on GPUs full fine-tunes under DDP lost far less loss in 12 steps than the same runs under ZeRO-2/3 with
    fp32 masters (docs/validation.md, fourth session). The planner does not choose DDP for such a run where
    a strategy with masters applies, and warns where it runs anyway (`master_weights_warning`)."""
    return job.adapter == "full" and steps_16bit_params(job, strategy)


def steps_16bit_params(job: Job, strategy: str) -> bool:
    """The optimizer steps the trained 16-bit parameters of a 16-bit model as they are (no fp32 master): a full
    fine-tune's weights (`steps_16bit_weights`) or peft's modules_to_save copies, which peft makes in the
    model's dtype while it upcasts the LoRA weights to fp32."""
    return job.weight_bytes < 4 and not keeps_fp32_master(strategy)


def state_bytes(job: Job, strategy: str | None = None) -> StateBytes:
    """`strategy` None: the sharded strategies' accounting (fp32 masters), as the ZeRO paper counts."""
    master = keeps_fp32_master(strategy) and job.weight_bytes < 4
    if strategy is not None and info(strategy).offload_optimizer:
        job = replace(job, optimizer="adamw")  # compile resolves it so: the CPU steps fp32 Adam
    flat = strategy is not None and info(strategy).backend == "deepspeed"
    weights = weight_bytes(job)
    if job.reference == "copy":  # dpo/kto: a frozen reference model
        weights += count_params(job.arch).total * job.weight_bytes  # frozen reference model
    # parameters trained in the model's dtype: a full fine-tune, peft's modules_to_save copies
    n = count_params(job.arch).text_model if job.adapter == "full" else saved_module_params(job)
    if job.adapter != "full":
        weights += job.weight_bytes * n  # the trainable copy beside the frozen original
    trainable, grads = (4 * n if master else 0.0), job.weight_bytes * n
    if strategy is not None and info(strategy).backend == "fsdp" and master:
        # accelerate's FSDP2 upcasts what is trained to fp32 before sharding: no 16-bit copy of it stays
        # (the compute copy exists only while a unit is gathered), and its gradients are fp32 shards
        weights -= job.weight_bytes * n
        grads = 4 * n
    embeddings, others = stepped_tensors(job)
    param_bytes = 4 if master else job.weight_bytes
    # the Trainer's 32-bit override of an embedding's states (optimizer.keeps_32bit_states, which leaves DeepSpeed's
    # flat partitions out); strategy None accounts as the sharded strategies do, without it
    override = strategy is not None
    optimizer = optimizer_bytes(job.optimizer, others, param_bytes=param_bytes, flat=flat)
    optimizer += optimizer_bytes(job.optimizer, embeddings, param_bytes=param_bytes, flat=flat, embedding=override)
    paged = paged_state_bytes(job.optimizer, others, flat=flat)
    paged += paged_state_bytes(job.optimizer, embeddings, flat=flat, embedding=override)
    if job.adapter != "full":
        lora = lora_params(job)  # peft keeps LoRA weights in fp32: fp32 grads and moments
        trainable += 4 * lora
        grads += 4 * lora
        optimizer += optimizer_bytes(job.optimizer, adapter_tensors(job), param_bytes=4, flat=flat)
        paged += paged_state_bytes(job.optimizer, adapter_tensors(job), flat=flat)
        n += lora
    return StateBytes(weights, trainable, grads, optimizer, n, paged)


def peft_casts_adapter_inputs(*, adapter: str, strategy: str, autocast: bool) -> bool:
    """Where peft by default runs fp32 adapters and casts each targeted module's input to fp32, and autocast
    would cast it straight back: LoRA under DDP with bf16/fp16 autocast (see the module docstring). One rule
    for the planner and for finetune/train/model.py, which turns the cast off there unless
    adapter.cast_adapter_inputs or DoRA (without autocast the cast is what makes the fp32 matmul run). Not under
    DeepSpeed, whose engine casts every parameter to the compute dtype (params_16bit), the adapters too: peft's
    cast to the adapter's dtype is then none."""
    return adapter == "lora" and not strategies.shards_params(strategy) and not params_16bit(strategy) and autocast


def params_16bit(strategy: str) -> bool:
    """DeepSpeed's engine casts every parameter to the 16-bit compute dtype before training (ZeRO-1/2 too:
    engine._configure_distributed_model), so an adapter's weights and DoRA's magnitude, which peft and TRL would
    keep in fp32, train in 16 bits (row blind1-14: DoRA under ZeRO-2)."""
    return strategies.is_deepspeed(strategy)


def linears_keep_inputs(job: Job, strategy: str) -> bool:
    """ZeRO-3 replaces torch.nn.functional.linear for the process (deepspeed.zero.Init's memory_efficient_linear,
    on by default) with LinearFunctionForZeroStage3, which saves its input for the backward whether or not the
    weight needs a gradient: every frozen 16-bit base linear of an adapter keeps its input, where torch's linear
    keeps only the weight. It adds to the count where nothing else keeps that input: the norm outputs and the
    SwiGLU product once lora dropout gives the adapters their own copies, and the product before an untargeted
    down_proj (row blind5-07: LoRA with dropout under ZeRO-3, no checkpointing, 10.3 GiB over the plan). A
    quantized base runs bitsandbytes' own matmul, not torch's linear."""
    return strategies.zero_stage(strategy) == 3 and job.adapter == "lora" and not job.quantized_base


def adapter_input_casts(job: Job, strategy: str) -> bool:
    """Whether the casts run in this job (finetune keeps them only on request or for DoRA)."""
    return (job.cast_adapter_inputs or job.dora) and peft_casts_adapter_inputs(
        adapter=job.adapter, strategy=strategy, autocast=job.autocast
    )


def masked_attention(job: Job, *, micro_batch: int) -> tuple[int, int] | None:
    """(rows, row length) of the attention mask the kernel gets, None when it gets none."""
    if job.attention in ("flash", "varlen"):
        return None
    if job.packed:  # padding-free: one flat row (DPO: both sequences of each pair), a block-diagonal mask
        return 1, round(tokens_per_micro_batch(job, micro_batch))
    rows, longest = micro_batch * job.sequences_per_sample, round(peak_sequence_tokens(job))
    if rows > 1:  # padded to the batch's longest (DPO: chosen and rejected are two rows)
        return rows, longest
    return (1, longest) if job.attention == "eager" else None  # sdpa: is_causal, no mask


def cudnn_kept_bytes_per_token_layer(job: Job) -> float:
    """A layer's bytes a token beyond the varlen kernel's where the packed row's long examples run on cuDNN
    (Job.cudnn_long_examples, finetune/kernels.py). Itemized by the memory profile of docs/validation.md's
    twenty-third session: cuDNN keeps its own output, of which the row's output (the output projection's input,
    the examples' outputs concatenated) is a second copy where the varlen kernel's output is both; and it keeps its
    zero-padded copies of the example's queries, keys and values, which stand in for the varlen kernel's kept
    inputs but for their padding (the short examples' inputs are copied too, so no view keeps the whole row's)."""
    # a packed row's served layers under sdpa are counted with repeated key/value heads already (the `repeated` term)
    if not (long_examples_on_cudnn(job) and job.attention == "varlen"):
        return 0.0
    length = packed_example_tokens(job)
    padded = cudnn_padded_length(round(length))
    q, k, v = kernel_attention_widths(job)  # MLA's values padded to the keys' head size, and so is the output
    inputs = padded if job.cudnn_keeps_row_inputs else padded - length
    full_layers = 1 - sliding_layer_count(job.arch) / job.arch.num_layers  # sliding layers stay on the varlen kernel
    return full_layers * job.act_bytes * (q * padded + (q + k + v) * inputs) / length


def activation_bytes_per_token_layer(
    job: Job, *, micro_batch: int = 1, casts: bool = False, fp32_stream: bool = False, keeps_inputs: bool = False
) -> float:
    """Bytes a decoder layer keeps for its backward per token. `fp32_stream`: an fp32 model under 16-bit
    autocast (autocast_fp32_model), whose residual stream and norm outputs stay fp32. `keeps_inputs`: every
    linear keeps its input (linears_keep_inputs: ZeRO-3's linear)."""
    a, arch = job.act_bytes, job.arch
    h, i = arch.hidden_size, arch.intermediate_size
    q, kv, v = kernel_attention_widths(job)
    full = job.adapter == "full"
    r = 4 if fp32_stream else a  # the residual stream's dtype: every norm's input
    # Liger's RMSNorm keeps its input and an fp32 rstd per row instead of the fp32 upcast input
    # (LigerRMSNormFunction saves only X, W and rstd: its weight gradient needs no normalized copy either)
    # every norm keeps its input; the two pre-norms' outputs feed the linears/LoRA (Gemma-2/3's post-norms
    # feed the residual add, which keeps nothing). Under autocast those outputs are fp32 and not kept: each
    # trained linear reading one keeps its own 16-bit cast of it instead (q, k, v, gate and up: five a Llama
    # layer; a full 3B's memory profile, docs/validation.md twelfth session: 120,832 bytes a token-layer
    # against 90,112 with bf16 weights)
    outputs = a * sum(norm_output_readers(arch)) if fp32_stream and full else 2 * r * h
    n_norms = arch.norms_per_layer
    norms = (
        n_norms * ((r * h + 4) if job.liger else 4 * h) + outputs + n_norms * (r * h if full and not job.liger else 0)
    )
    if arch.qk_norm:
        # per-head norms on q and k before RoPE: their input kept like any RMSNorm's (RoPE multiplies the
        # output by cos/sin, which need no gradient, so keeps neither operand of it)
        qk = q + kv
        liger = job.liger_qk_norms  # Liger patches some families' q/k norms only (OLMo-2's stay eager)
        norms += (a * qk + 4 * (arch.num_attention_heads + arch.num_kv_heads)) if liger else 4 * qk
        norms += a * qk if full and not liger else 0
    # key/value heads kept repeated to the query's count: eager and masked sdpa repeat them, varlen does not
    # (Job.varlen_repeats_kv: runs of the path that did)
    repeated = (
        job.attention == "eager"
        or (job.attention == "varlen" and job.varlen_repeats_kv)
        or masked_attention(job, micro_batch=micro_batch) is not None
    )
    attention = (
        a * (2 * q + (q if repeated else kv) + (q if repeated else v))
        + 4 * arch.num_attention_heads
        + cudnn_kept_bytes_per_token_layer(job)
    )
    # dense SwiGLU and routed experts (plan/moe_memory.py)
    mlp = mlp_bytes_per_token_layer(job, keeps_product=keeps_inputs)
    lora = 0.0
    if not full:
        shapes = module_shapes(arch)
        dropout = job.lora_dropout > 0
        for name in job.lora_targets:
            fin, _, _ = shapes.get(name, (h, h, 1))
            # the r-wide intermediate, and dropout's mask over the module's input
            lora += a * job.lora_r + (dropout_mask_bytes(job, casts=casts) * fin if dropout else 0)
        if casts or dropout:
            # each module keeps its own copy of its input (the cast's, or the dropped-out one, or the cast of the
            # dropped-out fp32 input with both); the norm outputs and the MLP product that the adapters shared are
            # no longer kept (Llama 8B: 3*a*h + a*q = 32 KB per token), unless the base linears keep them
            lora += sum(a * shapes.get(n, (h, h, 1))[0] for n in job.lora_targets)
            if not keeps_inputs:
                qkv = any(n in job.lora_targets for n in ("q_proj", "k_proj", "v_proj"))
                gate_up = any(n in job.lora_targets for n in ("gate_proj", "up_proj"))
                lora -= a * h * (qkv + gate_up) + a * i * ("down_proj" in job.lora_targets)
        if job.dora:
            lora += dora_bytes_per_token_layer(job)
    return norms + attention + mlp + lora


def norm_output_readers(arch: ModelArch) -> list[int]:
    """In-widths of the linears of a (first kind of) layer that read a pre-norm's output."""
    return [fin * n for name, (fin, _, n) in layer_kinds(arch)[0][2].items() if name in NORM_OUTPUT_READERS]


def autocast_fp32_model(job: Job, *, strategy: str) -> bool:
    """An fp32 model trained under bf16/fp16 autocast (model.dtype float32 with DDP): FSDP2 computes in the
    MixedPrecisionPolicy's dtype, DeepSpeed converts the model to 16 bits, quantized bases dequantize."""
    return info(strategy).backend == "ddp" and job.weight_bytes == 4 and job.act_bytes != 4 and not job.quantized_base


def dora_bytes_per_token_layer(job: Job) -> float:
    """peft's DoRA (tuners/lora/dora.py) returns (m/||W+BA|| - 1) * base_result + m/||W+BA|| * lora_result
    * scaling with the trainable magnitude m: both products keep their token-sized operand for m's
    gradient, base_result and lora_result, each out_features wide in the compute dtype (the norm is
    detached). Measured with saved-tensor hooks on a Llama layer (h 256, i 640, all 7 projections,
    bf16 and fp32 adapters alike): 9,216 B per token more than LoRA = 2 x 2 B x (256+128+128+256+640
    +640+256) (tests/unit/plan/test_memory.py)."""
    shapes = module_shapes(job.arch)
    return sum(2 * job.act_bytes * shapes[n][1] * shapes[n][2] for n in job.lora_targets if n in shapes)


def dropout_mask_bytes(job: Job, *, casts: bool) -> int:
    """Bytes per element of the mask lora dropout keeps for its backward: torch's fused GPU kernel (native_dropout)
    keeps a boolean; its CPU path keeps the scaled noise in the input's dtype (fp32 where peft casts the input)."""
    if job.preset.vendor == "cpu":
        return 4 if casts else job.act_bytes
    return 1


# token x out-feature tensors in the promoted dtype that a DoRA module's backward holds at once: the base and LoRA
# outputs' gradients through the magnitude and the product whose sum over the tokens is the magnitude's gradient; where
# the promoted dtype is not the compute dtype (fp32 adapters or magnitude), also the output gradient cast up and the
# base output's gradient cast back (dora_backward_bytes_per_feature). The memory profile of SmolLM3-3B's DoRA at 32,768
# tokens on an H200 (docs/validation.md thirty-first session) held four fp32 tensors of 32,768 x 11,008 and one in bf16
# at its peak, in the up/gate projections' backward
DORA_BACKWARD_PROMOTED_COPIES = 3


def dora_backward_bytes_per_feature(*, promoted: int, act: int) -> int:
    """Bytes a token and out-feature that one DoRA module's backward holds at once beyond a LoRA module's (whose
    own, one compute-dtype tensor, the calibration already carries): 16 with fp32 adapters, 4 with 16-bit ones, as
    the peak of live tensors in one peft DoRA Linear's backward on CPU measures (tests/unit/plan/test_memory.py)."""
    return DORA_BACKWARD_PROMOTED_COPIES * promoted + (promoted + act if promoted != act else 0) - act


def dora_backward_bytes(job: Job, *, micro_batch: int, casts: bool, params_16bit: bool = False) -> float:
    """The backward of one DoRA module beyond the tensors the forward kept, for the widest targeted module (one
    module's backward runs at a time). Where that is the MLP's gate or up projection, down_proj's backward has run
    before it and freed the SwiGLU product and the activation's output that the layer's count keeps (2 x act a token
    and feature: at the profile's peak only the gate's and up's own outputs were left of the MLP's)."""
    if not job.dora or job.adapter == "full":
        return 0.0
    widths = {name: shape[1] for name, shape in module_shapes(job.arch).items() if name in job.lora_targets}
    if not widths:
        return 0.0
    widest = max(widths, key=lambda name: widths[name])
    _, promoted = job.dora_dtype_bytes(casts=casts, params_16bit=params_16bit)
    per_feature = dora_backward_bytes_per_feature(promoted=promoted, act=job.act_bytes)
    if widest in ("gate_proj", "up_proj"):
        per_feature -= 2 * job.act_bytes
    return tokens_per_micro_batch(job, micro_batch) * widths[widest] * max(per_feature, 0)


def dora_dropout_weight_bytes(job: Job, *, casts: bool) -> float:
    """Per decoder layer: with lora dropout, peft's DoRA recomputes the base output as F.linear(dropout(x), W)
    (plan/dora_time.py) and keeps W for the input gradient. Where it casts the input to fp32 (`casts`) W is an fp32
    copy that autocast casts back to a new 16-bit tensor, and a quantized base's W is its dequantized 16-bit copy:
    each targeted module's whole weight again, in the compute dtype (scripts/dora_rates.py on an H200: 2 x in x out
    bytes saved beyond DoRA's without dropout, at every shape; a 4-bit base on CPU the same, listed with
    saved-tensor hooks; none with bf16 adapters over 16-bit weights, whose F.linear keeps the weight itself)."""
    if not (job.dora_recomputes_base and (casts or job.quantized_base)):
        return 0.0
    shapes = module_shapes(job.arch)
    return sum(job.act_bytes * shapes[n][0] * shapes[n][1] * shapes[n][2] for n in job.lora_targets if n in shapes)


def dora_transient_bytes(job: Job) -> float:
    """DoRA recomputes ||W + scaling*BA|| per module on every forward: peft builds BA by pushing an
    in x in identity through lora_A and lora_B, then adds it to a copy of W and takes the row norms. The
    largest targeted module's temporaries, in fp32 (peft's adapter dtype): the identity and its r-wide
    image, BA, its cast, the cast W and the sum (4 out x in matrices)."""
    shapes = module_shapes(job.arch)
    sizes = [
        4 * (fin * fin + fin * job.lora_r) + 4 * 4 * fin * fout
        for n, (fin, fout, _) in shapes.items()
        if n in job.lora_targets
    ]
    return max(sizes, default=0.0)


def attention_matrix_bytes(job: Job, *, micro_batch: int) -> float:
    """Per layer: sdpa's float mask bias (rows x len^2), or eager's saved scores: the fp32 softmax and its
    cast back, and with attention logit soft-capping (Gemma-2) the tanh's output as well (autograd's saved
    tensors on a CPU trace of Gemma-2's eager attention in bf16: 8.0 bytes per score element with it, 6.0
    without); GPT-OSS's eager attention with sinks keeps only its softmax, in the compute dtype (2.0 bytes)."""
    masked = masked_attention(job, micro_batch=micro_batch)
    if masked is None:
        return 0.0
    rows, length = masked
    a = job.act_bytes
    scores = a if job.arch.attention_sinks else 4 + a + (a if job.arch.attn_logit_softcap else 0)
    per_element = a + (job.arch.num_attention_heads * scores if job.attention == "eager" else 0)
    # layers the varlen kernel still serves (see workload.varlen_fallback_layers) get no mask
    share = masked_row_layers(job) / job.arch.num_layers
    return rows * length * length * per_element * share


def eager_backward_bytes(job: Job, *, micro_batch: int) -> float:
    """The backward of one layer's eager attention: score-sized tensors beyond the saved ones while it runs (one
    layer's at a time). The gradient of the probabilities in the compute dtype, its fp32 cast and softmax's fp32
    input gradient, and with soft-capping the tanh's gradient; the compute-dtype probabilities the output matmul kept
    are freed by then. The memory profile of Gemma-2-9B at two 4,096-token examples packed (docs/validation.md,
    thirtieth session: 16 heads x 8,192^2 = 1 Gi score elements) held 12.0 GiB of the autograd engine's allocations
    at its peak beside the forward's 5.9 GiB of scores. GPT-OSS's softmax with sinks runs in the compute dtype: one
    such gradient, not measured."""
    masked = masked_attention(job, micro_batch=micro_batch)
    if masked is None or job.attention != "eager" or not masked_row_layers(job):
        return 0.0
    rows, length = masked
    a = job.act_bytes
    # the probabilities' gradient takes the place of the probabilities it was computed from
    per_element = a if job.arch.attention_sinks else 4 + 4 + (a if job.arch.attn_logit_softcap else 0)
    return rows * job.arch.num_attention_heads * length * length * per_element


def shared_mask_bytes(job: Job, *, micro_batch: int) -> float:
    """The 4-D masks a forward builds (masking_utils: sdpa_mask's boolean, eager_mask's additive float) and the model
    holds through its layers (a checkpointed layer's recompute takes them as inputs): one per kind of layer, so two
    where full and sliding-window layers mix (Gemma-3: create_causal_mask and create_sliding_window_causal_mask).
    A padded batch's rows; a packed row's block-diagonal masks where its layers fall back from the varlen kernel
    (train/attention.py builds them from the example bounds). None for a packed row on the varlen kernel
    (train/attention.py's packed_row_mask), whose runs before it held them (Job.builds_packed_row_mask: the memory
    profile of docs/validation.md's row 220, 0.84 GiB at a 30.6k-token row). flash_attention_2/3 get none."""
    if job.attention == "flash":
        return 0.0
    if job.attention == "varlen" and job.packed and not job.builds_packed_row_mask:
        return 0.0
    built = masked_attention(
        replace(job, attention="sdpa") if job.attention == "varlen" else job, micro_batch=micro_batch
    )
    if built is None:
        return 0.0
    rows, length = built
    kinds = 2 if 0 < sliding_layer_count(job.arch) < job.arch.num_layers else 1
    return kinds * rows * length * length * (job.act_bytes if job.attention == "eager" else 1)


def tokens_per_micro_batch(job: Job, micro_batch: int) -> float:
    """Tokens a micro-batch holds at its peak (activations, logits): workload.peak_tokens_per_micro_batch."""
    return peak_tokens_per_micro_batch(job, micro_batch)


def checkpointed_layers(job: Job, checkpointing: bool | int) -> int:
    """How many decoder layers are checkpointed: True = all, False = none, or a count k."""
    if isinstance(checkpointing, bool):
        return job.arch.num_layers if checkpointing else 0
    return max(0, min(int(checkpointing), job.arch.num_layers))


def activation_bytes(
    job: Job,
    *,
    micro_batch: int,
    checkpointing: bool | int,
    casts: bool = False,
    fp32_stream: bool = False,
    loss_head: float = 0.0,
    keeps_inputs: bool = False,
    params_16bit: bool = False,
) -> float:
    """Saved activations at the peak (the start of the backward pass). `keeps_inputs`: linears_keep_inputs;
    `params_16bit`: DeepSpeed's cast of every parameter (params_16bit, for DoRA's backward).

    Checkpointing the first k of L layers (finetune/train/callbacks.py): those keep only their input
    (act x h per token) and the other L - k keep everything. The backward reaches the checkpointed
    layers only after the un-checkpointed ones above them have freed theirs, so one layer's recompute
    adds to the peak only when every layer is checkpointed: (L-k) x layer + k x input, or L x input +
    one layer when k = L (which is why k = L - 1 needs less memory than k = L).

    The loss head's bytes (`loss_head`: loss_head_bytes) are freed before the first layer's backward starts, so
    they are never alive with that layer's transients (a checkpointed layer's recompute, its backward's gradients):
    the peak holds the larger of the two. With `loss_head` given, the bytes returned are what the activations add
    beside it (the memory profile of QLoRA DPO under FSDP2 with every layer checkpointed, docs/validation.md
    thirty-first session, peaked in the loss head with no layer recomputed)."""
    tokens = tokens_per_micro_batch(job, micro_batch)
    per_layer = (
        activation_bytes_per_token_layer(
            job, micro_batch=micro_batch, casts=casts, fp32_stream=fp32_stream, keeps_inputs=keeps_inputs
        )
        * tokens
        + attention_matrix_bytes(job, micro_batch=micro_batch)
        + dora_dropout_weight_bytes(job, casts=casts)
    )
    layers = job.arch.num_layers
    k = checkpointed_layers(job, checkpointing)
    stream = 4 if fp32_stream else job.act_bytes  # the residual stream: a checkpointed layer's kept input
    edges = 4 * stream * job.arch.hidden_size * tokens  # embedding output + final norm
    inputs = k * stream * job.arch.hidden_size * tokens
    recompute = per_layer if k == layers else 0.0
    # the peak is inside the first layer's backward, whose eager attention adds its gradients' scores, its DoRA
    # modules their output gradients and its routed experts their copies' gradients
    backward = (
        eager_backward_bytes(job, micro_batch=micro_batch)
        + dora_backward_bytes(job, micro_batch=micro_batch, casts=casts, params_16bit=params_16bit)
        + routed_backward_bytes_per_token(job) * tokens
    )
    held = (layers - k) * per_layer + inputs + edges + shared_mask_bytes(job, micro_batch=micro_batch)
    return held + max(recompute + backward, loss_head) - loss_head


def logits_bytes(job: Job, *, micro_batch: int) -> float:
    """Materialized logits and cross-entropy temporaries (a loss computed from full logits), and the chosen half's
    copy where a cross-entropy over it joins the loss (Job.nll_on_chosen)."""
    per_element = LOGITS_BYTES_PER_ELEMENT + (NLL_BYTES_PER_ELEMENT / 2 if job.nll_on_chosen else 0.0)
    return tokens_per_micro_batch(job, micro_batch) * job.arch.vocab_size * per_element


def loss_head_bytes(job: Job, *, micro_batch: int) -> float:
    """The LM head + loss at its peak: TRL's fused chunked head, or the materialized logits."""
    if not job.fused_lm_head:
        return logits_bytes(job, micro_batch=micro_batch)
    tokens = tokens_per_micro_batch(job, micro_batch)
    a, h = job.act_bytes, job.arch.hidden_size
    tile = min(tokens, FUSED_HEAD_TOKENS) * min(job.arch.vocab_size, FUSED_HEAD_VOCAB) * a
    per_token = (2 * a + 4) * h + 8 * 4  # hidden copy, fp32 gradient + its cast, fp32 per-token stats
    trained = job.adapter == "full" or "lm_head" in job.modules_to_save
    head_grad = job.arch.vocab_size * h * (4 + job.weight_bytes) if trained else 0.0
    return tokens * per_token + tile + head_grad


@dataclass(frozen=True)
class Footprint:
    memory: MemoryBreakdown  # per GPU
    host_ram_bytes: float  # per node, at its peak: while the model loads, while it trains or at the final save
    nvme_bytes: float  # per node
    host_ram_training_bytes: float = 0.0  # per node, what stays resident while it trains
    host_ram_saving_bytes: float = 0.0  # per node, at the final save (training's and the save's gather)


def footprint(
    job: Job, *, strategy: str, micro_batch: int, checkpointing: bool | int, sync_each_batch: bool = False
) -> Footprint:
    """Peak bytes per GPU (by part), host RAM per node and NVMe per node for one configuration;
    `sync_each_batch`: FSDP2 reduce-scatters every micro-batch (accelerate's sync_each_batch) instead of
    holding the unsharded gradients under the Trainer's no_sync."""
    p = job.preset
    states = state_bytes(job, strategy)
    shard = shard_degree(job, strategy)
    cpu = p.vendor == "cpu"
    layer, root = unit_bytes(job)
    grad_dtype = 4 if job.adapter != "full" else max(job.weight_bytes, 4)  # reduce in fp32
    layer_grads = states.trainable_params / job.arch.num_layers * grad_dtype
    tier = info(strategy)
    extra_grads = second_partition = 0.0
    if tier.backend == "ddp":
        # DDP's gradient buckets hold a second copy of the gradients (no gradient_as_bucket_view)
        comm = states.gradients if p.world_size > 1 else 0.0
    elif tier.zero_stage == 2:
        # ZeRO-2 reduces through two reduce buckets and re-gathers updated params through one
        # all-gather bucket, each reduce_bucket_size (h x h, compile/deepspeed.py) 16-bit elements
        comm = 3 * job.arch.hidden_size**2 * 2 if p.world_size > 1 else 0.0
        if accumulation_steps(job, micro_batch) > 1:
            # with accumulation the first micro-batch's reduced partition lives on DeepSpeed's reduction
            # stream until the step, and each later micro-batch reduces into a new one beside it: two 16-bit
            # partitions in that stream's own segment (full 1B on one H200, memory profile: 2 x 2.3 GiB)
            second_partition = states.trainable_params * 2 / state_shard_degree(job, strategy)
    elif tier.backend == "fsdp":
        comm = root + 2 * layer + fsdp_gradient_buffers(job, strategy=strategy)
        if accumulation_steps(job, micro_batch) > 1 and not sync_each_batch:
            extra_grads = fsdp_accumulated_gradients(job)
    else:
        # root unit (embedding, lm_head) stays gathered for the whole step; current + prefetched
        # layer gathered; one layer's gradients in the reduce-scatter buffer
        comm = root + 2 * layer + layer_grads
    states_shard = state_shard_degree(job, strategy)
    # offloaded optimizer: fp32 master, moments and the gradient partitions live (and step) on the CPU
    opt_on_gpu = 0.0 if tier.offload_optimizer else 1.0
    replicated = replicated_weight_bytes(job)  # every rank's whole copy, whatever is sharded or offloaded
    folded, fold_transient = expert_fold_copies(job, checkpointing=checkpointing)
    on_gpu = MemoryBreakdown(
        weights=replicated
        + (0.0 if tier.offload_params else (states.weights - replicated) / shard)
        + autocast_weight_copies(job, strategy=strategy, checkpointing=checkpointing)
        + folded,
        trainable=opt_on_gpu * states.trainable / states_shard,
        gradients=opt_on_gpu * states.gradients / states_shard + extra_grads,
        optimizer=opt_on_gpu * states.optimizer / states_shard,
    )
    logits = loss_head_bytes(job, micro_batch=micro_batch)
    acts = activation_bytes(
        job,
        micro_batch=micro_batch,
        checkpointing=checkpointing,
        casts=adapter_input_casts(job, strategy),
        fp32_stream=autocast_fp32_model(job, strategy=strategy),
        loss_head=logits,
        keeps_inputs=linears_keep_inputs(job, strategy),
        params_16bit=params_16bit(strategy),
    )
    fixed = CPU_FIXED_BYTES if cpu else 0.0
    if job.adapter == "qlora":
        # a dequantized 16-bit copy of the largest linear weight while it is multiplied
        fixed += 2 * max(fin * fout for fin, fout, _ in module_shapes(job.arch).values())
    if job.dora and job.adapter != "full":
        fixed += dora_transient_bytes(job)
    fixed += fold_transient
    # the optimizer step's temporaries replace the activations it runs after: only an excess adds
    step = 0.0
    if not tier.offload_optimizer:
        deepspeed = tier.backend == "deepspeed"
        step = optimizer_step_transient_bytes(
            job, flat=deepspeed, shard=state_shard_degree(job, strategy) if deepspeed else shard
        )
        if deepspeed:
            step += zero_gradient_cast_bytes(job, strategy=strategy, trainable_params=states.trainable_params)
    if not gradients_held_through_forward(job, strategy=strategy, micro_batch=micro_batch):
        # born in the backward as the activations are freed, gone before the next forward: they and the
        # step's temporaries replace the activations, and only an excess adds
        step += on_gpu.gradients
        on_gpu = replace(on_gpu, gradients=0.0)
    fixed += max(0.0, step - acts - logits) + second_partition
    subtotal = on_gpu.total + acts + logits + comm
    if not cpu:
        fixed += allocator_reserve_bytes(job, strategy, allocated=subtotal + fixed)
    memory = MemoryBreakdown(
        weights=on_gpu.weights,
        trainable=on_gpu.trainable,
        gradients=on_gpu.gradients,
        optimizer=on_gpu.optimizer,
        activations=acts,
        logits=logits,
        comm_buffers=comm,
        overhead=fixed + FRAGMENTATION * subtotal,
    )
    host = host_bytes(job, strategy=strategy, states=states)
    return Footprint(memory, host.peak, host.nvme, host.training, host.saving)


def allocator_reserve_bytes(job: Job, strategy: str, *, allocated: float = math.inf) -> float:
    """The caching allocator's reserve on a GPU rank (ALLOCATOR_RESERVE_BYTES) beside `allocated` bytes of planned
    tensors: "sharded" where large blocks come and go every layer or step (gathered parameters under ZeRO-3 and
    FSDP2, a full fine-tune's flat gradient and fp32 buffers under ZeRO-1/2), "plain" otherwise (DDP, an adapter
    under ZeRO-1/2), at most PLAIN_RESERVE_SHARE of the allocation: the blocks it keeps are the run's own."""
    tier = info(strategy)
    if tier.backend == "ddp" or (not tier.shards_params and job.adapter != "full"):
        return min(ALLOCATOR_RESERVE_BYTES["plain"], PLAIN_RESERVE_SHARE * allocated)
    return ALLOCATOR_RESERVE_BYTES["sharded"]


def zero_gradient_cast_bytes(job: Job, *, strategy: str, trainable_params: float) -> float:
    """DeepSpeed's step flattens this rank's 16-bit gradient partition and casts the flat copy to fp32 for the
    fp32 master weights (ZeRO-1/2: the whole partition at once, stage_1_and_2.step; ZeRO-3: one sub-group of
    sub_group_size elements at a time): 2 + 4 bytes an element, after the backward has freed the activations.
    Full 1B under ZeRO-2 on one H200 (memory profile): 2.3 + 4.6 GiB at the step, its peak."""
    elements = trainable_params / state_shard_degree(job, strategy)
    if info(strategy).zero_stage == 3:
        elements = min(elements, ZERO3_SUB_GROUP_ELEMENTS)
    return (2 + 4) * elements


def gradients_held_through_forward(job: Job, *, strategy: str, micro_batch: int) -> bool:
    """Whether a step's forward runs beside the gradients. The Trainer frees them after each optimizer step
    (zero_grad sets them to None), so only these keep them: accumulation (the earlier micro-batches'),
    DDP's buckets on several GPUs, DeepSpeed's and FSDP2's gradient partitions and reduce buffers. A single
    process without accumulation allocates them in the backward while the activations are freed: its memory
    profile (docs/validation.md, twelfth session) held the weights and optimizer states at the step's start
    and no gradient at the peak."""
    return info(strategy).backend != "ddp" or job.preset.world_size > 1 or accumulation_steps(job, micro_batch) > 1


def trained_unit_params(job: Job) -> tuple[float, float]:
    """(largest decoder layer, root unit) parameters that are trained: FSDP's units of gradient."""
    params = count_params(job.arch)
    if job.adapter == "full":
        return params.layer, params.root - params.towers
    return lora_params(job) / params.num_layers, saved_module_params(job)


def expert_fold_copies(job: Job, *, checkpointing: bool | int) -> tuple[float, float]:
    """(kept, transient) bytes of the routed experts' folded copies under adapter.target_experts. peft folds each
    MoE layer's adapters into a new tensor the size of its fused experts (torch.baddbmm(W, B, A) in the weights'
    dtype, ParamWrapper's parametrization), and the experts' GEMMs keep it for their input gradient from the
    layer's forward to its backward, with the adapter factors' casts to that dtype that baddbmm keeps: one copy of
    every layer's experts at the backward's start, but a checkpointed layer's (recomputed then). The backward of one
    layer adds its copy's gradient, as large (transient; with every layer checkpointed, its recomputed copy too).
    Checked with saved_tensors_hooks on one MoE block of each family (tests/unit/plan/test_expert_lora.py)."""
    layers = job.lora_expert_layers
    if not layers:
        return 0.0, 0.0
    folded = routed_expert_params(job.arch, layers=layers) + expert_lora_param_count(
        job.arch, r=job.lora_r, layers=layers
    )
    per_layer = folded / layers * job.weight_bytes
    # the first k layers are checkpointed: the adapted ones among them are taken as spread like the rest
    checkpointed = checkpointed_layers(job, checkpointing)
    kept = per_layer * layers * (job.arch.num_layers - checkpointed) / job.arch.num_layers
    return kept, per_layer * (2 if checkpointed == job.arch.num_layers else 1)


def autocast_weight_copies(job: Job, *, strategy: str, checkpointing: bool | int) -> float:
    """Bytes of the 16-bit copies that bf16/fp16 autocast makes of an fp32 model's weights under DDP
    (model.dtype float32, train.precision bf16/fp16): each matmul casts its weight, and autograd keeps the
    copy for the backward (the input's gradient needs it), from the layer's forward to its backward. At the
    backward's start every layer's copies are alive but a checkpointed layer's (recomputed then), and the
    lm_head's. FSDP2 casts through its MixedPrecisionPolicy (the gathered copy is counted as comm), DeepSpeed
    converts the model to 16 bits itself, and quantized bases dequantize per matmul (bitsandbytes)."""
    if not autocast_fp32_model(job, strategy=strategy):
        return 0.0
    layers = job.arch.num_layers
    kept = count_params(job.arch).layers_linear * (layers - checkpointed_layers(job, checkpointing)) / layers
    return job.act_bytes * (kept + job.arch.vocab_size * job.arch.hidden_size)


def fsdp_gradient_buffers(job: Job, *, strategy: str) -> float:
    """FSDP2 as accelerate configures it (fully_shard on every decoder layer and on the root;
    MixedPrecisionPolicy with the compute dtype for parameters and reduction): while a unit's backward
    runs autograd holds its unsharded 16-bit gradients, and the reduce-scatter reads a 16-bit copy of them
    into its output shard (the fp32 sharded gradients are counted with the states); the largest unit,
    often the root (embedding, lm_head) at the very end of the backward, sets the size. These live on
    FSDP2's reduce-scatter stream, whose expandable segment is not shared with the compute stream, so
    they add to the peak rather than fit into memory the activations free."""
    layer, root = trained_unit_params(job)
    a = job.act_bytes
    return a * layer + a * max(layer, root) * (1 + 1 / shard_degree(job, strategy))


def fsdp_accumulated_gradients(job: Job) -> float:
    """With gradient accumulation the Trainer runs every micro-batch but the last under accelerate's
    no_sync, which for FSDP2 is set_requires_gradient_sync(False): no reduce-scatter, and every unit's
    unsharded 16-bit gradients (the reduce dtype) are kept on each GPU until the last micro-batch's.
    accelerate's sync_each_batch (distributed.sync_each_batch) reduce-scatters every micro-batch into the
    sharded fp32 gradients instead: these bytes are what it frees."""
    layer, root = trained_unit_params(job)
    return job.act_bytes * (layer * job.arch.num_layers + root)


def largest_tensor_bytes(job: Job) -> float:
    """The largest parameter tensor in the model's dtype (workload.largest_parameter_elements); a load that goes
    tensor by tensor holds one at a time."""
    return largest_parameter_elements(job.arch) * job.weight_bytes


def loading_host_bytes(job: Job, *, strategy: str) -> float:
    """Host RAM (per node) that loading the weights takes beyond the processes themselves: only memory the
    kernel cannot reclaim counts. transformers maps a safetensors checkpoint and, when it is stored in the
    dtype the model loads in, hands out views of the mapped file: page cache, shared by every rank of the
    node and dropped under pressure, so each process holds only the tensor it is moving or quantizing.
    A checkpoint of another (or unknown) dtype, or weights built at random, are a real copy in every
    process that materializes the model: each DDP/ZeRO-2 rank, or once per node for the sharded strategies
    (cpu_ram_efficient_loading / zero.Init). FSDP2's sharded load and a 4-bit/8-bit load placed on the GPU
    by device_map go tensor by tensor whatever the dtype."""
    p = job.preset
    if p.vendor == "cpu":
        return 0.0  # the cpu preset's 'GPU memory' already is this RAM
    procs = p.gpus_per_node
    if (job.sharded_load and info(strategy).backend == "fsdp") or job.quantized_base or not job.load_copies:
        return float(procs * largest_tensor_bytes(job))
    # (ZeRO-2 builds no partitioned model: every rank loads it like DDP)
    replicated_load = not info(strategy).shards_params
    return float(count_params(job.arch).total * job.weight_bytes * (procs if replicated_load else 1))


def pinned_rounding_bytes(tensors: Tensors, *, shard: int, dtype_bytes: float) -> float:
    """What torch's pinned-memory allocator (CachingHostAllocator) adds to one rank's shards of `tensors`:
    it rounds every allocation up to a power of two, so a 50 MB shard takes 64 MiB. Shards split dim 0
    over `shard` ranks, padded as FSDP2 pads; 1-D entries (the norms and biases) are too small to count."""
    extra = 0.0
    for count, shape in tensors:
        if len(shape) < 2:
            continue
        size = math.ceil(-(-shape[0] // shard) * numel(shape[1:]) * dtype_bytes)
        extra += count * (pinned_size(size) - size)
    return extra


def pinned_size(nbytes: int) -> int:
    """Host bytes torch's CachingHostAllocator takes for a pinned allocation of `nbytes`: the next power of two."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def zero3_offload_pinned_bytes(job: Job, *, strategy: str) -> float:
    """Per node: what ZeRO-3's CPU optimizer offload pins beyond the bytes of its states. Each rank keeps the
    fp32 gradient partitions of all it trains in one flat pinned buffer (its bytes are counted with the
    gradients; this adds the allocator's rounding), and DeepSpeed's optimizer setup pins one fp32 gradient
    buffer per sub-group (ZERO3_SUB_GROUP_ELEMENTS, cut in parameter order) and then frees it into the
    pinned allocator's cache, which keeps it for the rest of the run."""
    world = state_shard_degree(job, strategy)
    parts = [-(-n // world) for n in trained_tensor_sizes(job)]
    groups, run = [], 0
    for n in parts:
        run += n
        if run >= ZERO3_SUB_GROUP_ELEMENTS:
            groups.append(run)
            run = 0
    groups += [run] if run else []
    flat = 4 * sum(parts)
    per_rank = pinned_size(flat) - flat + sum(pinned_size(4 * g) for g in groups)
    return job.preset.gpus_per_node * per_rank


def fsdp_offload_rounding_bytes(job: Job, *, strategy: str) -> float:
    """Per node: FSDP2's CPU offload pins each rank's parameter shards and the gradient shards the
    backward moves to the host (fp32 for what is trained, the model's dtype for a frozen 16-bit base);
    the pinned allocator's rounding of each is host RAM beyond the states themselves."""
    shard = shard_degree(job, strategy)
    trained = model_tensors(job.arch) if job.adapter == "full" else adapter_tensors(job) + saved_module_tensors(job)
    per_rank = 2 * pinned_rounding_bytes(trained, shard=shard, dtype_bytes=4)  # shards and their gradients
    if job.adapter == "lora" and not job.quantized_base:
        per_rank += pinned_rounding_bytes(model_tensors(job.arch), shard=shard, dtype_bytes=job.weight_bytes)
    return job.preset.gpus_per_node * per_rank


def final_save_host_bytes(job: Job, *, strategy: str) -> float:
    """Host RAM (per node) the final save takes beyond training. Under FSDP2 finetune's final save gathers a full
    state dict to rank 0's host (train/run.py: FULL_STATE_DICT, for plain safetensors): a full fine-tune's fp32 master
    weights (`keeps_fp32_master`), and beside them their cast to model.dtype (train/saved_dtype.py); an adapter whose
    save writes frozen weights (Job.save_gathers_model) the frozen base as loaded, of which peft keeps the adapter's
    keys. Measured as rank 0's peak RSS at the save (test_calibration.py): full 3B-8B 2.8-3.0 times their 16-bit
    weights beyond the process, 1.7 before the cast existed (the fp32 masters alone); LoRA 3B-70B before adapters
    gathered their trained parameters alone 0.98-1.0. The state dict is the whole checkpoint's: a multimodal model's
    frozen towers are gathered and cast with the text model (full Gemma-3-4B, row blind5-06: 1.8 GiB beyond the text
    model's 21.7 planned). DDP and ZeRO-2 save from the replica on the GPU tensor by tensor;
    ZeRO-3 gathers the 16-bit weights on rank 0 as its load did (which bounds it: 29.9 and 29.1 GiB of rank 0's RSS
    for 14B with the save and without, rows 108 and 111); an adapter's trained parameters alone are small."""
    if not job.final_save or job.preset.vendor == "cpu" or info(strategy).backend != "fsdp":
        return 0.0
    params = count_params(job.arch).total
    if job.adapter == "full":  # FSDP2 trains fp32 masters (keeps_fp32_master); a 16-bit model's cast is beside them
        cast = job.weight_bytes if job.final_save_casts and job.weight_bytes < 4 else 0
        return params * (4 + cast)
    return params * job.weight_bytes if job.save_gathers_model else 0.0


# how a plan says that the node's host RAM peaks at the final save (`final_save_host_bytes`)
AT_FINAL_SAVE = "at the final save, where rank 0 gathers the whole model"


def peaks_at_final_save(*, peak: float, training: float, saving: float) -> bool:
    """Whether the final save sets the node's host peak (it holds more than training, and no less than loading)."""
    return saving >= peak > training


@dataclass(frozen=True)
class HostBytes:
    peak: float  # per node: the processes and the largest of loading, training and the final save
    training: float  # per node: the processes and what they keep on the host while training
    nvme: float  # per node
    saving: float = 0.0  # per node: the processes, what training keeps and the final save's gather


def host_process_bytes(job: Job, *, strategy: str) -> float:
    """One rank's own host RAM: the interpreter, torch, the CUDA libraries and what its backend keeps."""
    if job.preset.vendor == "cpu":
        return CPU_FIXED_BYTES * 4
    if is_fsdp(strategy):
        return HOST_PER_FSDP_FULL_RANK_BYTES if job.adapter == "full" else HOST_PER_FSDP_ADAPTER_RANK_BYTES
    if strategies.is_deepspeed(strategy) and job.adapter == "full":
        return HOST_PER_DEEPSPEED_FULL_RANK_BYTES
    return HOST_PER_PROCESS_BYTES


def host_bytes(job: Job, *, strategy: str, states: StateBytes) -> HostBytes:
    p = job.preset
    procs = p.gpus_per_node
    base = host_process_bytes(job, strategy=strategy) * procs
    loading = loading_host_bytes(job, strategy=strategy)
    nodes = p.nodes
    tier = info(strategy)
    fp32_grads = states.trainable_params * 4  # the gradient partitions the CPU optimizer steps on
    nvme = 0.0
    if tier.offload == "nvme":
        # params and optimizer states on NVMe; host keeps fp32 gradient partitions and the swap buffers
        buffers = nvme_swap_buffer_bytes(job, strategy=strategy, trainable_params=states.trainable_params)
        training = fp32_grads / nodes + procs * buffers
        nvme = (states.weights + states.trainable + states.optimizer) / nodes
    elif tier.offload_params:
        # pinned params + fp32 master/moments + fp32 gradient partitions of this node's ranks; FSDP2
        # keeps only the fp32 (upcast) copy of trainable params, no 16-bit one beside it
        weights = states.weights
        if tier.backend == "fsdp" and job.adapter == "full" and states.trainable:
            weights = 0.0
        training = (weights + states.trainable + states.optimizer + fp32_grads) / nodes
        if tier.backend == "fsdp":
            training += fsdp_offload_rounding_bytes(job, strategy=strategy)
        else:  # ZeRO-3 offloads the optimizer with the parameters (their pinned buffers are not modelled)
            training += zero3_offload_pinned_bytes(job, strategy=strategy)
    elif tier.offload_optimizer:  # ZeRO-3's params stay on the GPUs; master, moments and grads pinned here
        training = (states.trainable + states.optimizer + fp32_grads) / nodes
        training += zero3_offload_pinned_bytes(job, strategy=strategy)
    else:
        training = 0.0
    # a paged optimizer's managed moments are mapped into the host process as well: full Llama-3.2-1B with
    # paged_adamw_8bit under ZeRO-2 (row 308) held 2.7 GiB of mapped pages beside 1.9 anonymous, its 2.3 GiB of
    # paged moments, where its ranks' usual mapped pages are 0.4-0.6
    training += procs * paged_optimizer_bytes_per_rank(job, strategy=strategy, states=states)
    if not info(strategy).shards_params and job.adapter == "lora" and not job.quantized_base:
        # a 16-bit base loads on the host before the Trainer moves it: peft builds the fp32 adapter there
        # too, and the C allocator keeps those pages after the move (measured: +2.8 GiB at r 256 on 8B)
        training += procs * 4 * lora_params(job)
    saving = training + final_save_host_bytes(job, strategy=strategy)  # what training keeps stays through the save
    return HostBytes(peak=base + max(loading, saving), training=base + training, nvme=nvme, saving=base + saving)

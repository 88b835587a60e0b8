"""Per-GPU, per-host and NVMe bytes of one training configuration. Pure arithmetic.

Model states (bytes per parameter), the mixed-precision AdamW accounting of the ZeRO paper
(Rajbhandari et al. 2020, K = 12): 2 (16-bit weights) + 2 (16-bit gradients) + 4 (fp32 master
weights) + 8 (fp32 Adam moments) = 16 bytes/param. FSDP2 with fp32 sharded params and a bf16
compute copy (4 + 4 grads + 8) lands on the same 16; a model loaded in fp32 has no separate master
(4 + 4 + 8). adamw_8bit / paged_adamw_8bit keep the two moments in 1 byte each (2 bytes/param).
- full: every parameter trainable at 16 bytes/param (12 with 8-bit moments).
- lora: frozen base in the model dtype; LoRA params r x (in + out) per targeted module per layer,
  in fp32 (PEFT upcasts adapters) with fp32 grads and Adam moments: 4 + 4 + 8 bytes each.
- qlora: linear weights of the layers in NF4: 0.5 byte/param plus one absmax per 64-block (fp32:
  0.0625 byte/param; with double quantization an 8-bit absmax + an fp32 scale per 256 blocks:
  1/64 + 4/16384 = 0.0159 byte/param, i.e. ~0.127 bits); embeddings, lm_head and norms stay 16-bit.

Activations per token per decoder layer (bytes, act = 2 for bf16), counted from the tensors a
Llama-style block saves for backward (checked by listing saved tensors with
torch.autograd.graph.saved_tensors_hooks on an 8B-shaped layer): autograd keeps an operand only when
the other one needs a gradient, so a frozen base saves less than a full fine-tune.
  2 RMSNorms, each: the fp32 upcast input (4*h) + the output the next linear/LoRA keeps (act*h), and for
  a full fine-tune also the pre-weight input the norm weight's gradient needs (act*h);
  attention (fused kernel, no s x s scores): q, k, v, the output (act*(2q + 2kv)) and the fp32
  logsumexp; RoPE inputs are not kept (cos/sin need no gradient). With an explicit mask (sdpa on packed
  rows or padded batches) transformers repeats k/v to all heads (act*q each) and torch turns the boolean
  mask into a float bias of rows x len^2 x act in every layer, kept by the memory-efficient kernel
  (measured: 1-GPU LoRA 8B with one packed 8192-token row allocates ~2 GiB more than twice the
  4096-token row, 32 x (8192^2 - 2 x 4096^2) x 2 B = 2.0 GiB); eager (not measured) keeps the
  scores instead: rows x heads x len^2 x (act + fp32 softmax 4);
  SwiGLU MLP: gate, up, silu(gate), product = 4*act*i (x top-k for MoE).
  LoRA: the r-wide intermediate per targeted module (+ a dropout copy of its input when dropout > 0).
  Under DDP peft keeps the adapters in fp32 and casts each targeted module's input to fp32, which
  autocast casts back to a new bf16 copy that the adapter keeps: one act*in copy per module, replacing
  the shared norm output / MLP product. finetune turns that cast off (adapter.cast_adapter_inputs:
  false, train/run.py): autocast then casts the shared bf16 input once per matmul, nothing extra kept.
  QLoRA (TRL casts its adapters to bf16), ZeRO-3 (TRL keeps them bf16) and FSDP2 (bf16 compute params)
  have no cast. Measured on H100/H200 (tests/data/
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

from dataclasses import dataclass

from finetune.plan.types import GIB, MemoryBreakdown
from finetune.plan.workload import Job, count_params, head_dim, lora_params, module_shapes

ADAM_FP32_MOMENT_BYTES = 8
ADAM_8BIT_MOMENT_BYTES = 2
CUDA_FIXED_BYTES = 1.5 * GIB  # CUDA context, cuBLAS/cuDNN workspaces, kernel images
NCCL_BYTES = 0.5 * GIB  # communicator channel buffers, only when there are several ranks
CPU_FIXED_BYTES = 0.5 * GIB  # the Python/torch process itself on the cpu preset
FRAGMENTATION = 0.05  # caching-allocator fragmentation, as a share of everything else
HOST_PER_PROCESS_BYTES = 3 * GIB  # python + torch + CUDA libraries per rank, host RAM
LOGITS_BYTES_PER_ELEMENT = 12
FUSED_HEAD_TOKENS, FUSED_HEAD_VOCAB = 4096, 32768  # trl/kernels/chunked_logprob.py tile shape
NF4_BYTES = 0.5
NF4_SCALE_BYTES = 4 / 64  # one fp32 absmax per 64-element block
NF4_DOUBLE_QUANT_SCALE_BYTES = 1 / 64 + 4 / (64 * 256)
NVME_PARAM_BUFFERS = 5  # ZeRO-Infinity param swap buffers (buffer_count), each one largest unit
SHARDED = ("fsdp2", "fsdp2-hybrid", "zero3", "zero3-offload", "zero3-nvme")
OFFLOADED = ("zero3-offload", "zero3-nvme")


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
    p = job.preset
    if strategy == "ddp":
        return 1
    if strategy == "fsdp2-hybrid":
        return p.gpus_per_node
    return p.world_size


def weight_bytes(job: Job) -> float:
    """Bytes of the (base) model weights as stored for training."""
    params = count_params(job.arch)
    if job.int8_base:  # LLM.int8 quantizes the linear layers; embeddings, head and norms keep the dtype
        linear = params.layer_linear * params.num_layers
        return linear + (params.total - linear) * job.weight_bytes
    if job.adapter != "qlora":
        return params.total * job.weight_bytes
    scale = NF4_DOUBLE_QUANT_SCALE_BYTES if job.double_quant else NF4_SCALE_BYTES
    linear = params.layer_linear * params.num_layers
    return linear * (NF4_BYTES + scale) + (params.total - linear) * job.weight_bytes


def unit_bytes(job: Job) -> tuple[float, float]:
    """(largest decoder layer, root unit) bytes as gathered by FSDP/ZeRO-3 for compute."""
    params = count_params(job.arch)
    layer = params.layer * job.weight_bytes
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


def state_bytes(job: Job) -> StateBytes:
    moments = ADAM_8BIT_MOMENT_BYTES if "8bit" in job.optimizer else ADAM_FP32_MOMENT_BYTES
    weights = weight_bytes(job)
    if job.reference == "copy":  # dpo/kto: a frozen reference model
        weights += count_params(job.arch).total * job.weight_bytes  # frozen reference model
    if job.adapter == "full":
        n = count_params(job.arch).total
        master = 4 * n if job.weight_bytes < 4 else 0
        return StateBytes(weights, master, job.weight_bytes * n, moments * n, n)
    n = lora_params(job)
    return StateBytes(weights, 4 * n, 4 * n, moments * n, n)


def peft_casts_adapter_inputs(*, adapter: str, strategy: str, act_bytes: int) -> bool:
    """Where peft by default runs fp32 adapters and casts each targeted module's input to fp32: LoRA
    under DDP with 16-bit compute (see the module docstring). One rule for the planner and for
    finetune/train/model.py, which turns the cast off there unless adapter.cast_adapter_inputs or DoRA."""
    return adapter == "lora" and strategy == "ddp" and act_bytes < 4


def adapter_input_casts(job: Job, strategy: str) -> bool:
    """Whether the casts run in this job (finetune keeps them only on request or for DoRA)."""
    return ((job.cast_adapter_inputs or job.dora)
            and peft_casts_adapter_inputs(adapter=job.adapter, strategy=strategy, act_bytes=job.act_bytes))


def masked_attention(job: Job, *, micro_batch: int) -> tuple[int, int] | None:
    """(rows, row length) of the attention mask the kernel gets, None when it gets none."""
    if job.attention in ("flash", "varlen"):
        return None
    if job.packed:  # padding-free: one flat row, a block-diagonal mask from the position_ids
        return 1, micro_batch * job.seq_len
    rows = micro_batch * job.sequences_per_sample
    if rows > 1:  # padded to the batch's longest (DPO: chosen and rejected are two rows)
        return rows, job.seq_len
    return (1, job.seq_len) if job.attention == "eager" else None  # sdpa: is_causal, no mask


def activation_bytes_per_token_layer(job: Job, *, micro_batch: int = 1, casts: bool = False) -> float:
    a, arch = job.act_bytes, job.arch
    h, i = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_attention_heads * head_dim(arch), arch.num_kv_heads * head_dim(arch)
    full = job.adapter == "full"
    # Liger's RMSNorm keeps its bf16 input and an fp32 rstd per row instead of the fp32 upcast input
    norms = 2 * ((a * h + 4) if job.liger else 4 * h) + 2 * (a * h + (a * h if full else 0))
    repeated = (job.attention in ("eager", "varlen")
                or masked_attention(job, micro_batch=micro_batch) is not None)
    attention = a * (2 * q + 2 * (q if repeated else kv)) + 4 * arch.num_attention_heads
    # SwiGLU: gate, up, silu(gate), product; Liger's fused kernel recomputes silu(gate) in backward
    mlp = (3 if job.liger else 4) * a * i * min(arch.experts_per_token, arch.num_experts)
    lora = 0.0
    if not full:
        shapes = module_shapes(arch)
        for name in job.lora_targets:
            fin, _, _ = shapes.get(name, (h, h, 1))
            lora += a * job.lora_r + (a * fin if job.lora_dropout > 0 else 0)
        if casts:
            # each module keeps its own copy of its input; the norm outputs and the MLP product that
            # the adapters shared are no longer kept (Llama 8B: 3*a*h + a*q = 32 KB per token)
            lora += sum(a * shapes.get(n, (h, h, 1))[0] for n in job.lora_targets)
            lora -= a * h * (any(n in job.lora_targets for n in ("q_proj", "k_proj", "v_proj"))
                             + any(n in job.lora_targets for n in ("gate_proj", "up_proj")))
            lora -= a * i * ("down_proj" in job.lora_targets)
    return norms + attention + mlp + lora


def attention_matrix_bytes(job: Job, *, micro_batch: int) -> float:
    """Per layer: sdpa's float mask bias (rows x len^2), or eager's saved scores (+ fp32 softmax)."""
    masked = masked_attention(job, micro_batch=micro_batch)
    if masked is None:
        return 0.0
    rows, length = masked
    a = job.act_bytes
    per_element = a + (job.arch.num_attention_heads * (4 + a) if job.attention == "eager" else 0)
    return rows * length * length * per_element


def tokens_per_micro_batch(job: Job, micro_batch: int) -> int:
    return micro_batch * job.seq_len * job.sequences_per_sample


def activation_bytes(job: Job, *, micro_batch: int, checkpointing: bool, casts: bool = False) -> float:
    tokens = tokens_per_micro_batch(job, micro_batch)
    per_layer = (activation_bytes_per_token_layer(job, micro_batch=micro_batch, casts=casts) * tokens
                 + attention_matrix_bytes(job, micro_batch=micro_batch))
    layers = job.arch.num_layers
    edges = 4 * job.act_bytes * job.arch.hidden_size * tokens  # embedding output + final norm
    if checkpointing:
        return layers * job.act_bytes * job.arch.hidden_size * tokens + per_layer + edges
    return layers * per_layer + edges


def logits_bytes(job: Job, *, micro_batch: int) -> float:
    """Materialized logits and cross-entropy temporaries (a loss computed from full logits)."""
    return tokens_per_micro_batch(job, micro_batch) * job.arch.vocab_size * LOGITS_BYTES_PER_ELEMENT


def loss_head_bytes(job: Job, *, micro_batch: int) -> float:
    """The LM head + loss at its peak: TRL's fused chunked head, or the materialized logits."""
    if not job.fused_lm_head:
        return logits_bytes(job, micro_batch=micro_batch)
    tokens = tokens_per_micro_batch(job, micro_batch)
    a, h = job.act_bytes, job.arch.hidden_size
    tile = min(tokens, FUSED_HEAD_TOKENS) * min(job.arch.vocab_size, FUSED_HEAD_VOCAB) * a
    per_token = (2 * a + 4) * h + 8 * 4  # hidden copy, fp32 gradient + its cast, fp32 per-token stats
    head_grad = job.arch.vocab_size * h * (4 + job.weight_bytes) if job.adapter == "full" else 0.0
    return tokens * per_token + tile + head_grad


@dataclass(frozen=True)
class Footprint:
    memory: MemoryBreakdown  # per GPU
    host_ram_bytes: float  # per node
    nvme_bytes: float  # per node


def footprint(job: Job, *, strategy: str, micro_batch: int, checkpointing: bool) -> Footprint:
    """Peak bytes per GPU (by part), host RAM per node and NVMe per node for one configuration."""
    p = job.preset
    states = state_bytes(job)
    shard = shard_degree(job, strategy)
    cpu = p.vendor == "cpu"
    layer, root = unit_bytes(job)
    grad_dtype = 4 if job.adapter != "full" else max(job.weight_bytes, 4)  # reduce in fp32
    layer_grads = states.trainable_params / job.arch.num_layers * grad_dtype
    if strategy == "ddp":
        # DDP's gradient buckets hold a second copy of the gradients (no gradient_as_bucket_view)
        comm = states.gradients if p.world_size > 1 else 0.0
    else:
        # root unit (embedding, lm_head) stays gathered for the whole step; current + prefetched
        # layer gathered; one layer's gradients in the reduce-scatter buffer
        comm = root + 2 * layer + layer_grads
    if strategy in OFFLOADED:
        on_gpu = MemoryBreakdown(weights=0.0, trainable=0.0, gradients=0.0, optimizer=0.0)
    else:
        on_gpu = MemoryBreakdown(weights=states.weights / shard, trainable=states.trainable / shard,
                                 gradients=states.gradients / shard, optimizer=states.optimizer / shard)
    acts = activation_bytes(job, micro_batch=micro_batch, checkpointing=checkpointing,
                            casts=adapter_input_casts(job, strategy))
    logits = loss_head_bytes(job, micro_batch=micro_batch)
    fixed = CPU_FIXED_BYTES if cpu else CUDA_FIXED_BYTES + (NCCL_BYTES if p.world_size > 1 else 0)
    if job.adapter == "qlora":
        # a dequantized 16-bit copy of the largest linear weight while it is multiplied
        fixed += 2 * max(fin * fout for fin, fout, _ in module_shapes(job.arch).values())
    subtotal = on_gpu.total + acts + logits + comm
    memory = MemoryBreakdown(weights=on_gpu.weights, trainable=on_gpu.trainable,
                             gradients=on_gpu.gradients, optimizer=on_gpu.optimizer,
                             activations=acts, logits=logits, comm_buffers=comm,
                             overhead=fixed + FRAGMENTATION * subtotal)
    host, nvme = _host_and_nvme(job, strategy=strategy, states=states, layer=layer)
    return Footprint(memory, host, nvme)


def _host_and_nvme(job: Job, *, strategy: str, states: StateBytes, layer: float) -> tuple[float, float]:
    p = job.preset
    procs = p.gpus_per_node
    base = (CPU_FIXED_BYTES * 4 if p.vendor == "cpu" else HOST_PER_PROCESS_BYTES) * procs
    # loading: DDP ranks each materialize the model on CPU before moving it; sharded strategies
    # load once per node (cpu_ram_efficient_loading / zero.Init) and scatter
    model_bytes = count_params(job.arch).total * job.weight_bytes
    loading = model_bytes * (procs if strategy == "ddp" and job.adapter != "qlora" else 1)
    if p.vendor == "cpu":
        loading = 0.0  # the cpu preset's 'GPU memory' already is this RAM
    nodes = p.nodes
    if strategy == "zero3-offload":
        # pinned params + fp32 master/moments + fp32 gradient partitions of this node's ranks
        offloaded = (states.weights + states.trainable + states.optimizer
                     + states.trainable_params * 4) / nodes
        return base + max(loading, offloaded), 0.0
    if strategy == "zero3-nvme":
        # params and optimizer states on NVMe; host keeps fp32 gradient partitions and swap buffers
        buffers = procs * (NVME_PARAM_BUFFERS * layer + 2 * GIB)  # + optimizer swap buffers
        host = states.trainable_params * 4 / nodes + buffers
        nvme = (states.weights + states.trainable + states.optimizer) / nodes
        return base + max(loading, host), nvme
    return base + loading, 0.0

"""The step time a mixture-of-experts layer adds beyond its active parameters' FLOPs at the dense rate.

transformers 5 runs routed experts with grouped_mm (integrations/moe.py, grouped_mm_experts_forward;
plan/moe_memory.py says why that path): per MoE layer and micro-batch the router (a linear to E logits,
softmax, top-k), a sort of the T*k routed copies by expert, a gather of the hidden states into that
order, one grouped GEMM for gate_up over all experts, the gating, one grouped GEMM for down, the
routing-weight product, the inverse permutation and the sum over the k copies of each token.

Two things cost time that the dense model's FLOPs-at-efficiency does not show:

1. The expert GEMMs are as small as the tokens one expert gets: m = T*k/E rows on average (T tokens in
   the micro-batch), not T. Grouped GEMMs of a few hundred to a few thousand rows per group run far
   below a dense GEMM on the same card; published H100 bf16 figures: CUTLASS sm90 grouped GEMM ~160
   TFLOP/s at 512 rows per expert (K 2048, N 1536; tgale96/grouped_gemm#37, cuBLAS per-expert loops
   110-130), torch's grouped_mm MoE forward 242 TFLOP/s at 2048 rows per expert (hidden 2048, dispatch
   included; ByteDance-Seed/VeOmni#460). The GEMMs' efficiency of plan/timing.py x m/(m + GROUPED_HALF_ROWS)
   with 1,400 rows gives 159 and 352 TFLOP/s there (the dispatch traffic below, about a third of that
   forward's time, makes up the second one's difference). The routed experts' FLOPs run at that efficiency
   instead of the micro-batch's.
2. The dispatch moves every routed copy through HBM several times, forward and backward, bytes the
   streaming passes of a dense MLP of the same width do not include (plan/timing.py counts the routed
   experts' linears as one: `workload.linear_features_per_token`). Counting each
   kernel's inputs and outputs once, per routed copy (a the compute dtype's bytes, h hidden, i expert
   width, k experts per token; x/k where a kernel touches one row per token, not per copy):
     forward: the gather into expert order (ah/k + ah), gating act(gate)*up (2ai + 3ai), the
              routing-weight product (2ah), the inverse permutation (2ah), the sum over k (ah + ah/k);
     backward: the sum's expanded gradient materialized (ah/k + ah), the inverse permutation's
              scatter-add into zeros (4ah), the routing product's gradients and the weight's reduction
              (6ah), the gating's gradients and their concatenation (13ai), the gather's scatter-add
              into zeros (ah + 3ah/k).
   Checked against the aten ops of transformers' grouped_mm_experts_forward, forward and backward,
   listed with a dispatch mode (tests/unit/plan/test_moe_time.py). Of these, the gating's passes are
   a dense SwiGLU MLP's too; the dense step time was fitted with Liger's fused SwiGLU (3ai forward,
   5ai backward), so the experts' eager gating counts beyond those (2ai, 8ai), with Liger or without
   (a dense MLP's own eager passes without Liger: plan/unfused_time.py). GPT-OSS's
   clamped sigmoid gating has about three times SwiGLU's elementwise passes (16ai forward, 32ai
   backward), all beyond a SwiGLU MLP's. Per token the router: E logits in the compute dtype, fp32
   softmax, top-k, and their gradients ((a + 20) * E bytes). Timed at the bandwidth streaming
   kernels reach (plan/bandwidth.py).
3. adapter.target_experts (peft's target_parameters on the fused experts): every forward folds the adapters into a
   copy of each layer's experts, and the backward computes that copy's whole weight gradient in the grouped GEMMs
   (2 FLOPs per active expert parameter per token, as a full fine-tune's; plan/timing.py counts them with the
   step's FLOPs) before two rank-r products reduce it to the adapters' gradients. The fold's products stream the
   experts' bytes (`expert_fold_seconds`).
Not counted: kernel launch latency (a few dozen kernels per MoE layer, hidden behind GEMMs of thousands
of rows) and routing imbalance (the grouped kernel schedules all experts' tiles together, so an
uneven split changes the tile padding, not the work).
"""

from __future__ import annotations

from finetune.plan.bandwidth import memory_seconds
from finetune.plan.workload import (
    Job,
    computed_tokens_per_micro_batch,
    expert_size,
    moe_layer_count,
    routed_expert_params,
)
from finetune.registry.schema import ModelArch

GROUPED_HALF_ROWS = 1400  # rows per group at which a grouped GEMM reaches half the dense GEMMs' rate (H100 figures)


def routed_rows(job: Job, *, micro_batch: int) -> float:
    """Average rows one expert's GEMM gets per micro-batch: T*k/E."""
    arch = job.arch
    tokens = computed_tokens_per_micro_batch(job, micro_batch)
    return tokens * min(arch.experts_per_token, arch.num_experts) / arch.num_experts


def grouped_gemm_share(job: Job, *, micro_batch: int, half_tokens: float) -> float:
    """The routed experts' GEMM efficiency over the dense one the step time uses at this micro-batch
    (which scales by tokens/(tokens + half_tokens)): m/(m + GROUPED_HALF_ROWS) against that, at most 1."""
    m = routed_rows(job, micro_batch=micro_batch)
    tokens = computed_tokens_per_micro_batch(job, micro_batch)
    return min(1.0, (m / (m + GROUPED_HALF_ROWS)) / (tokens / (tokens + half_tokens)))


def routed_active_params(arch: ModelArch, *, layers: int | None = None) -> float:
    """Routed expert parameters one token multiplies with (its top-k experts') over `layers` MoE layers (default:
    all)."""
    k = min(arch.experts_per_token, arch.num_experts)
    return routed_expert_params(arch, layers=layers) * k / arch.num_experts


def routed_flops_per_token(job: Job) -> float:
    """FLOPs per token in the routed experts' GEMMs: 2 per active expert parameter forward, 2 for the input
    gradient, 2 more for the weight gradient in the layers whose experts are trained (Job.trained_expert_layers)."""
    return 4 * routed_active_params(job.arch) + 2 * routed_active_params(job.arch, layers=job.trained_expert_layers)


# peft's fold of adapter.target_experts per MoE layer and micro-batch, in passes over the fused experts' bytes:
# forward, torch.baddbmm reads W and writes the copy (2; again in a checkpointed layer's recompute); backward, the
# copy's gradient is written by the grouped GEMMs and read by the two rank-r products that give A's and B's (3)
FOLD_FORWARD_PASSES = 2
FOLD_BACKWARD_PASSES = 3


def expert_fold_seconds(job: Job, *, repeat: float = 1.0) -> float:
    """adapter.target_experts: the memory-bound passes of peft's fold of the adapters into each layer's experts
    (rank-r products over a tensor the size of the experts: streaming, not FLOPs-bound) for one micro-batch."""
    if not job.lora_experts:
        return 0.0
    passes = repeat * FOLD_FORWARD_PASSES + FOLD_BACKWARD_PASSES
    folded = routed_expert_params(job.arch, layers=job.lora_expert_layers)
    return memory_seconds(job.preset, passes * folded * job.weight_bytes)


EAGER_SWIGLU = (5, 13)  # act(gate) * up, forward and backward, in units of a*i per routed copy
FUSED_SWIGLU = (3, 5)  # Liger's SwiGLU kernels
_GPT_OSS_GATING = (16, 32)


def routed_pass_bytes(job: Job) -> tuple[float, float]:
    """(forward, backward) bytes per token of one MoE layer's routed-expert kernels other than the
    GEMMs, as transformers runs them (the dispatch and the experts' gating; see the module docstring)."""
    arch, a = job.arch, job.act_bytes
    h, i = arch.hidden_size, expert_size(arch)
    k = min(arch.experts_per_token, arch.num_experts)
    gating = _GPT_OSS_GATING if arch.family == "gpt_oss" else EAGER_SWIGLU
    forward = k * (6 * a * h + 2 * a * h / k + gating[0] * a * i)
    backward = k * (12 * a * h + 4 * a * h / k + gating[1] * a * i)
    return forward, backward


def dispatch_bytes_per_token(job: Job) -> tuple[float, float]:
    """(forward, backward) bytes per token of one MoE layer beyond what a dense MLP of the same FLOPs
    moves: the routed passes less the SwiGLU passes the dense efficiency already holds (Liger's: it was
    measured with them; plan/unfused_time.py adds a dense MLP's eager ones), plus the router."""
    arch, a = job.arch, job.act_bytes
    i, e = expert_size(arch), arch.num_experts
    k = min(arch.experts_per_token, e)
    forward, backward = routed_pass_bytes(job)
    router = (a + 20) * e / 2
    return forward - k * FUSED_SWIGLU[0] * a * i + router, backward - k * FUSED_SWIGLU[1] * a * i + router


def moe_seconds(job: Job, *, micro_batch: int, efficiency: float, half_tokens: float, repeat: float = 1.0) -> float:
    """Seconds one micro-batch spends on MoE work beyond its FLOPs at `efficiency` (the dense rate the
    step time uses), per GPU: the routed GEMMs' lower efficiency and the dispatch traffic. `repeat`
    counts checkpointed forwards (1 + the checkpointed share) for the forward-only parts."""
    layers = moe_layer_count(job.arch)
    if not layers:
        return 0.0
    p = job.preset
    tokens = computed_tokens_per_micro_batch(job, micro_batch)
    flops = routed_flops_per_token(job) * tokens
    if repeat > 1.0:  # the recomputed forward: 2 FLOPs per active expert parameter per token
        flops += (repeat - 1.0) * routed_active_params(job.arch) * 2 * tokens
    share = grouped_gemm_share(job, micro_batch=micro_batch, half_tokens=half_tokens)
    gemm = flops / (job.peak_tflops * 1e12 * efficiency) * (1 / share - 1)
    forward, backward = dispatch_bytes_per_token(job)
    return (
        gemm
        + memory_seconds(p, layers * tokens * (repeat * forward + backward))
        + expert_fold_seconds(job, repeat=repeat)
    )

"""What autograd keeps per token in a decoder layer's MLP, dense or mixture-of-experts.

Dense SwiGLU (and an MoE layer's shared expert) of width w: gate, up and silu(gate) (3*act*w; Liger's
fused kernel recomputes silu(gate): 2*act*w), plus the product gate*up when the down projection needs
its input for a gradient (trained, or a LoRA target: act*w).

Routed experts, transformers 5's default experts implementation (grouped_mm: modeling_utils'
get_correct_experts_implementation picks it whenever the model can dispatch it; integrations/moe.py's
grouped_mm_experts_forward). Each token is copied to its top-k experts; per routed copy:
  gate_up output (act*2i, kept whole: silu reads the gate half, the product the up half), the
  activation's output (act*i; GPT-OSS's clamped sigmoid gating keeps three more i-wide tensors: act*4i),
  the down projection's output (act*h, kept for the routing weight's gradient: the product with the
  routing weight, which requires a gradient through the router), the routing weight itself (act; fp32
  in Mixtral, whose router keeps its top-k weights in fp32), and three int64 index vectors (the
  gather of the hidden states, the routing-weight gather, the inverse permutation): 24 bytes.
  Trained experts (full fine-tune, or LoRA on the experts' folded copy: adapter.target_experts) also keep the
  gathered input and the product for their weight gradients: act*(h + i). The frozen experts of a LoRA run keep
  neither (grouped_mm saves an operand only for the other's gradient).
Per token: the top-k indices (8k), and the router's own tensors by convention: a softmax router
(Mixtral, Qwen-MoE, OLMoE) keeps its fp32 probabilities (4E) and, normalizing the top-k (Mixtral, Qwen3-MoE
by default), the fp32 top-k values and their sum (4k + 4); DeepSeek's (and GLM-4.5's) sigmoid router keeps bf16 scores
(2E), its selection mask (E) and gathered weights (2k + 10 bytes of group indices, n_group = 1; a few
bytes more per group), and when trained the bf16 copy of its fp32-cast input (act*h); GPT-OSS's softmax
over the top-k logits keeps act*k; Granite's, over its fp32 top-k logits, 4k. Qwen2-MoE's sigmoid gate on
the shared expert keeps the shared output and the gate (act*h + act).
Checked by listing saved tensors with torch.autograd.graph.saved_tensors_hooks on one MoE block of
each family (transformers 5.24, bf16, 1024 tokens, h 256, i 128, 8 experts, top-2; tests/unit/plan/test_moe_memory.py):
with frozen experts Qwen2-MoE 5,478 B/token, Qwen3-MoE 2,672, Mixtral 2,676, DeepSeek-V3 ~3,450 (its
group selection varies by a few bytes), GPT-OSS 4,168. Liger's own expert kernels never run: finetune
asks Liger for no SwiGLU on the model types whose patch would swap the experts (registry.families.liger_swiglu),
so a dense MLP or shared expert there keeps transformers' SwiGLU activations (Job.liger_swiglu).
"""

from __future__ import annotations

from finetune.plan.workload import Job, expert_size, moe_layer_count
from finetune.registry.families import DEEPSEEK_ROUTED

_SOFTMAX_ROUTERS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")

_NORMALIZED_TOPK = ("mixtral", "qwen3_moe")  # the family's default norm_topk_prob


def dense_mlp_bytes(job: Job, width: int, *, keeps_product: bool = False) -> float:
    """A SwiGLU MLP of `width` (a dense layer's, or an MoE layer's shared expert). `keeps_product`: down_proj keeps
    its input though it is frozen (plan/memory.py linears_keep_inputs)."""
    a = job.act_bytes
    product = keeps_product or job.adapter == "full" or "down_proj" in job.lora_targets
    return a * width * ((2 if job.liger_swiglu else 3) + (1 if product else 0))


def routed_bytes(job: Job, *, trained: bool | None = None) -> float:
    """One MoE layer's routed experts and router, per token (see the module docstring). `trained`: whether this
    layer's experts get weight gradients (default: a full fine-tune's, or every MoE layer adapted by
    adapter.target_experts)."""
    if trained is None:
        trained = job.trained_expert_layers == moe_layer_count(job.arch) > 0
    arch, a = job.arch, job.act_bytes
    h, i, e = arch.hidden_size, expert_size(arch), arch.num_experts
    k = min(arch.experts_per_token, e)
    family = arch.family
    activation = 4 * i if family == "gpt_oss" else i
    weight = 4 if family == "mixtral" else a
    copy = a * (2 * i + activation + h) + weight + 24
    if trained:  # the weight gradients' operands (adapter.target_experts: of the folded copy)
        copy += a * (h + i) + (8 if arch.expert_bias and job.adapter == "full" else 0)
    router = 8 * k
    if family in _SOFTMAX_ROUTERS:
        router += 4 * e + (4 * k + 4 if family in _NORMALIZED_TOPK else 0)
    elif family in DEEPSEEK_ROUTED:  # GLM-4.5's router is DeepSeek's code (its fp32 cast undone by autocast)
        router += 3 * e + 2 * k + 10
        if job.adapter == "full":  # the router casts its input to fp32: autocast's bf16 copy of it is kept
            router += a * h
    elif family == "gpt_oss":
        router += a * k
    elif family in ("granitemoe", "granitemoeshared"):  # softmax over the fp32 top-k logits
        router += 4 * k
    if arch.shared_expert_gate:
        router += a * h + a
    return k * copy + router


def routed_backward_bytes_per_token(job: Job) -> float:
    """The gradients an MoE layer's routed experts hold at once in their backward, per token, beyond what the forward
    saved (the output's, the activation's, gate_up's and the permuted input's, per routed copy):
      softmax-routed experts (OLMoE, Qwen2/3-MoE, Granite-MoE): a x max(4i, 3h) a copy frozen, a x max(h + 2i, 2h)
        trained (their weight gradients counted apart);
      GPT-OSS (its clamped gating keeps wider activations): a x max(6i, 3h) frozen, a x max(4i, 2h) trained;
      fp32 routing weights (Mixtral, DeepSeek, GLM-4.5): max(4ai, 3ah + 8h), trained or not (their trained experts
        hold less, irregularly: this bounds them);
    and a shared expert a x h a token (DeepSeek's, GLM's), a gated one (Qwen2-MoE) a x h a copy. Measured on CPU with
    one transformers 5.24 MoE block of each family at two expert sizes (tests/unit/plan/test_moe_memory.py); with
    OLMoE's shapes at 32,768 tokens, 3.0 GiB, where blind3-03's memory profile (docs/validation.md, thirty-second
    session) held 2.8 GiB beyond the plan inside an MoE layer's recompute and backward."""
    arch, a = job.arch, job.act_bytes
    if not moe_layer_count(arch):
        return 0.0
    h, i = arch.hidden_size, expert_size(arch)
    k = min(arch.experts_per_token, arch.num_experts)
    trained = job.trained_expert_layers > 0
    if arch.family == "mixtral" or arch.family in DEEPSEEK_ROUTED:
        copy = max(a * 4 * i, a * 3 * h + 8 * h)
    elif arch.family == "gpt_oss":
        copy = a * max(4 * i, 2 * h) if trained else a * max(6 * i, 3 * h)
    else:
        copy = a * max(h + 2 * i, 2 * h) if trained else a * max(4 * i, 3 * h)
    shared = 0.0
    if arch.shared_expert_gate:
        copy += a * h
    elif arch.shared_expert_intermediate_size:
        shared = a * h
    return k * copy + shared


def mlp_bytes_per_token_layer(job: Job, *, keeps_product: bool = False) -> float:
    """The MLP's kept activations per token, averaged over the decoder layers (dense and MoE); `keeps_product`: as
    dense_mlp_bytes."""
    arch = job.arch
    moe = moe_layer_count(arch)
    dense = (arch.num_layers - moe) * dense_mlp_bytes(job, arch.intermediate_size, keeps_product=keeps_product)
    sparse = 0.0
    if moe:
        shared = arch.shared_expert_intermediate_size
        trained = job.trained_expert_layers  # of which the experts keep their weight gradients' operands
        sparse = trained * routed_bytes(job, trained=True) + (moe - trained) * routed_bytes(job, trained=False)
        sparse += moe * (dense_mlp_bytes(job, shared, keeps_product=keeps_product) if shared else 0.0)
    return (dense + sparse) / arch.num_layers

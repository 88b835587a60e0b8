"""The host's time to launch a step on a GPU, which the step time combines with the GPU's compute as a soft
maximum (plan/timing.py, soft_max): the host's time where it is the larger by far, more than either where
the two are close.

PyTorch runs eagerly: the host's Python (modules, autograd, peft, the Trainer and TRL's loss) launches
every kernel of a micro-batch one after the other. When a micro-batch's GPU work is short (micro-batch 1,
short rows, small models) the GPU waits for the host, and the step takes the host's time, whatever the
FLOPs say. Measured (docs/validation.md, fifth session), with the profiler's kernel counts and the steady
step time of runs whose GPU work was a third of their step or less:

  full 3B (28 layers) under DDP, micro-batch 1 x 512:   ~2,150 kernels a micro-batch, 197 ms (H100 host)
  LoRA r16 8B (32 layers, 7 modules), 1 x 512:         ~5,290 kernels a micro-batch, 395 ms (H100 host)

which is 61 ms a micro-batch (collate, training_step, the loss's Python) plus 63 us a kernel. The same two
figures predict the 2 x H200 host's micro-batch-1 runs of full 3B within 5% under DDP and FSDP2 (rows 79-82,
whose FSDP2 kernels come from its own profile). These hosts (virtualized Xeons) are what the calibration
knows; a faster host has a lower floor, so the figure is not a promise for every machine, and `finetune
plan --measure` times the real one.

Kernels a micro-batch, from the profiles (docs/results/profiles/):
  a decoder layer, full fine-tune, Liger + varlen:   71   (full3b-ddp-mb1-h200x2: 2,087 a micro-batch)
  each LoRA-targeted linear of a layer:             12.8  ((5,217 - 100) / 32 layers - 71, / 7 modules),
                                                    2 fewer with adapter.fused_lora (plan/lora_time.py),
                                                    and 10 (q/k/v) and 4 (gate/up) a layer fewer with
                                                    adapter.fused_lora_groups
  a layer without Liger (eager RMSNorm/RoPE/SwiGLU): +123 (lora8b-noliger-h200 against lora8b-finetune-h200)
  q/k norms Liger does not patch (OLMo-2's; any without Liger): +24 each, two a layer (counted on CPU)
  lora dropout, per targeted linear:                 +2   (its kernel forward and backward)
  FSDP2's per-layer all-gathers and copies:          +24  (full3b-fsdp2-offload: 2,758 a micro-batch)
  an MoE layer's fold of adapter.target_experts:     +15  (peft's parametrization registered and removed around
                                                    each forward, the factors' casts, baddbmm and its backward:
                                                    0.96 ms a layer's forward and backward measured on a
                                                    2-core CPU host, tiny Qwen3-MoE, over 63 us a kernel)
  outside the layers (embedding, final norm, loss):  100
  a checkpointed layer re-runs its forward:          +1/3 of its kernels
  a DPO/KTO reference forward (adapters off):        +1/3 of a full layer's per layer (KTO: two, the
                                                    completion's and its KL completion's)
  KTO's forward of the KL completion (adapters on):  +1/3 of the layer's
and per optimizer step, per trained tensor (clipping's norms, the non-finite check, the optimizer):
  FSDP2 (DTensor shards): 4.7 (3,961 - 2,758 kernels over 255 tensors); DDP/DeepSpeed: 1.3 (LoRA 8B:
  592 kernels over 448 tensors).
DeepSpeed also runs a Python gradient hook per trained tensor on every micro-batch (ZeRO's bucketing of
the gradient into its partition): 0.59 ms a tensor, from one row (full 3B under ZeRO-2 on one H100 at
micro-batch 2 x 4: 352 ms a micro-batch against 192 ms of the kernel floor and 202 ms of GPU work); the
ZeRO-2 rows with more GPU work a micro-batch (rows 53, 68, 85) hide it, as this floor says. Checked out of
sample on full 1B (row 89: predicted 0.82 of the measured tokens/s; 0.32 ms a tensor there).
ZeRO-3 gathers a module's partitioned parameters in a Python hook before each use and frees them after it (the
forward, the backward, a checkpointed layer's recompute, the reference's forwards, KTO's KL forward): 1.2 ms of host
a use of a module whose parameters are partitioned (larger than strategies.zero3_persistence_threshold), from row 100
(DPO LoRA 3B under ZeRO-3 on 2 H200s: 1,264 such uses a micro-batch, 2.08 s a step against 0.66 s of the
kernel floor; its profiled twin, row 102, shows the host inside DeepSpeed's module hooks while the GPU waits).
Out of sample it moves row 22 (LoRA 8B, ZeRO-3 offload) from 1.86 to 0.80 of the measured speed, row 23 (full
8B) from 1.20 to 1.15, rows 54 and 71 (full 3B, optimizer offload) from 1.25 and 1.18 to 1.14 and 0.99, and row
108 (full 14B on 4 H100s, 43 of 48 layers checkpointed) from 2.30 to 1.47: what is left there is not identified.
A hook is the host's Python (which a probed host's figure scales, as it scales a launch) and a wait for its gather
(which it does not): ZERO3_HOOK_HOST_SHARE of the 1.2 ms scales. On hosts probed at 30-39 us a kernel the hooks took
0.74-1.2 ms a use (rows 359-361: row 100's DPO setting, LoRA 8B and Granite-3.1-8B LoRA, each left over from its
step beside the planned launches), against 0.95-1.15 on the hosts the figure was fitted on. All of it scaled put those
rows at 1.02, 1.20 and 1.26 of their speed, none of it at 0.70, 0.74 and 0.96, half at 0.83, 0.91 and 1.10. The half
was set from those three rows; out of sample, Qwen2.5-7B LoRA (probed at 47 us) and full 3B (66 us) ran at 1.24 and
1.16 of their plans (0.85-1.15 expected; 1.13 and 1.18 with none of it scaled, 1.37 and 1.15 with all of it).
DoRA's layer (its weight norm, the magnitude's products, their gradients and casts): +33 a targeted linear,
counted on CPU (KERNELS_PER_DORA_LINEAR). QLoRA's dequantization: 3 kernels a use of a 4-bit weight
(KERNELS_PER_QUANTIZED_USE). Not counted (the floor stays a lower bound there): eager attention's extra ops, an MoE
layer's routing.
"""

from __future__ import annotations

from finetune import strategies
from finetune.plan.lora_time import KERNELS_SAVED_PER_FUSED_LINEAR, fused_lora_runs, grouped_kernels_saved
from finetune.plan.optimizer import trained_tensors
from finetune.plan.workload import Job, expanded, layer_kinds, layer_lora, numel, targeted_linears

HOST_S_PER_MICRO_BATCH = 0.061
HOST_S_PER_KERNEL = 63e-6
# The host's speed is the machine's, not the card's: the 2 x H200 machines of 2026-11-30 ran host-bound blind rows
# (docs/validation.md, twenty-ninth and thirtieth sessions) at 29-51 us a kernel (their steady steps over the kernels
# counted), the H100 machines at 63. A plan for a named preset keeps the slowest host measured, so it never counts on
# a host it has not seen, and says how much faster the fastest measured would be; a plan made on the machine itself
# times its host (host_s_per_kernel, finetune/hostprobe.py).
FASTEST_HOST_S_PER_KERNEL = 29e-6
KERNELS_PER_LAYER = 71.0
KERNELS_PER_ADAPTED_LINEAR = 12.8
# peft's DoRA layer beyond LoRA's, forward and backward, with the fp32 cast of the module's input it keeps
# (train/model.py adapter_input_casting): the identity, the weight norm, the magnitude's products and their
# gradients, the casts between. Counted as the non-view aten ops of one peft DoRA Linear against a LoRA one under
# bf16 autocast (tests/unit/plan/test_dora_kernels.py); an H200 launched 32-34 more CUDA kernels a module than
# LoRA's with fp32 adapters (25-27 with bf16 ones: scripts/dora_rates.py). With lora dropout DoRA's recomputed
# base output adds 4-9 more (the same script), not counted: DoRA's floor already runs above the host time row
# 269's profile measured (1.42 s of host operators a step, the profiler's own cost included, against 1.56 planned)
KERNELS_PER_DORA_LINEAR = 33.0
KERNELS_WITHOUT_LIGER_PER_LAYER = 123.0
# transformers' eager RMSNorm, forward and backward (the fp32 upcast, pow, mean, eps, rsqrt, the products and their
# gradients, the casts back): counted as the non-view aten ops of Llama's, Qwen3's and OLMo-2's norm modules
# (tests/unit/plan/test_host_time.py). A model's q/k norms run it wherever Liger does not patch them
# (Job.liger_qk_norms: OLMo-2 with Liger on; any model with it off), two a layer. OLMo-2-7B's QLoRA profile
# (blind2-03-profiled, docs/validation.md thirty-first session) launched 6,920 kernels a micro-batch beyond the
# optimizer step's against 5,239 planned without these and the dropout's
KERNELS_PER_EAGER_NORM = 24.0
# lora dropout on a targeted linear: torch's fused dropout kernel forward and its backward (the same profile: 448
# native_dropout and 442 native_dropout_backward calls in two steps of 224 targeted linears)
KERNELS_PER_LORA_DROPOUT = 2.0
# QLoRA: bitsandbytes dequantizes a 4-bit weight at each use, its double-quantized absmax first (fp32), then the weight
# (bf16), and a cast: 3 kernels a use of a quantized linear, in its forward, its backward (the input's gradient) and a
# checkpointed layer's recompute (blind4-02-profiled, Qwen2.5-1.5B QLoRA: 8,960 of each of the three in two steps of
# 16 micro-batches, docs/validation.md thirty-third session)
KERNELS_PER_QUANTIZED_USE = 3.0
KERNELS_FSDP_PER_LAYER = 24.0
KERNELS_PER_EXPERT_FOLD = 15.0
KERNELS_OUTSIDE_LAYERS = 100.0
FORWARD_SHARE = 1 / 3  # of a layer's kernels: the forward (the backward launches about twice as many)
KERNELS_PER_TRAINED_TENSOR_STEP = {"fsdp": 4.7, "other": 1.3}
# a micro-batch's gradient hook per trained tensor, in seconds whatever the host: scaled with the probed host's figure
# it moved the probed ZeRO-2 rows apart (blind2-07 from 0.98 to 1.20 of its speed, blind4-10 from 0.89 to 1.04)
DEEPSPEED_HOOK_S_PER_TENSOR = 0.59e-3
ZERO3_HOOK_S_PER_MODULE_USE = 1.2e-3  # ZeRO-3's gather and release around one use of a partitioned module, at 63 us
ZERO3_HOOK_HOST_SHARE = 0.5  # of it, the host's Python: scaled by a probed host's figure (the rest waits on a gather)


def trained_tensor_count(job: Job) -> int:
    """Tensors the optimizer steps: a full fine-tune's every parameter (each layer's matrices and norms, the
    embedding, the lm_head when untied, the final norm); an adapter's A and B (and DoRA's magnitudes)."""
    if job.adapter != "full":
        return len(expanded(trained_tensors(job)))
    arch = job.arch
    per_layer = sum(
        count * (len(shapes) + arch.norms_per_layer + 2 * arch.qk_norm) for count, _, shapes in layer_kinds(arch)
    )
    return per_layer + 1 + (0 if arch.tied_embeddings else 1) + 1


def kernels_per_micro_batch(job: Job, *, strategy: str, checkpointed_layers: int) -> float:
    """Kernels the host launches for one micro-batch's forward and backward (see the module docstring)."""
    arch = job.arch
    base = KERNELS_PER_LAYER + (0.0 if job.liger else KERNELS_WITHOUT_LIGER_PER_LAYER)
    if arch.qk_norm and not job.liger_qk_norms:
        base += 2 * KERNELS_PER_EAGER_NORM
    layer = base
    if job.adapter != "full":
        targeted = sum(n for n, _, _ in targeted_linears(arch, job.lora_targets))
        per_linear = KERNELS_PER_ADAPTED_LINEAR + (KERNELS_PER_DORA_LINEAR if job.dora else 0.0)
        per_linear += KERNELS_PER_LORA_DROPOUT if job.lora_dropout > 0 else 0.0
        if fused_lora_runs(job, strategy):  # adapter.fused_lora: no scale or add kernels (plan/lora_time.py)
            per_linear -= KERNELS_SAVED_PER_FUSED_LINEAR
        layer += (per_linear * targeted - grouped_kernels_saved(job, strategy)) / arch.num_layers
    if strategies.is_fsdp(strategy):
        layer += KERNELS_FSDP_PER_LAYER
    layer += KERNELS_PER_EXPERT_FOLD * job.lora_expert_layers / arch.num_layers
    kernels = arch.num_layers * layer + checkpointed_layers * FORWARD_SHARE * layer
    # the reference's forwards run with the adapters off; KTO's policy forward of the KL completion with them
    kernels += arch.num_layers * FORWARD_SHARE * (job.reference_passes * base + job.policy_forward_only_passes * layer)
    if job.adapter == "qlora":
        kernels += KERNELS_PER_QUANTIZED_USE * quantized_uses_per_micro_batch(
            job, checkpointed_layers=checkpointed_layers
        )
    return kernels + KERNELS_OUTSIDE_LAYERS


def quantized_uses_per_micro_batch(job: Job, *, checkpointed_layers: int) -> float:
    """Uses of QLoRA's 4-bit weights in one micro-batch: each quantized linear of the layers (transformers quantizes
    the nn.Linear modules; fused 3D experts stay 16-bit) in every forward (a checkpointed layer's again, the forwards
    without gradients) and backward."""
    arch = job.arch
    linears = sum(count * sum(copies for _, _, copies in shapes.values()) for count, _, shapes in layer_kinds(arch))
    return linears / arch.num_layers * layer_passes(job, checkpointed_layers=checkpointed_layers)


def liger_launches_per_pass(job: Job) -> int:
    """Liger's Triton launches in one forward or backward of a layer: its norms (Job.liger_qk_norms: its q/k norms
    too), its RoPE and, where Liger's SwiGLU/GeGLU runs it, its MLP's activation; 0 without Liger."""
    if not job.liger:
        return 0
    return job.arch.norms_per_layer + (2 if job.liger_qk_norms else 0) + 1 + (1 if job.liger_swiglu else 0)


def layer_passes(job: Job, *, checkpointed_layers: int) -> int:
    """A micro-batch's forwards and backwards of decoder layers: each layer's forward and backward, a checkpointed
    layer's forward again, and the forwards without gradients (the reference's, KTO's KL completion)."""
    layers = job.arch.num_layers
    return 2 * layers + checkpointed_layers + layers * job.forward_only_passes


def liger_launches_per_micro_batch(job: Job, *, checkpointed_layers: int) -> float:
    """Liger's Triton kernels launched in one micro-batch: liger_launches_per_pass over the layer passes, and the
    final norm's. Counted as one kernel each in kernels_per_micro_batch (the Llama layer the floor was measured on
    has four a pass); scripts/host_launch_costs.py prints them beside its timings, which put a launch's host cost at
    6-10 times the probe's figure a kernel (docs/validation.md, thirty-second session). Not in the floor: a
    Triton-launch term proportional to the host's figure fixed Gemma-3's probed rows and put Gemma-2's and Qwen3's
    unprobed rows 0.67-0.69 of their speed."""
    if not job.liger:
        return 0.0
    passes = layer_passes(job, checkpointed_layers=checkpointed_layers)
    return liger_launches_per_pass(job) * passes + 2 + job.forward_only_passes


def zero3_module_uses(job: Job, *, checkpointed_layers: int) -> int:
    """Uses of modules whose parameters ZeRO-3 partitions, in one micro-batch: each decoder linear (an MoE
    layer's fused experts as one), a targeted linear's LoRA A and B where they are larger than the persistence
    threshold, the embedding and the untied LM head; used in the forward and the backward, a checkpointed
    layer's forward again, the base's modules once more in each reference forward, and every module in KTO's
    forward of the KL completion."""
    arch = job.arch
    threshold = strategies.zero3_persistence_threshold(arch.hidden_size)
    base = adapter = recompute = 0
    for count, is_moe, shapes in layer_kinds(arch):
        linears = sum(copies for _, _, copies in shapes.values()) + (1 if is_moe else 0)
        lora = 0
        if job.adapter != "full":
            lora = sum(copies for copies, shape in layer_lora(job, shapes) if numel(shape) > threshold)
        base += count * linears
        adapter += count * lora
        recompute += round(checkpointed_layers * count / arch.num_layers) * (linears + lora)
    outside = 1 + (0 if arch.tied_embeddings else 1)
    uses = 2 * (base + adapter + outside) + recompute
    uses += job.reference_passes * (base + outside) + job.policy_forward_only_passes * (base + adapter + outside)
    return uses


def host_s_per_kernel(job: Job) -> float:
    """The host's time a launched kernel: the preset's, where this machine's host was measured
    (finetune/hostprobe.py), else the slowest host measured."""
    return job.preset.host_s_per_kernel or HOST_S_PER_KERNEL


def host_seconds(
    job: Job, *, strategy: str, grad_accum: int, checkpointed_layers: int, s_per_kernel: float | None = None
) -> float:
    """The host's time to launch one optimizer step (grad_accum micro-batches) on a GPU (on the cpu preset the
    step-time model counts the host as the Trainer's own work, timing.CPU_HOST_S_PER_MICRO_BATCH); `s_per_kernel`:
    the host's time a launched kernel (default: host_s_per_kernel)."""
    if s_per_kernel is None:
        s_per_kernel = host_s_per_kernel(job)
    micro = HOST_S_PER_MICRO_BATCH + s_per_kernel * kernels_per_micro_batch(
        job, strategy=strategy, checkpointed_layers=checkpointed_layers
    )
    tensors = trained_tensor_count(job)
    if strategies.is_deepspeed(strategy):
        micro += DEEPSPEED_HOOK_S_PER_TENSOR * tensors
    if strategies.is_zero3(strategy):
        host_speed = s_per_kernel / HOST_S_PER_KERNEL  # against the hosts the hook's figure was fitted on
        hook = ZERO3_HOOK_S_PER_MODULE_USE * (1 - ZERO3_HOOK_HOST_SHARE + ZERO3_HOOK_HOST_SHARE * host_speed)
        micro += hook * zero3_module_uses(job, checkpointed_layers=checkpointed_layers)
    step = s_per_kernel * KERNELS_PER_TRAINED_TENSOR_STEP["fsdp" if strategies.is_fsdp(strategy) else "other"] * tensors
    return grad_accum * micro + step

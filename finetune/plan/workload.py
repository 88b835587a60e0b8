"""What the planner computes on: the recipe's workload as plain numbers, and parameter counts.

`Job` is a frozen dataclass (not pydantic) so the search loop can make variants with
`dataclasses.replace` at no validation cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from operator import attrgetter
from statistics import NormalDist

from finetune.kernels import CUDNN_MIN_EXAMPLE_TOKENS
from finetune.recipe.schema import EMBEDDING_MODULES, least_micro_batch, quantized_base
from finetune.registry.families import LIGER_QK_NORM_MODEL_TYPES, liger_swiglu
from finetune.registry.schema import HardwarePreset, ModelArch

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# A padding-free micro-batch's tokens vary with the lengths it draws; the memory peak of a run is its largest
# micro-batch. The planner plans the sum at which the largest of the run's micro-batches stays below with this
# probability's complement (a Gaussian sum of the lengths; the lengths' own tail is capped by the longest):
PEAK_EXCEEDED = 0.01
# ... and, where the run's length is not known, this many standard deviations: the 1-in-100 largest of ~35,000
# micro-batches, a long run's
PEAK_SIGMAS = 5.0
# methods whose sample is a pair: chosen and rejected are both trained (KTO's sample is one completion)
PAIRED_METHODS = ("dpo", "orpo", "simpo", "reward")
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the linears a decoder layer's attention block (self_attn) holds, by the names layer_kinds gives them (split or
# fused q/k/v, MLA's down- and up-projections); the others live in its MLP block
ATTENTION_LINEARS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "qkv_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
)
# the linears of a layer whose input is a pre-norm's output, by the names layer_kinds gives them (q/k/v split or
# fused, MLA's down-projections, gate/up split or fused); o_proj and down_proj read the attention's and the MLP's
# own outputs
NORM_OUTPUT_READERS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "q_a_proj",
    "kv_a_proj_with_mqa",
    "gate_proj",
    "up_proj",
    "gate_up_proj",
)


@dataclass(frozen=True)
class Job:
    arch: ModelArch
    preset: HardwarePreset
    adapter: str = "lora"  # full | lora | qlora
    method: str = "sft"  # sft | pretrain | dpo | kto | orpo | simpo | reward
    reference: str = "none"  # dpo/kto reference: none | implicit | copy | precompute
    task_eval: bool = False  # data.task_eval: rank 0 generates with a second copy of the model (memory.task_eval_peak)
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ALL_LINEAR
    lora_dropout: float = 0.0
    modules_to_save: tuple[str, ...] = ()  # adapter.modules_to_save: fully trained copies (embed_tokens, lm_head)
    dora: bool = False
    # adapter.target_experts: how many MoE layers get a rank-r adapter per routed expert on their fused expert
    # weights (peft's target_parameters), folded into a copy of each such layer's experts every forward
    lora_expert_layers: int = 0
    double_quant: bool = True
    int8_base: bool = False  # adapter.load_in_8bit: the base's linear weights in 1 byte (LLM.int8)
    weight_bytes: int = 2  # model.dtype
    act_bytes: int = 2  # the compute dtype's (recipe.schema.compute_dtype): 2 for bf16/fp16, 4 for fp32
    autocast: bool = True  # train.precision bf16/fp16: the step runs under torch autocast (fp32: it does not)
    optimizer: str = "adamw"
    clips_gradients: bool = True  # train.max_grad_norm > 0: the Trainer takes the gradients' norm every step
    seq_len: int = 2048
    packed: bool = False  # data.packing: padding-free rows of micro_batch x seq_len tokens
    # data.example_tokens: the packed examples' token-weighted mean length, sum(l^2)/sum(l) (`packed_length`);
    # None: unknown, planned as examples as long as the row (long-context data, the slower case)
    example_tokens: float | None = None
    # data.sequence_tokens: the data's mean, longest and standard deviation of a sequence (a pair's prompt + one
    # completion, an unpacked example, or a packed example that fills its row alone); None: unknown, planned as
    # max_length (packed rows: full)
    sequence_tokens: float | None = None
    longest_sequence_tokens: int | None = None
    sequence_tokens_std: float = 0.0
    # sequences the run trains over all ranks (train.max_steps x global batch, or train.epochs x the data's
    # count): how many micro-batches it draws; None: unknown
    run_sequences: int | None = None
    # flash (flash_attention_2/3, flex: no materialized mask) | varlen (finetune's, no mask) | sdpa | eager
    attention: str = "sdpa"
    # varlen with grouped key/value heads repeated to the query's count before the kernel (two query-sized
    # copies kept per layer). train/attention.py gives them to the kernel as they are wherever torch's varlen
    # takes them (2.11 without a switch, 2.13 with enable_gqa): True only for runs of the repeating path
    varlen_repeats_kv: bool = False
    # model.cudnn_long_examples on a card that runs it (attention_time.card_runs_cudnn_long_examples): the varlen
    # kernel's examples of CUDNN_MIN_EXAMPLE_TOKENS or more run on cuDNN's causal attention
    cudnn_long_examples: bool = False
    # runs of the cuDNN path before the short examples' q, k, v were copied: views of them kept the whole row's q, k
    # and v beside cuDNN's padded copies (plan/memory.py cudnn_kept_bytes_per_token_layer)
    cudnn_keeps_row_inputs: bool = False
    # a packed row on the varlen kernel still gets transformers' block-diagonal masks (runs before
    # train/attention.py's packed_row_mask skipped them; plan/memory.py shared_mask_bytes)
    builds_packed_row_mask: bool = False
    # rows padded to a multiple of this many tokens (resolved.row_multiple: plan.row_multiple says when); the
    # planner counts it at every micro-batch (pads_rows: the run skips one-sequence unpadded micro-batches)
    row_multiple: int | None = None
    # False: the run turns cuDNN's attention off (resolved.cudnn_attention: plan.cudnn_attention_off says when), and
    # sdpa's memory-efficient kernel takes the masked rows (plan/attention_time.py EFFICIENT_KERNEL_SLOWDOWN)
    cudnn_attention: bool = True
    # attention "sdpa" on packed rows because some layers fall back from finetune's varlen kernel
    # (`varlen_fallback_layers`): how many layers the varlen kernel still serves (Gemma-3's global ones)
    varlen_layers: int = 0
    # the varlen kernel takes sliding windows (finetune.kernels.torch_runs_varlen_windows: torch 2.11 and later); False
    # sends a sliding-window model's sliding layers to sdpa over the masked packed row (varlen_fallback_layers)
    varlen_windows: bool = True
    # TRL >= 1.x SFT/DPO score tokens through add_fused_lm_head (chunked, the (tokens, vocab) logits are
    # never materialized); False for a trainer that computes the loss from full logits
    fused_lm_head: bool = True
    # a cross-entropy over the chosen sequences' full logits beside the preference loss: ORPO's SFT term, SimPO/CPO
    # with method.cpo_alpha > 0 (TRL's CPO and ORPO trainers: a shifted copy of those logits, then the loss)
    nll_on_chosen: bool = False
    # adapter.cast_adapter_inputs: peft's per-module fp32 cast of LoRA inputs (finetune skips it by default)
    cast_adapter_inputs: bool = False
    fused_lora: bool = False  # adapter.fuses_lora: finetune's fused LoRA layer (plan/lora_time.py)
    fused_lora_groups: bool = False  # adapter.fused_lora_groups: shared-input linears as one (plan/lora_time.py)
    liger: bool = False  # train.liger resolved: Liger RMSNorm/RoPE/SwiGLU kernels (keep fewer activations)
    global_batch_size: int = 16
    micro_batch: int | None = None  # pinned by the recipe, else searched
    checkpointing: str = "auto"  # auto | on | off
    # with checkpointing "on": how many layers (the first k) are checkpointed, as a resolved recipe
    # records a partial choice (resolved.checkpoint_layers); None = every layer
    checkpoint_layers: int | None = None
    strategy: str = "auto"  # auto or a pinned concrete strategy
    # distributed.sync_each_batch (schema.sync_each_batch_pin): reduce FSDP2's gradients every micro-batch
    # (True) or on a step's last only (False, the Trainer's no_sync); None: searched
    sync_each_batch: bool | None = None
    nvme_path: str | None = None  # ZeRO-Infinity swap dir (recipe's, else the preset's)
    # read bandwidth of nvme_path measured on this machine (registry/disk.py), GB/s; None: the preset's figure
    nvme_read_gbps: float | None = None
    # under FSDP2 each rank reads only its shards from the checkpoint (schema.loads_sharded); otherwise
    # FSDP loads the whole model once per node and scatters it
    sharded_load: bool = False
    # loading makes a real copy of the weights in host RAM (not views of the mapped checkpoint): the
    # checkpoint is stored in another dtype than model.dtype, or in one not known, or the weights are
    # built at random (finetune.plan.memory.loading_host_bytes)
    load_copies: bool = True
    # the final save (none under `finetune plan --measure`): under FSDP2 a full fine-tune's, or an adapter's that writes
    # frozen weights (recipe/schema.py final_save_gathers_trained_only), gathers the whole model to rank 0's host
    final_save: bool = True
    save_gathers_model: bool = False
    final_save_casts: bool = True  # a full fine-tune's gathered fp32 masters are cast to model.dtype (saved_dtype.py)
    # host threads of each rank for the offload tiers' CPU optimizer step; None: as finetune's launcher
    # gives them (finetune.plan.offload_time.host_threads_per_rank)
    host_threads_per_rank: int | None = None

    @property
    def liger_swiglu(self) -> bool:
        """Liger's SwiGLU kernel runs the dense MLPs and shared experts (registry.families.liger_swiglu: not on
        the model types whose patch would also swap the routed experts); its norms and RoPE run wherever `liger`."""
        return self.liger and liger_swiglu(self.arch.family)

    @property
    def liger_qk_norms(self) -> bool:
        """Liger's RMSNorm runs the model's q/k norms (registry.families.LIGER_QK_NORM_MODEL_TYPES); elsewhere they are
        transformers' eager RMSNorm, with Liger on or off."""
        return self.liger and self.arch.qk_norm and self.arch.family in LIGER_QK_NORM_MODEL_TYPES

    @property
    def lora_experts(self) -> bool:
        """adapter.target_experts adapts some MoE layer's routed experts."""
        return self.lora_expert_layers > 0

    @property
    def trained_expert_layers(self) -> int:
        """MoE layers whose routed experts' weight gradients are computed: a full fine-tune's every one, or the
        folded copies' under adapter.target_experts (peft's LoRA reaches its factors through the gradient of the
        whole copy)."""
        return moe_layer_count(self.arch) if self.adapter == "full" else self.lora_expert_layers

    @property
    def computes_fp32(self) -> bool:
        """The step's matmuls run in float32 (recipe.schema.compute_dtype decided the activation width)."""
        return self.act_bytes == 4

    @property
    def peak_tflops(self) -> float:
        """The dense peak the step's matmuls run at (fp32 compute on a GPU: its FP32 rate, not bf16's)."""
        return self.preset.compute_peak_tflops(fp32=self.computes_fp32)

    @property
    def quantized_base(self) -> bool:
        """bitsandbytes quantizes the base's linear weights (QLoRA's 4 bits, LoRA's load_in_8bit): from_pretrained
        places them on the GPU tensor by tensor (device_map), and they are not 16-bit tensors."""
        return quantized_base(self.adapter, load_in_8bit=self.int8_base)

    @property
    def dora_recomputes_base(self) -> bool:
        """peft's DoRA with lora dropout computes each adapted linear's base output again on the dropped-out input
        (plan/dora_time.py recomputed_base_flops_per_token, plan/memory.py dora_dropout_weight_bytes)."""
        return self.dora and self.lora_dropout > 0 and self.adapter != "full"

    def dora_dtype_bytes(self, *, casts: bool, params_16bit: bool = False) -> tuple[int, int]:
        """(adapter, promoted): the bytes of peft's DoRA adapter weights and of the dtype its token-side products
        (the magnitude times the base and LoRA outputs) are promoted to. The adapters are fp32 where peft casts the
        adapter input to fp32 (`casts`: DDP LoRA, plan/memory.py adapter_input_casts) or without autocast, else
        the compute dtype (QLoRA, DeepSpeed, FSDP2); on a quantized base TRL casts the adapters to bf16 but keeps the
        magnitude in fp32 (its updates would round to zero), which promotes the products to fp32 all the same,
        unless DeepSpeed casts every parameter to 16 bits (`params_16bit`: plan/memory.py params_16bit)."""
        adapter = 4 if casts or self.act_bytes == 4 else self.act_bytes
        magnitude = 4 if self.quantized_base and not params_16bit else adapter
        return adapter, max(adapter, magnitude)

    @property
    def reference_forward(self) -> bool:
        """dpo/kto run the reference model's forward in the step (its log-probs are not precomputed)."""
        return self.reference in ("implicit", "copy")

    @property
    def min_micro_batch(self) -> int:
        """The smallest micro-batch the method trains (recipe.schema.MIN_MICRO_BATCH)."""
        return least_micro_batch(self.method)[0]

    @property
    def sequences_per_sample(self) -> int:
        """Sequences trained (forward and backward) per sample: a pair's chosen and rejected; one otherwise."""
        return 2 if self.method in PAIRED_METHODS else 1

    @property
    def reference_passes(self) -> int:
        """The reference model's forwards per trained sequence in the step: DPO's; KTO's on the completion and on
        its mismatched KL completion (TRL's KTOTrainer estimates the KL term from a second, shifted batch)."""
        if not self.reference_forward:
            return 0
        return 2 if self.method == "kto" else 1

    @property
    def policy_forward_only_passes(self) -> int:
        """The trained model's forwards without gradients per trained sequence: KTO's KL completion (under
        torch.no_grad in TRL 1.16: no activations kept, no backward)."""
        return 1 if self.method == "kto" else 0

    @property
    def forward_only_passes(self) -> int:
        """Forwards without a backward per trained sequence, the reference's and the policy's."""
        return self.reference_passes + self.policy_forward_only_passes


@dataclass(frozen=True)
class Params:
    """Parameter counts of one architecture (elements, not bytes). Layers may differ (dense and MoE
    layers of DeepSeek/Qwen-MoE), so the layer figures are sums over all decoder layers."""

    embed: int
    lm_head: int  # 0 when tied to the embedding
    layers: int  # every decoder layer, all experts
    # the nn.Linear weights of all layers, what bitsandbytes quantizes (QLoRA packs these to 4 bit); an MoE
    # layer's routed experts are not among them: transformers 5 keeps every family's experts in fused 3D
    # parameters (e.g. MixtralExperts.gate_up_proj), which its bitsandbytes integration leaves in the dtype
    layers_linear: int
    layers_active: int  # every layer, counting only the experts a token is routed to (+ shared experts)
    largest_layer: int  # the biggest decoder layer: what FSDP/ZeRO-3 gathers at once
    final_norm: int
    num_layers: int
    towers: int = 0  # a multimodal checkpoint's vision tower and projector: weights only (ModelArch)

    @property
    def total(self) -> int:
        """Every parameter the checkpoint loads."""
        return self.text_model + self.towers

    @property
    def text_model(self) -> int:
        """The text model's parameters: what a full fine-tune trains (the towers stay frozen)."""
        return self.embed + self.lm_head + self.layers + self.final_norm

    @property
    def active(self) -> int:
        """Parameters one token uses: embedding row lookups aside, everything but the unrouted experts."""
        return self.embed + self.lm_head + self.layers_active + self.final_norm

    @property
    def layer(self) -> int:
        """The largest decoder layer (FSDP's unit)."""
        return self.largest_layer

    @property
    def root(self) -> int:
        """What FSDP's root unit holds (embedding, lm_head, final norm, towers): all outside the layers."""
        return self.embed + self.lm_head + self.final_norm + self.towers

    @property
    def matmul_active(self) -> int:
        """Parameters a token multiplies with (the FLOPs 'N'): layers (active experts) + lm_head."""
        head = self.lm_head or self.embed  # tied: the embedding matrix is the lm_head matmul
        return self.layers_active + head


def longest_sequence(job: Job) -> int:
    """The longest sequence: the data's (data.sequence_tokens), else max_length."""
    return min(job.seq_len, job.longest_sequence_tokens or job.seq_len)


def peak_sequence_tokens(job: Job) -> float:
    """Tokens of a sequence at a micro-batch's peak: max_length, or the data's longest (data.sequence_tokens):
    TRL pads a micro-batch's sequences to its longest (rounded up to Job.row_multiple), and padding-free pairs
    hold at most that many each."""
    longest = longest_sequence(job)
    return longest if job.packed else padded_row(job, longest)


def peak_tokens_per_micro_batch(job: Job, micro_batch: int) -> float:
    """Tokens a micro-batch holds at its peak (activations, logits). Padded sequences are padded to the
    micro-batch's longest: at most the data's longest (data.sequence_tokens), which one long sequence
    brings into any micro-batch. Padding-free pairs hold their real tokens: a sum of n independent
    lengths, planned at n x mean + z x std x sqrt(n) (`peak_sigmas`: the largest of the run's micro-batches), and
    never more than n x longest, and so do packed examples that fill a row each. Unknown lengths: every sequence
    at max_length (packed SFT rows are full)."""
    n = micro_batch * job.sequences_per_sample
    longest = n * peak_sequence_tokens(job)
    if not (job.packed and job.sequence_tokens):
        return padded_row(job, longest)
    z = peak_sigmas(job, micro_batch)
    return padded_row(job, min(longest, n * mean_sequence_tokens(job) + z * job.sequence_tokens_std * n**0.5))


def pads_rows(job: Job, *, micro_batch: int) -> bool:
    """The run pads its rows to Job.row_multiple at this micro-batch: packed rows always, padded sequences where a
    micro-batch holds more than one (a single unpadded sequence gets no mask: sdpa's causal flash kernel)."""
    return bool(job.row_multiple) and (job.packed or micro_batch * job.sequences_per_sample > 1)


def padded_row(job: Job, tokens: float) -> float:
    """A row of `tokens` as the collator pads it: up to a multiple of Job.row_multiple."""
    m = job.row_multiple
    return -(-tokens // m) * m if m else tokens


def peak_sigmas(job: Job, micro_batch: int) -> float:
    """Standard deviations above its mean at which a padding-free micro-batch's tokens are planned: the value the
    largest of the run's M micro-batches passes with probability PEAK_EXCEEDED (each passes it with PEAK_EXCEEDED
    / M), M = the run's sequences / micro_batch; PEAK_SIGMAS where the run's length is unknown. A 12-step test run
    of 24 micro-batches plans 3.3 sigma, a run of 100,000 micro-batches 5.2."""
    if not job.run_sequences:
        return PEAK_SIGMAS
    draws = max(1, -(-job.run_sequences // micro_batch))
    return NormalDist().inv_cdf(1 - PEAK_EXCEEDED / draws)


def mean_sequence_tokens(job: Job) -> float:
    """Real tokens of a trained sequence: the data's mean (data.sequence_tokens), else max_length (packed rows
    are full; unknown lengths are planned as max_length)."""
    return min(job.seq_len, job.sequence_tokens or job.seq_len)


def expected_largest_of(n: int) -> float:
    """The expected largest of n independent standard normal draws, by Blom's approximation
    (inv_cdf((n - 0.375) / (n + 0.25))): 0 for one, 0.59 for two (exactly 0.56), 1.05 for four (1.03), 1.43 for
    eight (1.42), 2.07 for thirty-two (2.04)."""
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) if n > 1 else 0.0


def computed_sequence_tokens(job: Job, micro_batch: int) -> float:
    """Tokens a sequence costs the GPU on average: padding-free pairs (data.packing) compute their real tokens;
    padded sequences their micro-batch's longest. With the data's lengths measured (data.sequence_tokens) that
    is the expected largest of the micro-batch's n sequences, mean + std x expected_largest_of(n), at most the
    data's longest, and half a Job.row_multiple more where the run pads the rows (`pads_rows`), at most the data's
    longest rounded up to the multiple; a
    one-sequence micro-batch is not padded at all. Unknown lengths: max_length. (The peak memory plans the
    micro-batch that meets the data's longest: peak_sequence_tokens.)"""
    if job.packed:
        return mean_sequence_tokens(job)
    if not job.sequence_tokens:
        return peak_sequence_tokens(job)
    n = micro_batch * job.sequences_per_sample
    tokens = min(longest_sequence(job), mean_sequence_tokens(job) + job.sequence_tokens_std * expected_largest_of(n))
    if not pads_rows(job, micro_batch=micro_batch):
        return tokens
    # never past the data's longest rounded up (a multiple larger than the data's lengths pads every row to it)
    return min(tokens + (job.row_multiple or 0) / 2, padded_row(job, longest_sequence(job)))


def computed_tokens_per_micro_batch(job: Job, micro_batch: int) -> float:
    """Tokens a micro-batch costs the GPU on average (the step's time; its peak memory holds
    memory.tokens_per_micro_batch), padding included: half a Job.row_multiple where the rows' lengths vary
    (measured), full rows rounded up."""
    tokens = micro_batch * computed_sequence_tokens(job, micro_batch) * job.sequences_per_sample
    if not job.packed:  # each sequence padded to its micro-batch's longest: computed_sequence_tokens
        return tokens
    if job.row_multiple and job.sequence_tokens:
        return tokens + job.row_multiple / 2
    return padded_row(job, tokens)


def batch_share(job: Job) -> int:
    """Sequences per rank per optimizer step (the global batch over the world, at least 1)."""
    return max(1, round(job.global_batch_size / job.preset.world_size))


def holds_a_micro_batch(job: Job) -> bool:
    """A GPU's share of the global batch reaches the method's smallest micro-batch (KTO's 2)."""
    return batch_share(job) >= job.min_micro_batch


def accumulation_steps(job: Job, micro_batch: int) -> int:
    return max(1, round(batch_share(job) / micro_batch))


def head_dim(arch: ModelArch) -> int:
    return arch.head_dim or arch.hidden_size // arch.num_attention_heads


def attended_positions(arch: ModelArch, seq_len: float) -> float:
    """L x s of the attention FLOPs term, with sliding-window layers (GPT-OSS) attending to at most
    their window: (L - sliding) x s + sliding x min(s, window)."""
    sliding = sliding_layer_count(arch)
    window = min(seq_len, arch.sliding_window or seq_len)
    return (arch.num_layers - sliding) * seq_len + sliding * window


def needs_model_eager(arch: ModelArch) -> bool:
    """Every layer's scores need what neither the varlen kernel nor sdpa computes, so each runs the model's
    own eager attention: logit soft-capping (Gemma-2) or attention sinks (GPT-OSS). The runtime's copy of
    this rule is finetune/train/attention.py's needs_model_eager (by the layer's call arguments)."""
    return bool(arch.attn_logit_softcap) or arch.attention_sinks


def varlen_fallback_layers(arch: ModelArch, *, windows: bool = True) -> int:
    """Decoder layers of `arch` that finetune's varlen kernel does not serve: it has no logit soft-capping, no
    attention sinks and no attention dropout (a config's attention_dropout > 0, every layer; train/attention.py's
    `plain`), so finetune/train/attention.py's `varlen_attention_forward` hands a layer that passes `softcap` or
    `s_aux` to the model's own eager attention (`needs_model_eager`), and one with dropout to transformers'
    sdpa_attention_forward, each with the block-diagonal mask over the whole packed row (keep the two rules
    together). Each of those is on every layer. Sliding windows the kernel runs (`window_size`, torch 2.11 and later:
    train/attention.py's window_arguments); `windows` False (an older torch: finetune.kernels.torch_runs_varlen_windows)
    sends the sliding layers to sdpa as well (`layer_falls_back`). 0: the kernel serves them all."""
    if needs_model_eager(arch) or arch.attention_dropout:
        return arch.num_layers
    if not windows and not arch.window_in_mask_only:
        return sliding_layer_count(arch)
    return 0


def packed_row_fallback_layers(job: Job) -> int:
    """Layers of `job` that run a packed row through sdpa or eager over its block-diagonal mask because finetune's
    varlen kernel does not serve them (`varlen_fallback_layers`); 0 where the run has no such layers: rows not
    packed, or attention on a varlen or flash kernel."""
    if not (job.packed and job.attention in ("sdpa", "eager") and job.varlen_layers < job.arch.num_layers):
        return 0
    return varlen_fallback_layers(job.arch, windows=job.varlen_windows)


def sliding_layer_count(arch: ModelArch) -> int:
    """Decoder layers that attend within a sliding window (0 where the config has no window)."""
    return min(arch.sliding_layers, arch.num_layers) if arch.sliding_window else 0


def band_positions(window: float, seq_len: float) -> float:
    """The keys a query attends to on average in a causal row of `seq_len` tokens under a window of `window`: s/2
    (query i sees i+1 keys) where the window spans the row, else the band's w - w^2/(2s)."""
    return seq_len / 2 if window >= seq_len else window - window * window / (2 * seq_len)


def sliding_causal_positions(arch: ModelArch, seq_len: float) -> float:
    """The sliding-window layers' share of `causal_positions`."""
    return sliding_layer_count(arch) * band_positions(arch.sliding_window or seq_len, seq_len)


def causal_positions(arch: ModelArch, seq_len: float) -> float:
    """L x the keys a query attends to on average in a causal row of `seq_len` tokens: s/2 for a full
    layer, the band (`band_positions`) for a sliding layer."""
    return (arch.num_layers - sliding_layer_count(arch)) * seq_len / 2 + sliding_causal_positions(arch, seq_len)


def skips_masked_blocks(job: Job, *, micro_batch: int) -> bool:
    """The attention kernel computes only blocks on or below the causal diagonal: the flash and varlen
    kernels, and sdpa on one unpadded row (is_causal, no mask: its flash backend). A kernel given an
    explicit mask (padded rows, a packed row's block-diagonal mask, eager) computes every block."""
    if job.attention in ("flash", "varlen"):
        return True
    return job.attention == "sdpa" and not job.packed and micro_batch * job.sequences_per_sample == 1


def packed_length(lengths, *, max_length: int) -> float | None:
    """The token-weighted mean length of examples (each cut at `max_length`): sum(l^2) / sum(l). A
    causal kernel that runs each packed example on its own (varlen, flash) computes l^2/2 scores for an
    example of l tokens, so per token of a packed row it computes sum(l^2)/(2 sum(l)) of them: this
    length's triangle, whatever the row length. None for no tokens."""
    cut = [min(int(n), max_length) for n in lengths if n > 0]
    total = sum(cut)
    return sum(n * n for n in cut) / total if total else None


def attention_span(
    *, seq_len: int, example_tokens: float | None, sequence_mean: float | None, sequence_std: float
) -> float:
    """The positions a trained token attends to, token-weighted over the data and at most `seq_len`: the s of the
    useful attention FLOPs (timing.model_flops_per_token, the MFU's numerator). A packed row's examples attend within
    themselves, not across the row (data.example_tokens, `packed_length`); unpacked sequences of mean m and standard
    deviation d weigh each token by its sequence's length, E[l^2]/E[l] = m + d^2/m (data.sequence_tokens); unknown
    lengths are planned as long as the row."""
    if example_tokens:
        return min(seq_len, example_tokens)
    if sequence_mean:
        return min(seq_len, sequence_mean + sequence_std**2 / sequence_mean)
    return seq_len


def job_attention_span(job: Job) -> float:
    """`attention_span` of the job's data (a packed job's measured examples, else its sequences)."""
    return attention_span(
        seq_len=job.seq_len,
        example_tokens=job.example_tokens if job.packed else None,
        sequence_mean=job.sequence_tokens,
        sequence_std=job.sequence_tokens_std,
    )


def masked_row_layers(job: Job) -> int:
    """Decoder layers whose attention gets the mask over the packed row: all but those finetune's varlen kernel
    still serves (varlen_fallback_layers says which fall back); every layer of unpacked rows."""
    return job.arch.num_layers - (min(job.varlen_layers, job.arch.num_layers) if job.packed else 0)


def packed_example_tokens(job: Job) -> float:
    """The length a packed row's examples run at: their token-weighted length where the data's are known
    (Job.example_tokens, `packed_length`), else the row's (long-context data, the slower assumption), at most the
    row's."""
    return min(job.seq_len, job.example_tokens or job.seq_len)


def long_examples_on_cudnn(job: Job) -> bool:
    """A packed row's examples run on cuDNN's causal attention (Job.cudnn_long_examples, finetune/kernels.py): in its
    full layers, cuDNN having no window (a model whose every layer slides, Mistral-7B-v0.1, has none there)."""
    return (
        job.cudnn_long_examples
        and job.packed
        and packed_example_tokens(job) >= CUDNN_MIN_EXAMPLE_TOKENS
        and sliding_layer_count(job.arch) < job.arch.num_layers
    )


def kernel_example_tokens(job: Job, micro_batch: int) -> float:
    """The length a causal kernel's examples run at: a packed row's examples (`packed_example_tokens`), else a
    sequence padded to its micro-batch's longest (`computed_sequence_tokens`)."""
    return packed_example_tokens(job) if job.packed else computed_sequence_tokens(job, micro_batch)


def executed_attention_positions(job: Job, *, micro_batch: int) -> float:
    """L x key positions per query token that the attention kernels really compute (the step time's
    attention FLOPs; the MFU's stay `attended_positions`, the convention that counts the full s x s).
    sdpa or eager with a mask over a packed row of T tokens (computed_tokens_per_micro_batch: full rows, or
    the measured lengths, padding included) compute every T x T block (a masked kernel skips none, and a
    sliding window is only more mask); a causal kernel
    computes the triangle of each row (`causal_positions`). The varlen and flash kernels run each
    packed example as its own row: the triangle of the examples' token-weighted mean length
    (`Job.example_tokens`, `packed_length`) when the data's lengths are known, else of examples as long
    as seq_len (long-context data, the slower assumption)."""
    arch = job.arch
    if job.packed and job.attention in ("sdpa", "eager"):
        masked = masked_row_layers(job)
        row = computed_tokens_per_micro_batch(job, micro_batch)  # the real tokens, padding included
        return masked * row + (arch.num_layers - masked) * packed_example_tokens(job) / 2
    if skips_masked_blocks(job, micro_batch=micro_batch):
        # a padded sequence over its micro-batch's (padded) longest; a packed row's examples on their own
        return causal_positions(arch, kernel_example_tokens(job, micro_batch))
    return attended_positions(arch, job.seq_len if job.packed else computed_sequence_tokens(job, micro_batch))


def is_mla(arch: ModelArch) -> bool:
    return arch.kv_lora_rank is not None


def mla_dims(arch: ModelArch) -> tuple[int, int, int, int]:
    """(kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim) of an MLA architecture (the
    config reader sets all four together)."""
    return (arch.kv_lora_rank or 0, arch.qk_nope_head_dim or 0, arch.qk_rope_head_dim or 0, arch.v_head_dim or 0)


def attention_widths(arch: ModelArch) -> tuple[int, int, int]:
    """(q, k, v) widths per token of one layer's attention inputs (all heads). MLA expands its latent
    into full per-head keys and values (no grouped kv heads)."""
    if is_mla(arch):
        _, nope, rope, v = mla_dims(arch)
        qk = arch.num_attention_heads * (nope + rope)
        return qk, qk, arch.num_attention_heads * v
    q, kv = arch.num_attention_heads * head_dim(arch), arch.num_kv_heads * head_dim(arch)
    return q, kv, kv


def kernel_attention_widths(job: Job) -> tuple[int, int, int]:
    """(q, k, v) widths as the job's attention kernel takes them: the flash kernels (flash, varlen) take one head
    size, so MLA's values reach them zero-padded to the keys' (train/attention.py)."""
    q, k, v = attention_widths(job.arch)
    if job.attention in ("flash", "varlen") and is_mla(job.arch):
        v = k
    return q, k, v


def moe_layer_count(arch: ModelArch) -> int:
    if arch.num_experts == 1:
        return 0
    return arch.num_layers if arch.moe_layers is None else min(arch.moe_layers, arch.num_layers)


def expert_size(arch: ModelArch) -> int:
    return arch.moe_intermediate_size or arch.intermediate_size


def _attention_shapes(arch: ModelArch) -> dict[str, tuple[int, int, int]]:
    h = arch.hidden_size
    if not is_mla(arch):
        q, kv, _ = attention_widths(arch)
        if arch.fused_qkv:
            return {"qkv_proj": (h, q + 2 * kv, 1), "o_proj": (q, h, 1)}
        return {"q_proj": (h, q, 1), "k_proj": (h, kv, 1), "v_proj": (h, kv, 1), "o_proj": (q, h, 1)}
    heads = arch.num_attention_heads
    kv_rank, nope, rope, v = mla_dims(arch)
    qk = heads * (nope + rope)
    shapes = (
        {"q_a_proj": (h, arch.q_lora_rank, 1), "q_b_proj": (arch.q_lora_rank, qk, 1)}
        if arch.q_lora_rank
        else {"q_proj": (h, qk, 1)}
    )
    shapes.update(
        kv_a_proj_with_mqa=(h, kv_rank + rope, 1), kv_b_proj=(kv_rank, heads * (nope + v), 1), o_proj=(heads * v, h, 1)
    )
    return shapes


def layer_kinds(arch: ModelArch) -> list[tuple[int, bool, dict[str, tuple[int, int, int]]]]:
    """[(how many layers, is MoE, linear modules as name -> (in, out, copies))] of the decoder.

    The names are the nn.Linear modules peft can target by name. transformers 5 stores routed experts
    as fused 3D parameters (not nn.Linear), so an MoE layer lists only its shared expert (and gate)."""
    h, i = arch.hidden_size, arch.intermediate_size
    attention = _attention_shapes(arch)
    gate_up = {"gate_up_proj": (h, 2 * i, 1)} if arch.fused_gate_up else {"gate_proj": (h, i, 1), "up_proj": (h, i, 1)}
    dense = dict(attention, **gate_up, down_proj=(i, h, 1))
    moe = moe_layer_count(arch)
    kinds = []
    if arch.num_layers - moe:
        kinds.append((arch.num_layers - moe, False, dense))
    if moe:
        shared = arch.shared_expert_intermediate_size
        sparse = dict(attention)
        if shared:
            sparse.update(gate_proj=(h, shared, 1), up_proj=(h, shared, 1), down_proj=(shared, h, 1))
        if arch.shared_expert_gate:
            sparse["shared_expert_gate"] = (h, 1, 1)
        kinds.append((moe, True, sparse))
    return kinds


def module_shapes(arch: ModelArch) -> dict[str, tuple[int, int, int]]:
    """name -> (in_features, out_features, copies per layer) of the widest layer kind's linear modules."""
    shapes: dict[str, tuple[int, int, int]] = {}
    for _, _, kind in layer_kinds(arch):
        for name, shape in kind.items():
            if name not in shapes or shape[0] * shape[1] > shapes[name][0] * shapes[name][1]:
                shapes[name] = shape
    return shapes


def linear_features_per_token(arch: ModelArch) -> float:
    """Input plus output features, summed over every linear one token passes through: the decoder layers' (each
    layer kind's modules, the routed experts' gate_up and down) and the lm_head. The activations
    the streaming kernels around the GEMMs read and write scale with this sum, the GEMMs' FLOPs with the products
    (plan/timing.py, linear_traffic_seconds)."""
    features = 0.0
    for count, is_moe, shapes in layer_kinds(arch):
        features += count * sum((fin + fout) * copies for fin, fout, copies in shapes.values())
        if is_moe:  # as a dense MLP of the routed experts' FLOPs (top-k x their width): the per-copy dispatch beyond
            # that is plan/moe_time.py's
            h, width = arch.hidden_size, min(arch.experts_per_token, arch.num_experts) * expert_size(arch)
            features += count * ((h + 2 * width) + (width + h))
    return features + arch.hidden_size + arch.vocab_size


def count_params(arch: ModelArch) -> Params:
    # pydantic models are not hashable; cache on the numbers that matter (read by one C-level getter:
    # the planner's search calls this thousands of times per plan)
    return _count_params(_counted(arch))


_COUNTED = (
    "norms_per_layer",
    "qk_norm",
    "qk_norm_per_head",
    "mlp_bias",
    "hidden_size",
    "intermediate_size",
    "num_experts",
    "experts_per_token",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "attention_bias",
    "vocab_size",
    "tied_embeddings",
    "num_layers",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "shared_expert_gate",
    "moe_layers",
    "router_bias",
    "expert_bias",
    "attention_sinks",
    "o_proj_bias",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "frozen_tower_params",
)


_counted = attrgetter(*_COUNTED)


@lru_cache(maxsize=256)
def _count_params(values: tuple) -> Params:
    arch = ModelArch.model_construct(**dict(zip(_COUNTED, values)))
    h, e = arch.hidden_size, arch.num_experts
    attention = sum(fin * fout for fin, fout, _ in _attention_shapes(arch).values())
    q, kv, _ = attention_widths(arch)
    norms = arch.norms_per_layer * h
    if arch.qk_norm:  # one head wide (shared by the heads), or over all q and k heads
        norms += 2 * head_dim(arch) if arch.qk_norm_per_head else q + kv
    if is_mla(arch):  # q_a/kv_a RMSNorms; attention_bias adds biases to q_a, kv_a and o
        kv_rank, _, rope, _ = mla_dims(arch)
        norms += (arch.q_lora_rank or 0) + kv_rank
        bias = (arch.q_lora_rank or 0) + kv_rank + rope + h if arch.attention_bias else 0
    else:
        bias = (q + 2 * kv) if arch.attention_bias else 0
        bias += h if arch.o_proj_bias else 0
    if arch.attention_sinks:
        bias += arch.num_attention_heads
    base = attention + bias + norms
    dense_mlp = 3 * h * arch.intermediate_size + ((2 * arch.intermediate_size + h) if arch.mlp_bias else 0)
    moe = moe_layer_count(arch)
    layers = layers_linear = layers_active = 0
    largest = 0
    if arch.num_layers - moe:
        n = arch.num_layers - moe
        layers += n * (base + dense_mlp)
        layers_linear += n * (attention + 3 * h * arch.intermediate_size)
        layers_active += n * (base + dense_mlp)
        largest = base + dense_mlp
    if moe:
        i = expert_size(arch)
        one = 3 * h * i + ((2 * i + h) if arch.expert_bias else 0)
        width = arch.shared_expert_intermediate_size
        shared = 3 * h * width + (h if arch.shared_expert_gate else 0)
        shared += (2 * width + h) if arch.mlp_bias and width else 0  # DeepSeek-V2's MLP class, shared too
        router = h * e + (e if arch.router_bias else 0)
        layer = base + e * one + shared + router
        layers += moe * layer
        layers_linear += moe * (attention + 3 * h * arch.shared_expert_intermediate_size)
        layers_active += moe * (base + min(arch.experts_per_token, e) * one + shared + router)
        largest = max(largest, layer)
    embed = arch.vocab_size * h
    return Params(
        embed=embed,
        lm_head=0 if arch.tied_embeddings else embed,
        layers=layers,
        layers_linear=layers_linear,
        layers_active=layers_active,
        largest_layer=largest,
        final_norm=h,
        num_layers=arch.num_layers,
        towers=arch.frozen_tower_params,
    )


def lora_params(job: Job, *, active: bool = False) -> int:
    """r x (in + out) per targeted module per layer (plus DoRA's magnitude vector, one per output), and the routed
    experts' adapters under adapter.target_experts (`active`: only the share a token's top-k experts use)."""
    return lora_param_count(
        job.arch, r=job.lora_r, targets=job.lora_targets, dora=job.dora, experts=job.lora_expert_layers, active=active
    )


# the fused routed-expert weights of an MoE layer as transformers 5 names them in every MoE family it has (Mixtral,
# Qwen2/3-MoE, OLMoE, Granite-MoE, DeepSeek-V2/V3, GPT-OSS, Llama-4): peft's target_parameters under
# adapter.target_experts, in the order of fused_expert_shapes
FUSED_EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.down_proj")


def fused_expert_shapes(arch: ModelArch) -> tuple[tuple[int, int], ...]:
    """(in_features, out_features) of one expert in each fused routed-expert weight of an MoE layer, as peft's
    target_parameters adapts them: gate_up_proj (hidden -> 2 x width) and down_proj (width -> hidden)."""
    h, i = arch.hidden_size, expert_size(arch)
    return ((h, 2 * i), (i, h))


def routed_expert_params(arch: ModelArch, *, layers: int | None = None) -> int:
    """Parameters of the routed experts' fused weights (biases left out) over `layers` MoE layers (default: all)."""
    per_expert = sum(fin * fout for fin, fout in fused_expert_shapes(arch))
    return (moe_layer_count(arch) if layers is None else layers) * arch.num_experts * per_expert


def expert_lora_param_count(arch: ModelArch, *, r: int, layers: int, active: bool = False) -> float:
    """peft's adapters on the fused experts of `layers` MoE layers (adapter.target_experts): per layer and fused
    weight, A of (r x experts) x in and B of out x (r x experts), r x (in + out) per expert. `active`: a token's
    share, its top-k experts' adapters (the useful FLOPs of `timing.model_flops_per_token`)."""
    experts = arch.num_experts
    total = layers * experts * r * sum(fin + fout for fin, fout in fused_expert_shapes(arch))
    return total * min(arch.experts_per_token, experts) / experts if active else total


def expert_adapter_layers(arch: ModelArch, target_experts: bool | list[int]) -> int:
    """How many MoE layers adapter.target_experts adapts: every one (true), none (false), or those listed, each of
    which must be an MoE layer (the last moe_layer_count of the decoder: DeepSeek's and GLM's first layers are
    dense); ValueError names the ones that are not."""
    moe = moe_layer_count(arch)
    if isinstance(target_experts, bool):
        return moe if target_experts else 0
    first = arch.num_layers - moe
    wrong = [i for i in target_experts if not first <= i < arch.num_layers]
    if wrong:
        where = f"its MoE layers are {first}-{arch.num_layers - 1}" if moe else "it has no MoE layer"
        raise ValueError(f"layer(s) {', '.join(map(str, wrong))} of {arch.key} have no routed experts ({where})")
    return len(target_experts)


def targeted_linears(arch: ModelArch, targets: tuple[str, ...] | list[str]) -> list[tuple[int, int, int]]:
    """(how many in the model, in_features, out_features) of each decoder linear kind that `targets` names
    (a layer kind without the module, e.g. gate_proj in an MoE layer without a shared expert, adds none)."""
    return [
        (count * shapes[name][2], shapes[name][0], shapes[name][1])
        for count, _, shapes in layer_kinds(arch)
        for name in targets
        if name in shapes
    ]


def lora_param_count(
    arch: ModelArch,
    *,
    r: int,
    targets: tuple[str, ...] | list[str],
    dora: bool,
    experts: int = 0,
    active: bool = False,
) -> int:
    """The adapter's parameters: `targets`' linears, the embedding's, and the routed experts' of `experts` MoE
    layers (adapter.target_experts; `active`: a token's share of those, expert_lora_param_count)."""
    total = sum(n * (r * (fin + fout) + (fout if dora else 0)) for n, fin, fout in targeted_linears(arch, targets))
    if "embed_tokens" in targets:  # peft's Embedding adapter: A is r x vocab, B hidden x r
        total += r * (arch.vocab_size + arch.hidden_size)
    if experts:
        total += round(expert_lora_param_count(arch, r=r, layers=experts, active=active))
    return total


Tensors = list[tuple[int, tuple[int, ...]]]  # (how many, shape) of trained tensors


def model_tensors(arch: ModelArch) -> Tensors:
    """Every parameter tensor of the text model by shape (a full fine-tune trains them all): embedding and
    lm_head, each layer kind's weights (`layer_weights`), then the norms and biases as one vector (their
    exact split does not change any optimizer's state size materially)."""
    h = arch.hidden_size
    out: Tensors = [(1, (arch.vocab_size, h))]
    if not arch.tied_embeddings:
        out.append((1, (arch.vocab_size, h)))
    for count, is_moe, shapes in layer_kinds(arch):
        out += [(count * n, shape) for n, shape in layer_weights(arch, shapes, is_moe=is_moe)]
    matrices = sum(n * numel(shape) for n, shape in out)
    out.append((1, (max(0, count_params(arch).text_model - matrices),)))
    return out


def largest_parameter_elements(arch: ModelArch) -> int:
    """Elements of the model's largest parameter tensor: the embedding or LM head (vocab x hidden), an MLP
    projection, or an MoE layer's fused routed experts (transformers 5 holds them as one tensor)."""
    return max(numel(shape) for _, shape in model_tensors(arch)[:-1])  # the last entry: norms and biases


def layer_weights(arch: ModelArch, shapes: dict[str, tuple[int, int, int]], *, is_moe: bool) -> Tensors:
    """One decoder layer's weight matrices in the order the layer registers them: its linear weights
    (out x in), then for an MoE layer transformers 5's fused routed experts (experts x 2*width x hidden
    gate_up, experts x hidden x width down) and router."""
    out: Tensors = [(copies, (fout, fin)) for fin, fout, copies in shapes.values()]
    if is_moe:
        e = arch.num_experts
        out += [(1, (e, fout, fin)) for fin, fout in fused_expert_shapes(arch)] + [(1, (e, arch.hidden_size))]
    return out


def layer_lora(job: Job, shapes: dict[str, tuple[int, int, int]]) -> Tensors:
    """One decoder layer's LoRA A (r x in) and B (out x r) of each targeted module, in the layer's order."""
    r = job.lora_r
    out: Tensors = []
    for name, (fin, fout, copies) in shapes.items():
        if name in job.lora_targets:
            out += [(copies, (r, fin)), (copies, (fout, r))]
    return out


def expert_lora(job: Job) -> Tensors:
    """adapter.target_experts' adapters over the adapted MoE layers: per layer and fused expert weight, A of
    (r x experts) x in and B of out x (r x experts)."""
    if not job.lora_experts:
        return []
    wide, layers = job.lora_r * job.arch.num_experts, job.lora_expert_layers
    return [t for fin, fout in fused_expert_shapes(job.arch) for t in ((layers, (wide, fin)), (layers, (fout, wide)))]


def embedding_lora(job: Job) -> Tensors:
    """peft's embedding adapter (A r x vocab, B hidden x r) when embed_tokens is targeted."""
    if "embed_tokens" not in job.lora_targets:
        return []
    return [(1, (job.lora_r, job.arch.vocab_size)), (1, (job.arch.hidden_size, job.lora_r))]


def expanded(tensors: Tensors) -> list[int]:
    """The elements of every tensor of `tensors`, one entry per tensor, in order."""
    return [numel(shape) for n, shape in tensors for _ in range(n)]


def trained_tensor_sizes(job: Job) -> list[int]:
    """Elements of each trained matrix in the order the model registers them (the embedding, each decoder
    layer in turn, the LM head; an adapter's A and B per targeted module and layer): DeepSpeed cuts its
    optimizer sub-groups in this order. Norms and biases (another parameter group) are left out."""
    a = job.arch
    full = job.adapter == "full"
    out = [a.vocab_size * a.hidden_size] if full else expanded(embedding_lora(job))
    for count, is_moe, shapes in layer_kinds(a):
        layer = layer_weights(a, shapes, is_moe=is_moe) if full else layer_lora(job, shapes)
        out += expanded(layer) * count
    if not full:
        out += expanded(expert_lora(job))
    if full and not a.tied_embeddings:
        out.append(a.vocab_size * a.hidden_size)
    return out + expanded(saved_module_tensors(job))


def adapter_tensors(job: Job) -> Tensors:
    """LoRA's A (r x in) and B (out x r) per targeted module, DoRA's magnitude (out), and peft's
    embedding adapter (A r x vocab, B hidden x r): the tensors lora_param_count counts."""
    out: Tensors = []
    for count, _, shapes in layer_kinds(job.arch):
        out += [(count * n, shape) for n, shape in layer_lora(job, shapes)]
        if job.dora:
            out += [(count * c, (fout,)) for name, (_, fout, c) in shapes.items() if name in job.lora_targets]
    return out + expert_lora(job) + embedding_lora(job)


def saved_modules(job: Job) -> list[str]:
    """adapter.modules_to_save that peft copies and trains whole: the vocab x hidden modules."""
    return copied_modules(job.modules_to_save)


def copied_modules(modules_to_save: tuple[str, ...] | list[str]) -> list[str]:
    """Of adapter.modules_to_save, the vocab x hidden modules peft copies and trains whole."""
    return sorted(set(modules_to_save) & set(EMBEDDING_MODULES))


def saved_module_tensors(job: Job) -> Tensors:
    """adapter.modules_to_save: one vocab x hidden copy per named module."""
    n = len(saved_modules(job))
    return [(n, (job.arch.vocab_size, job.arch.hidden_size))] if n else []


def stepped_tensors(job: Job) -> tuple[Tensors, Tensors]:
    """The tensors the optimizer steps beside an adapter's LoRA factors (a full fine-tune's every parameter, an
    adapter's modules_to_save copies), split into the nn.Embedding weights (a full fine-tune's input embedding, one
    tensor with the LM head where tied; the copy of embed_tokens) and the rest."""
    shape = (job.arch.vocab_size, job.arch.hidden_size)
    if job.adapter == "full":
        tensors = model_tensors(job.arch)
        return tensors[:1], tensors[1:]
    saved = saved_modules(job)
    return [(1, shape)] if "embed_tokens" in saved else [], [(1, shape)] if "lm_head" in saved else []


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def saved_module_params(job: Job) -> int:
    """adapter.modules_to_save: peft trains a full copy of each named module (embed_tokens, lm_head)."""
    return copied_module_params(job.arch, job.modules_to_save)


def adapter_params(
    arch: ModelArch,
    *,
    r: int,
    targets: tuple[str, ...] | list[str],
    dora: bool,
    experts: int,
    modules_to_save: tuple[str, ...] | list[str],
    active: bool = False,
) -> int:
    """An adapter's trained parameters: its LoRA (lora_param_count) and the whole copies of modules_to_save."""
    copies = copied_module_params(arch, modules_to_save)
    return lora_param_count(arch, r=r, targets=targets, dora=dora, experts=experts, active=active) + copies


def copied_module_params(arch: ModelArch, modules_to_save: tuple[str, ...] | list[str]) -> int:
    """adapter.modules_to_save: peft trains a full copy of each named vocab x hidden module (embed_tokens, lm_head)."""
    return len(copied_modules(modules_to_save)) * arch.vocab_size * arch.hidden_size


def trainable_params(job: Job, *, active: bool = False) -> int:
    """Parameters the run trains; `active`: those one token's FLOPs reach (a token's top-k experts' adapters of
    adapter.target_experts, not every expert's: the 6T of timing.model_flops_per_token)."""
    if job.adapter == "full":
        return count_params(job.arch).text_model
    return lora_params(job, active=active) + saved_module_params(job)

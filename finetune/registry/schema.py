"""Schemas of the registries (model architectures, hardware presets).

The registries are YAML data validated by the same strict machinery as recipes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from finetune.recipe.schema import Strict

# cores per GPU assumed when a preset does not say how many CPU cores its node has
CORES_PER_GPU_ASSUMED = 8
# a GPU preset without peak_fp32_tflops: its bf16 tensor-core peak over this (A100 16, H100 14.8; B200 28 and
# MI300X 8 either side; consumer cards ~2), so an fp32 plan on such a card is slow rather than optimistic
FP32_SHARE_ASSUMED = 16


class ModelArch(Strict):
    """The numbers the planner needs about a decoder-only transformer."""

    key: str = Field(description="registry key, e.g. llama-3.1-8b")
    hub_ids: list[str] = Field(default_factory=list, description="Hub ids this entry describes")
    family: str = Field(description="transformers model_type, e.g. llama, qwen2, mistral, gemma2")
    hidden_size: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int | None = Field(None, ge=1, description="default hidden_size / heads")
    intermediate_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    tied_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2): a few thousand params per layer
    max_position_embeddings: int = 8192
    rope_scaling: dict[str, str | float | int] | None = Field(
        None,
        description="the RoPE scaling config.json itself sets (rope_scaling / rope_parameters: rope_type, factor, "
        "original_max_position_embeddings), which model.rope_scaling is merged over as training merges it",
    )
    dequantized_from: str | None = Field(
        None,
        description="the quant_method of a checkpoint published quantized that finetune loads dequantized "
        "(registry.derive.DEQUANTIZING_CONFIGS: gpt-oss's mxfp4, DeepSeek's fp8): planned and trained as the "
        "16-bit model",
    )
    checkpoint_dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None,
        description="dtype the published weights are stored in (config.json's dtype / torch_dtype); "
        "None: not known, and the planner counts a converted copy of the weights while they load",
    )
    frozen_tower_params: int = Field(
        0,
        ge=0,
        description="parameters a multimodal checkpoint adds to its text decoder (vision tower, projector): "
        "loaded with the model and held as weights, frozen and not run on text (finetune.train.model freezes "
        "them and keeps adapters off them)",
    )
    num_experts: int = Field(1, ge=1, description="MoE experts per layer (1 = dense)")
    experts_per_token: int = Field(1, ge=1)
    # Mixture-of-experts detail (transformers' conventions: Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, GPT-OSS)
    moe_intermediate_size: int | None = Field(
        None, ge=1, description="width of one routed expert's MLP; default intermediate_size (Mixtral)"
    )
    shared_expert_intermediate_size: int = Field(
        0, ge=0, description="width of the always-on shared expert MLP of an MoE layer (0: none)"
    )
    shared_expert_gate: bool = Field(False, description="Qwen2-MoE: a 1-wide sigmoid gate on the shared expert")
    moe_layers: int | None = Field(
        None,
        ge=0,
        description="decoder layers with the MoE MLP (the others are dense with "
        "intermediate_size); default all layers when num_experts > 1",
    )
    router_bias: bool = Field(False, description="GPT-OSS: the router has a bias per expert")
    expert_bias: bool = Field(False, description="GPT-OSS: each expert's gate_up/down projections have biases")
    attention_sinks: bool = Field(False, description="GPT-OSS: one learned sink logit per head")
    attention_dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="dropout on the attention probabilities while training (config.json attention_dropout; "
        "Granite-3 MoE: 0.1): the varlen kernel has none, so such a model's packed rows run sdpa",
    )
    o_proj_bias: bool = Field(False, description="the attention output projection has a bias (GPT-OSS)")
    fused_qkv: bool = Field(False, description="q, k and v are one qkv_proj linear module (Phi-3)")
    fused_gate_up: bool = Field(False, description="gate and up are one gate_up_proj linear module (Phi-3, GLM)")
    mlp_bias: bool = Field(
        False, description="the dense MLPs' (and shared experts') gate/up/down projections have biases (mlp_bias)"
    )
    # Multi-head latent attention (DeepSeek-V2/V3); kv_lora_rank set means MLA
    q_lora_rank: int | None = Field(None, ge=1, description="MLA: query down-projection rank (None: full q_proj)")
    kv_lora_rank: int | None = Field(None, ge=1, description="MLA: key/value down-projection rank")
    qk_rope_head_dim: int | None = Field(None, ge=1, description="MLA: rotary part of each q/k head")
    qk_nope_head_dim: int | None = Field(None, ge=1, description="MLA: non-rotary part of each q/k head")
    v_head_dim: int | None = Field(None, ge=1, description="MLA: value head width")
    sliding_window: int | None = Field(None, ge=1, description="window of the sliding-attention layers")
    sliding_layers: int = Field(0, ge=0, description="how many layers attend within sliding_window only")
    window_in_mask_only: bool = Field(
        False,
        description="the sliding layers apply their window only through transformers' mask, not as the attention "
        "function's sliding_window argument (Qwen2-MoE): flash kernels, which read no mask, would drop it",
    )
    attn_logit_softcap: float | None = Field(
        None,
        gt=0,
        description="attention logit soft-capping (config.json attn_logit_softcapping; Gemma-2: "
        "50.0): scores pass through cap * tanh(score / cap), which no torch flash kernel does",
    )
    decoder_layer_class: str = Field(description="e.g. LlamaDecoderLayer (FSDP wrap policy)")
    lora_targets: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    chat_template: bool = True
    license: str | None = None
    notes: str | None = None
    qk_norm: bool = Field(
        False,
        description="an RMSNorm over each query and key head before RoPE (Qwen3, Gemma-3): its saved input "
        "adds to every layer's activations",
    )
    qk_norm_per_head: bool = Field(
        True,
        description="the q/k norms' weights are one head wide (Qwen3, Gemma-3); False: they span all heads "
        "(OLMo-2, Cohere)",
    )
    norms_per_layer: int = Field(
        2,
        ge=1,
        le=4,
        description="weighted norms on each decoder layer's residual branches: 2 (pre-attention, pre-MLP), 4 "
        "with Gemma-2/3's post-attention and post-MLP norms, 1 where attention and MLP run in parallel (Cohere)",
    )

    @model_validator(mode="after")
    def _shapes_fit_together(self):
        # shapes transformers could not build either (it fails on them only when it loads the model)
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_attention_heads} attention heads cannot share {self.num_kv_heads} key/value heads "
                "(grouped-query attention needs a whole number of query heads per key/value head)"
            )
        if self.head_dim is None and self.kv_lora_rank is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a whole number of heads of {self.num_attention_heads} "
                "(set head_dim where the model's heads are not hidden_size / heads wide)"
            )
        if self.moe_layers is not None and self.moe_layers > self.num_layers:
            raise ValueError(f"{self.moe_layers} MoE layers of {self.num_layers} layers")
        return self


class HardwarePreset(Strict):
    """One machine (or cluster) as the planner sees it. Bandwidths in GB/s (10^9 bytes)."""

    name: str
    description: str = ""
    gpu_model: str
    vendor: Literal["nvidia", "amd", "cpu"] = "nvidia"
    gpu_memory_gib: float = Field(gt=0, description="usable memory per GPU (GiB)")
    gpus_per_node: int = Field(ge=1)
    nodes: int = Field(1, ge=1)
    intra_node_link: Literal["nvlink", "pcie", "infinity-fabric", "none"] = "nvlink"
    intra_node_bandwidth_gbps: float = Field(gt=0, description="per-GPU bus bandwidth, GB/s")
    inter_node_fabric: Literal["infiniband", "roce", "ethernet", "none"] = "none"
    inter_node_bandwidth_gbps: float = Field(0, ge=0, description="per-node, GB/s")
    host_ram_gib: float = Field(gt=0, description="per node")
    nvme_path: str | None = Field(None, description="local NVMe for ZeRO-Infinity offload")
    nvme_bandwidth_gbps: float = Field(0, ge=0)
    peak_bf16_tflops: float = Field(gt=0, description="dense, per GPU")
    peak_fp32_tflops: float | None = Field(
        None,
        gt=0,
        description="dense FP32 without tensor cores, per GPU: what PyTorch's float32 matmuls run at (TF32 is "
        "off by default), so the step time of a run that computes in fp32 (train.precision: fp32 with float32 "
        "weights). The presets' figures are the vendors' datasheets and whitepapers: H100/H200 SXM 67, HGX B200 "
        "80, MI300X 163.4 (vector), RTX 4090 82.6, RTX 5090 104.8, RTX PRO 6000 Blackwell 125. None: "
        "1/FP32_SHARE_ASSUMED of peak_bf16_tflops",
    )
    gpu_memory_bandwidth_gbps: float | None = Field(
        None,
        gt=0,
        description="per-GPU memory (HBM/GDDR) bandwidth from the vendor datasheet, GB/s: the "
        "step time of memory-bound work the FLOPs do not show (DoRA's weight norms); None: not modelled",
    )
    # offload strategies move states over PCIe and run Adam on the host CPUs
    host_to_device_bandwidth_gbps: float = Field(25, gt=0, description="per GPU, PCIe, GB/s")
    nvme_capacity_gib: float | None = Field(None, gt=0, description="per node; None: not checked")
    supports_bf16: bool = True
    nccl_env: dict[str, str] = Field(default_factory=dict, description="NCCL settings for launches")
    slurm_partition: str | None = Field(None, description="job.sbatch --partition for this cluster")
    slurm_account: str | None = Field(None, description="job.sbatch --account for this cluster")
    slurm_time: str | None = Field(
        None, pattern=r"^(\d+-)?\d+(:\d{2}){0,2}$", description="job.sbatch --time limit, e.g. 2-00:00:00"
    )
    host_s_per_kernel: float | None = Field(
        None,
        gt=0,
        description="seconds the host takes to launch one of a training step's kernels: the host floor of a step "
        "whose GPU work is short. A plan made on the machine itself (--hardware auto) that is host-bound measures it "
        "(`python -m finetune.hostprobe` prints the figure, for a preset file); None: the slowest host measured "
        "(finetune/plan/host_time.py HOST_S_PER_KERNEL)",
    )
    host_cpu_cores: int | None = Field(
        None,
        ge=1,
        description="CPU cores per node (the cores this process may use, when detected): the offload tiers step "
        "the optimizer on the host with cores / ranks-per-node threads each; "
        f"None: {CORES_PER_GPU_ASSUMED} per GPU assumed",
    )

    @model_validator(mode="after")
    def _nodes_are_linked(self):
        # the sharded and data-parallel strategies' collectives cross it every step: the plan times them on it
        if self.nodes > 1 and (self.inter_node_fabric == "none" or not self.inter_node_bandwidth_gbps):
            raise ValueError(
                f"{self.nodes} nodes need the fabric between them: set inter_node_fabric (infiniband, roce or "
                "ethernet) and inter_node_bandwidth_gbps (per node, GB/s)"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def compute_peak_tflops(self, *, fp32: bool) -> float:
        """The dense peak a step's matmuls run at: bf16/fp16 tensor cores, or FP32 ones for a run that
        computes in float32 on a GPU (a CPU preset's peak is already its fp32 vector rate)."""
        if not fp32 or self.vendor == "cpu":
            return self.peak_bf16_tflops
        return self.peak_fp32_tflops or self.peak_bf16_tflops / FP32_SHARE_ASSUMED

    @property
    def node_cpu_cores(self) -> int:
        """host_cpu_cores, or the assumption for a preset that does not say."""
        return self.host_cpu_cores or CORES_PER_GPU_ASSUMED * self.gpus_per_node

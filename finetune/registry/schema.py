"""Schemas of the registries (model architectures, hardware presets).

The registries are YAML data validated by the same strict machinery as recipes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from finetune.recipe.schema import Strict


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
    num_experts: int = Field(1, ge=1, description="MoE experts per layer (1 = dense)")
    experts_per_token: int = Field(1, ge=1)
    decoder_layer_class: str = Field(description="e.g. LlamaDecoderLayer (FSDP wrap policy)")
    lora_targets: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                 "gate_proj", "up_proj", "down_proj"])
    chat_template: bool = True
    license: str | None = None
    notes: str | None = None


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
    # offload strategies move states over PCIe and run Adam on the host CPUs
    host_to_device_bandwidth_gbps: float = Field(25, gt=0, description="per GPU, PCIe, GB/s")
    nvme_capacity_gib: float | None = Field(None, gt=0, description="per node; None: not checked")
    supports_bf16: bool = True
    nccl_env: dict[str, str] = Field(default_factory=dict, description="NCCL settings for launches")
    slurm_partition: str | None = Field(None, description="job.sbatch --partition for this cluster")
    slurm_account: str | None = Field(None, description="job.sbatch --account for this cluster")
    slurm_time: str | None = Field(None, pattern=r"^(\d+-)?\d+(:\d{2}){0,2}$",
                                   description="job.sbatch --time limit, e.g. 2-00:00:00")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

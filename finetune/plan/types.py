"""What the planner produces. Plain dataclasses: the compiler and the CLI read these."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

GIB = 1024**3


def memory_unit(device: str) -> str:
    """How a plan's per-device memory reads: per GPU, or the host's RAM for the cpu preset's one process (`device`:
    a plan's device or a preset's vendor, "cpu" for both)."""
    return "GiB" if device == "cpu" else "GiB/GPU"


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU (peak during a training step)."""

    weights: float = 0.0  # model weights resident on this GPU (sharded where the strategy shards)
    trainable: float = 0.0  # extra trainable parameter copies (fp32 master, LoRA weights)
    gradients: float = 0.0
    optimizer: float = 0.0  # Adam moments (+ master weights where kept separately)
    activations: float = 0.0  # saved for backward, all layers, at the micro-batch
    logits: float = 0.0  # logits + cross-entropy temporaries (dominant for 128k vocabularies)
    comm_buffers: float = 0.0  # all-gather / reduce-scatter / bucket buffers, prefetch
    overhead: float = 0.0  # the caching allocator's reserve beyond what is allocated (workspaces, freed blocks kept)

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.trainable
            + self.gradients
            + self.optimizer
            + self.activations
            + self.logits
            + self.comm_buffers
            + self.overhead
        )

    def gib(self) -> dict[str, float]:
        out = {k: round(v / GIB, 3) for k, v in asdict(self).items()}
        out["total"] = round(self.total / GIB, 3)
        return out


@dataclass
class Candidate:
    strategy: str
    micro_batch_size: int
    activation_checkpointing: bool
    memory: MemoryBreakdown
    fits: bool
    host_ram_bytes: float = 0.0  # per node, at its peak: the processes + the largest of loading, training, the save
    host_ram_training_bytes: float = 0.0  # per node: the processes + the states kept on the host
    host_ram_saving_bytes: float = 0.0  # per node: the above + the final save's gather (memory.final_save_host_bytes)
    nvme_bytes: float = 0.0  # per node
    compute_time_s: float = 0.0  # one optimizer step (all micro-batches)
    comm_time_s: float = 0.0  # exposed communication per optimizer step
    step_time_s: float = 0.0
    bottleneck: str = ""  # "compute" | "intra-node" | "inter-node" | "offload" | "host" (the Trainer on a CPU)
    reason: str = ""  # why it does not fit (empty when it fits)
    gradient_accumulation_steps: int = 1
    checkpoint_layers: int = 0  # decoder layers checkpointed (the first k); activation_checkpointing = k > 0
    # fits only within choose.TIGHT_HEADROOM of GPU memory, not HEADROOM (chosen over offloading)
    tight: bool = False
    # accelerate's sync_each_batch: FSDP2 reduces every micro-batch (True) or on a step's last only (False,
    # the Trainer's no_sync); None where it is no setting (another tier, or no accumulation)
    sync_each_batch: bool | None = None

    @property
    def per_gpu_memory_gib(self) -> float:
        return self.memory.total / GIB

    def to_json(self) -> dict:
        return {
            "strategy": self.strategy,
            "fits": self.fits,
            "per_gpu_memory_gib": round(self.per_gpu_memory_gib, 2),
            "micro_batch_size": self.micro_batch_size,
            "activation_checkpointing": self.activation_checkpointing,
            "checkpoint_layers": self.checkpoint_layers,
            "memory_gib": self.memory.gib(),
            "host_ram_gib": round(self.host_ram_bytes / GIB, 2),
            "host_ram_training_gib": round(self.host_ram_training_bytes / GIB, 2),
            "nvme_gib": round(self.nvme_bytes / GIB, 2),
            "step_time_s": round(self.step_time_s, 3),
            "compute_time_s": round(self.compute_time_s, 3),
            "comm_time_s": round(self.comm_time_s, 3),
            "bottleneck": self.bottleneck,
            "reason": self.reason,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "sync_each_batch": self.sync_each_batch,
            "tight": self.tight,
        }


@dataclass
class Plan:
    model: str  # registry key
    hardware: str  # preset name
    adapter: str
    method: str
    strategy: str  # chosen (or the best attempt when nothing fits)
    fits: bool
    micro_batch_size: int
    gradient_accumulation_steps: int
    activation_checkpointing: bool
    per_gpu_memory_gib: float
    world_size: int
    num_nodes: int
    gpus_per_node: int
    seq_len: int
    global_batch_size: int
    tokens_per_step: int
    step_time_s: float
    tokens_per_second: float
    mfu: float  # model FLOPs utilisation the timing model assumed
    why: str  # one or two sentences: why this strategy/micro-batch
    candidates: list[Candidate] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)  # when nothing fits
    total_params: float = 0.0
    active_params: float = 0.0  # used by one token: MoE models leave out the experts it is not routed to
    frozen_tower_params: float = 0.0  # a multimodal checkpoint's vision tower and projector, loaded frozen
    trainable_params: float = 0.0
    memory: MemoryBreakdown | None = None
    host_ram_gib: float = 0.0  # per node, at its peak (while loading or while training)
    host_ram_training_gib: float = 0.0  # per node, while training
    device: str = "cuda"  # "cpu" for the cpu preset
    # what to pass to registry.get_preset() to get this preset back: its name, "auto", or the
    # absolute path of a user's preset file (plan.hardware is the preset's own name)
    hardware_source: str = ""
    # the kernels the run will use, as the memory model assumed them (attention, Liger, adapter casts)
    kernels: str = ""
    # whether the setting lies within the calibration runs' range, or what it extrapolates to (plan/coverage.py)
    basis: str = ""
    checkpoint_layers: int = 0  # k of num_layers decoder layers checkpointed (0: off)
    num_layers: int = 0
    # settings the compiled run replaces (e.g. an 8-bit optimizer under ZeRO-3 offload), said in the plan
    substitutions: list[str] = field(default_factory=list)
    # what the user should know before launching (e.g. data.max_length past the model's own context)
    warnings: list[str] = field(default_factory=list)
    # the chosen setting fits only within choose.TIGHT_HEADROOM of GPU memory (Candidate.tight)
    tight: bool = False
    sync_each_batch: bool | None = None  # the chosen Candidate.sync_each_batch
    # rows padded to a multiple of this many tokens (plan.row_multiple says when); None: not padded
    row_multiple: int | None = None
    # False: the run turns cuDNN's attention off (plan.cudnn_attention_off says when)
    cudnn_attention: bool = True
    # an NVMe plan: the swap directory's read bandwidth the step time used (GB/s) and where the figure came from
    nvme_read_gbps: float = 0.0
    disk: str = ""
    # this machine's host time a kernel where the plan timed it (finetune/hostprobe.py); 0: the slowest host measured
    host_s_per_kernel: float = 0.0

    @property
    def chosen(self) -> Candidate:
        """The candidate of the chosen strategy (its best setting: one candidate per strategy)."""
        return next(c for c in self.candidates if c.strategy == self.strategy)

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "hardware": self.hardware,
            "adapter": self.adapter,
            "method": self.method,
            "strategy": self.strategy,
            "fits": self.fits,
            "tight": self.tight,
            "per_gpu_memory_gib": round(self.per_gpu_memory_gib, 2),
            "memory_gib": self.memory.gib() if self.memory else None,
            "host_ram_gib": round(self.host_ram_gib, 2),
            "host_ram_training_gib": round(self.host_ram_training_gib, 2),
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "sync_each_batch": self.sync_each_batch,
            "row_multiple": self.row_multiple,
            "cudnn_attention": self.cudnn_attention,
            "activation_checkpointing": self.activation_checkpointing,
            "checkpoint_layers": self.checkpoint_layers,
            "num_layers": self.num_layers,
            "world_size": self.world_size,
            "num_nodes": self.num_nodes,
            "gpus_per_node": self.gpus_per_node,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "tokens_per_step": self.tokens_per_step,
            "step_time_s": round(self.step_time_s, 3),
            "tokens_per_second": round(self.tokens_per_second, 1),
            "mfu": round(self.mfu, 3),
            "why": self.why,
            "total_params": self.total_params,
            "active_params": self.active_params,
            "frozen_tower_params": self.frozen_tower_params,
            "trainable_params": self.trainable_params,
            "device": self.device,
            "kernels": self.kernels,
            "basis": self.basis,
            "nvme_read_gbps": round(self.nvme_read_gbps, 3),
            "disk": self.disk,
            "host_s_per_kernel": self.host_s_per_kernel,
            "substitutions": self.substitutions,
            "warnings": self.warnings,
            "candidates": [c.to_json() for c in self.candidates],
            "suggestions": self.suggestions,
        }

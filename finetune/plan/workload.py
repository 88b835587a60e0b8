"""What the planner computes on: the recipe's workload as plain numbers, and parameter counts.

`Job` is a frozen dataclass (not pydantic) so the search loop can make variants with
`dataclasses.replace` at no validation cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from finetune.registry.schema import HardwarePreset, ModelArch

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
PAIRED_METHODS = ("dpo", "kto", "orpo", "simpo", "reward")
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Job:
    arch: ModelArch
    preset: HardwarePreset
    adapter: str = "lora"  # full | lora | qlora
    method: str = "sft"  # sft | pretrain | dpo | kto | orpo | simpo | reward
    reference: str = "none"  # dpo/kto reference: none | implicit | copy | precompute
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ALL_LINEAR
    lora_dropout: float = 0.0
    dora: bool = False
    double_quant: bool = True
    int8_base: bool = False  # adapter.load_in_8bit: the base's linear weights in 1 byte (LLM.int8)
    weight_bytes: int = 2  # model.dtype
    act_bytes: int = 2  # 2 for bf16/fp16 training, 4 for fp32
    optimizer: str = "adamw"
    seq_len: int = 2048
    packed: bool = False  # data.packing: padding-free rows of micro_batch x seq_len tokens
    # flash (flash_attention_2/3, flex: no materialized mask) | varlen (finetune's, no mask) | sdpa | eager
    attention: str = "sdpa"
    # TRL >= 1.x SFT/DPO score tokens through add_fused_lm_head (chunked, the (tokens, vocab) logits are
    # never materialized); False for a trainer that computes the loss from full logits
    fused_lm_head: bool = True
    # adapter.cast_adapter_inputs: peft's per-module fp32 cast of LoRA inputs (finetune skips it by default)
    cast_adapter_inputs: bool = False
    liger: bool = False  # train.liger resolved: Liger RMSNorm/RoPE/SwiGLU kernels (keep fewer activations)
    global_batch_size: int = 16
    micro_batch: int | None = None  # pinned by the recipe, else searched
    checkpointing: str = "auto"  # auto | on | off
    strategy: str = "auto"  # auto or a pinned concrete strategy
    nvme_path: str | None = None  # ZeRO-Infinity swap dir (recipe's, else the preset's)

    @property
    def sequences_per_sample(self) -> int:
        # pairs run chosen and rejected; KTO runs each completion and its mismatched KL completion
        return 2 if self.method in PAIRED_METHODS else 1


@dataclass(frozen=True)
class Params:
    """Parameter counts of one architecture (elements, not bytes)."""

    embed: int
    lm_head: int  # 0 when tied to the embedding
    layer: int  # one decoder layer, all experts
    layer_linear: int  # the quantizable linear weights of one layer (QLoRA packs these to 4 bit)
    layer_active: int  # one layer, counting only the experts a token is routed to
    final_norm: int
    num_layers: int

    @property
    def total(self) -> int:
        return self.embed + self.lm_head + self.num_layers * self.layer + self.final_norm

    @property
    def root(self) -> int:
        """What FSDP's root unit holds (embedding, lm_head, final norm): all outside the layers."""
        return self.embed + self.lm_head + self.final_norm

    @property
    def matmul_active(self) -> int:
        """Parameters a token multiplies with (the FLOPs 'N'): layers (active experts) + lm_head."""
        head = self.lm_head or self.embed  # tied: the embedding matrix is the lm_head matmul
        return self.num_layers * self.layer_active + head


def head_dim(arch: ModelArch) -> int:
    return arch.head_dim or arch.hidden_size // arch.num_attention_heads


def module_shapes(arch: ModelArch) -> dict[str, tuple[int, int, int]]:
    """name -> (in_features, out_features, copies per layer) for the linear modules LoRA can target."""
    h, i, e = arch.hidden_size, arch.intermediate_size, arch.num_experts
    q, kv = arch.num_attention_heads * head_dim(arch), arch.num_kv_heads * head_dim(arch)
    shapes = {"q_proj": (h, q, 1), "k_proj": (h, kv, 1), "v_proj": (h, kv, 1), "o_proj": (q, h, 1)}
    if e == 1:
        shapes.update(gate_proj=(h, i, 1), up_proj=(h, i, 1), down_proj=(i, h, 1))
    else:  # Mixtral's per-expert names (older transformers) and the fused names
        shapes.update(w1=(h, i, e), w3=(h, i, e), w2=(i, h, e),
                      gate_proj=(h, i, e), up_proj=(h, i, e), down_proj=(i, h, e))
    return shapes


def count_params(arch: ModelArch) -> Params:
    # pydantic models are not hashable; cache on the numbers that matter
    return _count_params(arch.family, arch.hidden_size, arch.intermediate_size, arch.num_experts,
                         arch.experts_per_token, arch.num_attention_heads * head_dim(arch),
                         arch.num_kv_heads * head_dim(arch), head_dim(arch), arch.attention_bias,
                         arch.vocab_size, arch.tied_embeddings, arch.num_layers)


@lru_cache(maxsize=256)
def _count_params(family: str, h: int, i: int, e: int, k: int, q: int, kv: int, hd: int,
                  attention_bias: bool, vocab: int, tied: bool, num_layers: int) -> Params:
    attn = h * q + 2 * h * kv + q * h
    bias = (q + 2 * kv) if attention_bias else 0
    # gemma2/3 have 4 norms per layer (pre/post attention and MLP); qwen3/gemma3 add q/k norms
    norms = (4 if family.startswith("gemma") else 2) * h
    if family in ("qwen3", "gemma3", "gemma3_text"):
        norms += 2 * hd
    mlp_one = 3 * h * i
    router = h * e if e > 1 else 0
    linear = attn + e * mlp_one
    embed = vocab * h
    return Params(
        embed=embed, lm_head=0 if tied else embed,
        layer=linear + bias + norms + router, layer_linear=linear,
        layer_active=attn + bias + norms + router + min(k, e) * mlp_one,
        final_norm=h, num_layers=num_layers)


def lora_params(job: Job) -> int:
    """r x (in + out) per targeted module per layer (plus DoRA's magnitude vector)."""
    shapes = module_shapes(job.arch)
    total = 0
    for name in job.lora_targets:
        fin, fout, copies = shapes.get(name, (job.arch.hidden_size, job.arch.hidden_size, 1))
        total += copies * (job.lora_r * (fin + fout) + (fout if job.dora else 0))
    return total * job.arch.num_layers


def trainable_params(job: Job) -> int:
    return count_params(job.arch).total if job.adapter == "full" else lora_params(job)

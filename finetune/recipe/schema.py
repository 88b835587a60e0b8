"""The recipe schema: strict, typed, every default written here.

Unknown keys are errors (extra="forbid"); the loader turns pydantic's errors into
messages with the full key path and a did-you-mean suggestion. Cross-field rules that
need the whole recipe live in `Recipe._check_conflicts`; each says how to fix it.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from finetune.kernels import CUDNN_MIN_EXAMPLE_TOKENS
from finetune.strategies import (
    AUTO,
    BNB_UNDER_FSDP_REFUSAL,
    StrategyName,
    is_fsdp,
    shards_params,
    weighs_sync_each_batch,
)
from finetune.strategies import NAMES as STRATEGY_NAMES

# the torch.compile backend of train.compile: regions (compile/accelerate.py sets it; the converters read the peers'
# backends against it)
COMPILE_BACKEND = "inductor"

Dtype = Literal["bfloat16", "float16", "float32"]
DataFormat = Literal["messages", "alpaca", "sharegpt", "text", "prompt_completion", "preference", "unpaired"]
MethodType = Literal["sft", "dpo", "kto", "orpo", "simpo", "reward", "pretrain"]
# the data formats each method trains on (checked in recipe_conflicts)
METHOD_FORMATS: dict[str, tuple[str, ...]] = {
    "sft": ("messages", "alpaca", "sharegpt", "text", "prompt_completion"),
    "pretrain": ("text",),
    "dpo": ("preference",),
    "orpo": ("preference",),
    "simpo": ("preference",),
    "reward": ("preference",),
    "kto": ("preference", "unpaired"),
}
# methods that score against a reference model (the others need none)
REFERENCE_METHODS = ("dpo", "kto")
# methods whose TRL trainers turn the model's dropout off (their configs' disable_dropout, True by default, which
# finetune keeps): peft's lora dropout is an nn.Dropout they set to p = 0, so adapter.dropout does not train there
DROPOUT_OFF_METHODS = ("dpo", "kto", "orpo", "simpo", "reward")
# the smallest micro-batch a method trains, and why: TRL's KTOTrainer refuses a micro-batch of 1 (after the model
# has loaded)
MIN_MICRO_BATCH: dict[str, tuple[int, str]] = {
    "kto": (2, "TRL's KTO estimates its KL term from each row's prompt with another row's completion")
}


def trained_lora_dropout(recipe: Recipe) -> float:
    """The lora dropout the run trains with: adapter.dropout, or 0 for DROPOUT_OFF_METHODS (compiled into the
    resolved recipe, so peft builds no dropout module at all: plan.substitutions says so)."""
    return 0.0 if recipe.method.type in DROPOUT_OFF_METHODS else recipe.adapter.dropout


def least_micro_batch(method: str) -> tuple[int, str]:
    """The smallest micro-batch `method` trains, and why (1 and no reason for most)."""
    return MIN_MICRO_BATCH.get(method, (1, ""))


# the vocab x hidden modules: what adapter.modules_to_save may name, what peft writes whole when the vocabulary grew
EMBEDDING_MODULES = ("embed_tokens", "lm_head")
# data.packing: these methods pack examples into padding-free rows (whose lengths the planner reads); DPO runs
# each micro-batch's pairs as one padding-free row, examples never sharing a sequence (train/dpo_pairs.py)
PACKED_EXAMPLE_METHODS = ("sft", "pretrain")
PADDING_FREE_METHODS = (*PACKED_EXAMPLE_METHODS, "dpo")
# The canonical column names each format reads; `columns:` maps them to the file's names.
FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "alpaca": ("instruction", "input", "output"),
    "sharegpt": ("conversations",),
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected"),
    "unpaired": ("prompt", "completion", "label"),
}
# preference rows may leave the prompt inside chosen/rejected (hh-rlhf's implicit prompt)
OPTIONAL_COLUMNS = {"alpaca": ("input",), "messages": (), "preference": ("prompt",)}
CONFLICT_ERROR = "recipe_conflict"  # pydantic error type of a cross-field conflict; ctx has key, message


def _yaml_switch(value):
    # YAML 1.1 reads a bare on/off as true/false: `liger: off` must mean "off", not a type error
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


OnOffAuto = Annotated[Literal["auto", "on", "off"], BeforeValidator(_yaml_switch)]


class Strict(BaseModel):
    """Base for every schema section: unknown keys are errors, types are not coerced loosely."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class ModelSection(Strict):
    name: str = Field(
        description="Hub id (org/name) or a local directory with config.json (relative "
        "paths are read from the recipe's folder)"
    )
    arch: str | None = Field(
        None,
        description="model registry key; default: derived from name (a known Hub "
        "id, or the config.json of a local or cached model)",
    )
    dtype: Dtype = Field("bfloat16", description="dtype the weights are loaded and trained in")
    attn_implementation: Literal[
        "auto", "varlen", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"
    ] = Field(
        "auto",
        description="attention kernel; auto: varlen (PyTorch's flash varlen kernel) for packed SFT "
        "on NVIDIA GPUs, else sdpa",
    )
    cudnn_long_examples: bool = Field(
        True,
        description="with the varlen kernel on H100/H200-class GPUs, run each packed example of at least "
        f"{CUDNN_MIN_EXAMPLE_TOKENS:,} tokens on cuDNN's causal attention instead (measured 1.3-1.6x the varlen "
        "kernel's rate there, the longer the faster); false: every example on the varlen kernel",
    )
    trust_remote_code: bool = Field(
        False, description="allow the model repo's own Python code (transformers' trust_remote_code)"
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of the model")
    allow_pickle: bool = Field(False, description="allow .bin (pickle) weights; off: safetensors only")
    rope_scaling: dict[str, str | float | int] | None = Field(
        None,
        description=(
            "RoPE scaling override for context extension, passed to the model config, e.g. {rope_type: yarn, "
            "factor: 4.0, original_max_position_embeddings: 8192}; merged into the model's own RoPE parameters"
        ),
    )
    attention_dropout: float | None = Field(
        None,
        ge=0.0,
        lt=1.0,
        description=(
            "dropout on the attention probabilities while training, overriding config.json's attention_dropout "
            "(e.g. 0 for a model whose config sets 0.1, such as Granite: finetune's varlen kernel has no dropout, so "
            "with dropout every layer runs sdpa over the packed row's mask, slower and larger); default: the config's"
        ),
    )
    init: Literal["pretrained", "random"] = Field(
        "pretrained",
        description=(
            "pretrained: load the weights. random: build the model from its config.json with random weights "
            "(seeded by train.seed; needs only the config and tokenizer files), for throughput and memory "
            "trials such as `finetune plan --measure` before downloading a model; the trained result is not "
            "a usable model"
        ),
    )

    @field_validator("rope_scaling")
    @classmethod
    def _rope_numbers(cls, v):
        # the planner reads the context's reach from these two (plan.context_check); transformers reads the rest
        for key, least in (("factor", 1.0), ("original_max_position_embeddings", 1)):
            value = (v or {}).get(key)
            if value is not None and (isinstance(value, (str, bool)) or not math.isfinite(value) or value < least):
                raise ValueError(f"{key} must be a finite number of at least {least}, got {value!r}")
        return v


class MethodSection(Strict):
    type: MethodType = Field(
        "sft",
        description=(
            "sft; dpo; kto (unpaired or paired preferences); orpo; simpo (TRL's CPOTrainer, loss simpo); "
            "reward (a reward model scoring chosen over rejected); pretrain (continued pre-training on raw text, "
            "packed, loss on every token)"
        ),
    )
    # DPO, KTO, ORPO (its lambda), SimPO
    beta: float = Field(
        0.1,
        gt=0,
        le=10,
        description="dpo/kto: KL strength; orpo: the odds-ratio weight "
        "(lambda); simpo: the reward scale (paper: 2.0-2.5)",
    )
    loss_type: Literal[
        "sigmoid", "ipo", "hinge", "robust", "bco_pair", "sppo_hard", "nca_pair", "apo_zero", "apo_down"
    ] = Field("sigmoid", description="DPO only: TRL's DPO loss variant")
    reference: Literal["auto", "implicit", "copy", "precompute"] = Field(
        "auto",
        description="DPO/KTO: the reference model. implicit: LoRA/QLoRA reuse the base with the "
        "adapter disabled (no second copy); copy: a frozen copy of the model; "
        "precompute: reference log-probs computed once up front; auto: implicit for "
        "LoRA/QLoRA, copy for a full fine-tune",
    )
    simpo_gamma: float = Field(0.5, ge=0, description="simpo: the target reward margin")
    cpo_alpha: float = Field(
        0.0, ge=0, description="simpo: weight of an added NLL term on chosen (0 = pure SimPO; >0 = CPO-SimPO)"
    )
    desirable_weight: float = Field(1.0, gt=0, description="kto: loss weight of desirable (label true) rows")
    undesirable_weight: float = Field(1.0, gt=0, description="kto: loss weight of undesirable rows")
    center_rewards_coefficient: float | None = Field(
        None, ge=0, description="reward: pull the mean reward to 0 with this weight (none: off)"
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value):
        # `method: dpo` is accepted as `method: {type: dpo}`
        return {"type": value} if isinstance(value, str) else value


def quantized_base(adapter: str, *, load_in_8bit: bool) -> bool:
    """bitsandbytes quantizes the frozen base's linear weights: QLoRA's 4 bits, or LoRA's load_in_8bit (LLM.int8).
    The recipe's (AdapterSection.quantizes_base) and the planner's (Job.quantized_base) one rule."""
    return adapter == "qlora" or (adapter == "lora" and load_in_8bit)


class AdapterSection(Strict):
    type: Literal["full", "lora", "qlora"] = Field(
        "lora",
        description="full: train every weight; lora: low-rank adapters on a frozen base; qlora: LoRA on a 4-bit base",
    )
    r: int = Field(16, ge=1, le=4096, description="LoRA rank")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (the update is scaled by alpha / r)")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description=(
            "dropout on the LoRA input; with adapter.dora, peft then recomputes every adapted linear's base output "
            "(a second matmul forward and backward; under DDP and QLoRA a 16-bit copy of each adapted weight kept): "
            "`finetune plan` says what it costs. Not trained by dpo, kto, orpo, simpo and reward, whose TRL trainers "
            "turn the model's dropout off (compiled to 0, and the plan says so)"
        ),
    )
    target_modules: list[str] | str | None = Field(
        None,
        description="default: the model registry's LoRA targets; a list of module names, all-linear, or "
        "a regular expression matched against each module's full name (peft's rule), e.g. "
        "'.*\\.(q_proj|v_proj)'",
    )
    target_experts: bool | list[Annotated[int, Field(ge=0)]] = Field(
        False,
        description="LoRA/QLoRA on a mixture-of-experts model: also train a rank-r adapter per routed expert on "
        "each MoE layer's fused expert weights (experts.gate_up_proj and experts.down_proj, which transformers 5 "
        "holds as 3D parameters that adapter.target_modules cannot reach; peft's target_parameters); true: every "
        "MoE layer, or a list of decoder layer indices, e.g. [7, 15, 23]. peft folds the adapters into a copy of "
        "each such layer's expert weights every forward, so the run keeps that copy and computes the experts' "
        "weight gradients as a full fine-tune would (both planned); ddp and zero2 only, no dropout or DoRA",
    )
    dora: bool = Field(False, description="weight-decomposed LoRA (DoRA)")
    rslora: bool = Field(False, description="rank-stabilized LoRA: scale by alpha / sqrt(r)")
    modules_to_save: list[Literal[EMBEDDING_MODULES]] | None = Field(  # type: ignore[valid-type]
        None,
        description="modules trained in full beside the adapter and saved with it (peft's "
        "modules_to_save), e.g. [embed_tokens, lm_head] after adding tokens",
    )
    load_in_8bit: bool = Field(
        False,
        description=(
            "LoRA only: load the frozen base in 8 bit (bitsandbytes LLM.int8()), half the weight memory of bf16"
        ),
    )
    loraplus_lr_ratio: float | None = Field(
        None,
        gt=0,
        description=(
            "LoRA+: the lora_B matrices learn this many times faster than lora_A (paper: 16); peft's "
            "create_loraplus_optimizer"
        ),
    )
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="QLoRA only: bitsandbytes 4-bit data type")
    double_quant: bool = Field(
        True, description="QLoRA only: quantize the quantization scales too (about 0.4 bits per parameter saved)"
    )
    compute_dtype: Dtype = Field(
        "bfloat16", description="QLoRA only: dtype the 4-bit weights are dequantized to for each matmul"
    )
    storage_dtype: Literal["bfloat16", "float16", "float32", "uint8"] = Field(
        "bfloat16",
        description="QLoRA only: dtype the packed 4-bit weights are stored in; it must match "
        "model.dtype so FSDP2/ZeRO-3 can shard them with everything else (uint8 is "
        "not shardable, TRL #3436)",
    )
    fused_lora: bool = Field(
        True,
        description="LoRA (not QLoRA, an 8-bit base or DoRA): run each targeted linear and its adapter as one "
        "autograd function whose scale and adds happen inside the GEMMs (in-place addmm), four elementwise "
        "passes fewer per module and micro-batch; the same parameters, gradients and checkpoints as peft's. "
        "Measured +8.8% steady tokens/s on an 8B LoRA on one H100 (docs/benchmarks.md); false runs peft's layer",
    )
    fused_lora_groups: bool = Field(
        True,
        description="with adapter.fused_lora: the targeted linears that read one input (q/k/v, gate/up) run as "
        "one autograd function: one GEMM reads the input for all their adapters, and their input gradients "
        "accumulate inside the GEMMs instead of being added in elementwise passes; false runs each alone",
    )
    cast_adapter_inputs: bool = Field(
        False,
        description="peft's cast of each LoRA input to the adapter weights' fp32; under bf16/fp16 "
        "autocast the matmul casts back at once, so finetune skips that round trip "
        "(false); true restores peft's default",
    )

    @property
    def quantizes_base(self) -> bool:
        """bitsandbytes quantizes the frozen base's linear weights (`quantized_base`)."""
        return quantized_base(self.type, load_in_8bit=self.load_in_8bit)

    @property
    def quantization_key(self) -> str:
        """The recipe key that asks for the quantized base, for a message that names it."""
        return "adapter.type" if self.type == "qlora" else "adapter.load_in_8bit"

    @property
    def fuses_lora(self) -> bool:
        """adapter.fused_lora where it applies: plain LoRA on a 16-bit base (peft's nn.Linear layers)."""
        return self.fused_lora and self.type == "lora" and not self.load_in_8bit and not self.dora

    @property
    def groups_lora(self) -> bool:
        """adapter.fused_lora_groups where it applies: with the fused layer."""
        return self.fuses_lora and self.fused_lora_groups

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value):
        return {"type": value} if isinstance(value, str) else value

    @field_validator("target_experts")
    @classmethod
    def _expert_layers(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("an empty list adapts no layer's experts; list layer indices, or use true or false")
            if len(set(v)) != len(v):
                raise ValueError(f"layer indices repeat in {v}; list each layer once")
        return v

    @field_validator("target_modules")
    @classmethod
    def _regex_compiles(cls, v):
        if isinstance(v, list) and not v:  # peft refuses an adapter on no module, after the model has loaded
            raise ValueError("an empty list targets no module; name modules, or leave it out for the model's own")
        if isinstance(v, str) and v != "all-linear":
            import re

            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(
                    f"not a valid regular expression ({exc}); use a list of module names, "
                    f"all-linear, or a valid pattern"
                ) from None
        return v


class DataSource(Strict):
    path: str = Field(
        description="local .jsonl/.json/.parquet/.csv file (relative paths are read from the "
        "recipe's folder), or a Hub dataset id"
    )
    format: DataFormat = Field(
        "messages",
        description="row layout: messages, alpaca, sharegpt, text, prompt_completion, preference or unpaired (KTO)",
    )
    columns: dict[str, str] = Field(default_factory=dict, description="canonical column -> column in the file")
    split: str = Field("train", description="dataset split to read; a slice like train[:80%] also on local files")
    subset: str | None = Field(None, description="dataset configuration (Hub datasets with several)")
    max_samples: int | None = Field(None, ge=1, description="read at most this many rows")
    streaming: bool = Field(
        False,
        description=(
            "read the source lazily while training (text corpora larger than RAM): format text with method "
            "pretrain or sft, train.max_steps set; every train source streams, rows are tokenized on the fly, "
            "only the first 1000 rows are checked before launch and nothing is cached"
        ),
    )
    weight: float | None = Field(
        None,
        gt=0,
        description=(
            "mixing weight: when any train source has one, examples are drawn from the sources in proportion "
            "to their weights (datasets.interleave_datasets, until every source is used up; unset = 1)"
        ),
    )

    @field_validator("split")
    @classmethod
    def _split_syntax(cls, v):
        from finetune.data.splits import parse_split

        parse_split(v)
        return v

    @model_validator(mode="after")
    def _known_columns(self):
        valid = FORMAT_COLUMNS[self.format]
        for canonical in self.columns:
            if canonical not in valid:
                raise ValueError(
                    f"columns.{canonical}: not a column of format {self.format!r}; its columns are {', '.join(valid)}"
                )
        return self


class TaskEvalSection(DataSource):
    """Held-out examples scored by exact match of greedy generation against the last answer."""

    n: int = Field(50, ge=1, description="how many examples of the file to score")
    max_new_tokens: int = Field(32, ge=1, le=4096, description="generation length limit per example")


class SequenceTokens(Strict):
    """data.sequence_tokens: what the planner reads of the lengths of sequences trained one to a row."""

    mean: float = Field(ge=1, allow_inf_nan=False, description="the sequences' mean length in tokens")
    longest: int = Field(gt=0, description="the longest sequence in tokens")
    std: float = Field(0.0, ge=0, allow_inf_nan=False, description="the sequences' standard deviation in tokens")
    count: int | None = Field(
        None,
        ge=1,
        description="training sequences (records) measured: with train.epochs, how many micro-batches a run draws, "
        "the largest of which padding-free pairs' peak is planned at (unset: a long run's)",
    )

    @model_validator(mode="after")
    def _mean_within_longest(self):
        if self.mean > self.longest:
            raise ValueError(f"mean {self.mean:g} is longer than longest {self.longest}: mean <= longest")
        return self


class DataSection(Strict):
    sources: list[DataSource] = Field(
        min_length=1, description="training data, one or more sources (`data: {path: ...}` is shorthand for one)"
    )
    eval_sources: list[DataSource] = Field(default_factory=list, description="held-out data for the eval loss")
    eval_fraction: float | None = Field(
        None, gt=0, lt=1, description="hold out this share of the training rows for the eval loss instead"
    )
    eval_rows: int | None = Field(
        None,
        ge=1,
        description="hold out this many of the training rows for the eval loss instead (a count where "
        "eval_fraction is a share, as TRL's test_split_size, LLaMA-Factory's val_size and axolotl's val_set_size "
        "take either)",
    )
    max_length: int = Field(2048, ge=8, le=1_048_576, description="tokens per sequence (per packed row when packing)")
    packing: bool = Field(
        False,
        description="SFT: pack examples into padding-free rows of max_length; DPO: run each micro-batch's chosen "
        "and rejected sequences as one padding-free row of their real tokens (no padding, no mask)",
    )
    chat_template: str | None = Field(
        None,
        description=(
            "default: the tokenizer's own. Jinja text, a path to a .jinja file, or a shipped template's name: "
            "chatml, llama3, qwen2.5, qwen3, mistral, gemma, phi-3"
        ),
    )
    assistant_only_loss: bool = Field(True, description="loss on assistant/completion tokens only")
    max_too_long_fraction: float = Field(
        0.05, ge=0, le=1, description="preflight: error when more than this share of examples is longer than max_length"
    )
    seed: int = Field(
        0, ge=0, le=2**32 - 1, description="seed of the data order and of the eval_fraction split (0 .. 2**32-1)"
    )
    cache_dir: str | None = Field(
        None, description="tokenized-data cache; default $FINETUNE_CACHE_DIR, else ~/.cache/finetune/tokenized"
    )
    task_eval: TaskEvalSection | None = Field(
        None, description="greedy-generation exact-match eval on held-out prompts, before and after training"
    )
    allow_paths: list[str] = Field(
        default_factory=list,
        description="more directories data files may lie "
        "in (besides the recipe's folder, its "
        "project root and the current directory)",
    )
    allow_outside: bool = Field(
        False, description="turn off the check that data files lie inside the allowed directories (docs/reliability.md)"
    )
    example_tokens: float | None = Field(
        None,
        gt=0,
        description="packing: the examples' token-weighted mean length, sum(l^2)/sum(l) in tokens, which sets "
        "the attention cost the planner plans for packed rows; `finetune run` and `finetune plan` measure it "
        "from local data with the model's tokenizer.json (set it for Hub data; unset: examples as long as "
        "max_length)",
    )

    sequence_tokens: SequenceTokens | None = Field(
        None,
        description="sequences not packed into rows (DPO, ORPO, SimPO, KTO, reward models: prompt + one "
        "completion; SFT/pretrain without packing: an example), or packed examples no two of which fit in one row "
        "(each then fills a row alone): their length in tokens, each cut at max_length. "
        "`mean` gives the real tokens a run counts and padding-free pairs' work, `longest` the padded rows' "
        "work and peak memory, `std` padding-free pairs' and packed rows' peak; `finetune run` and `finetune plan` "
        "measure them from local data with the model's tokenizer.json (set them for Hub data; unset: every "
        "sequence as long as max_length, every packed row full)",
    )

    @model_validator(mode="before")
    @classmethod
    def _single_source(cls, value):
        # `data: {path: x.jsonl, format: alpaca}` is shorthand for one source
        if isinstance(value, dict) and "path" in value and "sources" not in value:
            source_keys = set(DataSource.model_fields)
            src = {k: v for k, v in value.items() if k in source_keys}
            rest = {k: v for k, v in value.items() if k not in source_keys}
            return {**rest, "sources": [src]}
        return value


# the dtype each train.precision computes in (fp32: no mixed precision, nothing is cast)
PRECISION_DTYPE: dict[str, str | None] = {"bf16": "bfloat16", "fp16": "float16", "fp32": None}


def compute_dtype(recipe) -> str:
    """The dtype the step's matmuls and activations run in: the mixed-precision dtype under autocast, else
    (train.precision: fp32) the weights' own, QLoRA's dequantized compute dtype for a QLoRA base."""
    mixed = PRECISION_DTYPE[recipe.train.precision]
    if mixed:
        return mixed
    return recipe.adapter.compute_dtype if recipe.adapter.type == "qlora" else recipe.model.dtype


BNB_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit")  # train.optimizer's bitsandbytes ones


def bnb_under_fsdp(optimizer: str, strategy: str) -> bool:
    """A bitsandbytes optimizer on an FSDP2 tier, which cannot step its DTensor parameters (BNB_UNDER_FSDP_REFUSAL);
    never for strategy auto, where the planner leaves those tiers out."""
    return optimizer in BNB_OPTIMIZERS and strategy != AUTO and is_fsdp(strategy)


class TrainSection(Strict):
    epochs: float | None = Field(
        None, gt=0, le=1000, description="passes over the training data (default 1 when max_steps is unset)"
    )
    max_steps: int | None = Field(None, ge=1, description="optimizer steps; set this or epochs")
    lr: float = Field(2e-4, gt=0, lt=1, description="peak learning rate")
    scheduler: Literal["cosine", "linear", "constant", "constant_with_warmup", "cosine_with_min_lr"] = Field(
        "cosine", description="learning-rate schedule after warmup"
    )
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="share of the steps spent warming up")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, ge=0, description="gradient clipping norm (0: off)")
    global_batch_size: int = Field(
        16,
        ge=1,
        le=1_000_000,
        description="sequences per optimizer step over all GPUs (the planner rounds it to the nearest achievable)",
    )
    micro_batch_size: Literal["auto"] | int = Field(
        "auto", description="sequences per GPU per forward pass; auto: the planner picks the largest that fits"
    )
    activation_checkpointing: OnOffAuto = Field(
        "auto", description="recompute activations in backward; auto: only where needed to fit"
    )
    optimizer: Literal[
        "adamw", "adamw_8bit", "paged_adamw_8bit", "adamw_torch_fused", "paged_adamw_32bit", "adafactor"
    ] = Field(
        "adamw",
        description=(
            "adamw: torch's fused AdamW on GPUs; adamw_8bit / paged_adamw_8bit / paged_adamw_32bit: bitsandbytes; "
            "adafactor: transformers' Adafactor, factored fp32 second moments and no first moment (DeepSpeed's flat "
            "partitions are not factored); where the optimizer is offloaded its CPU AdamW replaces any of these "
            "(the plan says so)"
        ),
    )
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="Adam's first-moment decay")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="Adam's second-moment decay")
    adam_epsilon: float = Field(1e-8, gt=0, description="Adam's epsilon")
    neftune_noise_alpha: float | None = Field(
        None, gt=0, description=("NEFTune: noise added to the input embeddings while training (paper: 5)")
    )
    seed: int = Field(
        42, ge=0, le=2**32 - 1, description="seed of the model initialization and dropout (0 .. 2**32-1, numpy's range)"
    )
    precision: Literal["bf16", "fp16", "fp32"] = Field(
        "bf16",
        description="mixed-precision mode: bf16/fp16 autocast, or fp32 (none: the weights' dtype computes; "
        "float32 weights then run their matmuls at the GPU's FP32 rate, which the plan times and warns of)",
    )
    logging_steps: int = Field(1, ge=1, description="log metrics every this many steps")
    eval_steps: int | None = Field(
        None, ge=1, description="eval loss every this many steps (default: before and after training only)"
    )
    evals_per_epoch: int | None = Field(
        None,
        ge=1,
        description=(
            "evaluate this many times per pass over the training data (instead of train.eval_steps); the step "
            "interval is computed from the real number of optimizer steps per epoch"
        ),
    )
    warmup_steps: int | None = Field(None, ge=0, description="warmup in optimizer steps (instead of warmup_ratio)")
    min_lr: float | None = Field(None, ge=0, description="scheduler cosine_with_min_lr: the final learning rate")
    min_lr_ratio: float | None = Field(
        None,
        ge=0,
        lt=1,
        description=(
            "scheduler cosine_with_min_lr: the final learning rate as a share of train.lr (default 0.1 when "
            "neither min_lr nor min_lr_ratio is set)"
        ),
    )
    early_stopping_patience: int | None = Field(
        None,
        ge=1,
        description=(
            "stop when the eval loss has not improved for this many evaluations (needs eval data and an eval "
            "cadence); the best checkpoint is kept"
        ),
    )
    early_stopping_threshold: float = Field(
        0.0, ge=0, description=("early stopping: how much the eval loss must fall to count as an improvement")
    )
    load_best_model_at_end: bool = Field(
        False,
        description=(
            "after training, load the checkpoint with the lowest eval loss and save that as the result; checkpoints "
            "are written at every evaluation unless output.save_every / saves_per_epoch say otherwise"
        ),
    )
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="a non-finite loss or gradient norm: stop at once, or skip the step"
    )
    max_bad_steps: int = Field(0, ge=0, description="with on_nonfinite: skip, stop after this many skipped steps")
    liger: OnOffAuto = Field(
        "auto",
        description="Liger's Triton RMSNorm/RoPE/SwiGLU kernels; auto: on for "
        "supported models on NVIDIA GPUs when liger-kernel is "
        "installed (the LM head is already fused by TRL). Mixtral, Qwen3-MoE and DeepSeek get its norms and "
        "RoPE only: its SwiGLU patch would swap their experts for a slower fused MoE",
    )
    compile: Literal["off", "regions"] = Field(
        "off",
        description=(
            f"regions: torch.compile each decoder layer (accelerate's regional compilation with the {COMPILE_BACKEND} "
            "backend and its default mode: one layer is compiled and its code reused by the others), to fuse the "
            "elementwise work between the matmuls; the first steps pay the compilation, and on 8B LoRA with packed "
            "rows it measured slower than eager (docs/benchmarks.md). off: eager"
        ),
    )
    oom_retries: int = Field(
        2,
        ge=0,
        le=10,
        description=(
            "when a rank runs out of memory, `finetune run` re-plans from its measured peak (a smaller "
            "micro-batch with more accumulation, or activation checkpointing; the global batch stays) and "
            "resumes from the last complete checkpoint, at most this many times; 0: fail at once"
        ),
    )
    deferred_metrics: bool = Field(
        True,
        description=(
            "SFT/pretrain and plain DPO (sigmoid loss): keep the per-micro-batch metrics (entropy, token "
            "accuracy, num_tokens; DPO's rewards, margins, logits and log-probabilities) and SFT's tokens-seen "
            "count on the GPU and gather them once per logged step, instead of TRL's and the Trainer's host "
            "syncs and gathers on every micro-batch; the logged figures and the loss are the same. false: TRL's "
            "own compute_loss"
        ),
    )

    @field_validator("micro_batch_size")
    @classmethod
    def _positive(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("must be 'auto' or a positive integer")
        return v


class DistributedSection(Strict):
    strategy: StrategyName = Field(
        "auto",
        description="auto (the planner chooses) or one of "
        "finetune/strategies.py: ddp, fsdp2, fsdp2-hybrid, zero3, "
        "zero3-offload, zero3-nvme",
    )
    timeout_minutes: float = Field(
        30, gt=0, le=24 * 60, description="collective-operation timeout: a rank waiting longer fails the run"
    )
    nvme_path: str | None = Field(None, description="ZeRO-Infinity swap dir; default: the preset's")
    sharded_load: bool = Field(
        True,
        description="under FSDP2 on GPUs: each rank builds the model on the meta device and reads only its own "
        "shards from the checkpoint (finetune/train/sharded_load.py); false: every rank loads the whole model "
        "(QLoRA) or rank 0 loads it and sends each tensor to the others, as accelerate does",
    )
    sync_each_batch: Literal["auto"] | bool = Field(
        "auto",
        description=(
            "accelerate's sync_each_batch under gradient accumulation, for fsdp2 and fsdp2-hybrid: true "
            "reduce-scatters the gradients after every micro-batch (one reduce-scatter per micro-batch, nothing "
            "unsharded kept between them); false reduces once per optimizer step, the Trainer's default (its "
            "no_sync keeps every layer's unsharded 16-bit gradients on each GPU until the step's last "
            "micro-batch: ~16 GB for a full 8B); auto: the planner takes the faster setting that fits. The "
            "other strategies have no such setting (DeepSpeed reduces every micro-batch anyway): true with one of "
            "them pinned is refused"
        ),
    )


class OutputSection(Strict):
    dir: str | None = Field(None, description="default: runs/<recipe file name>")
    save_every: int | None = Field(None, ge=1, description="steps; default: at the end only")
    saves_per_epoch: int | None = Field(
        None,
        ge=1,
        description=("checkpoint this many times per pass over the training data (instead of output.save_every)"),
    )
    keep: int = Field(2, ge=1, description="complete checkpoints kept (older ones are deleted)")


class HubSection(Strict):
    repo: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$",
        description="ORG/NAME to push to after a successful run; unset: no push",
    )
    private: bool = Field(True, description="create the repo private")
    push: Literal["adapter", "merged"] = Field(
        "adapter", description="push the adapter, or the model with the adapter merged in"
    )
    revision: str | None = Field(None, description="branch to push to (created from main if missing)")


class LoggingSection(Strict):
    # pydantic copies a list default for every instance, so no factory is needed
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio", "none"]] = Field(
        ["tensorboard"], description="experiment trackers"
    )
    project: str | None = Field(None, description="tracker project name")
    run_name: str | None = Field(None, description="the run's name in every tracker; default: the run directory's name")
    entity: str | None = Field(None, description="wandb team or user the run is logged under (WANDB_ENTITY)")
    offline: bool = Field(
        False,
        description="trackers write only inside RUN_DIR (wandb offline mode, "
        "mlflow file store RUN_DIR/mlruns, trackio local); sync later",
    )
    loss_log_scale: bool = Field(False, description="loss.png: logarithmic loss axis")
    loss_smoothing: float = Field(
        0.9, ge=0, lt=1, description="loss.png: weight of the past in the smoothed line (EMA); 0 draws no smoothed line"
    )
    profile_steps: tuple[int, int] | None = Field(
        None,
        description="[start, stop]: torch.profiler over optimizer steps start..stop-1, written to RUN_DIR/profile/",
    )

    memory_profile_step: int | None = Field(
        None,
        ge=1,
        description="optimizer step N: the CUDA allocator records that step, and each rank writes what held the "
        "memory at its peak, by the code that allocated it, to RUN_DIR/profile/rank-K.memory.json (the step runs "
        "slower; pick one after the first and outside profile_steps)",
    )

    @field_validator("profile_steps")
    @classmethod
    def _window(cls, v):
        if v is not None and not 1 <= v[0] < v[1]:
            raise ValueError("must be [start, stop] with 1 <= start < stop (optimizer steps)")
        return v


class TokenizerSection(Strict):
    """Special-token overrides and new tokens (the embedding matrix grows to fit them)."""

    pad_token: str | None = Field(
        None,
        description="the padding token (added when the vocabulary lacks it); "
        "default: the tokenizer's, else its EOS token",
    )
    eos_token: str | None = Field(None, description="the end-of-sequence token (added when missing)")
    bos_token: str | None = Field(None, description="the beginning-of-sequence token (added when missing)")
    added_tokens: list[str] = Field(
        default_factory=list,
        description=(
            "new special tokens (never split), e.g. chat markers such as <|im_start|>; the embeddings grow to the "
            "new vocabulary (new rows start at the mean embedding); with LoRA set adapter.modules_to_save: "
            "[embed_tokens, lm_head] so they are learned"
        ),
    )

    @property
    def new_token_count(self) -> int:
        """An upper bound on the rows the vocabulary grows by (tokens already present add none)."""
        return len(set(self.added_tokens) | {t for t in (self.pad_token, self.eos_token, self.bos_token) if t})

    @property
    def may_resize_embeddings(self) -> bool:
        """Whether these overrides may grow the embeddings (finetune.train.model.fit_embeddings)."""
        return self.new_token_count > 0


SLURM_TIME = r"^(\d+-)?\d+(:\d{2}){0,2}$"  # what sbatch --time accepts: MM, HH:MM:SS, D-HH[:MM[:SS]]


class SlurmSection(Strict):
    """Settings of the generated job.sbatch; each overrides the hardware preset's."""

    partition: str | None = Field(
        None, description="#SBATCH --partition; default: the preset's, else the cluster's default partition"
    )
    account: str | None = Field(None, description="#SBATCH --account; default: the preset's, else none")
    time: str | None = Field(
        None,
        pattern=SLURM_TIME,
        description="#SBATCH --time limit, e.g. 2-00:00:00 or 12:00:00; default: the preset's, else the partition's",
    )


class ResolvedSection(Strict):
    """Planner decisions, written by `compile` into recipe.resolved.yaml; users never set it."""

    hardware: str = Field(description="the preset planned for")
    world_size: int = Field(description="processes in total")
    num_nodes: int = Field(description="nodes")
    gpus_per_node: int = Field(description="processes per node")
    device: Literal["cuda", "cpu"] = Field(description="where the ranks compute")
    gradient_accumulation_steps: int = Field(description="micro-batches per optimizer step")
    predicted_peak_gib: float = Field(description="the planner's peak memory per GPU (per process on CPU)")
    decoder_layer_class: str = Field(description="the class FSDP wraps and checkpoints layer by layer")
    lora_targets: list[str] = Field(description="the registry's LoRA target modules of the model")
    model_family: str = Field(description="the architecture family (model registry)")
    activation_checkpointing_by: Literal["trainer", "fsdp", "none"] = Field(
        "trainer",
        description="who applies train.activation_checkpointing: fsdp = accelerate's FSDP plugin "
        "(the trainer must not set gradient_checkpointing too), trainer = "
        "TrainingArguments.gradient_checkpointing, none = off",
    )
    checkpoint_layers: int | None = Field(
        None,
        ge=0,
        description="decoder layers checkpointed, the first k of the model's (None: all when "
        "train.activation_checkpointing is on); the planner's choice for a tight fit",
    )
    row_multiple: int | None = Field(
        None,
        ge=1,
        description="rows are padded to a multiple of this many tokens (the planner's choice where sdpa runs "
        "cuDNN's masked attention over them, which plans each new row length once, or Liger's Triton kernels take "
        "a packed row's length: finetune.plan.row_multiple); None: not padded",
    )
    cudnn_attention: bool = Field(
        True,
        description="false: the ranks turn cuDNN's attention off (its masked backward gives NaN at row lengths of 64 "
        "mod 128, and this method's collator cannot pad to whole 128-key tiles: finetune.plan.cudnn_attention_off)",
    )
    measure: bool = Field(
        False,
        description=(
            "written by `finetune plan --measure`: train max_steps steps to measure peak memory and "
            "tokens/s, then save nothing (no checkpoint, no model) and evaluate nothing"
        ),
    )


class Recipe(Strict):
    model: ModelSection = Field(description="the base model")
    method: MethodSection = Field(
        default_factory=MethodSection, description="the training objective (`method: dpo` is shorthand)"
    )
    adapter: AdapterSection = Field(
        default_factory=AdapterSection, description="what is trained (`adapter: qlora` is shorthand)"
    )
    data: DataSection = Field(description="training and eval data, and how it is tokenized")
    train: TrainSection = Field(default_factory=TrainSection, description="optimization")
    distributed: DistributedSection = Field(
        default_factory=DistributedSection, description="how the work is spread over GPUs"
    )
    hardware: str = Field("auto", description="preset name, a preset file, or auto")
    output: OutputSection = Field(default_factory=OutputSection, description="the run directory and its checkpoints")
    hub: HubSection = Field(default_factory=HubSection, description="publishing to the Hugging Face Hub")
    logging: LoggingSection = Field(default_factory=LoggingSection, description="trackers and profiling")
    tokenizer: TokenizerSection = Field(
        default_factory=TokenizerSection, description="special-token overrides and added tokens"
    )
    slurm: SlurmSection = Field(default_factory=SlurmSection, description="job.sbatch: partition, account, time limit")
    resolved: ResolvedSection | None = Field(
        None, description="written by the planner into recipe.resolved.yaml; never set by hand"
    )
    # where the recipe came from: relative data paths are anchored at _source_dir
    _source_dir: str | None = PrivateAttr(None)
    _source_name: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _method_defaults(self):
        # continued pre-training packs raw text unless the recipe says otherwise
        if self.method.type == "pretrain" and "packing" not in self.data.model_fields_set:
            self.data.packing = True
        return self

    @model_validator(mode="after")
    def _check_conflicts(self):
        problems = list(recipe_conflicts(self))
        if problems:
            key, message = problems[0]
            # a structured error: the loader reports `key` (not the whole recipe's location) as the place
            raise PydanticCustomError(CONFLICT_ERROR, "{message}", {"key": key, "message": message})
        return self


def _shards(strategy: str) -> bool:
    """A pinned strategy that shards the parameters (auto: the planner decides later)."""
    return strategy != AUTO and shards_params(strategy)


def _random_init_conflicts(recipe: Recipe):
    """model.init: random builds the weights, so nothing may need them loaded or worth keeping."""
    a = recipe.adapter
    builds_4bit_shards = (
        a.type == "qlora"
        and recipe.distributed.strategy != AUTO
        and is_fsdp(recipe.distributed.strategy)
        and loads_sharded(recipe)
    )
    if a.load_in_8bit or (a.type == "qlora" and not builds_4bit_shards):
        yield (
            a.quantization_key,
            (
                "model.init: random builds the weights in the model dtype, and bitsandbytes quantizes only while "
                "loading; QLoRA from random weights is built (and quantized) shard by shard under a pinned "
                f"distributed.strategy ({', '.join(n for n in STRATEGY_NAMES if is_fsdp(n))}) on GPUs; otherwise "
                "trial the shape with adapter.type: lora, or use model.init: pretrained"
            ),
        )
    if recipe.data.task_eval is not None:
        yield "data.task_eval", "model.init: random trains a trial model with nothing to score; remove data.task_eval"
    if recipe.hub.repo:
        yield "hub.repo", "a model trained from random weights (model.init: random) is a trial; remove hub.repo"


def recipe_conflicts(recipe: Recipe):
    """Yield (key path, message with a fix) for settings that contradict each other."""
    t, a, m, d = recipe.train, recipe.adapter, recipe.method, recipe.data
    window, memory_step = recipe.logging.profile_steps, recipe.logging.memory_profile_step
    if window is not None and memory_step is not None and window[0] <= memory_step < window[1]:
        yield (
            "logging.memory_profile_step",
            f"step {memory_step} is inside logging.profile_steps [{window[0]}, {window[1]}): recording the "
            f"allocator's history slows that step, and the profile would time it; pick a step outside the "
            f"window (e.g. memory_profile_step: {window[1]})",
        )
    if t.epochs is not None and t.max_steps is not None:
        yield (
            "train.max_steps",
            (
                "train.epochs and train.max_steps are both set; "
                "keep one of them (max_steps wins in most tools, here it is an error)"
            ),
        )
    least, why = least_micro_batch(m.type)
    if isinstance(t.micro_batch_size, int) and t.micro_batch_size < least:
        yield (
            "train.micro_batch_size",
            f"method {m.type} trains micro-batches of at least {least} ({why}); set train.micro_batch_size: "
            f"{least} or auto",
        )
    if t.global_batch_size < least:
        yield (
            "train.global_batch_size",
            f"method {m.type} trains micro-batches of at least {least} ({why}); set train.global_batch_size: "
            f"{least} or more",
        )
    allowed = METHOD_FORMATS[m.type]
    listed = [("data.sources", i, s) for i, s in enumerate(d.sources)]
    listed += [("data.eval_sources", i, s) for i, s in enumerate(d.eval_sources)]
    wrong = [(section, i, s.format) for section, i, s in listed if s.format not in allowed]
    if wrong:
        section, i, got = wrong[0]
        trained = {s.format for s in d.sources}
        others = f" (or {', '.join(allowed[1:])})" if len(allowed) > 1 else ""
        if section == "data.sources" and trained <= {"preference", "unpaired"}:
            fix = "set method: dpo (or kto/orpo/simpo/reward)"
        else:  # the one-source shorthand `data: {path, format}` is data.sources[0]
            fix = f"set {section}[{i}].format: {allowed[0]}{others} with data in that format"
            fix += ", or pick another method.type" if section == "data.sources" else ""
        yield (
            f"{section}[{i}].format",
            f"method {m.type} trains on format {', '.join(allowed)}, got {got}; {fix}",
        )
    if m.type == "reward" and d.task_eval is not None:
        yield "data.task_eval", "a reward model scores text and does not generate; remove data.task_eval"
    if bnb_under_fsdp(t.optimizer, recipe.distributed.strategy):
        yield "train.optimizer", BNB_UNDER_FSDP_REFUSAL
    if d.packing and m.type not in PADDING_FREE_METHODS:
        yield "data.packing", f"packing is not supported for method {m.type}; set data.packing: false"
    if a.type == "qlora":
        sharded = _shards(recipe.distributed.strategy)
        if a.storage_dtype != recipe.model.dtype and sharded:
            yield (
                "adapter.storage_dtype",
                (
                    f"QLoRA with {recipe.distributed.strategy} needs the 4-bit weights stored in the "
                    f"model dtype ({recipe.model.dtype}) so they can be sharded; set "
                    f"adapter.storage_dtype: {recipe.model.dtype}"
                ),
            )
        compute = PRECISION_DTYPE[t.precision]
        if sharded and compute and a.storage_dtype == recipe.model.dtype != compute:
            yield (
                "adapter.storage_dtype",
                (
                    f"QLoRA with {recipe.distributed.strategy} and train.precision {t.precision}: the sharded "
                    f"strategies cast every parameter to {compute} for compute, the packed 4-bit weights stored "
                    f"as {a.storage_dtype} too, which destroys them; set model.dtype and adapter.storage_dtype "
                    f"to {compute} (or train.precision: fp32)"
                ),
            )
        if t.precision == "fp32" and a.compute_dtype != "float32":
            yield (
                "adapter.compute_dtype",
                (
                    "train.precision fp32 with a 16-bit QLoRA compute dtype; "
                    "set adapter.compute_dtype: float32 or train.precision: bf16"
                ),
            )
    if recipe.model.init == "random":
        yield from _random_init_conflicts(recipe)
    if a.load_in_8bit and a.type != "lora":
        yield "adapter.load_in_8bit", "load_in_8bit is for adapter.type: lora (qlora is 4-bit already)"
    if a.loraplus_lr_ratio and a.type == "full":
        yield "adapter.loraplus_lr_ratio", "LoRA+ needs a LoRA adapter; set adapter.type: lora or remove it"
    if a.type == "full" and (a.dora or a.rslora):
        yield "adapter.dora", "dora/rslora are LoRA options; set adapter.type: lora or remove them"
    yield from expert_adapter_conflicts(recipe)
    if a.type == "full" and a.modules_to_save:
        yield (
            "adapter.modules_to_save",
            ("a full fine-tune already trains every module; remove adapter.modules_to_save or set adapter.type: lora"),
        )
    if t.precision == "bf16" and recipe.model.dtype == "float16":
        yield "train.precision", "model.dtype float16 with bf16 precision; set train.precision: fp16"
    yield from cadence_conflicts(recipe)
    yield from streaming_conflicts(recipe)
    if recipe.tokenizer.added_tokens and a.type != "full" and not a.modules_to_save:
        yield (
            "adapter.modules_to_save",
            (
                "tokenizer.added_tokens with a LoRA adapter leaves the new tokens' "
                "embeddings untrained; set adapter.modules_to_save: "
                "[embed_tokens, lm_head]"
            ),
        )
    if t.on_nonfinite == "stop" and t.max_bad_steps:
        yield "train.max_bad_steps", "max_bad_steps needs train.on_nonfinite: skip"
    held_out = [k for k, v in (("eval_fraction", d.eval_fraction), ("eval_rows", d.eval_rows)) if v]
    if len(held_out) == 2 or (held_out and d.eval_sources):
        key = held_out[-1] if len(held_out) == 2 else held_out[0]
        yield f"data.{key}", "set one of data.eval_sources, data.eval_fraction and data.eval_rows"
    strategy = recipe.distributed.strategy
    if recipe.distributed.sync_each_batch is True and strategy != AUTO and not weighs_sync_each_batch(strategy):
        # refused rather than ignored: the pin would say something the run does not do
        yield (
            "distributed.sync_each_batch",
            (
                f"distributed.strategy {strategy} has no sync_each_batch setting (only "
                f"{', '.join(n for n in STRATEGY_NAMES if weighs_sync_each_batch(n))} hold the gradients "
                "until a step's last micro-batch); remove distributed.sync_each_batch or set it to auto"
            ),
        )
    if m.type in REFERENCE_METHODS and m.reference == "implicit" and a.type == "full":
        yield (
            "method.reference",
            (
                "an implicit reference needs an adapter to disable; full fine-tuning has "
                "none; use reference: copy or precompute, or adapter: lora"
            ),
        )


def expert_adapter_conflicts(recipe: Recipe):
    """adapter.target_experts against what peft's target_parameters (its ParamWrapper) refuses or finetune has not
    run: dropout (no input to drop out of a folded weight), DoRA, and strategies that shard the parameters (the fold
    is a parametrization of the whole expert tensor)."""
    a = recipe.adapter
    if not a.target_experts:
        return
    if a.type == "full":
        yield "adapter.target_experts", "a full fine-tune trains the experts already; remove adapter.target_experts"
        return
    if a.dropout:
        yield (
            "adapter.dropout",
            "peft cannot apply dropout to LoRA on the experts' fused weights (adapter.target_experts); set "
            "adapter.dropout: 0 or remove adapter.target_experts",
        )
    if a.dora:
        yield "adapter.dora", "peft has no DoRA for the experts' fused weights; remove adapter.dora or target_experts"
    strategy = recipe.distributed.strategy
    if _shards(strategy):
        yield (
            "distributed.strategy",
            f"adapter.target_experts folds each adapter into its whole expert tensor, which {strategy} holds in "
            "shards; use ddp or zero2 (or auto), or remove adapter.target_experts",
        )


def packs_examples(recipe: Recipe) -> bool:
    """data.packing of SFT/pretrain examples into rows, whose examples' lengths the planner's attention time
    reads (data.example_tokens); DPO's padding-free pairs are planned at data.max_length per sequence."""
    return recipe.data.packing and recipe.method.type in PACKED_EXAMPLE_METHODS


def sync_each_batch_pin(recipe: Recipe) -> bool | None:
    """distributed.sync_each_batch as the planner and the Trainer take it: True/False, or None (auto) for
    the planner to decide. compile writes the planner's true/false into every resolved recipe; one resolved
    before the key existed carries auto, and ran under the Trainer's default no_sync, so auto in a resolved
    recipe is False (its plan, e.g. a calibration row's, is rebuilt as it ran)."""
    value = recipe.distributed.sync_each_batch
    if isinstance(value, bool):
        return value
    return False if recipe.resolved is not None else None


def dpo_reference(recipe: Recipe) -> str:
    """The DPO reference model as it runs, `auto` decided (the planner and the trainer both ask here):
    implicit (LoRA/QLoRA: the base with the adapter disabled, no second copy), copy (full fine-tune: a
    frozen second model) or precompute; "none" for SFT."""
    if recipe.method.type not in REFERENCE_METHODS:
        return "none"
    if recipe.method.reference == "auto":
        return "copy" if recipe.adapter.type == "full" else "implicit"
    return recipe.method.reference


def sharded_load_blocker(recipe: Recipe) -> str:
    """Why a recipe that wants the sharded load must still load the whole model, or "" when it need not:
    the settings that need the whole base at load time or tensors the checkpoint does not have (what only
    the checkpoint can tell is found at load time)."""
    a = recipe.adapter
    if recipe.method.type == "reward":
        return "method reward adds a score head the checkpoint does not have"
    if recipe.method.type in REFERENCE_METHODS and (a.type == "full" or dpo_reference(recipe) != "copy"):
        # only a reference finetune loads itself (an adapter's `reference: copy`) leaves the model alone
        return (
            f"method {recipe.method.type}'s trainer makes its reference from the model it is given (TRL copies "
            "a given adapter, or the whole model), which it cannot do from a sharded one"
        )
    if a.dora:
        return "adapter.dora computes its magnitudes from the whole base weights"
    if a.modules_to_save:
        return "adapter.modules_to_save copies whole base modules"
    if a.type == "qlora" and a.storage_dtype == "uint8":
        return "adapter.storage_dtype uint8 cannot be sharded by FSDP2"
    if recipe.tokenizer.may_resize_embeddings:
        return "tokenizer overrides may resize the embeddings (finetune.train.model.fit_embeddings)"
    return ""


def final_save_gathers_trained_only(recipe: Recipe) -> bool:
    """Whether an adapter's final save under FSDP2 gathers the trained parameters alone to rank 0
    (finetune/train/adapter_save.py), not the whole model: only where peft writes no frozen weight. peft's
    save_embedding_layers writes the whole embedding and LM head when the recipe grew the vocabulary (tokenizer.*
    tokens added) or targets them, so those runs, and every full fine-tune, gather the whole model. The planner
    counts that gather in the host RAM of the final save (plan/memory.py final_save_host_bytes)."""
    a = recipe.adapter
    if a.type == "full" or recipe.tokenizer.may_resize_embeddings:
        return False
    # target_modules: a list of names or one regex; peft's own test is a substring match on either
    targets = " ".join(a.target_modules) if isinstance(a.target_modules, (list, tuple)) else a.target_modules or ""
    return not any(name in targets for name in EMBEDDING_MODULES)


def loads_sharded(recipe: Recipe) -> bool:
    """Under FSDP2 each rank loads only its shards (finetune/train/sharded_load.py): distributed.sharded_load
    is on and sharded_load_blocker names no reason. The planner and the recipe checks ask here."""
    return recipe.distributed.sharded_load and not sharded_load_blocker(recipe)


def cadence_conflicts(recipe: Recipe):
    """Evaluation, checkpoint, warmup and schedule settings that exclude or need each other."""
    t, o, d = recipe.train, recipe.output, recipe.data
    if t.evals_per_epoch and t.eval_steps:
        yield "train.evals_per_epoch", "set train.evals_per_epoch or train.eval_steps, not both"
    if o.saves_per_epoch and o.save_every:
        yield "output.saves_per_epoch", "set output.saves_per_epoch or output.save_every, not both"
    # a resolved recipe writes the default ratio out, so only another ratio conflicts
    if t.warmup_steps is not None and t.warmup_ratio != TrainSection.model_fields["warmup_ratio"].default:
        yield "train.warmup_steps", "set train.warmup_steps or train.warmup_ratio, not both"
    if t.min_lr is not None and t.min_lr_ratio is not None:
        yield "train.min_lr", "set train.min_lr or train.min_lr_ratio, not both"
    if (t.min_lr is not None or t.min_lr_ratio is not None) and t.scheduler != "cosine_with_min_lr":
        yield "train.scheduler", "min_lr / min_lr_ratio need train.scheduler: cosine_with_min_lr"
    if t.early_stopping_patience or t.load_best_model_at_end:
        what = "train.early_stopping_patience" if t.early_stopping_patience else "train.load_best_model_at_end"
        cadence = t.eval_steps or t.evals_per_epoch
        if not (d.eval_sources or d.eval_fraction or d.eval_rows):
            also = "" if cadence else " and train.evals_per_epoch: 1"
            yield (
                what,
                (
                    f"{what} needs eval data{'' if cadence else ' and an eval cadence'}; add "
                    f"data.eval_fraction: 0.1 (or data.eval_sources){also}"
                ),
            )
        elif not cadence:
            yield what, f"{what} needs an eval cadence; set train.evals_per_epoch: 1 (or train.eval_steps)"


def streaming_conflicts(recipe: Recipe):
    """data.sources[].streaming needs a finite step count and plain text; it is all or nothing."""
    d, t = recipe.data, recipe.train
    streams = [s.streaming for s in d.sources]
    if not any(streams) and not any(s.streaming for s in d.eval_sources):
        return
    if any(s.streaming for s in d.eval_sources):
        yield "data.eval_sources", "eval sources are read whole; set streaming: false there (and max_samples)"
    elif not all(streams):
        yield "data.sources", "either every train source streams or none does; set streaming on all of them"
    elif any(s.format != "text" for s in d.sources) or recipe.method.type not in ("pretrain", "sft"):
        yield "data.sources", "streaming reads format text for method pretrain or sft; set those, or streaming: false"
    elif t.max_steps is None:
        yield "train.max_steps", "a streamed corpus has no known length; set train.max_steps (and remove train.epochs)"
    elif t.evals_per_epoch or recipe.output.saves_per_epoch:
        yield (
            "train.evals_per_epoch",
            (
                "a streamed corpus has no epochs; use train.eval_steps / output.save_every "
                "instead of the per-epoch cadence"
            ),
        )
    elif d.eval_fraction or d.eval_rows:
        key = "data.eval_fraction" if d.eval_fraction else "data.eval_rows"
        yield key, "a streamed corpus cannot be split; use data.eval_sources instead"

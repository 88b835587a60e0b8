"""The recipe schema: strict, typed, every default written here.

Unknown keys are errors (extra="forbid"); the loader turns pydantic's errors into
messages with the full key path and a did-you-mean suggestion. Cross-field rules that
need the whole recipe live in `Recipe._check_conflicts`; each says how to fix it.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, field_validator, model_validator

Dtype = Literal["bfloat16", "float16", "float32"]
Strategy = Literal["auto", "ddp", "fsdp2", "fsdp2-hybrid", "zero3", "zero3-offload", "zero3-nvme"]
CONCRETE_STRATEGIES = ("ddp", "fsdp2", "fsdp2-hybrid", "zero3", "zero3-offload", "zero3-nvme")
DataFormat = Literal["messages", "alpaca", "sharegpt", "text", "prompt_completion", "preference"]
# The canonical column names each format reads; `columns:` maps them to the file's names.
FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "alpaca": ("instruction", "input", "output"),
    "sharegpt": ("conversations",),
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected"),
}
OPTIONAL_COLUMNS = {"alpaca": ("input",), "messages": (), "preference": ()}


def _yaml_switch(value):
    # YAML 1.1 reads a bare on/off as true/false: `liger: off` must mean "off", not a type error
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


OnOffAuto = Annotated[Literal["auto", "on", "off"], BeforeValidator(_yaml_switch)]


class Strict(BaseModel):
    """Base for every schema section: unknown keys are errors, types are not coerced loosely."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class ModelSection(Strict):
    name: str = Field(description="Hub id (org/name) or a local directory with config.json")
    arch: str | None = Field(None, description="registry key; default: derived from name")
    dtype: Dtype = "bfloat16"
    # auto: varlen (PyTorch's flash varlen kernel) for packed SFT on NVIDIA GPUs, else sdpa
    attn_implementation: Literal["auto", "varlen", "sdpa", "eager", "flash_attention_2",
                                 "flash_attention_3", "flex_attention"] = "auto"
    trust_remote_code: bool = False
    revision: str | None = None
    allow_pickle: bool = Field(False, description="allow .bin (pickle) weights; off: safetensors only")


class MethodSection(Strict):
    type: Literal["sft", "dpo"] = "sft"
    # DPO only
    beta: float = Field(0.1, gt=0, le=10)
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "bco_pair", "sppo_hard",
                       "nca_pair", "apo_zero", "apo_down"] = "sigmoid"
    # implicit: LoRA/QLoRA reuse the base with the adapter disabled (no second copy);
    # copy: a frozen copy of the model; precompute: reference log-probs computed once up front.
    reference: Literal["auto", "implicit", "copy", "precompute"] = "auto"

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value):
        # `method: dpo` is accepted as `method: {type: dpo}`
        return {"type": value} if isinstance(value, str) else value


class AdapterSection(Strict):
    type: Literal["full", "lora", "qlora"] = "lora"
    r: int = Field(16, ge=1, le=4096)
    alpha: float = Field(32, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: Union[list[str], Literal["all-linear"], None] = Field(
        None, description="default: the model registry's LoRA targets")
    dora: bool = False
    rslora: bool = False
    # QLoRA only
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    compute_dtype: Dtype = "bfloat16"
    # The dtype the packed 4-bit weights are stored in. It must match the model's dtype so
    # FSDP2/ZeRO-3 can shard them with everything else (TRL #3436; uint8 is not shardable).
    storage_dtype: Literal["bfloat16", "float16", "float32", "uint8"] = "bfloat16"
    # peft casts each LoRA input to the adapter weights' fp32; under bf16/fp16 autocast the matmul is
    # cast back at once, so finetune skips that round trip (false). true restores peft's default.
    cast_adapter_inputs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value):
        return {"type": value} if isinstance(value, str) else value


class DataSource(Strict):
    path: str = Field(description="local .jsonl/.json/.parquet/.csv file, or a Hub dataset id")
    format: DataFormat = "messages"
    columns: dict[str, str] = Field(default_factory=dict,
                                    description="canonical column -> column in the file")
    split: str = "train"
    subset: str | None = None
    max_samples: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _known_columns(self):
        valid = FORMAT_COLUMNS[self.format]
        for canonical in self.columns:
            if canonical not in valid:
                raise ValueError(
                    f"columns.{canonical}: not a column of format {self.format!r}; "
                    f"its columns are {', '.join(valid)}")
        return self


class TaskEvalSection(DataSource):
    """Held-out examples scored by exact match of greedy generation against the last answer."""

    n: int = Field(50, ge=1, description="how many examples of the file to score")
    max_new_tokens: int = Field(32, ge=1, le=4096)


class DataSection(Strict):
    sources: list[DataSource] = Field(min_length=1)
    eval_sources: list[DataSource] = Field(default_factory=list)
    eval_fraction: float | None = Field(None, gt=0, lt=1)
    max_length: int = Field(2048, ge=8, le=1_048_576)
    packing: bool = False
    chat_template: str | None = Field(None, description="jinja text or a path to a .jinja file")
    assistant_only_loss: bool = True
    # preflight: error when more than this share of examples is longer than max_length
    max_too_long_fraction: float = Field(0.05, ge=0, le=1)
    seed: int = Field(0, ge=0, le=2**32 - 1, description="shuffle/split seed (0 .. 2**32-1)")
    # tokenized-data cache; default $FINETUNE_CACHE_DIR, else ~/.cache/finetune/tokenized
    cache_dir: str | None = None
    # greedy-generation exact-match eval on held-out prompts, run before and after training
    task_eval: TaskEvalSection | None = None
    # data files must lie inside the recipe's dir, its project root or the current dir (symlinks
    # resolved); allow_paths adds directories, allow_outside turns the check off (docs/reliability.md)
    allow_paths: list[str] = Field(default_factory=list)
    allow_outside: bool = False

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


class TrainSection(Strict):
    epochs: float | None = Field(None, gt=0, le=1000)
    max_steps: int | None = Field(None, ge=1)
    lr: float = Field(2e-4, gt=0, lt=1)
    scheduler: Literal["cosine", "linear", "constant", "constant_with_warmup"] = "cosine"
    warmup_ratio: float = Field(0.03, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0, le=1)
    max_grad_norm: float = Field(1.0, ge=0)
    global_batch_size: int = Field(16, ge=1, le=1_000_000)
    micro_batch_size: Union[Literal["auto"], int] = "auto"
    activation_checkpointing: OnOffAuto = "auto"
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = "adamw"
    seed: int = Field(42, ge=0, le=2**32 - 1, description="random seed (0 .. 2**32-1, numpy's range)")
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    logging_steps: int = Field(1, ge=1)
    eval_steps: int | None = Field(None, ge=1)
    # non-finite loss/grad-norm: stop at once, or skip up to max_bad_steps such steps
    on_nonfinite: Literal["stop", "skip"] = "stop"
    max_bad_steps: int = Field(0, ge=0)
    # Liger's Triton RMSNorm/RoPE/SwiGLU kernels (auto: on for supported models on NVIDIA GPUs when
    # liger-kernel is installed). The LM head is already fused by TRL (chunked log-probs).
    liger: OnOffAuto = "auto"

    @field_validator("micro_batch_size")
    @classmethod
    def _positive(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("must be 'auto' or a positive integer")
        return v


class DistributedSection(Strict):
    strategy: Strategy = "auto"
    timeout_minutes: float = Field(30, gt=0, le=24 * 60)
    nvme_path: str | None = Field(None, description="ZeRO-Infinity swap dir; default: the preset's")


class OutputSection(Strict):
    dir: str | None = Field(None, description="default: runs/<recipe file name>")
    save_every: int | None = Field(None, ge=1, description="steps; default: at the end only")
    keep: int = Field(2, ge=1)


class HubSection(Strict):
    repo: str | None = Field(None, pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
    private: bool = True
    push: Literal["adapter", "merged"] = "adapter"
    revision: str | None = None


class LoggingSection(Strict):
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "none"]] = Field(
        default_factory=lambda: ["tensorboard"])
    project: str | None = None
    # [start, stop]: torch.profiler over optimizer steps start..stop-1 -> RUN_DIR/profile/ (finetune/train/profile.py)
    profile_steps: tuple[int, int] | None = None

    @field_validator("profile_steps")
    @classmethod
    def _window(cls, v):
        if v is not None and not 1 <= v[0] < v[1]:
            raise ValueError("must be [start, stop] with 1 <= start < stop (optimizer steps)")
        return v


class ResolvedSection(Strict):
    """Planner decisions, written by `compile` into recipe.resolved.yaml; users never set it."""

    hardware: str
    world_size: int
    num_nodes: int
    gpus_per_node: int
    device: Literal["cuda", "cpu"]
    gradient_accumulation_steps: int
    predicted_peak_gib: float
    decoder_layer_class: str
    lora_targets: list[str]
    model_family: str
    # who applies train.activation_checkpointing: "fsdp" = accelerate's FSDP plugin
    # (fsdp_activation_checkpointing; the trainer must NOT set gradient_checkpointing),
    # "trainer" = TrainingArguments.gradient_checkpointing, "none" = off
    activation_checkpointing_by: Literal["trainer", "fsdp", "none"] = "trainer"


class Recipe(Strict):
    model: ModelSection
    method: MethodSection = Field(default_factory=MethodSection)
    adapter: AdapterSection = Field(default_factory=AdapterSection)
    data: DataSection
    train: TrainSection = Field(default_factory=TrainSection)
    distributed: DistributedSection = Field(default_factory=DistributedSection)
    hardware: str = Field("auto", description="preset name, a preset file, or auto")
    output: OutputSection = Field(default_factory=OutputSection)
    hub: HubSection = Field(default_factory=HubSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    resolved: ResolvedSection | None = None
    # where the recipe came from: relative data paths are anchored at _source_dir
    _source_dir: str | None = PrivateAttr(None)
    _source_name: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check_conflicts(self):
        problems = list(recipe_conflicts(self))
        if problems:
            key, message = problems[0]
            raise ValueError(f"@{key}@ {message}")
        return self


def recipe_conflicts(recipe: Recipe):
    """Yield (key path, message with a fix) for settings that contradict each other."""
    t, a, m, d = recipe.train, recipe.adapter, recipe.method, recipe.data
    if t.epochs is not None and t.max_steps is not None:
        yield "train.max_steps", ("train.epochs and train.max_steps are both set; "
                                  "keep one of them (max_steps wins in most tools, here it is an error)")
    formats = {s.format for s in d.sources + d.eval_sources}
    if m.type == "dpo" and formats != {"preference"}:
        bad = sorted(formats - {"preference"})
        yield "data.sources", (f"method dpo needs format 'preference' (prompt/chosen/rejected), "
                               f"got {', '.join(bad)}; set data.format: preference or method: sft")
    if m.type == "sft" and "preference" in formats:
        yield "data.sources", ("format 'preference' is for method dpo; set method: dpo, or use "
                               "a messages/prompt_completion dataset for SFT")
    if m.type == "dpo" and d.packing:
        yield "data.packing", "packing is not supported for DPO; set data.packing: false"
    if a.type == "qlora":
        if a.storage_dtype != recipe.model.dtype and recipe.distributed.strategy not in ("auto", "ddp"):
            yield "adapter.storage_dtype", (
                f"QLoRA with {recipe.distributed.strategy} needs the 4-bit weights stored in the "
                f"model dtype ({recipe.model.dtype}) so they can be sharded; set "
                f"adapter.storage_dtype: {recipe.model.dtype}")
        if t.precision == "fp32" and a.compute_dtype != "float32":
            yield "adapter.compute_dtype", ("train.precision fp32 with a 16-bit QLoRA compute dtype; "
                                            "set adapter.compute_dtype: float32 or train.precision: bf16")
    if a.type == "full" and (a.dora or a.rslora):
        yield "adapter.dora", "dora/rslora are LoRA options; set adapter.type: lora or remove them"
    if t.precision == "bf16" and recipe.model.dtype == "float16":
        yield "train.precision", "model.dtype float16 with bf16 precision; set train.precision: fp16"
    if t.on_nonfinite == "stop" and t.max_bad_steps:
        yield "train.max_bad_steps", "max_bad_steps needs train.on_nonfinite: skip"
    if d.eval_fraction and d.eval_sources:
        yield "data.eval_fraction", "set either data.eval_fraction or data.eval_sources, not both"

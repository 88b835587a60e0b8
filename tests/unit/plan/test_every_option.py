"""Every recipe option that changes memory or time is planned: each leaf of the recipe schema is changed,
one at a time, in a few planned settings (LoRA SFT, DPO, QLoRA on one H100; a full fine-tune with FSDP2
on four), and the plan's memory and time must move unless the key is listed in NO_EFFECT with the reason
it costs neither. A new recipe field fails here until it is modelled or listed, and a listed key that
starts to move the plan fails too (the reason went stale)."""

from __future__ import annotations

import copy
import typing

import pytest
from pydantic import BaseModel, ValidationError

from finetune.errors import FinetuneError
from finetune.plan import plan_on
from finetune.recipe import load_recipe
from finetune.recipe.schema import Recipe
from finetune.registry import resolve_model
from tests.helpers.calibration_rows import preset_for

PRESETS = {n: preset_for("NVIDIA H100 80GB HBM3", gpus_per_node=n) for n in (1, 4)}
MODEL = {"name": "llama-3.1-8b", "arch": "llama-3.1-8b"}
FIXED = {"global_batch_size": 8, "micro_batch_size": 2, "activation_checkpointing": "off", "max_steps": 10}
# (GPUs, recipe): micro-batch and checkpointing pinned so a changed cost shows in the numbers
SETTINGS = {
    "sft-lora": (1, {"adapter": {"type": "lora"}, "data": {"path": "t.jsonl", "packing": True}}),
    "dpo-lora": (
        1,
        {"method": {"type": "dpo"}, "adapter": {"type": "lora"}, "data": {"path": "t.jsonl", "format": "preference"}},
    ),
    "qlora": (1, {"adapter": {"type": "qlora"}, "data": {"path": "t.jsonl", "packing": True}}),
    "full-fsdp2": (
        4,
        {
            "adapter": {"type": "full"},
            "data": {"path": "t.jsonl", "packing": True},
            "train": {"micro_batch_size": 1, "activation_checkpointing": "on"},
            "distributed": {"strategy": "fsdp2"},
        },
    ),
    # float32 weights: train.precision decides whether the matmuls run on bf16 tensor cores or in fp32
    "fp32-weights": (
        1,
        {"model": {"dtype": "float32"}, "adapter": {"type": "lora"}, "data": {"path": "t.jsonl", "packing": True}},
    ),
}

# Keys that cost no memory and no step time, and why. Steady step time is what the planner predicts:
# saves, evals and logging happen between steps and are not in it.
NO_EFFECT = {
    "model.name": "which weights are loaded; the shape comes from model.arch here",
    "model.revision": "which weights are loaded",
    "model.trust_remote_code": "permission to run the repository's code",
    "model.allow_pickle": "which weight file format may be read",
    "model.rope_scaling": "changes RoPE's frequencies, not tensor shapes or FLOPs",
    "model.init": "the weights' values, not their shapes (a random build's time is in the load, not a step)",
    "method.beta": "a coefficient of the preference loss",
    "method.loss_type": "DPO's loss variants are elementwise on the same per-sequence log-probabilities",
    "method.simpo_gamma": "a coefficient of the loss",
    "method.cpo_alpha": (
        "a coefficient of the loss in these settings; under method simpo a non-zero one adds a cross-entropy over "
        "the chosen logits, which is planned (Job.nll_on_chosen, tests/unit/plan/test_memory.py)"
    ),
    "method.desirable_weight": "a coefficient of the loss",
    "method.undesirable_weight": "a coefficient of the loss",
    "method.center_rewards_coefficient": "a coefficient of the reward loss",
    "adapter.alpha": "the LoRA scale, one multiply",
    "adapter.rslora": "the LoRA scale, one multiply",
    "adapter.loraplus_lr_ratio": "per-group learning rates of the same optimizer state",
    "adapter.quant_type": "nf4 and fp4 pack the same 4 bits per weight with the same block statistics",
    "adapter.storage_dtype": "the container of the packed 4-bit data: the same bytes",
    "adapter.compute_dtype": "under bf16/fp16 autocast the dequantized matmuls run in the autocast dtype",
    "data.eval_fraction": "held-out rows for the eval loss, between steps",
    "data.eval_rows": "held-out rows for the eval loss, between steps",
    "data.chat_template": "how text becomes tokens; the row length is data.max_length",
    "data.assistant_only_loss": "which tokens count in the loss, not how many are computed",
    "data.max_too_long_fraction": "a data check before training",
    "data.seed": "the order of the rows",
    "data.cache_dir": "where tokenized data is cached",
    "data.allow_paths": "where data may be read from",
    "data.allow_outside": "where data may be read from",
    "train.epochs": "the run length, not the step",
    "train.max_steps": "the run length, not the step",
    "train.lr": "a value the optimizer reads",
    "train.scheduler": "a value the optimizer reads",
    "train.warmup_ratio": "a value the optimizer reads",
    "train.warmup_steps": "a value the optimizer reads",
    "train.min_lr": "a value the optimizer reads",
    "train.min_lr_ratio": "a value the optimizer reads",
    "train.weight_decay": "a value the optimizer reads",
    "train.adam_beta1": "a value the optimizer reads",
    "train.adam_beta2": "a value the optimizer reads",
    "train.adam_epsilon": "a value the optimizer reads",
    "train.max_grad_norm": "one norm over the gradients already reduced; no extra buffers",
    "train.neftune_noise_alpha": "noise added to the input embeddings, one elementwise op",
    "train.seed": "random state",
    "train.logging_steps": "between steps",
    "train.eval_steps": "between steps",
    "train.evals_per_epoch": "between steps",
    "train.early_stopping_patience": "between steps",
    "train.early_stopping_threshold": "between steps",
    "train.load_best_model_at_end": "after training",
    "train.on_nonfinite": "a check of the loss already on the host",
    "train.max_bad_steps": "a check of the loss already on the host",
    "train.oom_retries": "what happens after an out-of-memory failure",
    "train.deferred_metrics": "one device-to-host sync per micro-batch; unmodelled (a fraction of a percent)",
    "train.compile": (
        "measured on 8B LoRA (H200): steady tokens/s 0.92x eager and max reserved 1.04x, inside the planner's "
        "bounds, so the plan is eager's; the first steps' compilation (~90 s) is not in the step time"
    ),
    "distributed.timeout_minutes": "how long a collective may hang",
    "distributed.sharded_load": (
        "how the weights reach each rank's shards before the first step: the same shards, so the same step "
        "memory and time; what it changes, the host RAM of loading, is planned (tests/unit/plan/test_host_ram.py)"
    ),
    "output.dir": "where the run is written",
    "output.save_every": "checkpoints are written between steps",
    "output.saves_per_epoch": "checkpoints are written between steps",
    "output.keep": "how many checkpoints stay on disk",
    "hub.repo": "after training",
    "hub.private": "after training",
    "hub.push": "after training",
    "hub.revision": "after training",
    "logging.report_to": "between steps",
    "logging.project": "a name",
    "logging.run_name": "a name",
    "logging.entity": "a name",
    "logging.offline": "where metrics go",
    "logging.loss_log_scale": "a plot",
    "logging.loss_smoothing": "a plot",
    "logging.profile_steps": (
        "a profiler window of a few steps (slower); its event buffers hold ~2 GiB more host RAM for an 8B LoRA "
        "step of ~30,000 kernel launches (docs/validation.md row 176), which the plan does not count"
    ),
    "logging.memory_profile_step": "one step of the allocator's history (slower; outside the timed window)",
    "slurm.partition": "where the job is queued",
    "slurm.account": "where the job is queued",
    "slurm.time": "the job's time limit",
    "hardware": "the preset itself is passed to the planner here",
}
# Keys whose change this test cannot make in these settings, and where their cost is checked instead.
CHECKED_ELSEWHERE = {
    "data.sources": "the rows read (format, columns, split, weights...); their lengths reach the planner as "
    "data.example_tokens",
    "data.eval_sources": "held-out rows, evaluated between steps",
    "adapter.target_experts": "LoRA on an MoE model's routed experts (refused on the dense model of the settings "
    "here): its parameters, folded expert copies and FLOPs move the plan in tests/unit/plan/test_expert_lora.py",
    "data.task_eval": "generation before and after training with a whole copy of the model on one GPU: refused "
    "where that copy cannot fit beside the trainer's state (tests/unit/plan/test_task_eval.py)",
    "model.cudnn_long_examples": "examples of 8,192 tokens or more on cuDNN (the settings here train 2,048-token "
    "rows): its time and kept tensors move the plan in tests/unit/plan/test_packed_attention.py",
}
ALTERNATIVE_TEXT = {
    "tokenizer.eos_token": "<|new_eos|>",
    "tokenizer.bos_token": "<|new_bos|>",
    "tokenizer.added_tokens": ["<|a|>", "<|b|>"],
    "adapter.modules_to_save": ["embed_tokens", "lm_head"],
    "model.arch": "qwen2.5-7b",
    "adapter.target_modules": ["q_proj", "v_proj"],
    "data.chat_template": "chatml",
    "data.sequence_tokens": {"mean": 300.0, "longest": 900, "std": 100.0},
    # auto plans no_sync in full-fsdp2 (it fits and is faster), so only true moves the plan
    "distributed.sync_each_batch": True,
}


def _leaves(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _leaves(field.annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


LEAVES = {key: field for key, field in _leaves(Recipe) if key != "resolved"}  # resolved: written by compile


def _alternatives(key: str, field, current):
    if key in ALTERNATIVE_TEXT:
        return [ALTERNATIVE_TEXT[key]]
    values = []
    annotation = field.annotation
    args = (annotation,) if typing.get_origin(annotation) is typing.Literal else typing.get_args(annotation)
    for arg in args or (annotation,):
        if typing.get_origin(arg) is typing.Literal:
            values += typing.get_args(arg)
        elif arg is bool:
            values.append(not current)
        elif arg is int:
            values += [max(1, (current or 1) * 2), max(1, (current or 2) // 2)]
        elif arg is float:
            values += [(current or 0.25) * 2, (current or 0.25) / 2]
        elif arg is str:
            values.append("alt")
    return [v for v in dict.fromkeys(values) if v != current]


def _get(raw: dict, key: str):
    node = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _costs(raw: dict, gpus: int):
    recipe = load_recipe(raw)
    plan = plan_on(recipe, arch=resolve_model(recipe.model), preset=PRESETS[gpus], source="test")
    return plan.kernels, [
        (c.strategy, c.micro_batch_size, c.checkpoint_layers, round(c.memory.total), round(c.step_time_s, 6))
        for c in plan.candidates
    ]


def _setting(name: str) -> dict:
    gpus, extra = SETTINGS[name]
    raw = {"model": dict(MODEL), "train": dict(FIXED), "hardware": "auto"}
    for section, values in extra.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


def _moves(key: str) -> tuple[bool, int]:
    """(the plan moved in some setting, how many changes could be planned at all)"""
    field, planned = LEAVES[key], 0
    for name, (gpus, _) in SETTINGS.items():
        base = _setting(name)
        defaults = load_recipe(base).model_dump()
        before = _costs(base, gpus)
        for value in _alternatives(key, field, _get(defaults, key)):
            raw = copy.deepcopy(base)
            *sections, leaf = key.split(".")
            node = raw
            for section in sections:
                node = node.setdefault(section, {})
            node[leaf] = value
            try:
                after = _costs(raw, gpus)
            except (FinetuneError, ValidationError):
                continue  # not valid in this setting (e.g. DoRA with QLoRA's storage): another setting has it
            planned += 1
            if after != before:
                return True, planned
    return False, planned


def test_every_listed_key_is_a_recipe_key():
    assert not (set(NO_EFFECT) | set(CHECKED_ELSEWHERE)) - set(LEAVES)


@pytest.mark.parametrize("key", sorted(set(LEAVES) - set(CHECKED_ELSEWHERE)))
def test_the_option_moves_the_plan_or_says_why_not(key):
    moved, planned = _moves(key)
    if key in NO_EFFECT:
        assert not moved, f"{key} changes the plan; remove it from NO_EFFECT ({NO_EFFECT[key]!r})"
    else:
        assert planned, f"no change of {key} could be planned: give it a value in ALTERNATIVE_TEXT"
        assert moved, f"{key} changes nothing the planner predicts: model its cost, or list it in NO_EFFECT with why"

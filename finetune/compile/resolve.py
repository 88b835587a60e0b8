"""The resolved recipe: every default written out and every planner decision made concrete.

This is the one artifact that crosses into the ranks (`finetune.train RUN_DIR/recipe.resolved.yaml`),
so it must stand alone: paths are absolute (the file lives in the run dir, not next to the
recipe) and nothing is left `auto`.
"""

from __future__ import annotations

from pathlib import Path

from finetune import strategies
from finetune.compile.accelerate import checkpointing_owner, partial_checkpointing
from finetune.compile.deepspeed import nvme_path_for, optimizer_in_ds_config
from finetune.plan import attention_implementation, liger_enabled
from finetune.plan.types import Plan
from finetune.recipe.load import recipe_dir
from finetune.recipe.paths import anchored, is_inline_template
from finetune.recipe.schema import Recipe, ResolvedSection, trained_lora_dropout
from finetune.registry import list_models
from finetune.registry.schema import HardwarePreset, ModelArch


def _absolute_if_local(value: str | None, base: Path, *, want_dir: bool = False) -> str | None:
    """A path that exists relative to the recipe becomes absolute; Hub ids stay as they are."""
    if not value:
        return value
    candidate = anchored(value, base)
    exists = candidate.is_dir() if want_dir else candidate.is_file()
    return str(candidate.resolve()) if exists else value


def resolve_recipe(recipe: Recipe, plan: Plan, *, run_dir: Path, arch: ModelArch, preset: HardwarePreset) -> Recipe:
    base = recipe_dir(recipe)
    data = recipe.model_dump(mode="python")
    data["model"]["name"] = _absolute_if_local(recipe.model.name, base, want_dir=True)
    # a registry key only: an architecture read from config.json is read again from it (its derived key names
    # no registry entry, and a later re-plan -- after an OOM, by --measure, by a tool -- would not find it)
    data["model"]["arch"] = recipe.model.arch or (arch.key if arch.key in {a.key for a in list_models()} else None)
    for group in ("sources", "eval_sources"):
        for src in data["data"][group]:
            src["path"] = _absolute_if_local(src["path"], base)
    if data["data"].get("task_eval"):
        data["data"]["task_eval"]["path"] = _absolute_if_local(data["data"]["task_eval"]["path"], base)
    template = recipe.data.chat_template
    if template and not is_inline_template(template):
        data["data"]["chat_template"] = _absolute_if_local(template, base)
    hardware = _absolute_if_local(recipe.hardware, base)
    if hardware == recipe.hardware and hardware not in ("auto", preset.name):
        hardware = preset.name  # planned for another preset (--hardware overrides the recipe)
    data["hardware"] = hardware

    data["model"]["attn_implementation"] = attention_implementation(recipe, preset, arch=arch)
    data["train"]["liger"] = "on" if liger_enabled(recipe, preset, arch=arch) else "off"
    # no dropout module where the method's trainer would set it to p = 0 (peft's lora groups then stay fused)
    data["adapter"]["dropout"] = trained_lora_dropout(recipe)
    targets = list(arch.lora_targets)
    if recipe.adapter.type != "full" and recipe.adapter.target_modules is None:
        data["adapter"]["target_modules"] = targets

    train = data["train"]
    train["micro_batch_size"] = plan.micro_batch_size
    train["activation_checkpointing"] = "on" if plan.activation_checkpointing else "off"
    # what actually runs: world x micro-batch x accumulation (the planner rounds to fit)
    train["global_batch_size"] = plan.world_size * plan.micro_batch_size * plan.gradient_accumulation_steps
    if optimizer_in_ds_config(plan) or strategies.offloads_optimizer(plan.strategy):
        # the offloaded states are stepped on the CPU: DeepSpeed's CPU Adam (declared in ds_config.json)
        # or torch's AdamW on FSDP2's host-RAM shards; bitsandbytes' 8-bit optimizers are CUDA kernels
        train["optimizer"] = "adamw"

    dist = data["distributed"]
    dist["strategy"] = plan.strategy
    # always a concrete true/false: a resolved recipe's auto means the Trainer's default (schema.sync_each_batch_pin)
    dist["sync_each_batch"] = plan.sync_each_batch is True
    if strategies.info(plan.strategy).offload == "nvme":
        dist["nvme_path"] = nvme_path_for(recipe, preset)

    data["output"]["dir"] = str(run_dir)
    data["resolved"] = ResolvedSection(
        hardware=preset.name,
        world_size=plan.world_size,
        num_nodes=plan.num_nodes,
        gpus_per_node=plan.gpus_per_node,
        device=plan.device,
        gradient_accumulation_steps=plan.gradient_accumulation_steps,
        predicted_peak_gib=round(float(plan.per_gpu_memory_gib), 2),
        decoder_layer_class=arch.decoder_layer_class,
        lora_targets=targets,
        model_family=arch.family,
        activation_checkpointing_by=checkpointing_owner(plan),
        checkpoint_layers=plan.checkpoint_layers if partial_checkpointing(plan) else None,
        row_multiple=plan.row_multiple,
        cudnn_attention=plan.cudnn_attention,
    ).model_dump(mode="python")
    resolved = Recipe.model_validate(data)
    resolved._source_dir = str(run_dir)
    resolved._source_name = recipe._source_name
    return resolved

"""compile_run: Recipe + Plan -> run_dir/{recipe.resolved.yaml, plan.json, accelerate.yaml,
ds_config.json, launch.sh, job.sbatch, launch.json} and a LaunchSpec. Pure Python."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from finetune import strategies
from finetune.compile.accelerate import accelerate_config, checkpointing_owner
from finetune.compile.deepspeed import ds_config
from finetune.compile.files import json_text, write_atomic, yaml_text
from finetune.compile.multinode import render_launch_sh, render_sbatch
from finetune.compile.resolve import resolve_recipe
from finetune.compile.spec import DEFAULT_MAIN_PORT, LaunchSpec
from finetune.errors import DoesNotFitError, RecipeError
from finetune.plan.render import sync_text
from finetune.plan.types import Plan
from finetune.recipe.load import dump_recipe, recipe_dir, recipe_name
from finetune.recipe.schema import Recipe
from finetune.registry.schema import HardwarePreset, ModelArch
from finetune.rundir import ACCELERATE_YAML, DS_CONFIG, JOB_SBATCH, LAUNCH_JSON, LAUNCH_SH, PLAN_JSON, RESOLVED_RECIPE

ENTRY_MODULE = "finetune.train"
# Shutdown grace the torchrun agent gives ranks after forwarding a signal (its default is
# 30 s, too short to write a 70B checkpoint); SIGUSR1 is added to the signals it forwards.
SHUTDOWN_GRACE_S = 300


def _resolve_inputs(recipe: Recipe, plan: Plan, arch, preset):
    if arch is None or preset is None:
        from finetune import registry  # lazy: tests may pass both explicitly

        base = recipe_dir(recipe)
        if arch is None:
            arch = registry.resolve_model(recipe.model, base_dir=base)
        if preset is None:
            # the plan names the preset it planned for; a preset *file* is named by the recipe
            try:
                preset = registry.get_preset(plan.hardware, base_dir=base)
            except RecipeError:
                preset = registry.get_preset(recipe.hardware, base_dir=base)
    return arch, preset


def _check_plan(plan: Plan) -> None:
    if not plan.fits:
        options = "; ".join(plan.suggestions) if plan.suggestions else "see `finetune plan`"
        raise DoesNotFitError(f"nothing fits on {plan.hardware}: {plan.why}", key="distributed.strategy", hint=options)
    if plan.strategy not in strategies.NAMES:
        raise RecipeError(
            f"the plan's strategy {plan.strategy!r} is not one finetune can launch",
            key="distributed.strategy",
            hint=f"use one of {', '.join(strategies.NAMES)}",
        )
    if plan.device == "cpu" and strategies.shards_params(plan.strategy):
        raise RecipeError(
            f"{plan.strategy} needs GPUs; on CPU only ddp (gloo) runs",
            key="distributed.strategy",
            hint="set distributed.strategy: ddp or auto",
        )
    if plan.world_size != plan.num_nodes * plan.gpus_per_node:
        raise ValueError(
            f"inconsistent plan: world_size {plan.world_size} != {plan.num_nodes} nodes x {plan.gpus_per_node}"
        )


def _env(plan: Plan, preset: HardwarePreset) -> tuple[dict, dict]:
    # PET_SIGNALS_TO_HANDLE is torchrun's --signals-to-handle (read by the torchrun inside
    # `accelerate launch`): its agent forwards SIGUSR1 to the ranks instead of dying of it
    env = {"PYTHONUNBUFFERED": "1", "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}
    defaults = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(SHUTDOWN_GRACE_S)}
    if plan.device == "cpu":
        # each rank's Accelerator takes the CPU/gloo path (see LaunchSpec.argv)
        env["ACCELERATE_USE_CPU"] = "true"
    else:
        # a failed collective raises in every rank instead of hanging until the job dies
        defaults["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
        # growing segments instead of fixed blocks: measured on an H200, QLoRA reserved 132 GiB
        # for 88 GiB allocated without it (fragmentation the planner cannot see)
        defaults["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        defaults.update(preset.nccl_env)
    return env, defaults


def _summary(recipe: Recipe, plan: Plan, preset: HardwarePreset, arch: ModelArch) -> str:
    ckpt = {"fsdp": "on (FSDP)", "trainer": "on", "none": "off"}[checkpointing_owner(plan)]
    lines = [
        f"{recipe_name(recipe)}: {recipe.method.type} {recipe.adapter.type} of {arch.key} on "
        f"{preset.name} ({plan.device})",
        f"strategy {plan.strategy}, {plan.num_nodes} node(s) x {plan.gpus_per_node} = "
        f"{plan.world_size} process(es); micro-batch {plan.micro_batch_size} x accumulation "
        f"{plan.gradient_accumulation_steps}; activation checkpointing {ckpt}"
        # said only when it departs from the Trainer's default (no_sync)
        + (sync_text(plan) if plan.sync_each_batch else ""),
        f"predicted peak {plan.per_gpu_memory_gib:.1f} GiB per {'GPU' if plan.device == 'cuda' else 'process'}",
        *([f"disk: {plan.disk}"] if plan.disk else []),  # an NVMe plan's step is the swap disk's
    ]
    lines += [f"substituted: {s}" for s in plan.substitutions]
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


@dataclass
class Compiled:
    """What compile would write, before it is written (so a run can be checked against it first)."""

    spec: LaunchSpec
    resolved: Recipe  # the recipe ranks will read (recipe.resolved.yaml)
    plan: Plan
    texts: dict[str, str]  # file name in RUN_DIR -> content

    def write(self) -> LaunchSpec:
        run_dir = Path(self.spec.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        # the resolved recipe goes last: a run dir with it present is complete
        for name in sorted(self.texts, key=lambda n: n == RESOLVED_RECIPE):
            write_atomic(run_dir / name, self.texts[name], executable=name in (LAUNCH_SH, JOB_SBATCH))
        return self.spec


def compile_run(
    recipe: Recipe,
    plan: Plan,
    *,
    run_dir: str | Path,
    arch: ModelArch | None = None,
    preset: HardwarePreset | None = None,
    module: str = ENTRY_MODULE,
    main_port: int = DEFAULT_MAIN_PORT,
) -> LaunchSpec:
    """Write the run directory for `recipe` as planned and return how to launch it.

    `arch`/`preset` default to the registry's answer for the recipe's model and the plan's
    hardware. `module` is the per-rank entry point (`python -m MODULE RESOLVED_RECIPE`).
    Only the files named here are (atomically) replaced; checkpoints and adapters stay.
    """
    return prepare_run(
        recipe, plan, run_dir=run_dir, arch=arch, preset=preset, module=module, main_port=main_port
    ).write()


def prepare_run(
    recipe: Recipe,
    plan: Plan,
    *,
    run_dir: str | Path,
    arch: ModelArch | None = None,
    preset: HardwarePreset | None = None,
    module: str = ENTRY_MODULE,
    main_port: int = DEFAULT_MAIN_PORT,
) -> Compiled:
    """compile_run without writing anything: the launch spec, the resolved recipe and the file texts."""
    _check_plan(plan)
    arch, preset = _resolve_inputs(recipe, plan, arch, preset)
    run_dir = Path(run_dir).expanduser().resolve()
    resolved = resolve_recipe(recipe, plan, run_dir=run_dir, arch=arch, preset=preset)
    resolved_path = run_dir / RESOLVED_RECIPE
    env, env_defaults = _env(plan, preset)
    spec = LaunchSpec(
        run_dir=str(run_dir),
        strategy=plan.strategy,
        device=plan.device,
        num_nodes=plan.num_nodes,
        procs_per_node=plan.gpus_per_node,
        world_size=plan.world_size,
        main_port=main_port,
        module=module,
        module_args=[str(resolved_path)],
        config_file=str(run_dir / ACCELERATE_YAML),
        env=env,
        env_defaults=env_defaults,
        summary=_summary(recipe, plan, preset, arch),
    )

    texts: dict[str, str] = {}
    texts[RESOLVED_RECIPE] = (
        "# Written by `finetune compile`: the recipe with every default and planner decision\n"
        "# made concrete. The ranks read this file; rerun compile instead of editing it.\n" + dump_recipe(resolved)
    )
    texts[PLAN_JSON] = json_text(plan.to_json())
    ds_path = None
    if strategies.is_deepspeed(plan.strategy):
        ds_path = str(run_dir / DS_CONFIG)
        texts[DS_CONFIG] = json_text(ds_config(recipe, plan, arch=arch, preset=preset))
    acc = accelerate_config(recipe, plan, arch=arch, main_port=main_port, ds_config_path=ds_path)
    texts[ACCELERATE_YAML] = yaml_text(
        acc,
        header=(
            "Written by `finetune compile` for accelerate 1.15; rerun compile instead of editing.\n"
            + spec.summary
            + (
                "\nmachine_rank and main_process_ip are given per node on the command line."
                if plan.num_nodes > 1
                else ""
            )
        ),
    )
    spec.files = {name: str(run_dir / name) for name in texts}
    spec.files[LAUNCH_SH] = str(run_dir / LAUNCH_SH)
    spec.files[JOB_SBATCH] = str(run_dir / JOB_SBATCH)  # every run can go to Slurm, one node or many
    spec.files[LAUNCH_JSON] = str(run_dir / LAUNCH_JSON)
    texts[LAUNCH_SH] = render_launch_sh(spec)
    texts[JOB_SBATCH] = render_sbatch(
        spec, job_name=f"finetune-{recipe_name(recipe)}", **slurm_options(recipe, preset), python_env=sys.prefix
    )
    texts[LAUNCH_JSON] = json_text(spec.to_json())
    return Compiled(spec=spec, resolved=resolved, plan=plan, texts=texts)


def slurm_options(recipe: Recipe, preset) -> dict:
    """partition, account, time for job.sbatch: the recipe's slurm section over the preset's."""
    r = recipe.slurm
    return {
        "partition": r.partition or preset.slurm_partition,
        "account": r.account or preset.slurm_account,
        "time": r.time or preset.slurm_time,
    }


def default_run_dir(recipe: Recipe) -> Path:
    """output.dir, else runs/<recipe name>; relative paths start at the current directory."""
    return Path(recipe.output.dir or Path("runs") / recipe_name(recipe)).expanduser().resolve()


def compile_recipe(
    recipe: Recipe | str | Path,
    *,
    run_dir: str | Path | None = None,
    hardware: str | None = None,
    overrides: list[str] | None = None,
    module: str = ENTRY_MODULE,
    main_port: int = DEFAULT_MAIN_PORT,
) -> LaunchSpec:
    """Load (if given a path), plan and compile in one call: what `finetune compile` does.

    `hardware` overrides the recipe's preset (name or file); `run_dir` overrides output.dir.
    Raises DoesNotFitError when the planner finds nothing that fits.
    """
    return prepare_recipe(
        recipe, run_dir=run_dir, hardware=hardware, overrides=overrides, module=module, main_port=main_port
    ).write()


def prepare_recipe(
    recipe: Recipe | str | Path,
    *,
    run_dir: str | Path | None = None,
    hardware: str | None = None,
    overrides: list[str] | None = None,
    module: str = ENTRY_MODULE,
    main_port: int = DEFAULT_MAIN_PORT,
) -> Compiled:
    """compile_recipe without writing anything (see Compiled.write)."""
    from finetune.plan import lookup, plan_on
    from finetune.recipe.load import load_recipe

    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe, overrides=overrides)
    elif overrides:
        raise ValueError("overrides apply when loading; pass a path, or apply them first")
    arch, preset, source = lookup(recipe, hardware=hardware)  # once: `auto` runs nvidia-smi
    the_plan = plan_on(recipe, arch=arch, preset=preset, source=source)
    return prepare_run(
        recipe,
        the_plan,
        run_dir=run_dir or default_run_dir(recipe),
        arch=arch,
        preset=preset,
        module=module,
        main_port=main_port,
    )

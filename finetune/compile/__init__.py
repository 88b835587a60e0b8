"""The launch compiler: a validated Recipe and its Plan become a run directory.

    compile_run(recipe, plan, *, run_dir, arch=None, preset=None, module="finetune.train",
                main_port=29500) -> LaunchSpec

writes recipe.resolved.yaml, plan.json, accelerate.yaml, ds_config.json (ZeRO-3 variants),
launch.sh, job.sbatch (multi-node) and launch.json.

    compile_recipe(recipe_or_path, *, run_dir=None, hardware=None, overrides=None) -> LaunchSpec

loads, plans and compiles in one call (`finetune compile`). Pure Python: no torch/accelerate import.
"""

from finetune.compile.compiler import ENTRY_MODULE, compile_recipe, compile_run, default_run_dir
from finetune.compile.spec import DEFAULT_MAIN_PORT, LaunchSpec

__all__ = ["compile_run", "compile_recipe", "default_run_dir", "LaunchSpec", "ENTRY_MODULE", "DEFAULT_MAIN_PORT"]

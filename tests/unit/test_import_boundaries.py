"""The launching process never imports the training stack, nor the ranks' code.

Load, plan, compile, the data and checkpoint checks, and everything else that runs before launch
(the CLI, the API, the pre-launch checks, the launcher) import no torch, transformers, trl, peft,
accelerate, deepspeed or bitsandbytes, and nothing from finetune/train/ (which serves the rank
processes only), at import time or on the way to a launch: they run in a fresh interpreter here, module
by module and then command by command, and the first step that pulls one in is named.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "trl", "peft", "accelerate", "deepspeed", "bitsandbytes")
# every module of these is imported (packages with all their submodules)
TORCH_FREE = (
    "finetune",
    "finetune.errors",
    "finetune.strategies",
    "finetune.rundir",
    "finetune.recipe",
    "finetune.registry",
    "finetune.plan",
    "finetune.compile",
    "finetune.data",
    "finetune.checkpoints",
    "finetune.cli",
    "finetune.api",
    "finetune.guard",
    "finetune.prelaunch",
    "finetune.launch",
)

PROBE = """
import importlib, json, pkgutil, sys
# the training stack, or finetune.train (the ranks' code)
heavy = lambda: sorted(m for m in sys.modules if m in HEAVY or m == "finetune.train" or m.startswith("finetune.train."))
steps = []
for name in TORCH_FREE:
    module = importlib.import_module(name)
    subs = [] if name == "finetune" or not hasattr(module, "__path__") else [
        info.name for info in pkgutil.walk_packages(module.__path__, name + ".")]
    steps += [("import " + name, name)] + [("import " + sub, sub) for sub in subs]
found = None
for what, name in steps:
    importlib.import_module(name)
    if heavy():
        found = [what, heavy()]
        break
from finetune.cli import main
commands = [
    ["validate", "recipes/quickstart.yaml"],
    ["plan", "recipes/llama405b-qlora.yaml", "--hardware", "server-8xh100", "--json"],
    ["compile", "recipes/llama70b-lora.yaml", "--hardware", "server-8xh100", "-o", TMP + "/compiled"],
    ["run", "recipes/quickstart.yaml", "--dry-run", "-o", TMP + "/dry-run"],
]
codes = []
for argv in commands:
    if found:
        break
    codes.append(main(argv))
    if heavy():
        found = ["finetune " + " ".join(argv), heavy()]
print(json.dumps({"found": found, "codes": codes, "imported": len(steps)}), file=sys.stderr)
"""


def test_the_launching_process_imports_no_training_stack(tmp_path):
    code = f"HEAVY = {HEAVY!r}\nTORCH_FREE = {TORCH_FREE!r}\nTMP = {str(tmp_path)!r}\n{PROBE}"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    assert report["found"] is None, f"{report['found'][0]} imported {report['found'][1]}"
    assert report["codes"] == [0, 0, 0, 0], proc.stdout[-3000:]
    assert report["imported"] > 40  # the walk found the packages' modules
    assert (tmp_path / "dry-run" / "recipe.resolved.yaml").is_file()


def test_importing_a_module_keeps_the_api_functions():
    # a submodule named like an API function (finetune.plan, finetune.compile) would replace the function
    # as an attribute of the package when it is first imported
    code = (
        "import importlib, pkgutil, finetune\n"
        "api = {name: getattr(finetune, name) for name in finetune.__all__ if callable(getattr(finetune, name))}\n"
        "for info in pkgutil.iter_modules(finetune.__path__):\n"
        "    importlib.import_module('finetune.' + info.name)\n"
        "print(sorted(name for name, value in api.items() if getattr(finetune, name) is not value))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"

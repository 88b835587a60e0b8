"""How long `finetune plan` takes, the imports included, for every shipped recipe (CPU, no GPU needed).

Each recipe is planned in a fresh Python process (`finetune plan RECIPE --hardware PRESET --json`, through
finetune.cli.main), so the figure is what a user waits for. The claim it checks (docs/architecture.md): a 405B plan
takes well under a second. The unit tests check what makes it so (no torch or transformers import on the way:
tests/unit/test_import_boundaries.py, tests/unit/test_cli.py), not the time, which depends on the machine.

    python scripts/bench_plan.py [--hardware server-8xh100] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = (
    "import sys, time, json\n"
    "t = time.perf_counter()\n"
    "from finetune.cli import main\n"
    "rc = main(['plan', sys.argv[1], '--hardware', sys.argv[2], '--json'])\n"
    "print(json.dumps({'rc': rc, 'elapsed_s': time.perf_counter() - t}), file=sys.stderr)\n"
)


def time_plan(recipe: Path, hardware: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CODE, str(recipe), hardware], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in proc.stderr.splitlines() if line.startswith("{")]
    if not lines:
        return {"rc": proc.returncode, "elapsed_s": None, "error": proc.stderr[-500:]}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hardware", default="server-8xh100")
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per recipe; the median is shown")
    args = parser.parse_args()
    print(f"{'recipe':28} {'median s':>9} {'max s':>7}  rc")
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        runs = [time_plan(recipe, args.hardware) for _ in range(args.repeat)]
        times = [r["elapsed_s"] for r in runs if r.get("elapsed_s") is not None]
        rcs = sorted({r["rc"] for r in runs})
        median = f"{statistics.median(times):9.3f}" if times else f"{'-':>9}"
        worst = f"{max(times):7.3f}" if times else f"{'-':>7}"
        print(f"{recipe.name:28} {median} {worst}  {rcs}")


if __name__ == "__main__":
    main()

"""Keep each shipped recipe's "# Plan (...)" header line equal to what the planner says now.

python scripts/recipe_headers.py          # rewrite the lines
python scripts/recipe_headers.py --check  # exit 1 if any is stale (tests/unit/recipe/test_recipe_headers.py)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from finetune.api import make_plan  # noqa: E402
from finetune.plan.render import checkpointing_text  # noqa: E402

LINE = re.compile(r"^# Plan \(finetune plan (?P<recipe>\S+) --hardware (?P<hw>\S+)\): .*$", re.M)


def describe(recipe_path: str, hardware: str) -> str:
    _, plan = make_plan(ROOT / recipe_path, hardware=hardware)
    if not plan.fits:
        return "does not fit; see `finetune plan` for what would"
    ckpt = checkpointing_text(plan)
    return (
        f"{plan.strategy}, {plan.per_gpu_memory_gib:.1f} GiB per GPU, micro-batch {plan.micro_batch_size}"
        f" x {plan.gradient_accumulation_steps} accumulation, checkpointing {ckpt}, "
        f"~{plan.tokens_per_second:,.0f} tokens/s"
    )


def main() -> int:
    check = "--check" in sys.argv
    stale = []
    for path in sorted((ROOT / "recipes").rglob("*.yaml")):
        text = path.read_text()
        match = LINE.search(text)
        if not match:
            continue
        fresh = (
            f"# Plan (finetune plan {match['recipe']} --hardware {match['hw']}): "
            f"{describe(match['recipe'], match['hw'])}"
        )
        if fresh != match.group(0):
            stale.append(path.name)
            if not check:
                path.write_text(text.replace(match.group(0), fresh))
    if stale:
        print(("stale: " if check else "updated: ") + ", ".join(stale))
    return 1 if (check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Each shipped recipe states its plan in a header comment; the comment must not rot."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_recipe_plan_headers_match_the_planner():
    proc = subprocess.run([sys.executable, "scripts/recipe_headers.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{proc.stdout}{proc.stderr}\nrun: python scripts/recipe_headers.py"

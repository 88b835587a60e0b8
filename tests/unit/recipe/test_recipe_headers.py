"""Each shipped recipe states its plan in a header comment; the comment must not rot."""

import subprocess
import sys

from tests.helpers.paths import ROOT


def test_recipe_plan_headers_match_the_planner():
    proc = subprocess.run(
        [sys.executable, "scripts/recipe_headers.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{proc.stdout}{proc.stderr}\nrun: python scripts/recipe_headers.py"


def test_readme_and_docs_point_at_nothing_outside_the_repository():
    # a user's clone has no /work/... or ../shared: the design lives in docs/architecture.md
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    offending = [p.name for p in texts if "/work/" in p.read_text() or "../shared" in p.read_text()]
    assert offending == []
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()

"""`finetune convert` of a peer config from tests/data/convert, through the CLI's own entry point."""

from __future__ import annotations

from pathlib import Path

from finetune.cli import main
from tests.helpers.paths import TEST_DATA

CONFIGS = TEST_DATA / "convert"


def convert_config(tmp_path: Path, name: str, source: str, *extra: str) -> tuple[int, Path]:
    """(exit code, the recipe written) for tests/data/convert/NAME converted --from SOURCE into tmp_path/recipes."""
    out = tmp_path / "recipes" / "converted.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    rc = main(["convert", str(CONFIGS / name), "--from", source, "-o", str(out), *extra])
    return rc, out

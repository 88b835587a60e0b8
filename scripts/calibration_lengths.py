"""Record the data's lengths on calibration rows measured before `finetune run` measured them.

A row of tests/data/gpu_calibration.json that came from scripts/gpu_validate.py's matrix trained on
`write_data(seed=0)` with the run's sequence length, example count and `long_examples` (deterministic),
tokenized by the random models' tokenizer (data/tiny-llama's files, copied by make_random_model.py).
This rebuilds that data and measures it exactly as `finetune run` now does (finetune.data.lengths): the
packed examples' token-weighted length of an SFT row (`example_tokens`) and the sequences' mean and longest
of a DPO row, or of a packed SFT row whose examples (`long_examples`) fill a row each (`sequence_tokens`),
written into the row as properties of the input data (no measured value changes). Rows whose resolved recipe
already carries them, or that neither pack nor pair, are left alone.

    python scripts/calibration_lengths.py [--check]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_validate import load_matrix, write_data  # noqa: E402

from finetune.data.lengths import LengthSample, measure_example_tokens, measure_sequence_tokens  # noqa: E402
from finetune.data.sources import load_source  # noqa: E402
from finetune.recipe import load_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "tests" / "data" / "gpu_calibration.json"
MATRIX = ROOT / "scripts" / "calibration_matrix.yaml"
# the matrix runs' raw files
QUEUE_SOURCES = {"validation-2026-11-26-h100x4-queue.json", "validation-2026-11-26-h100x4-queue2.json"}
# scripts/gpu_shipped.py's runs of the shipped recipes: write_data's SFT rows at the recipe's max_length (4,000 of
# them, the generator of today since 2026-11-26 01:51), packed; rows kept before `resolved` existed
SHIPPED_SOURCES = {"validation-2026-11-26-h100x4-70b.json"}
# matrix runs that trained on write_data's preference pairs as it writes them now (the rejected answer shorter
# than the chosen one; earlier pairs were of equal length)
PAIR_SOURCES = {
    "validation-2026-11-26-h200x4-queue3.json",
    "validation-2026-11-27-h200x2.json",
    "validation-2026-11-27-h100x2-dpo-pairs.json",
    "validation-2026-11-27-h200x4-eighth.json",
    "validation-2026-11-27-h200x2-dpo-profiled.json",
    "validation-2026-11-27-h200x2-dpo-deferred.json",
}


def _recipe_and_records(row: dict, entry: dict, work: Path, *, preference: bool):
    """The row's resolved recipe on the rebuilt data and the local tokenizer, and the data's records."""
    raw = copy.deepcopy(row.get("resolved") or _legacy_data_recipe(row))
    data = work / f"{row['name']}.jsonl"
    write_data(
        data,
        fmt="preference" if preference else "messages",
        seq=raw["data"]["max_length"],
        n=entry.get("examples", 4000),
        long_examples=entry.get("long_examples", False),
    )
    raw["model"].update(name=str(ROOT / "data" / "tiny-llama"), arch=None)
    raw["data"]["sources"][0]["path"] = str(data)
    recipe = load_recipe(raw, allow_resolved=True)
    return recipe, load_source(recipe.data.sources[0], base_dir=work).records


def _legacy_data_recipe(row: dict) -> dict:
    """The data section a row without `resolved` trained with (packed SFT rows at its seq_len), in a recipe."""
    return {
        "model": {"name": "tiny-llama"},
        "data": {"sources": [{"path": "train.jsonl"}], "max_length": row["seq_len"], "packing": True},
    }


def example_tokens(row: dict, entry: dict, work: Path) -> float | None:
    recipe, records = _recipe_and_records(row, entry, work, preference=False)
    return measure_example_tokens(recipe, records)


def sequence_tokens(row: dict, entry: dict, work: Path, *, preference: bool = True) -> dict | None:
    recipe, records = _recipe_and_records(row, entry, work, preference=preference)
    sample = LengthSample()
    sample.add(records)
    return measure_sequence_tokens(recipe, sample)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only print what would change")
    args = parser.parse_args()
    rows, matrix = json.loads(ROWS.read_text()), load_matrix(MATRIX)
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            if row.get("source") in SHIPPED_SOURCES and row["method"] == "sft" and row.get("example_tokens") is None:
                measured = example_tokens(row, {}, Path(tmp))
                if measured is not None:
                    print(f"{row['name']}: example_tokens {round(measured, 1)} (max_length {row['seq_len']}, shipped)")
                    row["example_tokens"] = round(measured, 1)
                continue
            entry = matrix.get(row["name"])
            resolved = row.get("resolved")
            if entry is None or not resolved or "excluded" in row:
                continue
            if resolved["method"]["type"] == "dpo":
                if row.get("source") not in PAIR_SOURCES or resolved["data"].get("sequence_tokens") is not None:
                    continue
                sequences = sequence_tokens(row, entry, Path(tmp))
                if sequences is not None and row.get("sequence_tokens") != sequences:
                    print(f"{row['name']}: sequence_tokens {sequences} (max_length {resolved['data']['max_length']})")
                    row["sequence_tokens"] = sequences
                continue
            if entry.get("long_examples") and row.get("sequence_tokens") is None:
                sequences = sequence_tokens(row, entry, Path(tmp), preference=False)
                if sequences is not None:
                    print(f"{row['name']}: sequence_tokens {sequences} (a packed row each)")
                    row["sequence_tokens"] = sequences
            if row.get("source") not in QUEUE_SOURCES:
                continue
            if not resolved["data"].get("packing") or resolved["data"].get("example_tokens") is not None:
                continue
            measured = example_tokens(row, entry, Path(tmp))
            if measured is None:
                continue
            print(f"{row['name']}: example_tokens {round(measured, 1)} (max_length {resolved['data']['max_length']})")
            row["example_tokens"] = round(measured, 1)
    if not args.check:
        ROWS.write_text(json.dumps(rows, indent=1))  # the file's own layout


if __name__ == "__main__":
    main()

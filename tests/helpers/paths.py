"""Where the repository's shipped test inputs live."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "data" / "tiny-llama"  # finetune.tiny's model, shipped
SAMPLES = ROOT / "data" / "samples"
QUICKSTART_DATA = ROOT / "data" / "quickstart"
TRAIN = QUICKSTART_DATA / "train.jsonl"
TEST_DATA = ROOT / "tests" / "data"  # inputs written for the tests
GOLDEN = ROOT / "tests" / "golden"  # compiled run files to compare against (UPDATE_GOLDEN=1 rewrites them)

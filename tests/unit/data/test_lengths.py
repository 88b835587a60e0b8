"""data.example_tokens (finetune/data/lengths.py): measured before launch as the ranks will tokenize
(the shipped tiny model's tokenizer and chat template, against transformers' own apply_chat_template),
used by the planner's packed attention, and left alone where it cannot be measured."""

from __future__ import annotations

import json

import pytest

from finetune.data.lengths import local_sample, measure_example_tokens, spread, with_example_tokens
from finetune.data.sources import load_source
from finetune.plan.workload import packed_length
from finetune.recipe import load_recipe
from tests.helpers.paths import TINY_MODEL
from tests.helpers.recipes import tiny_recipe


def _data(tmp_path, n=40):
    path = tmp_path / "train.jsonl"
    with path.open("w") as f:
        for i in range(n):
            text = " ".join(["word"] * (1 + 7 * i % 23))
            f.write(
                json.dumps({"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]})
            )
            f.write("\n")
    return path


def _recipe(tmp_path, **data):
    raw = tiny_recipe(data={"sources": [{"path": str(_data(tmp_path))}], "packing": True, "max_length": 64, **data})
    raw["data"]["eval_sources"] = []
    return load_recipe(raw)


def test_measured_as_transformers_tokenizes_the_conversations(tmp_path):
    from transformers import AutoTokenizer

    recipe = _recipe(tmp_path)
    records = load_source(recipe.data.sources[0], base_dir=tmp_path).records
    tokenizer = AutoTokenizer.from_pretrained(str(TINY_MODEL))
    lengths = [
        len(tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"]) for r in records
    ]
    assert max(lengths) > 64  # some are cut at max_length
    assert measure_example_tokens(recipe, records) == pytest.approx(packed_length(lengths, max_length=64))


def test_packed_length_by_hand():
    assert packed_length([100, 300], max_length=1000) == pytest.approx((100**2 + 300**2) / 400)
    assert packed_length([100, 3000], max_length=1000) == pytest.approx((100**2 + 1000**2) / 1100)
    assert packed_length([], max_length=10) is None


def test_recipe_gets_it_where_measurable_and_keeps_a_set_value(tmp_path):
    recipe = _recipe(tmp_path)
    sample = local_sample(recipe)
    assert len(sample) == 40
    measured = with_example_tokens(recipe, sample)
    assert 0 < measured.data.example_tokens <= 64
    assert with_example_tokens(_recipe(tmp_path, example_tokens=12.5), sample).data.example_tokens == 12.5
    unpacked = _recipe(tmp_path, packing=False)
    assert local_sample(unpacked) == [] and with_example_tokens(unpacked, sample).data.example_tokens is None
    hub = load_recipe(tiny_recipe(data={"sources": [{"path": "org/some-dataset"}], "packing": True}))
    assert local_sample(hub) == []
    assert spread(list(range(10)), 4) == [0, 2, 5, 7]


def test_plan_uses_the_measured_lengths(tmp_path):
    from finetune.api import make_plan

    # on NVIDIA GPUs packed rows run finetune's varlen kernel, one causal triangle per example
    recipe, plan = make_plan(_recipe(tmp_path), hardware="server-8xh100")
    assert recipe.data.example_tokens is not None
    _, long_examples = make_plan(_recipe(tmp_path, example_tokens=64), hardware="server-8xh100")
    assert "varlen" in plan.kernels and f"~{recipe.data.example_tokens:,.0f} tokens" in plan.kernels
    # the GPU's compute: the tiny model's step itself is the host's time to launch it (plan/host_time.py)
    chosen = next(c for c in plan.candidates if c.strategy == plan.strategy)
    longer = next(c for c in long_examples.candidates if c.strategy == long_examples.strategy)
    assert chosen.compute_time_s < longer.compute_time_s


def test_plan_reads_no_large_data(tmp_path):
    recipe = _recipe(tmp_path)
    assert local_sample(recipe, max_bytes=100) == []
    assert len(local_sample(recipe)) == 40

"""data.example_tokens and data.sequence_tokens (finetune/data/lengths.py): measured before launch as the
ranks will tokenize (the shipped tiny model's tokenizer and chat template, against transformers' own
apply_chat_template), used by the planner (packed attention; DPO's step time and peak memory), and left
alone where they cannot be measured."""

from __future__ import annotations

import json

import pytest

from finetune.data.lengths import (
    LengthSample,
    local_sample,
    longest_records,
    measure_example_tokens,
    measure_sequence_tokens,
    spread,
    with_measured_lengths,
)
from finetune.data.sources import load_source
from finetune.plan.workload import packed_length
from finetune.recipe import load_recipe
from tests.helpers.paths import TINY_MODEL
from tests.helpers.recipes import tiny_recipe


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _data(tmp_path, n=40):
    texts = (" ".join(["word"] * (1 + 7 * i % 23)) for i in range(n))
    rows = ({"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": "ok"}]} for t in texts)
    return _jsonl(tmp_path / "train.jsonl", rows)


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
    assert len(sample.spread) == 40
    measured = with_measured_lengths(recipe, sample)
    assert 0 < measured.data.example_tokens <= 64 and measured.data.sequence_tokens is None
    assert with_measured_lengths(_recipe(tmp_path, example_tokens=12.5), sample).data.example_tokens == 12.5
    # unpacked SFT rows are padded sequences: measured as such (data.sequence_tokens), not as packed examples
    unpacked = _recipe(tmp_path, packing=False)
    assert len(local_sample(unpacked).spread) == 40
    padded = with_measured_lengths(unpacked, sample)
    assert padded.data.example_tokens is None
    assert padded.data.sequence_tokens.longest == 64 and 0 < padded.data.sequence_tokens.mean < 64
    assert measured.data.sequence_tokens is None  # packed rows are full
    hub = load_recipe(tiny_recipe(data={"sources": [{"path": "org/some-dataset"}], "packing": True}))
    assert local_sample(hub).spread == []
    assert spread(list(range(10)), 4) == [0, 2, 5, 7]


def _pairs(tmp_path, n=60, long_every=0):
    words = (2 + 5 * i % 17 + (60 if long_every and i % long_every == long_every - 1 else 0) for i in range(n))
    texts = (" ".join(["word"] * w) for w in words)
    rows = (
        {
            "prompt": [{"role": "user", "content": t}],
            "chosen": [{"role": "assistant", "content": t.upper()}],
            "rejected": [{"role": "assistant", "content": "no"}],
        }
        for t in texts
    )
    return _jsonl(tmp_path / "pairs.jsonl", rows)


def _dpo(tmp_path, *, long_every=0, **data):
    source = {"path": str(_pairs(tmp_path, long_every=long_every)), "format": "preference"}
    raw = tiny_recipe(method={"type": "dpo"}, data={"sources": [source], "max_length": 96, **data})
    raw["data"]["eval_sources"] = []
    # 16-bit, as a GPU recipe would train: padding-free pairs then run the varlen kernel (the tiny model's fp32
    # would send them to sdpa's masked kernel, whose rows the planner pads: plan.row_multiple)
    raw["train"]["precision"] = "bf16"
    return load_recipe(raw)


def test_pairs_measured_as_transformers_renders_prompt_and_answer(tmp_path):
    from transformers import AutoTokenizer

    recipe = _dpo(tmp_path)
    records = load_source(recipe.data.sources[0], base_dir=tmp_path).records
    tokenizer = AutoTokenizer.from_pretrained(str(TINY_MODEL))
    lengths = [
        min(96, len(tokenizer.apply_chat_template(r["prompt"] + r[k], tokenize=True, return_dict=True)["input_ids"]))
        for r in records
        for k in ("chosen", "rejected")
    ]
    sample = LengthSample()
    sample.add(records)
    measured = measure_sequence_tokens(recipe, sample)
    mean = sum(lengths) / len(lengths)
    assert measured["mean"] == pytest.approx(mean, abs=0.1)
    assert measured["longest"] == max(lengths)
    assert measured["std"] == pytest.approx((sum((n - mean) ** 2 for n in lengths) / len(lengths)) ** 0.5, abs=0.1)
    assert measured["count"] == len(records)  # the pairs a pass over the data trains
    assert measure_sequence_tokens(_recipe(tmp_path), sample) is None  # packed SFT measures examples


def test_the_longest_is_found_outside_the_spread_sample(tmp_path):
    # one record in 25 is far longer; a spread sample of 2 misses all of them, the longest records do not
    recipe = _dpo(tmp_path, long_every=25)
    records = load_source(recipe.data.sources[0], base_dir=tmp_path).records
    sample = LengthSample(spread=spread(records, 2), longest=longest_records(records, 4))
    assert not any(r in sample.spread for r in sample.longest[:2])
    measured = measure_sequence_tokens(recipe, sample)
    assert measured["longest"] == 96 > measured["mean"]  # cut at max_length, as training cuts them
    assert with_measured_lengths(recipe, sample).data.sequence_tokens.longest == 96


def test_dpo_plan_reads_the_measured_sequences(tmp_path):
    from finetune.api import make_plan
    from finetune.plan.memory import tokens_per_micro_batch
    from finetune.plan.workload import computed_tokens_per_micro_batch, peak_sigmas

    recipe, plan = make_plan(_dpo(tmp_path, packing=True), hardware="server-8xh100")
    sequences = recipe.data.sequence_tokens
    assert sequences is not None and sequences.mean < sequences.longest <= 96
    # a run counts real tokens: the plan's tokens a step are the sequences' mean, not max_length
    rows = plan.global_batch_size * 2
    assert plan.tokens_per_step == round(rows * sequences.mean)
    _, unknown = make_plan(
        _dpo(tmp_path, packing=True, sequence_tokens={"mean": 96, "longest": 96}), hardware="server-8xh100"
    )
    assert unknown.tokens_per_step == rows * 96

    from finetune.plan import job_from_recipe, lookup

    arch, preset, _ = lookup(recipe, hardware="server-8xh100")
    pairs = job_from_recipe(recipe, arch=arch, preset=preset)
    n = 4 * 2
    # padding-free pairs: real tokens for the time, the run's largest micro-batch (at most n x longest) for the peak
    assert computed_tokens_per_micro_batch(pairs, 4) == pytest.approx(n * sequences.mean)
    bound = n * sequences.mean + peak_sigmas(pairs, 4) * sequences.std * n**0.5
    assert tokens_per_micro_batch(pairs, 4) == pytest.approx(min(bound, n * sequences.longest))
    # padded pairs: every sequence padded to the micro-batch's longest, the data's longest at worst, rounded up to
    # the multiple sdpa's padding mask gets on an NVIDIA GPU (plan.row_multiple)
    padded = job_from_recipe(_dpo(tmp_path, sequence_tokens=sequences.model_dump()), arch=arch, preset=preset)
    longest = -(-sequences.longest // padded.row_multiple) * padded.row_multiple
    assert computed_tokens_per_micro_batch(padded, 4) == tokens_per_micro_batch(padded, 4) == n * longest


def test_plan_uses_the_measured_lengths(tmp_path):
    from finetune.api import make_plan

    # on NVIDIA GPUs packed rows run finetune's varlen kernel, one causal triangle per example (a 16-bit kernel:
    # the tiny model's float32 weights train under bf16 autocast here, as a GPU recipe would)
    def gpu_recipe(**data):
        recipe = _recipe(tmp_path, **data)
        return recipe.model_copy(update={"train": recipe.train.model_copy(update={"precision": "bf16"})})

    recipe, plan = make_plan(gpu_recipe(), hardware="server-8xh100")
    assert recipe.data.example_tokens is not None
    _, long_examples = make_plan(gpu_recipe(example_tokens=64), hardware="server-8xh100")
    assert "varlen" in plan.kernels and f"~{recipe.data.example_tokens:,.0f} tokens" in plan.kernels
    # the GPU's compute: the tiny model's step itself is the host's time to launch it (plan/host_time.py)
    chosen = plan.chosen
    longer = long_examples.chosen
    assert chosen.compute_time_s < longer.compute_time_s


def test_plan_reads_no_large_data(tmp_path):
    recipe = _recipe(tmp_path)
    assert local_sample(recipe, max_bytes=100).spread == []
    assert len(local_sample(recipe).spread) == 40


def test_unpacked_sft_plans_its_padded_rows_at_the_data_longest(tmp_path):
    from finetune.api import make_plan
    from finetune.plan import job_from_recipe, lookup
    from finetune.plan.memory import tokens_per_micro_batch
    from finetune.plan.workload import computed_tokens_per_micro_batch, expected_largest_of

    short = _recipe(tmp_path, packing=False, max_length=256)
    recipe, plan = make_plan(short, hardware="server-8xh100")
    sequences = recipe.data.sequence_tokens
    assert sequences.longest <= 128 < 256  # the examples are far shorter than max_length
    assert plan.tokens_per_step == round(plan.global_batch_size * sequences.mean)  # the real tokens
    arch, preset, _ = lookup(recipe, hardware="server-8xh100")
    job = job_from_recipe(recipe, arch=arch, preset=preset)
    # rows padded to a micro-batch's longest: the peak at the data's longest (rounded up to plan.row_multiple on
    # an NVIDIA GPU), the work at the expected longest of the micro-batch's four (half a multiple of padding more),
    # never past the data's longest rounded up
    longest = -(-sequences.longest // job.row_multiple) * job.row_multiple
    assert tokens_per_micro_batch(job, 4) == 4 * longest
    expected = min(sequences.longest, sequences.mean + sequences.std * expected_largest_of(4)) + job.row_multiple / 2
    assert computed_tokens_per_micro_batch(job, 4) == pytest.approx(4 * min(expected, longest))
    _, at_max_length = make_plan(
        _recipe(tmp_path, packing=False, max_length=256, sequence_tokens={"mean": 256, "longest": 256}),
        hardware="server-8xh100",
    )
    # the GPU's compute (the tiny model's step itself is the host's time to launch it)
    chosen = plan.chosen
    longer = at_max_length.chosen
    assert chosen.compute_time_s < longer.compute_time_s


def test_the_pairs_peak_is_the_largest_micro_batch_of_the_run(tmp_path):
    """A run's peak is its largest padding-free micro-batch: the longer the run, the further above the mean it is
    planned; an unknown length plans a long run's."""
    from statistics import NormalDist

    from finetune.plan import job_from_recipe, lookup, run_sequences
    from finetune.plan.memory import tokens_per_micro_batch
    from finetune.plan.workload import PEAK_EXCEEDED, PEAK_SIGMAS, peak_sigmas

    measured = {"mean": 60.0, "longest": 96, "std": 10.0, "count": 1000}
    recipe = _dpo(tmp_path, packing=True, sequence_tokens=measured)
    arch, preset, _ = lookup(recipe, hardware="server-8xh100")

    def variant(count=1000, **train):
        sequences = recipe.data.sequence_tokens.model_copy(update={"count": count})
        return recipe.model_copy(
            update={
                "train": recipe.train.model_copy(update=train),
                "data": recipe.data.model_copy(update={"sequence_tokens": sequences}),
            }
        )

    short_run = variant(max_steps=12, global_batch_size=8)
    three_epochs = variant(max_steps=None, epochs=3)
    unknown_length = variant(count=None, max_steps=None)
    assert run_sequences(short_run) == 96 and run_sequences(three_epochs) == 3000
    assert run_sequences(unknown_length) is None
    short, long, unknown = (
        job_from_recipe(r, arch=arch, preset=preset) for r in (short_run, three_epochs, unknown_length)
    )
    # 12 steps of 8 pairs at micro-batch 4: 24 micro-batches, each past the plan with 1/24 of PEAK_EXCEEDED
    assert peak_sigmas(short, 4) == pytest.approx(NormalDist().inv_cdf(1 - PEAK_EXCEEDED / 24))
    assert 3.3 < peak_sigmas(short, 4) < peak_sigmas(long, 4) < peak_sigmas(long, 1)
    assert peak_sigmas(unknown, 4) == PEAK_SIGMAS
    assert tokens_per_micro_batch(short, 4) < tokens_per_micro_batch(long, 4) <= 4 * 2 * 96


def _long_examples(tmp_path, words, name="long.jsonl"):
    rows = (
        {"messages": [{"role": "user", "content": "word " * w}, {"role": "assistant", "content": "ok"}]} for w in words
    )
    return _jsonl(tmp_path / name, rows)


def test_packed_examples_no_two_of_which_fit_a_row_are_planned_a_row_each(tmp_path):
    from finetune.api import make_plan
    from finetune.plan import job_from_recipe, lookup
    from finetune.plan.memory import tokens_per_micro_batch

    def packed(words, name):
        raw = tiny_recipe(data={"sources": [{"path": str(_long_examples(tmp_path, words, name))}], "packing": True})
        raw["data"].update(eval_sources=[], max_length=256)
        raw["train"].update(precision="bf16", micro_batch_size=2)
        return load_recipe(raw)

    # every example longer than half a row (the tiny tokenizer: a token a character; "word " is 5): best-fit
    # packing gives each its own row, as long as the example
    long = packed([30 + i % 12 for i in range(50)], "long.jsonl")
    long = with_measured_lengths(long, local_sample(long))
    sequences = long.data.sequence_tokens
    assert sequences is not None and 150 < sequences.mean < sequences.longest < 256 and sequences.count == 50
    # one short example among them fills the long ones' rows: rows are full, as planned without lengths
    mixed = packed([30 + i % 12 for i in range(50)] + [2], "mixed.jsonl")
    assert with_measured_lengths(mixed, local_sample(mixed)).data.sequence_tokens is None

    arch, preset, _ = lookup(long, hardware="server-8xh100")
    rows = job_from_recipe(long, arch=arch, preset=preset)
    full = job_from_recipe(mixed, arch=arch, preset=preset)
    assert tokens_per_micro_batch(rows, 2) <= 2 * sequences.longest < tokens_per_micro_batch(full, 2) == 2 * 256
    _, plan = make_plan(long, hardware="server-8xh100")
    assert "a packed row each" in plan.kernels and plan.tokens_per_step == round(
        plan.global_batch_size * sequences.mean
    )


def test_row_pieces_and_rows_of_one():
    from finetune.data.lengths import row_pieces, rows_of_one

    assert row_pieces([300, 90, 0], max_length=100, split=False) == [100, 90]  # SFT truncates
    assert row_pieces([250, 90], max_length=100, split=True) == [100, 100, 50, 90]  # pretrain splits (bfd_split)
    assert rows_of_one([60, 70, 90], max_length=100)
    assert not rows_of_one([60, 40, 90], max_length=100)  # 60 + 40 share a row
    assert not rows_of_one([100, 100, 50, 30], max_length=100) and rows_of_one([80], max_length=100)

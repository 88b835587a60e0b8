"""The data's lengths in the model's tokens, measured before launch for the planner.

- data.example_tokens (SFT/pretrain with packing): the planner's attention cost for packed rows depends on
  the examples' lengths, not the row's: a causal kernel that runs each packed example on its own computes
  l^2/2 scores for an example of l tokens (finetune.plan.workload.packed_length).
- data.sequence_tokens (every run that does not pack: DPO, ORPO, SimPO, KTO and reward models, whose sequences
  are a prompt + one completion, and SFT/pretrain without packing, an example each): the real tokens a run
  counts, padded rows' work and peak (the longest), padding-free pairs' work and peak (mean and spread).
  Packed examples too when no two of them fit in one row (`rows_of_one`): best-fit packing then makes each
  example a row of its own, as long as the example, not max_length.

Torch-free: the local training records (as finetune.data reads them), each rendered with the chat template
the ranks will use (finetune.prelaunch.chat_renderer, as transformers renders it) and counted with the local
model's tokenizer.json through the `tokenizers` library. An evenly spread sample of SAMPLE records is enough
for a mean (a few %); a longest needs the data's tail, so the LONGEST records with the most characters are
measured beside it. None when the data or the tokenizer is not local, or a record has a layout this does not
render (then the planner keeps its assumption: max_length).
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass, field
from pathlib import Path

from finetune.recipe.schema import packs_examples

SAMPLE = 1000  # records measured per run, evenly spread over the training data
LONGEST = 32  # records with the most characters, measured for the longest sequence
SHORTEST = 32  # records with the fewest characters, measured for whether two examples fit in a packed row
PLAN_READ_BYTES = 256 * 2**20  # `finetune plan` reads local data up to this size to measure it


def spread(records: list[dict], n: int = SAMPLE) -> list[dict]:
    """At most `n` records evenly spread over `records`."""
    if len(records) <= n:
        return list(records)
    step = len(records) / n
    return [records[int(i * step)] for i in range(n)]


def longest_records(records: list[dict], n: int = LONGEST) -> list[dict]:
    """The `n` records with the most characters: the longest in tokens is among them (a tokenizer's tokens
    per character vary far less than the records' lengths)."""
    return heapq.nlargest(n, records, key=_characters)


def shortest_records(records: list[dict], n: int = SHORTEST) -> list[dict]:
    """The `n` records with the fewest characters: the shortest in tokens is among them."""
    return heapq.nsmallest(n, records, key=_characters)


def _characters(value) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_characters(v) for v in value.values())
    if isinstance(value, list):
        return sum(_characters(v) for v in value)
    return 0


@dataclass
class LengthSample:
    """Training records to measure: spread evenly over the data (the means), the longest (the peak) and the
    shortest (whether packed examples share rows)."""

    spread: list[dict] = field(default_factory=list)
    longest: list[dict] = field(default_factory=list)
    shortest: list[dict] = field(default_factory=list)
    records: int = 0  # every record added, measured or not

    def add(self, records: list[dict]) -> None:
        """One source's records."""
        self.records += len(records)
        self.spread += spread(records)
        self.longest = longest_records(self.longest + longest_records(records))
        self.shortest = shortest_records(self.shortest + shortest_records(records))


def row_pieces(lengths: list[int], *, max_length: int, split: bool) -> list[int]:
    """What packing places of examples of `lengths` tokens: each cut at max_length (SFT's truncation), or split
    into rows of max_length and the rest (`split`: pretrain's bfd_split)."""
    if not split:
        return [min(n, max_length) for n in lengths if n > 0]
    pieces = []
    for n in lengths:
        pieces += [max_length] * (n // max_length) + ([n % max_length] if n % max_length else [])
    return pieces


def rows_of_one(pieces: list[int], *, max_length: int) -> bool:
    """No two of these examples fit in one packed row (the two shortest exceed max_length together): best-fit
    packing gives each its own row, so a row holds one example's tokens, not max_length."""
    two = heapq.nsmallest(2, pieces)
    return len(two) < 2 or sum(two) > max_length


def _special_tokens(model_dir: Path) -> dict[str, str]:
    """The template's bos/eos/pad/unk strings, from tokenizer_config.json (strings or AddedToken dicts)."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    out = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(name) if isinstance(config, dict) else None
        value = value.get("content") if isinstance(value, dict) else value
        out[name] = value if isinstance(value, str) else ""
    return out


def _texts(records: list[dict], render, special: dict[str, str]) -> list[str] | None:
    texts = []
    for record in records:
        if "messages" in record and render is not None:
            texts.append(render(record["messages"], add_generation_prompt=False, **special))
        elif isinstance(record.get("text"), str):
            texts.append(record["text"])
        elif isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
            texts.append(record["prompt"] + record["completion"])
        else:
            return None  # a layout this estimate does not render: leave the planner's assumption
    return texts


def _sequence_texts(records: list[dict], render, special: dict[str, str]) -> list[str] | None:
    """Each record's trained sequences as text: prompt + chosen and prompt + rejected (preference), prompt +
    completion (unpaired, or SFT's prompt/completion), an SFT conversation or text as `_texts` renders it;
    conversations rendered whole, as the chat template renders prompt and answer."""
    texts: list[str] = []
    for record in records:
        prompt = record.get("prompt", "")
        answers = [record[k] for k in ("chosen", "rejected", "completion") if k in record]
        if not answers:
            one = _texts([record], render, special)
            if one is None:
                return None
            texts += one
            continue
        for answer in answers:
            if isinstance(prompt, str) and isinstance(answer, str):
                texts.append(prompt + answer)
            elif isinstance(prompt, list) and isinstance(answer, list) and render is not None:
                texts.append(render(prompt + answer, add_generation_prompt=False, **special))
            else:
                return None
    return texts


def _token_lengths(
    recipe, groups: list[list[dict]], texts_of, counted: dict[str, int] | None = None
) -> list[list[int] | None] | None:
    """For each group of records, the tokens of each text `texts_of(records, render, special)` gives (None for a
    group it cannot render), counted with the local tokenizer.json; None without one. `counted`: text -> tokens
    already counted, added to here (a packed run's examples and sequences are mostly the same texts)."""
    from finetune.prelaunch import chat_renderer, local_model_dir, template_text

    model_dir = local_model_dir(recipe)
    if model_dir is None or not (model_dir / "tokenizer.json").is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    template = template_text(recipe)
    render, special = chat_renderer(template) if template else None, _special_tokens(model_dir)
    rendered: list[list[str] | None] = []
    for records in groups:
        try:
            texts = texts_of(records, render, special) if records else None
        except Exception:  # a template that fails on a row is check_chat_template's to report
            texts = None
        rendered.append(texts or None)
    counted = {} if counted is None else counted
    new = [text for text in dict.fromkeys(t for texts in rendered if texts for t in texts) if text not in counted]
    if new:
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        counted.update(zip(new, (len(e.ids) for e in tokenizer.encode_batch(new, add_special_tokens=False))))
    return [[counted[text] for text in texts] if texts else None for texts in rendered]


def measure_sequence_tokens(recipe, sample: LengthSample, *, counted: dict[str, int] | None = None) -> dict | None:
    """{"mean", "longest", "std", "count"} of the trained sequences, each cut at data.max_length (longer rows are
    dropped or truncated before training; packed pretrain splits them): mean and standard deviation over the
    spread sample, the longest over it and the longest records, the count over every record. None when it
    cannot be measured here, or for packed examples that share rows (`rows_of_one`: those rows are full)."""
    measured = _token_lengths(recipe, [sample.spread, sample.longest, sample.shortest], _sequence_texts, counted)
    if measured is None or not measured[0]:
        return None
    cut, packed = recipe.data.max_length, packs_examples(recipe)
    split = packed and recipe.method.type == "pretrain"
    lengths, tail, head = (row_pieces(m or [], max_length=cut, split=split) for m in measured)
    if packed and not rows_of_one(lengths + tail + head, max_length=cut):
        return None
    mean = sum(lengths) / len(lengths)
    std = (sum((n - mean) ** 2 for n in lengths) / len(lengths)) ** 0.5
    return {
        "mean": round(mean, 1),
        "longest": max(lengths + tail),
        "std": round(std, 1),
        # sequences (rows) the records make: pretrain's split pieces are more
        "count": round(max(sample.records, len(sample.spread)) * len(lengths) / len(measured[0])),
    }


def measure_example_tokens(recipe, records: list[dict], *, counted: dict[str, int] | None = None) -> float | None:
    """The token-weighted mean length sum(l^2)/sum(l) of `records` (training records as finetune.data
    reads them, each cut at data.max_length), or None when it cannot be measured here."""
    from finetune.plan.workload import packed_length

    if not packs_examples(recipe):
        return None
    measured = _token_lengths(recipe, [records], _texts, counted)
    lengths = measured[0] if measured else None
    return packed_length(lengths, max_length=recipe.data.max_length) if lengths else None


def needs_measuring(recipe) -> bool:
    """The recipe plans from lengths it does not set: data.example_tokens (packing) or data.sequence_tokens."""
    data = recipe.data
    return (packs_examples(recipe) and data.example_tokens is None) or data.sequence_tokens is None


def with_measured_lengths(recipe, sample: LengthSample):
    """`recipe` with data.example_tokens (packed rows) or data.sequence_tokens (unpacked sequences) measured
    from `sample` where it is unset and measurable."""
    from finetune.recipe.schema import SequenceTokens

    data = recipe.data
    update: dict[str, object] = {}
    counted: dict[str, int] = {}  # each text tokenized once for both
    if data.example_tokens is None:
        example = measure_example_tokens(recipe, sample.spread, counted=counted)
        if example is not None:
            update["example_tokens"] = round(example, 1)
    if data.sequence_tokens is None:
        sequences = measure_sequence_tokens(recipe, sample, counted=counted)
        if sequences is not None:
            update["sequence_tokens"] = SequenceTokens(**sequences)
    return recipe.model_copy(update={"data": data.model_copy(update=update)}) if update else recipe


def local_sample(recipe, *, max_bytes: int = PLAN_READ_BYTES) -> LengthSample:
    """Training records of the recipe's local data for `finetune plan` and `compile`, which check no data:
    empty when nothing needs measuring, a source is on the Hub, missing, unreadable, or the files are larger
    than `max_bytes` together (planning stays fast; `finetune run` reads every row anyway and measures
    there). Empty, the plan keeps its assumption."""
    from finetune.data.sources import load_source, resolve_path
    from finetune.errors import FinetuneError
    from finetune.recipe.load import recipe_dir

    if not needs_measuring(recipe):
        return LengthSample()
    base, sample, size = recipe_dir(recipe), LengthSample(), 0
    for source in recipe.data.sources:
        try:
            path = resolve_path(source.path, base)
            if path is None or not path.is_file():
                return LengthSample()
            size += path.stat().st_size
            if size > max_bytes:
                return LengthSample()
            sample.add(load_source(source, base_dir=base).records)
        except (FinetuneError, OSError, ValueError):
            return LengthSample()
    return sample

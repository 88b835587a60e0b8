"""Preflight and tokenized datasets, before any model is loaded.

Order: read + convert every row (bad JSON, missing columns, wrong roles, empty files fail
here, naming file and row) -> chat template present where a format needs one -> tokens
(from the cache, or tokenized by the local main process only) -> length limits: more than
data.max_too_long_fraction over data.max_length is an error with the count, the rest are
dropped with a warning -> nothing left is an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from finetune.data.check import check_eval_split, eval_split
from finetune.data.sources import LoadedSource, load_source
from finetune.errors import DataError
from finetune.recipe.load import recipe_dir
from finetune.recipe.schema import Recipe, packs_examples
from finetune.train import cache
from finetune.train.tokenize import dpo_features, features_length, has_loss_tokens, sft_features_batch

log = logging.getLogger("finetune.train")

# how far the lengths the run's tokenizer makes may stray from the ones the plan used before a run says so: the
# planner's own count is a sample's (data/lengths.py: a mean within a few %)
PLANNED_LENGTH_TOLERANCE = 0.10

CHAT_FORMATS = ("messages", "alpaca", "sharegpt")


@dataclass
class PreparedData:
    train: object  # datasets.Dataset with the trainer's columns only
    eval: object | None
    cache_key: str
    cache_hit: bool
    notes: list[str] = field(default_factory=list)
    # content fingerprints of the train / eval sources, for the resume and rerun checks
    fingerprints: dict[str, list[str]] = field(default_factory=dict)


def check_chat_template(recipe: Recipe, tokenizer, sources: list[LoadedSource]) -> None:
    if tokenizer.chat_template:
        return
    fmts = [s.format for s in recipe.data.sources + recipe.data.eval_sources]
    needs = [
        (src, fmt)
        for src, fmt in zip(sources, fmts)
        if fmt in CHAT_FORMATS or (fmt in ("preference", "unpaired") and isinstance(src.records[0]["prompt"], list))
    ]
    if needs:
        src, fmt = needs[0]
        raise DataError(
            f"format {fmt!r} is rendered with a chat template, and the tokenizer of {recipe.model.name} has none",
            file=src.name,
            key="data.chat_template",
            hint="set data.chat_template (jinja text or a .jinja file), use a chat model, or use "
            "format text / prompt_completion",
        )


def _chars(value) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(v) for k, v in value.items() if not k.startswith("_"))
    if isinstance(value, list):
        return sum(_chars(v) for v in value)
    return 0


def min_tokens(record: dict, longest_token: int) -> int:
    """A lower bound of the record's token count, without tokenizing it: no token covers more characters
    than the vocabulary's longest entry (DPO counts the prompt and the longer answer, as features_length)."""
    if "chosen" in record:
        chars = _chars(record["prompt"]) + max(_chars(record["chosen"]), _chars(record["rejected"]))
    else:
        chars = _chars(record)
    return chars // max(longest_token, 1)


def _tokenize(records: list[dict], tokenizer, *, method: str, assistant_only_loss: bool, max_length: int):
    import datasets

    if method not in ("sft", "pretrain", "dpo"):  # kto, orpo, simpo, reward: finetune/train/methods.py
        from finetune.train.methods import method_rows

        return datasets.Dataset.from_list(method_rows(records, tokenizer, method=method))
    # a row far longer than max_length is dropped (or counted) without being tokenized: a 10 MB row
    # would otherwise cost gigabytes of token ids and offsets before it is dropped
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    huge = {i: n for i, r in enumerate(records) if (n := min_tokens(r, longest)) > max_length}
    keep = [r for i, r in enumerate(records) if i not in huge]
    if method == "dpo":
        feats = [dpo_features(r, tokenizer) for r in keep]
    else:
        feats = sft_features_batch(keep, tokenizer, assistant_only_loss=assistant_only_loss)
    columns = (
        list(feats[0])
        if feats
        else (["prompt_ids", "chosen_ids", "rejected_ids"] if method == "dpo" else ["input_ids", "labels"])
    )
    made = iter(feats)
    rows = []
    for i, r in enumerate(records):
        if i in huge:
            rows.append({**{c: [] for c in columns}, "_length": huge[i], "_has_loss": True})
        else:
            f = next(made)
            rows.append({**f, "_length": features_length(f), "_has_loss": has_loss_tokens(f)})
        rows[-1].update(_file=r["_file"], _row=r["_row"])
    return datasets.Dataset.from_list(rows)


def _enforce_lengths(ds, *, recipe: Recipe, split: str, notes: list[str]):
    max_len, limit = recipe.data.max_length, recipe.data.max_too_long_fraction
    total = len(ds)
    lengths, files, rows = ds["_length"], ds["_file"], ds["_row"]
    # packed continued pre-training splits long documents across rows (bfd_split): none is too long
    split_long = recipe.method.type == "pretrain" and recipe.data.packing
    too_long = [] if split_long else [i for i, n in enumerate(lengths) if n > max_len]
    if too_long and len(too_long) / total > limit:
        first = too_long[0]
        raise DataError(
            f"row {rows[first]}: {len(too_long)} of {total} {split} examples "
            f"({len(too_long) / total:.1%}) are longer than data.max_length={max_len} tokens "
            f"(this one: {lengths[first]}); the limit is data.max_too_long_fraction={limit}",
            file=files[first],
            key="data.max_length",
            hint=f"raise data.max_length (longest: {max(lengths)} tokens), or raise "
            f"data.max_too_long_fraction to drop them",
        )
    no_loss = [i for i, ok in enumerate(ds["_has_loss"]) if not ok]
    drop = set(too_long) | set(no_loss)
    if too_long:
        msg = (
            f"dropped {len(too_long)} of {total} {split} examples longer than data.max_length={max_len} "
            f"(first: {files[too_long[0]]} row {rows[too_long[0]]})"
        )
        log.warning(msg)
        notes.append(msg)
    if no_loss:
        msg = (
            f"dropped {len(no_loss)} {split} examples with no tokens to learn from "
            f"(first: {files[no_loss[0]]} row {rows[no_loss[0]]})"
        )
        log.warning(msg)
        notes.append(msg)
    if split == "train":
        kept = [n for i, n in enumerate(lengths) if i not in drop]
        if note := planned_lengths_note(recipe, kept):
            log.warning(note)
            notes.append(note)
    if drop:
        ds = ds.select([i for i in range(total) if i not in drop])
    if len(ds) == 0:
        raise DataError(
            f"no {split} examples left after filtering ({total} read, {len(drop)} dropped)",
            file=files[0],
            key="data.max_length",
            hint="raise data.max_length or fix the data",
        )
    return ds.remove_columns(["_length", "_has_loss", "_file", "_row"])


def prepare_data(recipe: Recipe, tokenizer, *, state) -> PreparedData:
    """Preflight + tokenized train/eval datasets. `state` is accelerate's PartialState."""
    d = recipe.data
    base = recipe_dir(recipe)
    train_sources = [load_source(s, base_dir=base) for s in d.sources]
    eval_sources = [load_source(s, base_dir=base) for s in d.eval_sources]
    check_chat_template(recipe, tokenizer, train_sources + eval_sources)

    def describe(srcs, cfgs):
        return [
            {
                "data": s.fingerprint,
                "format": c.format,
                "columns": c.columns,
                "max_samples": c.max_samples,
                "split": c.split,
                "weight": c.weight,
            }
            for s, c in zip(srcs, cfgs)
        ]

    parts = {
        "train": describe(train_sources, d.sources),
        "eval": describe(eval_sources, d.eval_sources),
        "eval_fraction": d.eval_fraction,
        **({"eval_rows": d.eval_rows} if d.eval_rows else {}),  # only where set: earlier cache keys stay valid
        "seed": d.seed,
        "max_length": d.max_length,
        "method": recipe.method.type,
        "packing": d.packing,
        "assistant_only_loss": d.assistant_only_loss,
    }
    if any(s.streaming for s in d.sources):  # read lazily while training; nothing to cache
        from finetune.train.streaming import streaming_train

        evals = (
            _enforce_lengths(
                _tokenize(
                    [r for s in eval_sources for r in s.records],
                    tokenizer,
                    method=recipe.method.type,
                    assistant_only_loss=d.assistant_only_loss,
                ),
                recipe=recipe,
                split="eval",
                notes=[],
            )
            if eval_sources
            else None
        )
        log.info("tokenized data: streaming the train sources (tokenized as they are read)")
        return PreparedData(
            train=streaming_train(recipe, tokenizer),
            eval=evals,
            cache_key="streaming",
            cache_hit=False,
            notes=["train sources streamed: only their first rows were checked"],
        )
    key = cache.cache_key(tokenizer_fp=cache.tokenizer_fingerprint(tokenizer), parts=parts)
    root = cache.cache_root(d.cache_dir)
    hit = True
    # Only the local main process tokenizes; the others wait, then read its entry (no races).
    with state.local_main_process_first():
        dd = cache.load_entry(root, key)
        if dd is None:
            hit = False
            dd = _build(recipe, tokenizer, train_sources, eval_sources)
            cache.save_entry(root, key, dd, {"key": key, **parts})
    log.info(f"tokenized data: {'cache hit' if hit else 'cache miss, tokenized and stored'} {key} ({root})")
    notes: list[str] = []
    train = _enforce_lengths(dd["train"], recipe=recipe, split="train", notes=notes)
    evals = _enforce_lengths(dd["eval"], recipe=recipe, split="eval", notes=notes) if "eval" in dd else None
    return PreparedData(
        train=train,
        eval=evals,
        cache_key=key,
        cache_hit=hit,
        notes=notes,
        fingerprints={"train": [s.fingerprint for s in train_sources], "eval": [s.fingerprint for s in eval_sources]},
    )


def planned_lengths_note(recipe: Recipe, lengths: list[int]) -> str:
    """What the plan assumed of the data's lengths against what the run's tokenizer made of every training row,
    or "" when they agree within PLANNED_LENGTH_TOLERANCE: the token-weighted example length of packed rows
    (data.example_tokens, the attention's cost) or the longest unpacked sequence (data.sequence_tokens, the
    memory peak). The planner counts with the model's tokenizer.json (data/lengths.py); transformers'
    AutoTokenizer can rebuild a tokenizer by its class and count otherwise."""
    from finetune.plan.workload import packed_length

    d = recipe.data
    checks = []  # (recipe key, what it is, planned, this run's)
    if packs_examples(recipe) and d.example_tokens:
        real = packed_length(lengths, max_length=d.max_length)
        checks.append(("data.example_tokens", "token-weighted example length", d.example_tokens, real))
    if d.sequence_tokens:  # unpacked sequences, or packed examples a row each
        real = max((min(n, d.max_length) for n in lengths), default=None)
        checks.append(("data.sequence_tokens.longest", "longest sequence", d.sequence_tokens.longest, real))
    for key, what, planned, real in checks:
        if not real or abs(real / planned - 1) <= PLANNED_LENGTH_TOLERANCE:
            continue
        effect = "more memory and time than planned" if real > planned else "less memory and time than planned"
        return (
            f"the tokenizer this run trains with makes a {what} of {real:,.0f} tokens where the plan used "
            f"{planned:,.0f} ({key}): {effect}. `finetune plan` counts with the model's tokenizer.json, which "
            f"transformers can rebuild by its tokenizer class; set {key}: {real:.0f} to plan with this count"
        )
    return ""


def _build(recipe: Recipe, tokenizer, train_sources, eval_sources):
    import datasets

    kw = dict(
        tokenizer=tokenizer,
        method=recipe.method.type,
        assistant_only_loss=recipe.data.assistant_only_loss,
        max_length=recipe.data.max_length,
    )
    weights = [s.weight for s in recipe.data.sources]
    if len(train_sources) > 1 and any(w is not None for w in weights):
        # mixing by weight: draw from each source in proportion until every one is used up
        parts = [_tokenize(s.records, **kw) for s in train_sources]
        total = sum(w or 1.0 for w in weights)
        train = datasets.interleave_datasets(
            parts,
            probabilities=[(w or 1.0) / total for w in weights],
            seed=recipe.data.seed,
            stopping_strategy="all_exhausted",
        )
    else:
        train = _tokenize([r for s in train_sources for r in s.records], **kw)
    out = {"train": train}
    if eval_sources:
        out["eval"] = _tokenize([r for s in eval_sources for r in s.records], **kw)
    elif (held_out := eval_split(recipe)) is not None:
        check_eval_split(recipe, len(train), file=train_sources[0].name)
        split = train.train_test_split(test_size=held_out[1], seed=recipe.data.seed)
        out = {"train": split["train"], "eval": split["test"]}
    return datasets.DatasetDict(out)

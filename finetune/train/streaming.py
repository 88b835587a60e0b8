"""Train sources read lazily (`data.sources[].streaming`), for text corpora larger than RAM.

Each source becomes a datasets.IterableDataset (a local file through the json/parquet/csv builders,
or a Hub dataset) whose rows are tokenized as they are read, exactly as the in-memory path tokenizes
`text` rows (finetune/train/tokenize.py); weighted sources are interleaved, and the whole repeats until
train.max_steps. Preflight has already
checked the first rows of each source (finetune/data/sources.py, PREVIEW_ROWS); rows later in the file
that fail are reported by the trainer's reader, not here.
"""

from __future__ import annotations

from finetune.data.sources import LOCAL_SUFFIXES, resolve_path
from finetune.recipe.load import recipe_dir
from finetune.recipe.schema import Recipe
from finetune.train.tokenize import sft_features


def _open(source, base):
    import datasets

    path = resolve_path(source.path, base)
    if path is None:
        return datasets.load_dataset(source.path, name=source.subset, split=source.split, streaming=True)
    kind = {"jsonl": "json"}.get(LOCAL_SUFFIXES[path.suffix], LOCAL_SUFFIXES[path.suffix])
    return datasets.load_dataset(kind, data_files=str(path), split="train", streaming=True)


def streaming_train(recipe: Recipe, tokenizer):
    """The train IterableDataset of input_ids/labels, read again from its start each time it runs out: a streamed
    run is train.max_steps long, and transformers' Trainer, given an iterable that ends before an optimizer step's
    micro-batches are drawn, starts a new epoch without stepping, forever (a stream shorter than one step, packed,
    spun at full CPU without a step)."""
    return _sources(recipe, tokenizer).repeat(None)


def _sources(recipe: Recipe, tokenizer):
    import datasets

    parts = []
    for source in recipe.data.sources:
        column = source.columns.get("text", "text")
        ds = _open(source, recipe_dir(recipe))
        if source.max_samples:
            ds = ds.take(source.max_samples)
        ds = ds.map(lambda row, c=column: sft_features({"text": row[c]}, tokenizer, assistant_only_loss=False))
        parts.append(ds.select_columns(["input_ids", "labels"]))
    weights = [s.weight for s in recipe.data.sources]
    if len(parts) == 1:
        return parts[0]
    if any(w is not None for w in weights):
        total = sum(w or 1.0 for w in weights)
        return datasets.interleave_datasets(
            parts,
            probabilities=[(w or 1.0) / total for w in weights],
            seed=recipe.data.seed,
            stopping_strategy="all_exhausted",
        )
    return datasets.concatenate_datasets(parts)

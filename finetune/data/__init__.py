"""Training data without torch: read the sources, convert every supported format, check every row.

    sources.py        local jsonl/json/parquet/csv files and Hub datasets -> converted records with file and row
    formats.py        one row of each format -> TRL's forms (preference.py: the preference layouts)
    splits.py         `split` with slicing ("train[:80%]"), for local files too
    chat_template.py  data.chat_template as text (inline jinja, a file, or a shipped name)
    check.py          what the launching process checks before anything is written
    lengths.py        the packed examples' token-weighted length (data.example_tokens) for the planner

The ranks tokenize what these modules read (finetune/train/preflight.py, tokenize.py).
"""

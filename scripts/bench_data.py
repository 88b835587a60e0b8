"""Data preparation on CPU: finetune's tokenized-data path against TRL's own SFT preprocessing.

One call, four measurements, each in a fresh Python process (no warm imports or caches shared):

  finetune-cold  `finetune.train.preflight.prepare_data` (what `finetune run` calls on each rank):
                 read + convert the jsonl, chat template + tokenize + assistant mask, store in an
                 empty tokenized-data cache, length checks. Includes `load_tokenizer`.
  finetune-warm  the same again with the same cache: must be a cache hit.
  trl-default    what a user writes from TRL's docs: `load_dataset("json", ...)` into a fresh datasets
                 cache, then `SFTTrainer(model, args=SFTConfig(max_length, assistant_only_loss=True),
                 train_dataset=ds, processing_class=tok)`; TRL's default dataset_num_proc (None = 1).
  trl-2proc      the same with dataset_num_proc=2 (this machine's cores).

TRL's figure is load_dataset + the SFTTrainer constructor (its `_prepare_dataset` runs inside it),
minus the constructor's fixed cost, measured on a 16-example dataset in the same process beforehand.
Both sides must end with the same rows, tokens and loss tokens (checked).

The tokenizer is built here, offline and deterministically: a byte-level BPE with Llama-3's
pre-tokenizer regex, trained to a 32k vocabulary on text from the same generator as the data,
wrapped as PreTrainedTokenizerFast with a Llama-3-style chat template carrying {% generation %}.

    python scripts/bench_data.py --examples 100000 --out docs/results/bench-data-$(date +%F).json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


class TextGen:
    """Zipf-distributed synthetic words with punctuation; numpy-vectorized, seeded."""

    def __init__(self, seed: int, *, lexicon: int = 20_000):
        import numpy as np

        self.np = np
        rng = np.random.default_rng(1234)  # one lexicon for the tokenizer's corpus and the data
        onsets = [
            "",
            "b",
            "c",
            "d",
            "f",
            "g",
            "h",
            "k",
            "l",
            "m",
            "n",
            "p",
            "r",
            "s",
            "t",
            "v",
            "w",
            "st",
            "tr",
            "pl",
            "ch",
            "sh",
            "th",
            "gr",
            "br",
        ]
        vowels = ["a", "e", "i", "o", "u", "ou", "ea", "io", "y"]
        codas = ["", "", "n", "r", "s", "t", "l", "nd", "ng", "ck", "st"]
        syll = [o + v + c for o in onsets for v in vowels for c in codas]
        words = set()
        while len(words) < lexicon:
            k = int(rng.integers(1, 5))
            words.add("".join(syll[i] for i in rng.integers(0, len(syll), k)))
        words = sorted(words)
        words += [str(n) for n in range(0, 2000, 7)] + ["the", "a", "of", "to", "and", "in", "is", "it"]
        suffixes = ["", ".", ",", "?", ":", ".\n\n", "!"]
        self.suffix_p = np.array([0.86, 0.06, 0.05, 0.008, 0.007, 0.01, 0.005])
        self.suffix_p /= self.suffix_p.sum()
        self.full = np.array([w + s for w in words for s in suffixes], dtype=object)
        self.n_suffix = len(suffixes)
        ranks = np.arange(len(words))
        self.word_p = 1.0 / (ranks + 2.7)
        self.word_p /= self.word_p.sum()
        self.rng = np.random.default_rng(seed)

    def words(self, n: int) -> list[str]:
        w = self.rng.choice(len(self.word_p), size=n, p=self.word_p)
        s = self.rng.choice(self.n_suffix, size=n, p=self.suffix_p)
        return self.full[w * self.n_suffix + s].tolist()


def write_data(path: Path, *, n: int, seed: int) -> dict:
    """n multi-turn chats: 1-4 user/assistant turns, 30% with a system prompt (10-60 words), 20-400
    words per turn (log-uniform, so short turns are common and long ones occur), a third of a turn's
    words in the user message and the rest in the assistant's answer."""
    gen = TextGen(seed)
    np, rng = gen.np, gen.rng
    turns = rng.integers(1, 5, n)
    has_system = rng.random(n) < 0.3
    turn_words = np.exp(rng.uniform(np.log(20), np.log(400), int(turns.sum()))).astype(int)
    user_words = np.maximum(turn_words // 3, 1)
    system_words = rng.integers(10, 61, n)
    pool = gen.words(int(turn_words.sum() + system_words[has_system].sum()))
    pos = turn = 0

    def take(k):
        nonlocal pos
        pos += k
        return " ".join(pool[pos - k : pos])

    with path.open("w") as fh:
        for i in range(n):
            messages = [{"role": "system", "content": take(int(system_words[i]))}] if has_system[i] else []
            for _ in range(int(turns[i])):
                u = int(user_words[turn])
                messages.append({"role": "user", "content": take(u)})
                messages.append({"role": "assistant", "content": take(int(turn_words[turn]) - u)})
                turn += 1
            fh.write(json.dumps({"messages": messages}) + "\n")
    return {
        "examples": n,
        "messages": int(2 * turns.sum() + has_system.sum()),
        "words": pos,
        "turns_mean": float(turns.mean()),
        "bytes": path.stat().st_size,
    }


def build_tokenizer(out_dir: Path, *, seed: int, vocab_size: int = 32_000) -> dict:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    gen = TextGen(seed + 1)
    corpus = [" ".join(gen.words(200)) for _ in range(4_000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(str(out_dir))
    return {
        "kind": "byte-level BPE, Llama-3 pre-tokenizer regex, trained offline on synthetic text",
        "vocab_size": tok.get_vocab_size(),
    }


def _column_stats(ds) -> dict:
    """Counts and a digest of input_ids + labels, to check that both sides produced the same rows."""
    import hashlib

    import numpy as np
    import pyarrow.compute as pc

    ids, labels = ds.data.column("input_ids"), ds.data.column("labels")
    digest = hashlib.sha256()
    for col in (ids, labels):
        digest.update(np.asarray(pc.list_value_length(col), dtype=np.int64).tobytes())
        digest.update(np.asarray(pc.list_flatten(col), dtype=np.int64).tobytes())
    loss = pc.sum(pc.not_equal(pc.list_flatten(labels), -100)).as_py()
    return {
        "rows": len(ds),
        "tokens": int(pc.sum(pc.list_value_length(ids)).as_py()),
        "loss_tokens": int(loss),
        "digest": digest.hexdigest()[:16],
    }


def phase_finetune(work: Path, *, src: str | None, recipe_file: str) -> dict:
    if src:  # another checkout of finetune (the code before a change), with its own cache dir
        sys.path.insert(0, src)
    t0 = time.perf_counter()
    from accelerate import PartialState

    from finetune.recipe.load import load_recipe
    from finetune.train.model import load_tokenizer
    from finetune.train.preflight import prepare_data

    t_import = time.perf_counter() - t0
    cfg = json.loads((work / "config.json").read_text())
    recipe = load_recipe(work / recipe_file)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(recipe)
    data = prepare_data(recipe, tokenizer, state=PartialState(cpu=True))
    seconds = time.perf_counter() - t0
    import finetune

    return {
        "seconds": seconds,
        "import_seconds": t_import,
        "cache_hit": data.cache_hit,
        "finetune_src": str(Path(finetune.__file__).parent.parent),
        "cache_key": data.cache_key,
        "notes": data.notes,
        "max_length": cfg["max_length"],
        **_column_stats(data.train),
    }


def phase_trl(work: Path, *, num_proc: int | None) -> dict:
    t0 = time.perf_counter()
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    t_import = time.perf_counter() - t0
    cfg = json.loads((work / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(work / "tokenizer"))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    ds_cache = tempfile.mkdtemp(dir=work, prefix=f"hfds-{num_proc}-")

    def args(name):
        return SFTConfig(
            output_dir=str(work / name),
            max_length=cfg["max_length"],
            assistant_only_loss=True,
            dataset_num_proc=num_proc,
            report_to="none",
            use_cpu=True,
            save_strategy="no",
        )

    # the constructor's fixed cost (accelerator, model wrapping, collator) on 16 examples
    small = load_dataset("json", data_files=str(work / "small.jsonl"), split="train", cache_dir=ds_cache)
    t0 = time.perf_counter()
    SFTTrainer(model=model, args=args("trl-small"), train_dataset=small, processing_class=tok)
    overhead = time.perf_counter() - t0

    t0 = time.perf_counter()
    ds = load_dataset("json", data_files=str(work / "data.jsonl"), split="train", cache_dir=ds_cache)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer = SFTTrainer(model=model, args=args("trl"), train_dataset=ds, processing_class=tok)
    t_ctor = time.perf_counter() - t0
    return {
        "seconds": t_load + t_ctor - overhead,
        "load_dataset_seconds": t_load,
        "constructor_seconds": t_ctor,
        "constructor_fixed_seconds": overhead,
        "import_seconds": t_import,
        "dataset_num_proc": num_proc,
        "max_length": cfg["max_length"],
        **_column_stats(trainer.train_dataset),
    }


def _run_phase(work: Path, phase: str, *, src: str | None) -> dict:
    out = work / f"result-{phase}.json"
    cmd = [sys.executable, __file__, "--phase", phase, "--work", str(work), "--phase-out", str(out)]
    subprocess.run(cmd + (["--finetune-src", src] if src else []), check=True)
    return json.loads(out.read_text())


def _versions() -> dict:
    import datasets
    import tokenizers
    import transformers
    import trl

    return {
        "python": platform.python_version(),
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "datasets": datasets.__version__,
        "tokenizers": tokenizers.__version__,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=100_000)
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the JSON result here")
    p.add_argument("--skip", nargs="*", default=[], help="phases to leave out (while developing)")
    p.add_argument("--before-src", help="a checkout of finetune before a change: adds finetune-before-cold")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--phase-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--finetune-src", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.phase:
        recipe_file = "recipe-before.yaml" if a.phase.startswith("finetune-before") else "recipe.yaml"
        result = (
            phase_finetune(a.work, src=a.finetune_src, recipe_file=recipe_file)
            if a.phase.startswith("finetune")
            else phase_trl(a.work, num_proc=None if a.phase == "trl-default" else 2)
        )
        a.phase_out.write_text(json.dumps(result))
        return

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        tok_info = build_tokenizer(work / "tokenizer", seed=a.seed)
        tok_info["build_seconds"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        data_info = write_data(work / "data.jsonl", n=a.examples, seed=a.seed)
        data_info["generate_seconds"] = time.perf_counter() - t0
        with (work / "data.jsonl").open() as fh, (work / "small.jsonl").open("w") as small:
            small.writelines(next(fh) for _ in range(min(16, a.examples)))
        (work / "config.json").write_text(json.dumps({"max_length": a.max_length}))
        for name, cache_dir in (("recipe.yaml", "ftcache"), ("recipe-before.yaml", "ftcache-before")):
            (work / name).write_text(
                f"model: {{name: {work / 'tokenizer'}}}\n"
                f"data: {{sources: [{{path: {work / 'data.jsonl'}, format: messages}}], max_length: {a.max_length},"
                f" assistant_only_loss: true, cache_dir: {work / cache_dir}}}\n"
                "hardware: cpu\n"
            )
        print(f"tokenizer {tok_info}\ndata {data_info}", flush=True)

        phases = {}
        names = (["finetune-before-cold"] if a.before_src else []) + [
            "finetune-cold",
            "finetune-warm",
            "trl-default",
            "trl-2proc",
        ]
        for name in names:
            if name in a.skip:
                continue
            phases[name] = _run_phase(work, name, src=a.before_src if "before" in name else None)
            r = phases[name]
            r["examples_per_s"] = a.examples / r["seconds"]
            r["tokens_per_s"] = r["tokens"] / r["seconds"]
            print(
                f"{name:20s} {r['seconds']:8.2f} s {r['examples_per_s']:10.0f} ex/s "
                f"{r['tokens_per_s']:12.0f} tok/s  rows {r['rows']} tokens {r['tokens']} "
                f"loss {r['loss_tokens']}" + (f" cache_hit={r['cache_hit']}" if "cache_hit" in r else ""),
                flush=True,
            )

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu_cores": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "versions": _versions(),
        "tokenizer": tok_info,
        "data": data_info,
        "max_length": a.max_length,
        "phases": phases,
    }
    ft = phases.get("finetune-cold")
    for trl_name in ("trl-default", "trl-2proc"):
        if ft and trl_name in phases:
            result[f"ratio_finetune_cold_vs_{trl_name}"] = phases[trl_name]["seconds"] / ft["seconds"]
            same = all(ft[k] == phases[trl_name][k] for k in ("rows", "tokens", "loss_tokens", "digest"))
            result[f"same_output_as_{trl_name}"] = same
    if ft and "finetune-before-cold" in phases:
        before = phases["finetune-before-cold"]
        result["speedup_finetune_cold_vs_before"] = before["seconds"] / ft["seconds"]
        result["same_output_before_after"] = before["digest"] == ft["digest"]
    result["total_seconds"] = time.perf_counter() - started
    print(
        json.dumps({k: v for k, v in result.items() if k.startswith(("ratio", "same", "speedup", "total"))}, indent=1)
    )
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

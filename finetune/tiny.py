"""Build the tiny offline model shipped in data/tiny-llama/ (quickstart and tests).

    python -m finetune.tiny [DATA_DIR]          # default: data/  (writes DATA_DIR/tiny-llama + samples)

A Llama-architecture model (random weights, fixed seed) and a character-level tokenizer
built with the `tokenizers` library: every printable ASCII character is one token, any
other byte falls back to <0xNN> byte tokens, so any text round-trips. Character tokens
make string tasks (uppercase, reverse) learnable by a model this small in a minute of CPU.
The chat template carries `{% generation %}` markers so assistant-only loss works, and the
end-of-turn token is inside them so the model learns to stop.
"""

from __future__ import annotations

import sys
from pathlib import Path

SEED = 1234
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<unk>"]
# Kept on one line in the tokenizer config; `generation` marks what assistant-only loss trains on.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Every linear layer's output size is a multiple of 32: bitsandbytes' CPU 4-bit inference kernel
# (used in eval mode) asserts N % 32 == 0 (bitsandbytes/functional.py, _convert_weight_packed_for_cpu).
MODEL_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=192,
    max_position_embeddings=256,
)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    for code in range(256):  # byte fallback for anything that is not printable ASCII
        vocab[f"<0x{code:02X}>"] = len(vocab)
    for code in list(range(32, 127)) + [ord("\n"), ord("\t")]:
        vocab[chr(code)] = len(vocab)
    # BPE with no merges and no pre-tokenizer = one token per character
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )


def build_model(tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    vocab_size = (len(tokenizer) + 63) // 64 * 64  # round up, as real models do
    config = LlamaConfig(
        vocab_size=vocab_size,
        **MODEL_SHAPE,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _words(rng, count: int, exclude: set[str] = frozenset()) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    out: dict[str, None] = {}
    while len(out) < count:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(3, 7)))
        if word not in exclude:
            out[word] = None
    return list(out)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def build_samples(data_dir: str | Path) -> None:
    """The quickstart task (uppercase a word: held-out words in eval.jsonl) and one small file per format."""
    import random

    data = Path(data_dir)
    rng = random.Random(SEED)
    train_words = _words(rng, 1000)
    eval_words = _words(rng, 100, exclude=set(train_words))

    def chat(w):
        return {"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": w.upper()}]}

    _write_jsonl(data / "quickstart" / "train.jsonl", [chat(w) for w in train_words])
    _write_jsonl(data / "quickstart" / "eval.jsonl", [chat(w) for w in eval_words])
    few = train_words[:64]
    _write_jsonl(
        data / "samples" / "preference.jsonl",
        [
            {
                "prompt": [{"role": "user", "content": w}],
                "chosen": [{"role": "assistant", "content": w.upper()}],
                "rejected": [{"role": "assistant", "content": w[::-1]}],
            }
            for w in few
        ],
    )
    _write_jsonl(
        data / "samples" / "alpaca.jsonl",
        [{"instruction": "Uppercase the word.", "input": w, "output": w.upper()} for w in few[:16]],
    )
    _write_jsonl(
        data / "samples" / "sharegpt.jsonl",
        [{"conversations": [{"from": "human", "value": w}, {"from": "gpt", "value": w.upper()}]} for w in few[:16]],
    )
    _write_jsonl(data / "samples" / "text.jsonl", [{"text": f"{w} -> {w.upper()}"} for w in few[:16]])
    _write_jsonl(
        data / "samples" / "prompt_completion.jsonl",
        [{"prompt": f"{w} -> ", "completion": w.upper()} for w in few[:16]],
    )


def build(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for path in out.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; the files are shipped in the repository
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    data = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent / "data"
    out = build(data / "tiny-llama")
    build_samples(data)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({size / 1024:.0f} KiB), {data}/quickstart and {data}/samples")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`finetune generate` / `finetune.generate()`: try a trained run.

One prompt, a file of prompts (batched), or an interactive chat.

The model is what the run left: a full model in RUN_DIR, or the base plus the LoRA adapter (peft),
or the merged model (`--merged`: RUN_DIR/merged, or any directory `finetune merge` wrote). Prompts go
through the tokenizer's chat template when it has one (the template the run trained with is saved
with the tokenizer in RUN_DIR). Generation is transformers' `generate`; tokens stream to the console
through its TextStreamer.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from finetune import rundir
from finetune.errors import FinetuneError
from finetune.merging import TOKENIZER_FILES, check_base_exists, resolve_base, run_kind


class GenerateError(FinetuneError):
    """The run directory or the prompts cannot be used for generation."""


@dataclass
class Settings:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy (deterministic)
    top_p: float = 1.0
    chat_template: bool = True  # use the tokenizer's chat template when it has one
    system: str | None = None

    def generate_kwargs(self, tokenizer) -> dict:
        sampling = self.temperature > 0
        kwargs = {"max_new_tokens": self.max_new_tokens, "do_sample": sampling, "pad_token_id": tokenizer.pad_token_id}
        if sampling:
            kwargs.update(temperature=self.temperature, top_p=self.top_p)
        else:  # greedy: unset the sampling knobs a model's generation_config may carry
            kwargs.update(temperature=None, top_p=None, top_k=None)
        return kwargs


def _recipe(run_dir: Path):
    """The run's resolved recipe, or None (a merged model directory has none)."""
    path = Path(run_dir) / rundir.RESOLVED_RECIPE
    if not path.is_file():
        return None
    from finetune.recipe import load_recipe

    return load_recipe(path, allow_resolved=True)


def model_dir(run_dir: Path, *, merged: bool) -> Path:
    """The directory whose weights are used: RUN_DIR, or its merged/ (or RUN_DIR itself when it is a
    merged model)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise GenerateError(
            "run directory not found", file=str(run_dir), hint="pass the directory `finetune run` wrote its outputs to"
        )
    if merged and run_kind(run_dir) != "full":
        if run_kind(run_dir / "merged") == "full":
            return run_dir / "merged"
        raise GenerateError(
            "no merged model here (neither RUN_DIR nor RUN_DIR/merged holds one)",
            file=str(run_dir),
            hint=f"run `finetune merge {run_dir} -o {run_dir}/merged` first, or leave out --merged to use the adapter",
        )
    if run_kind(run_dir) == "unknown":
        raise GenerateError(
            "no adapter (adapter_config.json) or model (config.json + *.safetensors) found",
            file=str(run_dir),
            hint="the run has not saved its final weights; resume it with `finetune run`",
        )
    return run_dir


def load(
    run_dir: str | Path,
    *,
    merged: bool = False,
    base_only: bool = False,
    dtype: str | None = None,
    device: str | None = None,
):
    """(model, tokenizer) for inference. base_only: the base model the run started from (for
    before/after comparisons), with the run's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = Path(run_dir)
    weights = model_dir(run_dir, merged=merged)
    recipe = _recipe(run_dir) or _recipe(weights)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:  # CPU: fp32 is the fast path; GPU: the dtype the run used
        dtype = (
            "float32"
            if device == "cpu"
            else (
                recipe.adapter.compute_dtype
                if recipe and recipe.adapter.type == "qlora"
                else (recipe.model.dtype if recipe else "bfloat16")
            )
        )
    kwargs = {"dtype": getattr(torch, dtype)}
    if recipe is not None:
        kwargs.update(revision=recipe.model.revision, trust_remote_code=recipe.model.trust_remote_code)
    kind = run_kind(weights)
    base = None
    if kind == "adapter" or base_only:
        if kind == "adapter":
            base = resolve_base(weights, json.loads((weights / "adapter_config.json").read_text()), recipe)
        elif recipe is not None:
            check_base_exists(run_dir, recipe)
            base = recipe.model.name
        else:
            raise GenerateError(
                "cannot tell the base model of a full fine-tune without recipe.resolved.yaml", file=str(run_dir)
            )
    from finetune.train.model import dequantizing_kwargs

    source = base if base is not None else str(weights)
    try:
        kwargs.update(dequantizing_kwargs(source, **{k: v for k, v in kwargs.items() if k != "dtype"}))
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as exc:
        raise GenerateError(
            f"cannot load the model {source!r}: {exc}",
            hint="make the base model available (local dir, or Hub access and login)",
        ) from None
    if kind == "adapter" and not base_only:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(weights), is_trainable=False)
    model.to(device).eval()
    tokenizer_dir = next((d for d in (weights, run_dir) if any((d / f).is_file() for f in TOKENIZER_FILES)), None)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir) if tokenizer_dir else source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # batched generation continues every row from its last token
    return model, tokenizer


def _as_text(tokenizer, prompt, settings: Settings) -> str:
    """A prompt (text or a messages list) as the model's input text."""
    if isinstance(prompt, list) or (settings.chat_template and tokenizer.chat_template):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if settings.system and not (messages and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": settings.system}, *messages]
        if not tokenizer.chat_template:
            raise GenerateError(
                "a messages prompt needs a chat template, and this tokenizer has none", hint="pass plain text prompts"
            )
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return prompt


def complete(
    model, tokenizer, prompts: list, settings: Settings, *, batch_size: int = 8, stream: bool = False
) -> list[str]:
    """The completion of each prompt (text or messages), `batch_size` at a time; stream=True prints
    the tokens of a single prompt as they come."""
    import torch
    from transformers import TextStreamer

    out: list[str] = []
    device = next(model.parameters()).device
    for start in range(0, len(prompts), batch_size):
        texts = [_as_text(tokenizer, p, settings) for p in prompts[start : start + batch_size]]
        # the template already holds the special tokens it wants (e.g. BOS); don't add them twice
        enc = tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            add_special_tokens=not (settings.chat_template and tokenizer.chat_template),
        )
        enc = {k: v.to(device) for k, v in enc.items()}
        streamer = (
            TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
            if (stream and len(texts) == 1)
            else None
        )
        with torch.no_grad():
            ids = model.generate(**enc, **settings.generate_kwargs(tokenizer), streamer=streamer)
        new = ids[:, enc["input_ids"].shape[1] :]
        out += [t.strip() for t in tokenizer.batch_decode(new, skip_special_tokens=True)]
    return out


def read_prompts(path: str | Path) -> list:
    """A .jsonl file of {"prompt": text} or {"messages": [...]} rows, or a text file with one prompt
    per line (blank lines skipped)."""
    path = Path(path)
    if not path.is_file():
        raise GenerateError("prompt file not found", file=str(path))
    lines = path.read_text().splitlines()
    if path.suffix != ".jsonl":
        return [line for line in lines if line.strip()]
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise GenerateError(f"line {number} is not JSON: {exc}", file=str(path)) from None
        if isinstance(row, dict) and isinstance(row.get("messages"), list):
            messages = row["messages"]
            prompts.append(messages[:-1] if messages and messages[-1].get("role") == "assistant" else messages)
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(row["prompt"])
        else:
            raise GenerateError(
                f"line {number} has neither a 'prompt' string nor a 'messages' list",
                file=str(path),
                hint='write {"prompt": "..."} or {"messages": [...]} per line',
            )
    return prompts


def generate(
    run_dir: str | Path,
    prompts,
    *,
    merged: bool = False,
    batch_size: int = 8,
    stream: bool = False,
    dtype: str | None = None,
    **settings,
) -> list[str]:
    """Completions of `prompts` (a string, a messages list, or a list of either) by the run's model.
    settings: max_new_tokens, temperature, top_p, chat_template, system (see Settings)."""
    single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict))
    items = [prompts] if single else list(prompts)
    model, tokenizer = load(run_dir, merged=merged, dtype=dtype)
    return complete(model, tokenizer, items, Settings(**settings), batch_size=batch_size, stream=stream)


def chat(
    run_dir: str | Path, *, merged: bool = False, dtype: str | None = None, stdin=None, stdout=None, **settings
) -> int:
    """An interactive chat on stdin/stdout with the tokenizer's chat template; the history is kept.
    `/reset` starts over, `/exit` (or end of input) ends."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    config = Settings(**settings)
    model, tokenizer = load(run_dir, merged=merged, dtype=dtype)
    if not tokenizer.chat_template:
        raise GenerateError(
            "this model's tokenizer has no chat template, so there is no chat format",
            file=str(run_dir),
            hint='use `finetune generate RUN_DIR "PROMPT"` for plain text',
        )
    interactive = stdin.isatty()
    history: list[dict] = []
    print("chat with the model: /reset starts over, /exit or Ctrl-D ends", file=stdout, flush=True)
    while True:
        if interactive:
            print("you> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            history = []
            print("(history cleared)", file=stdout, flush=True)
            continue
        history.append({"role": "user", "content": text})
        print("model> ", end="", file=stdout, flush=True)
        reply = complete(model, tokenizer, [history], config, stream=stdout is sys.stdout)[0]
        if stdout is not sys.stdout:
            print(reply, file=stdout, flush=True)
        history.append({"role": "assistant", "content": reply})

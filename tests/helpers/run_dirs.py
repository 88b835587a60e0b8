"""Build what `finetune run` leaves in RUN_DIR, with a real tiny Llama and a real peft adapter.

Used by the merge, push and generate tests (the session fixture `tiny_runs`). Everything is created
offline with fixed seeds: finetune.tiny's 64-wide 2-layer Llama and character tokenizer, a LoRA
adapter whose lora_B is non-zero (so merging changes the logits), the resolved recipe and plan
written by the real planner and compiler, and plausible metrics/summary/loss.png/checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import zlib
from pathlib import Path

from finetune.recipe import dump_recipe, load_recipe


def build_base(out: Path) -> Path:
    """The package's own tiny Llama (finetune.tiny: random weights, character tokenizer) saved with
    save_pretrained, without its chat template: the generate tests need a tokenizer that has none."""
    from finetune import tiny

    tokenizer = tiny.build_tokenizer()
    tokenizer.chat_template = None
    tiny.build_model(tokenizer).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def recipe_dict(base: Path, *, adapter: str = "lora", dora: bool = False) -> dict:
    return {
        "model": {"name": str(base), "dtype": "float32"},
        "method": {"type": "sft"},
        "adapter": {
            "type": adapter,
            "r": 8,
            "alpha": 16,
            "dora": dora,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        }
        if adapter != "full"
        else {"type": "full"},
        "data": {
            "sources": [
                {"path": "data/chat.jsonl", "format": "messages"},
                {"path": "HuggingFaceH4/ultrachat_200k", "split": "train_sft"},
            ],
            "max_length": 128,
        },
        "train": {"max_steps": 4, "lr": 1e-3, "global_batch_size": 4, "micro_batch_size": 2, "precision": "fp32"},
        "distributed": {"strategy": "ddp"},
        "hardware": "cpu",
        "hub": {"repo": "acme/tiny-from-recipe", "private": True, "push": "adapter", "revision": "exp-1"},
    }


def tiny_png(width: int = 8, height: int = 4) -> bytes:
    # one filter byte (0) per row, then RGB pixels
    raw = b"".join(
        b"\x00" + b"".join(bytes([(x * 30) % 256, (y * 60) % 256, 128]) for x in range(width)) for y in range(height)
    )

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def _write_run_files(run: Path, recipe: dict) -> None:
    from finetune.compile.compiler import prepare_recipe
    from finetune.rundir import PLAN_JSON, RESOLVED_RECIPE

    compiled = prepare_recipe(load_recipe(recipe), run_dir=run)  # what `finetune compile` writes for it
    for name in (RESOLVED_RECIPE, PLAN_JSON):
        (run / name).write_text(compiled.texts[name])
    rows = []
    for step in range(1, 5):
        rows.append(
            {
                "step": step,
                "loss": 6.3 - 0.2 * step,
                "learning_rate": 1e-3,
                "grad_norm": 1.5,
                "tokens_per_second": 900.0 + step,
                "peak_memory_gib": 0.1,
            }
        )
        if step % 2 == 0:
            rows.append({"step": step, "eval_loss": 6.4 - 0.1 * step})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # the keys finetune.train.run writes
    (run / "summary.json").write_text(
        json.dumps(
            {
                "run_dir": str(run),
                "tokenized_cache": {"key": "abc123", "hit": False},
                "method": "sft",
                "adapter": recipe["adapter"]["type"],
                "steps": 4,
                "final_train_loss": 5.5,
                "first_train_loss": 6.1,
                "best_eval_loss": 6.0,
                "eval_loss_before": 6.4,
                "eval_loss_final": 6.0,
                "train_runtime_s": 2.27,
                "tokens_seen": 2048,
                "tokens_per_second": 902.5,
            }
        )
    )
    (run / "loss.png").write_bytes(tiny_png())
    ckpt = run / "checkpoints" / "checkpoint-2"
    ckpt.mkdir(parents=True)
    (ckpt / "optimizer.pt").write_bytes(b"\x80\x04optimizer-state" * 64)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    (run / "train.log").write_text("step 1 loss 6.1\n")
    (run / "training_args.bin").write_bytes(b"\x80\x04pickled-training-args")  # Trainer.save_model
    (run / "runs").mkdir()
    (run / "runs" / "events.out.tfevents.1").write_bytes(b"tensorboard")


def build_lora_run(base: Path, run: Path, *, dora: bool = False) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    run.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        use_dora=dora,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero; make the adapter actually do something
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
            elif "lora_magnitude" in name:
                param.mul_(1.0 + 0.1 * torch.rand(param.shape, generator=gen))
    model.save_pretrained(run)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (base / name).is_file():
            shutil.copy2(base / name, run / name)
    _write_run_files(run, recipe_dict(base, dora=dora))
    return run


def build_full_run(base: Path, run: Path) -> Path:
    shutil.copytree(base, run)
    _write_run_files(run, recipe_dict(base, adapter="full"))
    return run


def tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def build_tiny_runs(root: Path) -> dict[str, Path]:
    """base, lora, dora and full run dirs under `root` (the session fixture `tiny_runs` builds them once)."""
    base = build_base(root / "tiny-llama")
    return {
        "base": base,
        "lora": build_lora_run(base, root / "run-lora"),
        "dora": build_lora_run(base, root / "run-dora", dora=True),
        "full": build_full_run(base, root / "run-full"),
    }


def variant_run(src: Path, dst: Path, **sections) -> Path:
    """A copy of run `src` whose recipe.resolved.yaml has `sections` merged in (and re-validated)."""
    import yaml

    from finetune.recipe.load import deep_merge

    shutil.copytree(src, dst)
    raw = yaml.safe_load((dst / "recipe.resolved.yaml").read_text())
    recipe = load_recipe(deep_merge(raw, sections), allow_resolved=True)
    (dst / "recipe.resolved.yaml").write_text(dump_recipe(recipe))
    return dst

"""A full fine-tune's DPO on padding-free pairs under DeepSpeed ZeRO-2, one CPU process (DeepSpeed's CPU
accelerator, gloo): TRL hands the reference copy to DeepSpeed in its __init__, so finetune's hooks meet a
DeepSpeedEngine. Trains two steps with the pairs (on finetune's attention) and two without, and prints JSON: the
reference's type, whether each of the reference model's own forwards got a packed row's bounds, whether its layers
got a mask, and both runs' losses.

    python -m tests.helpers.deepspeed_dpo_pairs PORT OUT_DIR   (tests/unit/train/test_dpo_pairs.py)"""

from __future__ import annotations

import json
import os
import sys


def _trainer(out_dir: str, pairs: bool):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from finetune.train import attention
    from finetune.train.trainers import attach_padding_free_pairs
    from tests.helpers.paths import TINY_MODEL

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32, attn_implementation="sdpa")
    if pairs:  # finetune's attention, as train/model.py loads it (on CPU each layer falls back to sdpa); TRL loads
        # the reference copy with the policy's attention
        model.set_attn_implementation(attention.register())
        attention.skip_packed_row_masks(model)
    rows = [
        {"prompt": "abc", "chosen": "ABC", "rejected": "cba"},
        {"prompt": "hello", "chosen": "HELLO", "rejected": "olleh world"},
    ] * 4
    zero2 = {
        "zero_optimization": {"stage": 2},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
    }
    args = DPOConfig(
        output_dir=os.path.join(out_dir, "pairs" if pairs else "padded"),
        deepspeed=zero2,
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
    )
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    if pairs:
        attach_padding_free_pairs(trainer, multiple=None)
    return trainer


def _train(out_dir: str, pairs: bool) -> tuple[dict, str]:
    """One run: its losses, and what the reference model itself was called with (after the pairs' hook) and its
    first layer got."""
    trainer = _trainer(out_dir, pairs)
    reference = trainer.accelerator.unwrap_model(trainer.ref_model)
    bounds: list[bool] = []
    masks: list[bool] = []
    reference.register_forward_pre_hook(
        lambda module, args, kwargs: bounds.append(kwargs.get("cu_seq_lens_q") is not None), with_kwargs=True
    )
    reference.model.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: masks.append(kwargs.get("attention_mask") is not None), with_kwargs=True
    )
    trainer.train()
    losses = [round(r["loss"], 6) for r in trainer.state.log_history if "loss" in r]
    return {"losses": losses, "reference_bounds": bounds, "masks": masks}, type(trainer.ref_model).__name__


def main() -> None:
    port, out_dir = sys.argv[1], sys.argv[2]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    padded, _ = _train(out_dir, pairs=False)
    pairs, reference_type = _train(out_dir, pairs=True)
    print("RESULT " + json.dumps({"padded": padded, "pairs": pairs, "reference_type": reference_type}))


if __name__ == "__main__":
    main()

"""One CPU rank of the sharded-QLoRA test: `torchrun ... -m tests.helpers.sharded_qlora_rank RESOLVED OUT`.

It joins the gloo group as a finetune rank does (accelerate's PartialState), loads the QLoRA model with
finetune.train.sharded_qlora on a CPU mesh (the FSDP plugin from the FSDP_* variables the test exported the
way `accelerate launch` exports them), hands it to finetune's build_trainer, and writes OUT/rank-K.json
(sizes, the trainer's view of the model, losses) and OUT/rank-K.pt (logits, quant states). accelerate runs
FSDP only on accelerators, so the steps are taken by a plain loop over the trainer's own collated batch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _four_bit_bytes(model) -> int:
    import bitsandbytes as bnb

    total = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            local = module.weight.to_local() if hasattr(module.weight, "to_local") else module.weight
            total += local.numel() * local.element_size()
    return total


def _quant_states(model) -> dict:
    import bitsandbytes as bnb

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            qs = module.quant_state
            out[name.removeprefix("base_model.model.").removesuffix(".base_layer")] = {
                "absmax": qs.absmax,
                "offset": qs.offset,
                "nested_absmax": qs.state2.absmax if qs.state2 is not None else None,
                "shape": tuple(qs.shape),
            }
    return out


def main() -> int:
    import torch
    from accelerate import PartialState
    from torch.distributed.device_mesh import init_device_mesh

    from finetune.recipe.load import load_recipe
    from finetune.train import sharded_qlora
    from finetune.train.model import load_tokenizer
    from finetune.train.preflight import prepare_data
    from finetune.train.trainers import build_trainer, training_args

    resolved, out = Path(sys.argv[1]), Path(sys.argv[2])
    state = PartialState(cpu=True)
    rank = state.process_index
    recipe = load_recipe(resolved, allow_resolved=True)
    mesh = init_device_mesh("cpu", (state.num_processes,))
    config, index = sharded_qlora.checkpoint(recipe)
    model, report = sharded_qlora.load_sharded(recipe, config=config, index=index, device="cpu", mesh=mesh)
    ids = torch.arange(3, 3 + 2 * 12).reshape(2, 12)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits

    lora_layers = sum(1 for n, _ in model.named_modules() if n.endswith("lora_A"))
    tokenizer = load_tokenizer(recipe)
    data = prepare_data(recipe, tokenizer, state=state)
    args = training_args(recipe, run_dir=resolved.parent, has_eval=False)
    trainer = build_trainer(recipe, args=args, model=model, tokenizer=tokenizer, data=data, callbacks=[])
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    batch = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels", "position_ids")}
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=recipe.train.lr)
    trainer.model.train()
    losses = []
    for _ in range(4):
        loss = trainer.model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    record = {
        "rank": rank,
        "world_size": state.num_processes,
        "local_bytes": report.local_bytes,
        "four_bit_bytes": _four_bit_bytes(model),
        "peak_transient_bytes": report.peak_transient_bytes,
        "tensors": report.tensors,
        "quantized": report.quantized,
        "trainer_model_is_loaded_model": trainer.model is model,
        "lora_layers_before": lora_layers,
        "lora_layers_after": sum(1 for n, _ in trainer.model.named_modules() if n.endswith("lora_A")),
        "trainable": [
            (n, str(p.dtype), type(p).__name__) for n, p in trainer.model.named_parameters() if p.requires_grad
        ],
        "losses": losses,
    }
    torch.save({"logits": logits, "quant_states": _quant_states(model)}, out / f"rank-{rank}.pt")
    (out / f"rank-{rank}.json").write_text(json.dumps(record))
    state.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

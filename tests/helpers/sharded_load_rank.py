"""One CPU rank of the sharded-load test: `torchrun ... -m tests.helpers.sharded_load_rank RESOLVED OUT [MODE]`.

It joins the gloo group as a finetune rank does (accelerate's PartialState), loads the LoRA or QLoRA model with
finetune.train.sharded_load on a CPU mesh (the FSDP plugin from the FSDP_* variables the test exported the
way `accelerate launch` exports them), hands it to finetune's build_trainer, and writes OUT/rank-K.json
(sizes, the trainer's view of the model, losses; for a full fine-tune, gradient accumulation reducing every
micro-batch or the last only: `_accumulation`) and OUT/rank-K.pt (logits, quant states). accelerate runs
FSDP only on accelerators, so the steps are taken by a plain loop over the trainer's own collated batch.
With `hybrid`, RESOLVED is a recipe compiled for fsdp2-hybrid: the rank only loads, on the 2-D mesh that
finetune.train.sharded_load.shard_mesh builds from the PARALLELISM_CONFIG_* variables, and records that.
With `random`, RESOLVED is a model.init: random recipe compiled for fsdp2 (`random_init`); with `dpo`, a
DPO LoRA recipe (`dpo`).
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


def _frozen_bytes(model) -> int:
    """This rank's bytes of the frozen base weights (its shards of them)."""
    total = 0
    for p in model.parameters():
        if not p.requires_grad:
            local = p.to_local() if hasattr(p, "to_local") else p
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


def _loss_and_grads(model, batch) -> tuple[float, dict]:
    loss = model(**batch).loss
    loss.backward()
    grads = {
        n.replace("._checkpoint_wrapped_module", ""): p.grad.full_tensor()
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    model.zero_grad()
    return loss.item(), grads


def _checkpointing_changes(plain, checkpointed, batch) -> dict:
    """What activation checkpointing (applied by the loader before sharding, as accelerate does) changes in
    the loss and the adapter gradients of one step: nothing, up to float rounding."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    plain_loss, plain_grads = _loss_and_grads(plain, batch)
    loss, grads = _loss_and_grads(checkpointed, batch)
    return {
        "wrapped": sum(isinstance(m, CheckpointWrapper) for m in checkpointed.modules()),
        "loss": abs(loss - plain_loss),
        "grad": max((grads[n].float() - g.float()).abs().max().item() for n, g in plain_grads.items()),
        "grad_scale": max(g.float().abs().max().item() for g in plain_grads.values()),
    }


def _final_save(trainer, target: Path) -> dict:
    """What finetune's final save of an adapter under FSDP2 runs on every rank once save_model finds FSDP's
    FULL_STATE_DICT (finetune/train/adapter_save.py; the CPU Trainer here has no FSDP plugin, so its
    save_model would not take that branch): what it gathered and wrote, and the trained parameters' full
    values to compare the file with (rank 0's `trained.pt`)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from finetune.train.adapter_save import trained_state_dict

    gathered = trained_state_dict(trainer.model)
    dcp_keys = sorted(
        get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    )
    trained = {n: p.full_tensor() for n, p in trainer.model.named_parameters() if p.requires_grad}  # collective
    trainer.save_trained_parameters(str(target))
    if trainer.args.should_save:
        torch.save(trained, target / "trained.pt")
    return {
        "gathers_trained_only": trainer.gathers_trained_only,
        "gathered_keys": sorted(gathered),
        "dcp_keys": dcp_keys,
        "gathered_bytes": sum(t.numel() * t.element_size() for t in gathered.values()),
    }


def _accelerate_finds_layers(plugin_args: dict, model) -> str:
    """What the Trainer's Accelerator does first with the model it prepares (set_auto_wrap_policy): "" or
    the error it raises."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    try:
        FullyShardedDataParallelPlugin(**plugin_args).set_auto_wrap_policy(model)
    except ValueError as exc:
        return str(exc)
    return ""


def _steps(model, loss_fn, *, lr: float, n: int = 4) -> list[float]:
    """n plain AdamW steps of `model`'s trainable parameters on the loss `loss_fn` computes: the losses."""
    import torch

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(n):
        loss = loss_fn()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _accumulation(model, batch, *, lr: float, steps: int = 3) -> dict:
    """A full fine-tune's gradient accumulation over two micro-batches (the batch's halves), as the Trainer runs
    it under FSDP2: reducing after each (accelerate's sync_each_batch: the Trainer enters no no_sync) or after
    the last only (accelerate's no_sync, which for FSDP2 is set_requires_gradient_sync(False) around the
    others). The Trainer's own FSDP2 loop does not run here (accelerate takes FSDP only on accelerators), so
    FSDP2's switch is set here as accelerate.no_sync sets it. Then `steps` steps reducing every micro-batch."""
    import torch

    halves = [
        {k: v[part] if torch.is_tensor(v) else v for k, v in batch.items()} for part in (slice(0, 2), slice(2, 4))
    ]
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def accumulate(each: bool) -> tuple[list[float], int]:
        losses, reduced_after_first = [], 0
        for i, half in enumerate(halves):
            model.set_requires_gradient_sync(each or i == len(halves) - 1)
            loss = model(**half).loss / len(halves)
            loss.backward()
            losses.append(loss.item())
            if i == 0:  # sharded fp32 gradients exist only where the micro-batch was reduce-scattered
                reduced_after_first = sum(p.grad is not None for _, p in trained)
        model.set_requires_gradient_sync(True)
        return losses, reduced_after_first

    _, each_reduced = accumulate(each=True)
    each = {n: p.grad.full_tensor() for n, p in trained}
    model.zero_grad()
    _, last_reduced = accumulate(each=False)
    diff = max((p.grad.full_tensor() - each[n]).abs().max().item() for n, p in trained)
    model.zero_grad()
    optimizer = torch.optim.AdamW([p for _, p in trained], lr=lr)
    losses = []
    for _ in range(steps):
        micro, _ = accumulate(each=True)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(micro))
    return {
        "trained": len(trained),
        "reduced_after_first": {"each": each_reduced, "last": last_reduced},
        "grad_diff": diff,
        "grad_scale": max(g.abs().max().item() for g in each.values()),
        "losses": losses,
    }


def _adapter(model) -> dict:
    """The whole LoRA weights as the ranks hold them between them (a collective: every rank calls it)."""
    return {n: p.full_tensor() for n, p in model.named_parameters() if p.requires_grad}


def hybrid(resolved: Path, out: Path) -> int:
    import torch
    from accelerate import PartialState
    from transformers import TrainingArguments

    from finetune.recipe.load import load_recipe
    from finetune.train import sharded_load

    state = PartialState(cpu=True)
    recipe = load_recipe(resolved, allow_resolved=True)
    args = TrainingArguments(output_dir=str(out / "args"), use_cpu=True, report_to=[])
    model, report = sharded_load.load_for_training(recipe, args=args)
    parallelism = args.parallelism_config  # what the Trainer's Accelerator will build its mesh from
    weight = model.get_input_embeddings().weight  # before a forward leaves the root's group unsharded
    mesh = weight.device_mesh
    adapter = _adapter(model)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.arange(3, 3 + 2 * 12).reshape(2, 12)).logits
    record = {
        "rank": state.process_index,
        "mesh": list(mesh.mesh_dim_names),
        "mesh_shape": list(mesh.shape),
        "placements": [str(p) for p in weight.placements],
        "handed_over": [parallelism.dp_replicate_size, parallelism.dp_shard_size],
        "same_mesh": parallelism.device_mesh[tuple(parallelism.fsdp_dim_names)].mesh.tolist() == mesh.mesh.tolist(),
        "trainer_plugin": args.fsdp_plugin_args,
        "four_bit_bytes": _four_bit_bytes(model),
        "local_bytes": report.local_bytes,
    }
    torch.save({"logits": logits, "adapter": adapter}, out / f"rank-{state.process_index}.pt")
    (out / f"rank-{state.process_index}.json").write_text(json.dumps(record))
    state.destroy_process_group()
    return 0


def random_init(resolved: Path, out: Path) -> int:
    """model.init: random through the sharded load (RESOLVED compiled for GPUs under fsdp2): only load,
    record this rank's bytes and the whole tensors the ranks hold between them, then a few plain optimizer
    steps on one fixed batch."""
    import torch
    from accelerate import PartialState
    from transformers import TrainingArguments

    from finetune.recipe.load import load_recipe
    from finetune.train import sharded_load

    state = PartialState(cpu=True)
    recipe = load_recipe(resolved, allow_resolved=True)
    args = TrainingArguments(output_dir=str(out / "args"), use_cpu=True, report_to=[])
    model, report = sharded_load.load_for_training(recipe, args=args)
    whole = {n: p.full_tensor() for n, p in model.named_parameters() if not p.requires_grad}  # a collective
    ids = torch.arange(3, 3 + 2 * 12).reshape(2, 12)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.train()
    losses = _steps(model, lambda: model(input_ids=ids, labels=ids).loss, lr=recipe.train.lr)
    record = {
        "rank": state.process_index,
        "four_bit_bytes": _four_bit_bytes(model),
        "frozen_bytes": _frozen_bytes(model),
        "tensors": report.tensors,
        "quantized": report.quantized,
        "initializer_range": model.config.initializer_range,
        "losses": losses,
    }
    torch.save({"logits": logits, "whole": whole}, out / f"rank-{state.process_index}.pt")
    (out / f"rank-{state.process_index}.json").write_text(json.dumps(record))
    state.destroy_process_group()
    return 0


def dpo(resolved: Path, out: Path) -> int:
    """A DPO recipe (RESOLVED on the CPU, FSDP settings from the environment): the sharded LoRA model handed
    to finetune's build_trainer, whose DPO trainer scores the reference with the adapter disabled; a few
    plain optimizer steps on one batch of its own collated pairs through the trainer's compute_loss."""
    import torch
    from accelerate import PartialState

    from finetune.recipe.load import load_recipe
    from finetune.train import sharded_load
    from finetune.train.model import load_tokenizer
    from finetune.train.preflight import prepare_data
    from finetune.train.trainers import build_trainer, training_args

    state = PartialState(cpu=True)
    recipe = load_recipe(resolved, allow_resolved=True)
    args = training_args(recipe, run_dir=resolved.parent, has_eval=False)
    model, _ = sharded_load.load_for_training(recipe, args=args)
    tokenizer = load_tokenizer(recipe)
    data = prepare_data(recipe, tokenizer, state=state)
    trainer = build_trainer(recipe, args=args, model=model, tokenizer=tokenizer, data=data, callbacks=[])
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    trainer.model.train()
    losses = _steps(trainer.model, lambda: trainer.compute_loss(trainer.model, batch), lr=recipe.train.lr)
    record = {
        "rank": state.process_index,
        "trainer": next(c.__name__ for c in type(trainer).__mro__ if c.__module__.startswith("trl.")),
        "trainer_model_is_loaded_model": trainer.model is model,
        "ref_model": None if trainer.ref_model is None else type(trainer.ref_model).__name__,
        "lora_layers": sum(1 for n, _ in trainer.model.named_modules() if n.endswith("lora_A")),
        "losses": losses,
    }
    (out / f"rank-{state.process_index}.json").write_text(json.dumps(record))
    torch.save({}, out / f"rank-{state.process_index}.pt")
    state.destroy_process_group()
    return 0


def main() -> int:
    import torch
    from accelerate import PartialState

    from finetune.recipe.load import load_recipe
    from finetune.train import sharded_load
    from finetune.train.model import load_tokenizer
    from finetune.train.preflight import prepare_data
    from finetune.train.trainers import build_trainer, training_args

    resolved, out = Path(sys.argv[1]), Path(sys.argv[2])
    state = PartialState(cpu=True)
    rank = state.process_index
    recipe = load_recipe(resolved, allow_resolved=True)
    # as finetune.train.run sets up a rank: the training arguments first, then the model
    args = training_args(recipe, run_dir=resolved.parent, has_eval=False)
    model, report = sharded_load.load_for_training(recipe, args=args)
    adapter = _adapter(model)
    ids = torch.arange(3, 3 + 2 * 12).reshape(2, 12)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits

    lora_layers = sum(1 for n, _ in model.named_modules() if n.endswith("lora_A"))
    tokenizer = load_tokenizer(recipe)
    data = prepare_data(recipe, tokenizer, state=state)
    trainer = build_trainer(recipe, args=args, model=model, tokenizer=tokenizer, data=data, callbacks=[])
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    batch = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels", "position_ids")}
    batch["use_cache"] = False  # as TRL's compute_loss calls the model
    trainer.model.train()
    ac_plugin = sharded_load.shard_plugin(recipe)
    ac_plugin.activation_checkpointing = True  # what FSDP_ACTIVATION_CHECKPOINTING=true gives
    config, index = sharded_load.checkpoint(recipe)
    ac_model, _ = sharded_load.load_sharded(recipe, config=config, index=index, device="cpu", plugin=ac_plugin)
    if recipe.adapter.groups_lora:  # as build_trainer groups the trainer's model: only checkpointing differs
        from finetune.train.fused_lora import group_shared_inputs

        group_shared_inputs(ac_model)
    ac_model.train()
    checkpointed = _checkpointing_changes(trainer.model, ac_model, batch)
    del ac_model
    trainer.model.train()
    losses = _steps(trainer.model, lambda: trainer.model(**batch).loss, lr=recipe.train.lr)
    full = recipe.adapter.type == "full"
    final_save = _final_save(trainer, out / "final") if not full else None
    accumulation = _accumulation(trainer.model, batch, lr=recipe.train.lr) if full else None

    record = {
        "rank": rank,
        "world_size": state.num_processes,
        "local_bytes": report.local_bytes,
        "four_bit_bytes": _four_bit_bytes(model),
        "frozen_bytes": _frozen_bytes(model),
        "peak_transient_bytes": report.peak_transient_bytes,
        "replicated_bytes": report.replicated_bytes,
        "tensors": report.tensors,
        "quantized": report.quantized,
        "trainer_model_is_loaded_model": trainer.model is model,
        "lora_layers_before": lora_layers,
        "lora_layers_after": sum(1 for n, _ in trainer.model.named_modules() if n.endswith("lora_A")),
        "trainable": [
            (n, str(p.dtype), type(p).__name__) for n, p in trainer.model.named_parameters() if p.requires_grad
        ],
        "losses": losses,
        "accumulation": accumulation,
        "checkpointing_changes": checkpointed,
        "final_save": final_save,
        "accelerate_wrap_error_with_env_plugin": _accelerate_finds_layers({}, model),
        "accelerate_wrap_error_with_trainer_plugin": _accelerate_finds_layers(args.fsdp_plugin_args, model),
    }
    torch.save({"logits": logits, "quant_states": _quant_states(model), "adapter": adapter}, out / f"rank-{rank}.pt")
    (out / f"rank-{rank}.json").write_text(json.dumps(record))
    state.destroy_process_group()
    return 0


if __name__ == "__main__":
    from finetune.train import collector

    # as finetune.train's entry point runs a rank (finetune/train/collector.py)
    collector.hold_until_loaded()
    import accelerate  # noqa: F401
    import torch  # noqa: F401

    from finetune.train import sharded_load, trainers  # noqa: F401

    collector.loaded()
    MODES = {"hybrid": hybrid, "random": random_init, "dpo": dpo}
    collector.exit_rank(MODES[sys.argv[3]](Path(sys.argv[1]), Path(sys.argv[2])) if sys.argv[3:] else main())

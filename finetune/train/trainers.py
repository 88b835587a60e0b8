"""SFTConfig / DPOConfig from the resolved recipe, and the TRL trainers built on them.

The distributed strategy is not set here: accelerate.yaml / ds_config.json (written by the
compiler) reach the Trainer's Accelerator through `accelerate launch`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from finetune.errors import RecipeError
from finetune.recipe.schema import Recipe, dpo_reference, sync_each_batch_pin
from finetune.rundir import CHECKPOINTS
from finetune.trackers import training_arguments

PADDING_FREE_PAIRS_NOTE = "DPO pairs run padding-free: each micro-batch's sequences as one row of their real tokens"


def _micro_batch(recipe: Recipe) -> int:
    mbs = recipe.train.micro_batch_size
    if not isinstance(mbs, int):
        raise RecipeError(
            "must be an integer in a resolved recipe (the planner writes it)",
            key="train.micro_batch_size",
            hint="run through `finetune run`, or set an integer",
        )
    return mbs


def trainer_checkpointing(recipe: Recipe) -> bool:
    """Activation checkpointing by the Trainer; off when accelerate's FSDP plugin applies it instead."""
    by = getattr(recipe.resolved, "activation_checkpointing_by", "trainer")
    return recipe.train.activation_checkpointing == "on" and by == "trainer"


def _checkpointing_args(on: bool) -> dict:
    """transformers 5.24 renamed gradient_checkpointing to activation_checkpointing (the old name
    warns); 5.17 knows only the old one."""
    from transformers import TrainingArguments

    name = (
        "activation_checkpointing"
        if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
        else "gradient_checkpointing"
    )
    from finetune.train.checkpointing import CHECKPOINTING_KWARGS

    return {name: on, f"{name}_kwargs": dict(CHECKPOINTING_KWARGS) if on else None}


def common_args(recipe: Recipe, *, run_dir: Path, has_eval: bool) -> dict:
    from finetune.train.cadence import cadence_args

    t, r = recipe.train, recipe.resolved
    cuda = r.device == "cuda"
    checkpointing = trainer_checkpointing(recipe)
    args = dict(
        output_dir=str(run_dir / CHECKPOINTS),
        **training_arguments(recipe, run_dir),
        per_device_train_batch_size=_micro_batch(recipe),
        per_device_eval_batch_size=_micro_batch(recipe),
        gradient_accumulation_steps=r.gradient_accumulation_steps,
        num_train_epochs=t.epochs if t.epochs is not None else 1.0,
        max_steps=t.max_steps if t.max_steps is not None else -1,
        learning_rate=t.lr,
        lr_scheduler_type=t.scheduler,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        optim=_optimizer(t.optimizer, cuda=cuda),
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_epsilon=t.adam_epsilon,
        neftune_noise_alpha=t.neftune_noise_alpha,
        bf16=t.precision == "bf16",
        fp16=t.precision == "fp16",
        **_checkpointing_args(checkpointing),
        seed=t.seed,
        data_seed=recipe.data.seed,
        logging_steps=t.logging_steps,
        logging_first_step=True,
        logging_nan_inf_filter=False,  # the default hides NaN losses from the logs (and from our policy)
        include_num_input_tokens_seen="non_padding",
        save_total_limit=recipe.output.keep,
        ddp_timeout=int(recipe.distributed.timeout_minutes * 60),
        # the planner's choice: the Trainer skips its no_sync while accumulating (FSDP2 reduce-scatters every
        # micro-batch instead of holding unsharded gradients until the last); false is accelerate's default
        accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": sync_each_batch_pin(recipe) is True}},
        use_cpu=not cuda,
        dataloader_num_workers=2 if cuda else 0,
        dataloader_pin_memory=cuda,
        disable_tqdm=True,  # finetune.train.progress prints one line per logged step instead
        **liger_args(recipe),
        # evaluation/save cadence, warmup (< 1 is a share of the total steps in transformers 5), schedule
        **cadence_args(recipe, has_eval=has_eval),
    )
    return args


# Liger's layer kernels only: TRL's fused LM head already scores tokens without full logits, and
# Liger's own fused cross-entropy would replace that forward (TRL refuses it)
LIGER_LAYERS = {
    "rope": True,
    "rms_norm": True,
    "swiglu": True,
    "cross_entropy": False,
    "fused_linear_cross_entropy": False,
}


def liger_args(recipe: Recipe) -> dict:
    """train.liger, as compile resolved it (finetune.plan.liger_enabled: auto = on for NVIDIA GPUs
    when liger-kernel is installed)."""
    from finetune.registry.families import liger_installed

    if recipe.train.liger != "on":
        return {}
    if not liger_installed():
        raise RecipeError(
            "liger-kernel is not installed on this machine",
            key="train.liger",
            hint="pip install liger-kernel, or set train.liger: off",
        )
    import warnings

    # TRL 1.x marks use_liger_kernel deprecated in favour of Hub kernels, which need the Hub
    warnings.filterwarnings("ignore", message=".*use_liger_kernel=True. is deprecated", category=FutureWarning)
    family = recipe.resolved.model_family if recipe.resolved else ""
    return {"use_liger_kernel": True, "liger_kernel_config": liger_kernel_config(family)}


def liger_kernel_config(model_type: str) -> dict:
    """The kernels Liger applies to a model of `model_type`: LIGER_LAYERS, SwiGLU where registry.families says."""
    from finetune.registry.families import liger_swiglu

    return {**LIGER_LAYERS, "swiglu": liger_swiglu(model_type)}


def sft_config(recipe: Recipe, *, run_dir: Path, has_eval: bool):
    from trl import SFTConfig

    d = recipe.data
    return SFTConfig(
        **common_args(recipe, run_dir=run_dir, has_eval=has_eval),
        max_length=d.max_length,
        packing=d.packing,
        # BFD packing is padding-free: one flat row with position_ids restarting per example. transformers
        # builds a block-diagonal mask from those position_ids for sdpa/eager too (masking_utils,
        # find_packed_sequence_indices), so packed examples never attend to each other with any attention
        # implementation; flash-attention just does it without materializing the mask.
        # continued pre-training splits long documents across packed rows instead of truncating them
        packing_strategy="bfd_split" if recipe.method.type == "pretrain" else "bfd",
        padding_free=d.packing,
        # the planner's choice where cuDNN's masked attention or Liger's Triton kernels meet the rows
        # (plan.row_multiple); a packed row's pads are examples of one token each, position 0, label -100
        pad_to_multiple_of=recipe.resolved.row_multiple if recipe.resolved else None,
        # the loss mask is already in our `labels` column (see finetune/train/tokenize.py)
        assistant_only_loss=False,
        completion_only_loss=False,
    )


def dpo_config(recipe: Recipe, *, run_dir: Path, has_eval: bool):
    from trl import DPOConfig

    m = recipe.method
    return DPOConfig(
        **common_args(recipe, run_dir=run_dir, has_eval=has_eval),
        max_length=recipe.data.max_length,
        beta=m.beta,
        loss_type=[m.loss_type],
        precompute_ref_log_probs=dpo_reference(recipe) == "precompute",
        # plan.row_multiple: TRL's padded pairs, or the padding-free pairs' row (finetune/train/dpo_pairs.py)
        pad_to_multiple_of=recipe.resolved.row_multiple if recipe.resolved and not recipe.data.packing else None,
    )


def training_args(recipe: Recipe, *, run_dir: Path, has_eval: bool):
    from finetune.train.methods import is_method_here, method_config

    if is_method_here(recipe):  # kto, orpo, simpo, reward
        return method_config(recipe, common_args(recipe, run_dir=run_dir, has_eval=has_eval))
    build = dpo_config if recipe.method.type == "dpo" else sft_config  # sft and pretrain: SFTTrainer
    return build(recipe, run_dir=run_dir, has_eval=has_eval)


def build_trainer(recipe: Recipe, *, args, model, tokenizer, data, callbacks: list):
    """The TRL trainer. `args` must be built before the model is loaded: under ZeRO-3 the
    TrainingArguments switch from_pretrained to partitioned (zero.Init) loading."""
    trainer = _trainer(recipe, args=args, model=model, tokenizer=tokenizer, data=data, callbacks=callbacks)
    if recipe.adapter.groups_lora:  # the peft model exists now
        from finetune.train.fused_lora import group_shared_inputs

        group_shared_inputs(trainer.model)
    return trainer


def _trainer(recipe: Recipe, *, args, model, tokenizer, data, callbacks: list):
    from finetune.train.model import carries_adapter, lora_config, reference_copy
    from finetune.train.subclass import trainer_class

    peft_config = None if carries_adapter(model) else lora_config(recipe, model)
    from finetune.train.methods import is_method_here, method_trainer

    if is_method_here(recipe):
        return method_trainer(
            recipe, args=args, model=model, tokenizer=tokenizer, data=data, callbacks=callbacks, peft_config=peft_config
        )
    if recipe.method.type in ("sft", "pretrain"):
        sft = trainer_class(sft_trainer_class(recipe), recipe)
        return sft(
            model=model,
            args=args,
            train_dataset=data.train,
            eval_dataset=data.eval,
            processing_class=tokenizer,
            peft_config=peft_config,
            callbacks=callbacks,
        )
    dpo = trainer_class(dpo_trainer_class(recipe), recipe)
    trainer = dpo(
        model=model,
        ref_model=reference_copy(recipe),
        args=args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
    )
    if recipe.data.packing:  # padding-free pairs (finetune/train/dpo_pairs.py)
        attach_padding_free_pairs(trainer, multiple=recipe.resolved.row_multiple if recipe.resolved else None)
    return trainer


def attach_padding_free_pairs(trainer, *, multiple: int | None) -> None:
    """The pairs' hooks on the policy and on the reference copy, if the trainer has one: the copy gets finetune's
    packed-row mask hooks as well, which the policy got at load (train/model.py load_training_model). TRL hands
    the copy to DeepSpeed or FSDP in its __init__, so it may be a DeepSpeedEngine here (whose `config` is DeepSpeed's
    dict): the hooks go on the model inside, which the engine's forward calls with the same arguments."""
    from finetune.train import attention
    from finetune.train.dpo_pairs import PaddingFreePairs

    pairs = PaddingFreePairs(multiple=multiple)
    pairs.attach(trainer.model)
    if trainer.ref_model is not None:
        reference = trainer.accelerator.unwrap_model(trainer.ref_model)
        pairs.attach(reference)
        if reference.config._attn_implementation == attention.NAME:
            attention.skip_packed_row_masks(reference)
    logging.getLogger("finetune.train").info(PADDING_FREE_PAIRS_NOTE)


def dpo_trainer_class(recipe: Recipe) -> type:
    """train.deferred_metrics: finetune's DPOTrainer subclass that logs TRL's metrics without a host sync or a
    gather per micro-batch (finetune/train/dpo.py), or the one that only takes tokenized data as it is."""
    from finetune.train.dpo import DeferredMetricsDPOTrainer, PretokenizedDPOTrainer

    return DeferredMetricsDPOTrainer if recipe.train.deferred_metrics else PretokenizedDPOTrainer


def sft_trainer_class(recipe: Recipe) -> type:
    """train.deferred_metrics: finetune's SFTTrainer subclass that logs TRL's metrics without a host sync per
    micro-batch (finetune/train/sft.py), or TRL's SFTTrainer as it is."""
    if recipe.train.deferred_metrics:
        from finetune.train.sft import DeferredMetricsSFTTrainer

        return DeferredMetricsSFTTrainer
    from trl import SFTTrainer

    return SFTTrainer


def _optimizer(name: str, *, cuda: bool) -> str:
    """TrainingArguments.optim: the 8-bit optimizers share their names with transformers'; adamw is
    torch's fused AdamW on GPUs."""
    if name != "adamw":
        return name
    return "adamw_torch_fused" if cuda else "adamw_torch"

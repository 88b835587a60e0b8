"""Evaluation and checkpoint cadence per epoch, warmup, the min-lr cosine schedule, early stopping.

`evals_per_epoch` / `saves_per_epoch` become step intervals only once the Trainer knows how many
optimizer steps an epoch has (packing and the world size change it), so EpochCadence sets them in
on_train_begin from the prepared dataloader, exactly as the Trainer counts update steps. The
TrainingArguments carry placeholders that pass their own checks until then.
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from finetune.recipe.schema import Recipe

log = logging.getLogger("finetune.train")
DEFAULT_MIN_LR_RATIO = 0.1


def cadence_args(recipe: Recipe, *, has_eval: bool) -> dict:
    """TrainingArguments for evaluation, saving, warmup, the schedule and the best checkpoint."""
    t, o = recipe.train, recipe.output
    evaluates = has_eval and bool(t.eval_steps or t.evals_per_epoch)
    best = t.load_best_model_at_end or bool(t.early_stopping_patience)
    saves = bool(o.save_every or o.saves_per_epoch) or (best and evaluates)
    # per-epoch cadences start at 1 (a multiple of everything) until EpochCadence knows the epoch length
    eval_steps = t.eval_steps or 1
    save_steps = o.save_every or (1 if o.saves_per_epoch else eval_steps if best else 500)
    args = {
        "eval_strategy": "steps" if evaluates else "no",
        "eval_steps": eval_steps,
        "save_strategy": "steps" if saves else "no",
        "save_steps": save_steps,
        "warmup_steps": t.warmup_steps if t.warmup_steps is not None else t.warmup_ratio,
    }
    if t.scheduler == "cosine_with_min_lr":
        # transformers' get_cosine_with_min_lr_schedule_with_warmup takes min_lr or min_lr_rate (a share of the peak)
        args["lr_scheduler_kwargs"] = (
            {"min_lr": t.min_lr}
            if t.min_lr is not None
            else {"min_lr_rate": t.min_lr_ratio if t.min_lr_ratio is not None else DEFAULT_MIN_LR_RATIO}
        )
    if best and evaluates:
        args.update(
            load_best_model_at_end=t.load_best_model_at_end, metric_for_best_model="eval_loss", greater_is_better=False
        )
    return args


class EpochCadence(TrainerCallback):
    """Turns evals_per_epoch / saves_per_epoch into step intervals at the start of training."""

    def __init__(self, *, evals_per_epoch: int | None, saves_per_epoch: int | None, saves_follow_evals: bool):
        self.evals, self.saves, self.follow = evals_per_epoch, saves_per_epoch, saves_follow_evals

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        n = len(train_dataloader)
        ga = args.gradient_accumulation_steps
        per_epoch = max(n // ga + int(n % ga > 0), 1)  # the Trainer's count of update steps per epoch
        if self.evals:
            state.eval_steps = max(per_epoch // self.evals, 1)
        if self.saves:
            state.save_steps = max(per_epoch // self.saves, 1)
        elif self.follow:
            state.save_steps = state.eval_steps
        if args.load_best_model_at_end and state.save_steps % state.eval_steps:
            # the best checkpoint must be one that was evaluated
            state.save_steps = max(state.save_steps // state.eval_steps, 1) * state.eval_steps
        log.info(
            f"{per_epoch} optimizer steps per epoch: evaluating every {state.eval_steps}, "
            f"saving every {state.save_steps} steps"
        )


def cadence_callbacks(recipe: Recipe, *, has_eval: bool) -> list:
    t, o = recipe.train, recipe.output
    out = []
    best = t.load_best_model_at_end or bool(t.early_stopping_patience)
    if t.evals_per_epoch or o.saves_per_epoch:
        out.append(
            EpochCadence(
                evals_per_epoch=t.evals_per_epoch if has_eval else None,
                saves_per_epoch=o.saves_per_epoch,
                saves_follow_evals=best and not (o.save_every or o.saves_per_epoch),
            )
        )
    if t.early_stopping_patience and has_eval:
        from transformers import EarlyStoppingCallback

        out.append(
            EarlyStoppingCallback(
                early_stopping_patience=t.early_stopping_patience, early_stopping_threshold=t.early_stopping_threshold
            )
        )
    return out

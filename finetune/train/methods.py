"""KTO, ORPO, SimPO and reward modelling on TRL's own trainers, and the rows each one is given.

    kto     trl.KTOTrainer                       rows prompt / completion / label (paired rows are unpaired)
    orpo    trl.experimental.orpo.ORPOTrainer    rows prompt / chosen / rejected (text or messages)
    simpo   trl.experimental.cpo.CPOTrainer      loss_type "simpo", the same rows
    reward  trl.RewardTrainer                    chosen_ids / rejected_ids (prompt + answer, tokenized here)

KTO, ORPO and CPO tokenize inside the trainer (they apply the chat template to message rows
themselves); preflight still tokenizes every row once to enforce data.max_length and to drop rows
with nothing to learn, naming file and row. SFT and DPO stay in trainers.py; continued
pre-training (`pretrain`) is SFT on raw text there.
"""

from __future__ import annotations

import os

from finetune.recipe.schema import Recipe
from finetune.train.subclass import trainer_class
from finetune.train.tokenize import dpo_features

METHOD_NAMES = {"kto": "KTO", "orpo": "ORPO", "simpo": "SimPO", "reward": "reward modelling"}


def _pair_lengths(record: dict, tokenizer) -> tuple[int, bool]:
    f = dpo_features(record, tokenizer)
    return len(f["prompt_ids"]) + max(len(f["chosen_ids"]), len(f["rejected_ids"])), bool(
        f["chosen_ids"] and f["rejected_ids"]
    )


def method_rows(records: list[dict], tokenizer, *, method: str) -> list[dict]:
    """Converted records -> the trainer's rows, each with `_length`, `_has_loss`, `_file`, `_row`."""
    from finetune.data.preference import unpair

    out = []
    for record in records:
        where = {"_file": record["_file"], "_row": record["_row"]}
        if method == "reward":
            f = dpo_features(record, tokenizer)
            out.append(
                {
                    "chosen_ids": f["prompt_ids"] + f["chosen_ids"],
                    "rejected_ids": f["prompt_ids"] + f["rejected_ids"],
                    "_length": len(f["prompt_ids"]) + max(len(f["chosen_ids"]), len(f["rejected_ids"])),
                    "_has_loss": bool(f["chosen_ids"] and f["rejected_ids"]),
                    **where,
                }
            )
        elif method == "kto":
            rows = unpair(record) if "chosen" in record else [{k: record[k] for k in ("prompt", "completion", "label")}]
            for row in rows:
                length, ok = _pair_lengths(
                    {"prompt": row["prompt"], "chosen": row["completion"], "rejected": row["completion"]}, tokenizer
                )
                out.append({**row, "_length": length, "_has_loss": ok, **where})
        else:
            length, ok = _pair_lengths(record, tokenizer)
            out.append(
                {
                    "prompt": record["prompt"],
                    "chosen": record["chosen"],
                    "rejected": record["rejected"],
                    "_length": length,
                    "_has_loss": ok,
                    **where,
                }
            )
    return out


def method_config(recipe: Recipe, common: dict):
    """The TRL config of a method in this module, on the common TrainingArguments."""
    m, max_length = recipe.method, recipe.data.max_length
    # plan.row_multiple: KTO's and the reward trainer's padded rows (ORPO's and CPO's collators take no multiple)
    multiple = recipe.resolved.row_multiple if recipe.resolved else None
    if m.type == "kto":
        from trl import KTOConfig

        return KTOConfig(
            **common,
            max_length=max_length,
            beta=m.beta,
            desirable_weight=m.desirable_weight,
            undesirable_weight=m.undesirable_weight,
            precompute_ref_log_probs=m.reference == "precompute",
            pad_to_multiple_of=multiple,
        )
    if m.type == "reward":
        from trl import RewardConfig

        return RewardConfig(
            **common,
            max_length=max_length,
            center_rewards_coefficient=m.center_rewards_coefficient,
            pad_to_multiple_of=multiple,
        )
    _quiet_experimental()
    # their batches hold chosen_/rejected_ ids where transformers' count looks for input_ids: CountsPairTokens
    common = {**common, "include_num_input_tokens_seen": "no"}
    if m.type == "orpo":
        from trl.experimental.orpo import ORPOConfig

        return ORPOConfig(**common, max_length=max_length, beta=m.beta)
    from trl.experimental.cpo import CPOConfig

    return CPOConfig(
        **common,
        max_length=max_length,
        loss_type="simpo",
        beta=m.beta,
        simpo_gamma=m.simpo_gamma,
        cpo_alpha=m.cpo_alpha,
    )


def _quiet_experimental() -> None:
    # ORPO and CPO live in trl.experimental, which warns on import; the choice is the recipe's, not an accident
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


class CountsPairTokens:
    """Mixed into ORPO's and CPO's trainers: their batches hold `chosen_*`/`rejected_*` tensors, so transformers'
    count of the tokens seen (finetune's tokens/s) finds no `input_ids` and stays 0. This counts both sequences'
    real tokens (prompt and answer, as DPO's trainer and the planner count a pair) on the device each
    micro-batch, and adds them over the ranks when the Trainer logs: one gather a log, no sync a micro-batch."""

    PAIR_MASKS = ("chosen_attention_mask", "rejected_attention_mask")
    _pair_tokens = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        tokens = sum(inputs[k].sum() for k in self.PAIR_MASKS if k in inputs)
        if not isinstance(tokens, int):  # a device tensor: the batch had the masks
            self._pair_tokens = tokens if self._pair_tokens is None else self._pair_tokens + tokens
        return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._pair_tokens is not None:  # every rank logs, so every rank joins the gather
            seen = self.accelerator.gather(self._pair_tokens.reshape(1)).sum()
            self.state.num_input_tokens_seen += int(seen)
            self._pair_tokens = None
        super().log(logs, start_time)


def method_trainer(recipe: Recipe, *, args, model, tokenizer, data, callbacks: list, peft_config):
    kw = {
        "model": model,
        "args": args,
        "train_dataset": data.train,
        "eval_dataset": data.eval,
        "processing_class": tokenizer,
        "peft_config": peft_config,
        "callbacks": callbacks,
    }
    m = recipe.method.type
    if m == "kto":
        from trl import KTOTrainer

        from finetune.train.model import reference_copy

        return trainer_class(KTOTrainer, recipe)(ref_model=reference_copy(recipe), **kw)
    if m == "reward":
        from trl import RewardTrainer

        return trainer_class(RewardTrainer, recipe)(**kw)
    _quiet_experimental()
    if m == "orpo":
        from trl.experimental.orpo import ORPOTrainer

        return trainer_class(ORPOTrainer, recipe, CountsPairTokens)(**kw)
    from trl.experimental.cpo import CPOTrainer

    return trainer_class(CPOTrainer, recipe, CountsPairTokens)(**kw)


def is_method_here(recipe: Recipe) -> bool:
    return recipe.method.type in METHOD_NAMES

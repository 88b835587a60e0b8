"""DPOTrainer subclasses: tokenized data taken as it is, and metrics without a host sync per micro-batch.

`PretokenizedDPOTrainer`: DPOTrainer (trl 1.16) always runs its own `_prepare_dataset`, which looks for text
`prompt` columns; SFTTrainer instead skips tokenization when `input_ids` is present. This subclass gives DPO the
same behaviour for datasets that already carry `prompt_ids` / `chosen_ids` / `rejected_ids` (built by
finetune/train/tokenize.py exactly as DPOTrainer's tokenize_fn does), so a cache hit really skips tokenization.

`DeferredMetricsDPOTrainer` (train.deferred_metrics): TRL 1.16's `DPOTrainer._compute_loss` logs entropy, token
counts, mean logits, token accuracy, rewards, reward accuracy and margins and log-probabilities on every
micro-batch with 15 gathers across the ranks and 13 `.item()` calls, each a host sync (and on several GPUs a
collective every rank must reach). For plain DPO (the sigmoid loss on reverse KL, no length-desensitized
log-probabilities, no WPO weighting, no MoE auxiliary loss) this subclass computes the loss with TRL's own
operations and TRL's own reference pass (`compute_ref_log_probs`), so the loss and the gradients are TRL's; it
keeps each micro-batch's metric sums and counts on the device and turns them, with one gather when the
Trainer logs, into the per-micro-batch values TRL appends to `self._metrics`. Every other configuration goes to
TRL's `_compute_loss` unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from trl import DPOTrainer

from finetune.train.deferred import DeferredMetrics, follows_trl, fused_output_fields

TOKENIZED = ("prompt_ids", "chosen_ids", "rejected_ids")
# keys of TRL's DPO batch that are not model inputs
NON_MODEL_KEYS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")
# the per-token fields of TRL's fused LM head output this trainer reads
FUSED_FIELDS = ("log_probs", "entropy", "is_top1", "mean_logits")
# what this trainer reads of DPOTrainer's own state (TRL 1.16)
TRAINER_STATE = (
    "_metrics",
    "_total_train_tokens",
    "_tp_size",
    "beta",
    "loss_types",
    "loss_weights",
    "ld_alpha",
    "f_divergence_type",
    "use_weighting",
    "aux_loss_enabled",
    "precompute_ref_logps",
)
# one row of sums per micro-batch, in this order
SUMS = (
    "entropy",  # entropy over the completion tokens
    "completion_tokens",
    "chosen_logits",
    "chosen_tokens",
    "rejected_logits",
    "rejected_tokens",
    "chosen_correct",  # the chosen completion's tokens predicted top-1
    "chosen_rewards",
    "rejected_rewards",
    "reward_accuracies",
    "margins",
    "chosen_logps",
    "rejected_logps",
    "pairs",
    "input_tokens",  # attention_mask's sum (training only; TRL's num_tokens)
)
# TRL's logged metric: (numerator, denominator) of SUMS, 0 where the denominator is
RATIOS = {
    "entropy": ("entropy", "completion_tokens"),
    "logits/chosen": ("chosen_logits", "chosen_tokens"),
    "logits/rejected": ("rejected_logits", "rejected_tokens"),
    "mean_token_accuracy": ("chosen_correct", "chosen_tokens"),
    "rewards/chosen": ("chosen_rewards", "pairs"),
    "rewards/rejected": ("rejected_rewards", "pairs"),
    "rewards/accuracies": ("reward_accuracies", "pairs"),
    "rewards/margins": ("margins", "pairs"),
    "logps/chosen": ("chosen_logps", "pairs"),
    "logps/rejected": ("rejected_logps", "pairs"),
}


class PretokenizedDPOTrainer(DPOTrainer):
    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if all(c in (dataset.column_names or []) for c in TOKENIZED):
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)


class DeferredMetricsDPOTrainer(DeferredMetrics, PretokenizedDPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import trl

        fields = fused_output_fields()
        self._deferred = (
            follows_trl(trl.__version__)
            and all(name in fields for name in FUSED_FIELDS)
            and all(hasattr(self, name) for name in TRAINER_STATE)
        )
        self._start_deferring()  # the tokens seen: the attention mask's sum, TRL's num_tokens

    def _takes_own_path(self, return_outputs: bool) -> bool:
        return (
            self._deferred
            and not return_outputs
            and list(self.loss_types) == ["sigmoid"]
            and self.f_divergence_type == "reverse_kl"
            and self.ld_alpha is None
            and not self.use_weighting
            and not self.aux_loss_enabled
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self._takes_own_path(return_outputs):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        mode = "train" if self.model.training else "eval"
        # TRL 1.16's policy pass: the fused LM head's per-token log-probabilities of the completion tokens
        model_kwargs = {k: v for k, v in inputs.items() if k not in NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        completion_mask = inputs["completion_mask"]
        shift_mask = completion_mask[..., 1:]
        labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)
        outputs = model(**model_kwargs, labels=labels, fused_lm_head=True)
        seq_len = shift_mask.size(1)
        chosen_logps, rejected_logps = outputs.log_probs[:, -seq_len:].sum(dim=1).chunk(2, dim=0)
        if self.precompute_ref_logps:
            ref_chosen_logps, ref_rejected_logps = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        else:  # TRL's reference pass: the adapter disabled on the policy, or the reference copy
            reference = self.model if self.ref_model is None else self.ref_model
            ref_chosen_logps, ref_rejected_logps = self.compute_ref_log_probs(reference, inputs)
        chosen_logratios = chosen_logps - ref_chosen_logps
        rejected_logratios = rejected_logps - ref_rejected_logps
        loss = -F.logsigmoid(self.beta * (chosen_logratios - rejected_logratios)).mean() * self.loss_weights[0]
        self._record(
            mode,
            outputs=outputs,
            inputs=inputs,
            shift_mask=shift_mask,
            logratios=(chosen_logratios.detach(), rejected_logratios.detach()),
            logps=(chosen_logps.detach(), rejected_logps.detach()),
        )
        return loss

    def _record(self, mode: str, *, outputs, inputs, shift_mask, logratios, logps) -> None:
        """The micro-batch's metric sums and counts, left on the device (no sync, no collective)."""
        seq_len = shift_mask.size(1)
        mask = shift_mask.to(torch.float64)
        chosen_mask, rejected_mask = mask.chunk(2, dim=0)
        chosen_logits, rejected_logits = outputs.mean_logits[:, -seq_len:].detach().double().chunk(2, dim=0)
        chosen_top1, _ = outputs.is_top1[:, -seq_len:].chunk(2, dim=0)
        chosen_rewards, rejected_rewards = (self.beta * r for r in logratios)
        tokens = inputs["attention_mask"].sum() if mode == "train" else mask.new_zeros(())
        sums = (
            (outputs.entropy[:, -seq_len:].detach().double() * mask).sum(),
            mask.sum(),
            (chosen_logits * chosen_mask).sum(),
            chosen_mask.sum(),
            (rejected_logits * rejected_mask).sum(),
            rejected_mask.sum(),
            (chosen_top1.double() * chosen_mask).sum(),
            chosen_rewards.double().sum(),
            rejected_rewards.double().sum(),
            (chosen_rewards > rejected_rewards).double().sum(),
            (chosen_rewards - rejected_rewards).double().sum(),
            logps[0].double().sum(),
            logps[1].double().sum(),
            mask.new_tensor(float(logps[0].numel())),
            tokens.double(),
        )
        self._append_pending(mode, torch.stack(sums))

    def _flush(self, mode: str) -> None:
        """Append to TRL's `self._metrics` the per-micro-batch values its `_compute_loss` would have appended."""
        pending = self._take_pending(mode, len(SUMS))
        if pending is None:
            return
        metrics = self._metrics[mode]
        for row in self._sum_over_ranks(pending).tolist():
            sums = dict(zip(SUMS, row, strict=True))
            if mode == "train":
                self._add_trained_tokens(sums["input_tokens"])
            metrics["num_tokens"] = [self._total_train_tokens]
            for key, (numerator, denominator) in RATIOS.items():
                metrics[key].append(sums[numerator] / sums[denominator] if sums[denominator] > 0 else 0.0)

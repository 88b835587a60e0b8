"""SFTTrainer whose per-micro-batch metrics stay on the device until the Trainer logs (train.deferred_metrics).

TRL 1.16's `SFTTrainer.compute_loss` records entropy, mean_token_accuracy and num_tokens on every
micro-batch with three or four `accelerator.gather_for_metrics` calls (collectives on a multi-GPU run),
four `.item()` calls and an `if num_valid > 0` on a device tensor. Each of those is a host sync: the CPU
waits for the GPU to drain its queue, and the GPU then idles while the CPU launches the backward.

This subclass computes the loss with TRL's own operations (so the loss and the gradients are bit-for-bit
TRL's), keeps the per-micro-batch sums (entropy, correct top-1, valid labels, tokens) on the device, and
turns them in `log()` with one gather into the very per-micro-batch values TRL appends to `self._metrics`.
TRL's `log()` then averages them as it always does: the logged entropy and mean_token_accuracy are the mean
of per-micro-batch ratios (TRL's definition, kept so the figures mean the same with the setting on or off),
and num_tokens is the running total of tokens trained on.

The paths this file does not re-implement (`return_outputs`, `compute_loss_func`, label smoothing, sequence
parallelism, the MoE auxiliary loss, loss types other than nll/dft, a TRL without the fused-head outputs)
go to TRL's `compute_loss` unchanged.
"""

from __future__ import annotations

import torch
from trl import SFTTrainer

from finetune.train.deferred import DeferredMetrics, follows_trl, fused_output_fields

# the per-token fields of TRL's FusedCausalLMOutput this trainer reads
FUSED_FIELDS = ("log_probs", "label_mask", "entropy", "is_top1")
# entropy sum, correct top-1, valid labels: one row per micro-batch
SUMS_WIDTH = 3


def deferred_metrics_supported() -> bool:
    """The installed TRL is one whose compute_loss this trainer follows, and its fused LM head returns
    log_probs, label_mask, entropy and is_top1."""
    import trl

    return follows(trl.__version__, fused_output_fields())


def follows(trl_version: str, output_fields) -> bool:
    """TRL_MIN <= trl_version < TRL_BEFORE (finetune/train/deferred.py), and the fused head's output has every
    field of FUSED_FIELDS."""
    return follows_trl(trl_version) and all(name in output_fields for name in FUSED_FIELDS)


# what this trainer reads of SFTTrainer's own state (TRL 1.16)
TRAINER_STATE = ("_metrics", "_total_train_tokens", "_tp_size", "aux_loss_enabled")


class DeferredMetricsSFTTrainer(DeferredMetrics, SFTTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._deferred = deferred_metrics_supported() and all(hasattr(self, name) for name in TRAINER_STATE)
        # per micro-batch [entropy sum, correct, valid], float64 on the device (exact for fp32/bf16 sums and
        # integer counts below 2**53); the sums' own dtypes, to divide in them as TRL does
        self._sum_dtypes: tuple[torch.dtype, torch.dtype, torch.dtype] | None = None
        # train tokens not yet added to TRL's self._total_train_tokens: a device sum (attention_mask) and a
        # host count (padding-free rows, whose length is known on the host). Counted for the tokens seen too,
        # they keep a padding-free row's EOS tokens that transformers' non_padding rule (input_ids != pad)
        # drops when the pad token is the EOS token
        self._pending_tokens: torch.Tensor | None = None
        self._pending_token_count = 0
        self._start_deferring()

    def _takes_own_path(self, return_outputs: bool) -> bool:
        if not self._deferred or return_outputs:
            return False
        if self.compute_loss_func is not None or self.label_smoother is not None or self.aux_loss_enabled:
            return False
        if self.args.loss_type not in ("nll", "dft"):
            return False
        parallelism = getattr(self.accelerator, "parallelism_config", None)
        return not (parallelism is not None and getattr(parallelism, "sp_enabled", False))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self._takes_own_path(return_outputs):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        mode = "train" if self.model.training else "eval"
        # TRL 1.16's plain path: the fused LM head's per-token log-probabilities, summed over the valid labels
        inputs["use_cache"] = False
        outputs = model(**inputs, fused_lm_head=True)
        per_token_loss = -outputs.log_probs  # zero on ignored positions
        if self.args.loss_type == "dft":
            per_token_loss = per_token_loss * outputs.log_probs.exp().detach()
        num_tokens = outputs.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
        loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        self._record(mode, outputs=outputs, inputs=inputs)
        return loss

    def _record(self, mode: str, *, outputs, inputs) -> None:
        """The micro-batch's metric sums, left on the device (no sync, no collective)."""
        sums = (outputs.entropy.detach().sum(), outputs.is_top1.sum(), outputs.label_mask.sum())
        self._sum_dtypes = tuple(s.dtype for s in sums)
        self._append_pending(mode, torch.stack([s.double() for s in sums]))
        if mode != "train":
            return
        # what TRL counts: the attention mask, or the padding-free row's length
        if "attention_mask" in inputs:
            mask_sum = inputs["attention_mask"].sum()
            self._pending_tokens = mask_sum if self._pending_tokens is None else self._pending_tokens + mask_sum
        elif "position_ids" in inputs and self.args.pad_to_multiple_of:
            # the collator's pads trail the row, each at position 0: count up to the last token at another position
            # (on the device, no sync; a row ending in a one-token example counts one token short)
            pos = inputs["position_ids"][0]
            real = torch.where(pos != 0, torch.arange(pos.numel(), device=pos.device), -1).max() + 1
            self._pending_tokens = real if self._pending_tokens is None else self._pending_tokens + real
        elif "position_ids" in inputs:
            self._pending_token_count += inputs["position_ids"].size(1)
        else:
            raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")

    def _flush(self, mode: str) -> None:
        """Gather the pending sums once and hand TRL's `log()` the per-micro-batch values its compute_loss
        would have appended. Every rank runs the same number of micro-batches, so every rank gathers here."""
        has_tokens = self._pending_tokens is not None or self._pending_token_count > 0
        if not self._pending[mode] and not has_tokens:
            return
        pending = self._take_pending(mode, SUMS_WIDTH)
        device = pending.device if pending is not None else self.args.device
        tokens = torch.tensor([float(self._pending_token_count)], dtype=torch.float64, device=device)
        if self._pending_tokens is not None:
            tokens = tokens + self._pending_tokens.to(device=device, dtype=torch.float64)
        local = tokens if pending is None else torch.cat([tokens, pending.reshape(-1)])
        total = self._sum_over_ranks(local)
        self._pending_tokens, self._pending_token_count = None, 0

        self._add_trained_tokens(total[0].item())
        metrics = self._metrics[mode]
        if pending is not None:
            entropy_dtype, correct_dtype, valid_dtype = self._sum_dtypes
            per_batch = total[1:].view(-1, SUMS_WIDTH)
            entropy = per_batch[:, 0].to(entropy_dtype)
            correct = per_batch[:, 1].to(correct_dtype)
            valid = per_batch[:, 2].to(valid_dtype)
            zero = torch.zeros((), dtype=torch.float32)
            metrics["entropy"].extend(torch.where(valid > 0, entropy / valid, zero).tolist())
            metrics["mean_token_accuracy"].extend(torch.where(valid > 0, correct / valid, zero).tolist())
        if pending is not None or "num_tokens" in metrics:
            metrics["num_tokens"] = [self._total_train_tokens]

"""Padding-free DPO pairs (data.packing with method dpo): a micro-batch's chosen and rejected sequences as one
flat row of their real tokens.

TRL 1.16's DPOTrainer pads chosen and rejected to the batch's longest and switches its own `padding_free` off
("temporarily unavailable after a refactor"), so every pad token is computed and attention runs on sdpa with a
padding mask. finetune keeps TRL's collator and loss unchanged and changes only the model call, through two
forward hooks (PyTorch's public hook API) on the model the trainer calls, for the calls that ask for TRL's fused
LM head (`fused_lm_head=True`: the policy's and the reference's log-probabilities):

- before the forward, the right-padded (2B, T) batch becomes one row of its real tokens, with position_ids
  restarting at each sequence, the sequence boundaries as TRL's padding-free SFT collator passes them
  (`cu_seq_lens_q/k`, `max_length_q/k`: what finetune's varlen attention reads; without it transformers
  builds the block-diagonal mask from the position_ids), and `shift_labels` (the next token's label, -100 at
  each sequence's last token, so no prediction crosses a boundary);
- after it, the per-token log-probabilities go back to the (2B, T - 1) layout TRL's loss sums over.

The log-probabilities, the loss and the gradients are the padded run's (tests/unit/train/test_dpo_pairs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PaddingFreePairs:
    """The two hooks and the layout of the call in flight (one at a time: the reference's forward runs
    after the policy's has returned)."""

    layouts: list = field(default_factory=list)

    def attach(self, module) -> None:
        module.register_forward_pre_hook(self.before, with_kwargs=True)
        module.register_forward_hook(self.after, with_kwargs=True)

    def before(self, module, args, kwargs):
        import torch

        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        if args or not kwargs.get("fused_lm_head") or ids is None or mask is None or kwargs.get("labels") is None:
            self.layouts.append(None)
            return None
        keep = mask.bool()
        lengths = keep.sum(dim=1)
        flat_labels = kwargs["labels"][keep]
        shift = torch.roll(flat_labels, -1)
        ends = torch.cumsum(lengths, dim=0)
        shift[ends - 1] = -100  # a sequence's last token predicts nothing (the next one is another sequence's)
        cu = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
        longest = int(lengths.max())
        starts = torch.repeat_interleave(ends - lengths, lengths)
        positions = torch.arange(int(ends[-1]), device=ids.device) - starts
        packed = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask", "labels")}
        packed.update(
            input_ids=ids[keep][None],
            position_ids=positions[None],
            shift_labels=shift[None],
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=longest,
            max_length_k=longest,
        )
        self.layouts.append(keep)
        return args, packed

    def after(self, module, args, kwargs, output):
        keep = self.layouts.pop()
        if keep is None:
            return None
        for name in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask"):
            packed = getattr(output, name, None)
            if packed is not None:
                padded = packed.new_zeros(keep.shape).masked_scatter(keep, packed[0])
                setattr(output, name, padded[:, :-1])
        return output

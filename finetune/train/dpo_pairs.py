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

With `multiple` (resolved.row_multiple: where layers run sdpa's masked kernel over the row, whose cuDNN plans
each new row length, or Liger's Triton kernels take its length) the row is padded at its end to a multiple of
that many tokens with one-token sequences (position 0, no label), which no real token attends to and the
log-probabilities leave behind.

The log-probabilities, the loss and the gradients are the padded run's (tests/unit/train/test_dpo_pairs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PaddingFreePairs:
    """The two hooks and the layout of the call in flight (one at a time: the reference's forward runs
    after the policy's has returned)."""

    multiple: int | None = None  # pad the row to a multiple of this many tokens (module docstring)
    layouts: list = field(default_factory=list)
    _last: tuple | None = None  # (the mask, its layout): the reference's call reuses the policy's

    def attach(self, module) -> None:
        # first among the module's pre-hooks: those registered at load read the bounds this one adds
        # (train/attention.py skip_packed_row_masks)
        module.register_forward_pre_hook(self.before, with_kwargs=True, prepend=True)
        module.register_forward_hook(self.after, with_kwargs=True)

    def layout(self, mask) -> dict:
        """Where each sequence's real tokens go in the flat row, worked out on the host from one copy of the
        mask: indexing by a device mask (its output's size) would wait for the GPU at every step of it, seven
        host syncs a call where this makes one a micro-batch. The index tensors go back without a wait."""
        if self._last is not None and self._last[0] is mask:
            return self._last[1]
        import torch

        host = mask.to("cpu").bool()
        lengths = host.sum(dim=1)
        ends = torch.cumsum(lengths, dim=0)
        starts = torch.repeat_interleave(ends - lengths, lengths)
        real = int(ends[-1])
        pads = -real % self.multiple if self.multiple else 0  # one-token sequences after the real ones
        layout = {
            "index": host.reshape(-1).nonzero().squeeze(1),  # the real tokens, in the order boolean indexing takes
            "positions": torch.cat([torch.arange(real) - starts, torch.zeros(pads, dtype=torch.long)]),
            "last": ends - 1,  # each sequence's last token predicts nothing (the next one is another sequence's)
            "cu": torch.cat([ends.new_zeros(1), ends, torch.arange(real + 1, real + pads + 1)]).to(torch.int32),
        }
        if mask.device.type == "cuda":
            layout = {k: v.pin_memory().to(mask.device, non_blocking=True) for k, v in layout.items()}
        layout["longest"] = int(lengths.max())
        layout["pads"] = pads
        self._last = (mask, layout)
        return layout

    def before(self, module, args, kwargs):
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        if args or not kwargs.get("fused_lm_head") or ids is None or mask is None or kwargs.get("labels") is None:
            self.layouts.append(None)
            return None
        at = self.layout(mask)
        shift = kwargs["labels"].reshape(-1).index_select(0, at["index"]).roll(-1)
        shift.index_fill_(0, at["last"], -100)  # a scalar fill: `shift[last] = -100` copies -100 from the host
        flat = ids.reshape(-1).index_select(0, at["index"])
        if at["pads"]:  # any token id: each pad is its own sequence, without a label
            import torch

            flat = torch.cat([flat, flat.new_zeros(at["pads"])])
            shift = torch.cat([shift, shift.new_full((at["pads"],), -100)])
        packed = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask", "labels")}
        packed.update(
            input_ids=flat[None],
            position_ids=at["positions"][None],
            shift_labels=shift[None],
            cu_seq_lens_q=at["cu"],
            cu_seq_lens_k=at["cu"],
            max_length_q=at["longest"],
            max_length_k=at["longest"],
        )
        self.layouts.append(mask.bool())
        return args, packed

    def after(self, module, args, kwargs, output):
        keep = self.layouts.pop()
        if keep is None:
            return None
        for name in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask"):
            packed = getattr(output, name, None)
            if packed is not None:  # the row's trailing pads are left out: masked_scatter takes what `keep` needs
                padded = packed.new_zeros(keep.shape).masked_scatter(keep, packed[0])
                setattr(output, name, padded[:, :-1])
        return output

"""What finetune's SFT and DPO trainers share to log TRL's per-micro-batch metrics without a host sync per
micro-batch (train.deferred_metrics; finetune/train/sft.py, finetune/train/dpo.py).

Each trainer computes its loss with TRL's own operations, appends one row of metric sums per micro-batch to
`_pending` on the device, and in `log()` sums the rows over the ranks with one gather and hands TRL's
`self._metrics` the per-micro-batch values TRL's compute_loss would have appended. The tokens trained, which
transformers otherwise counts with a gather and an `.item()` on every micro-batch, come from the same sums.
"""

from __future__ import annotations

import torch

# the compute_loss the trainers re-implement follows TRL 1.16's; TRL 2 may change it
TRL_MIN, TRL_BEFORE = "1.16", "2"
# past this many pending micro-batches the rows are stacked into one tensor, so a long logging interval
# holds a few large allocations instead of one small one per micro-batch
COMPACT_AT = 256


def follows_trl(trl_version: str) -> bool:
    """TRL_MIN <= trl_version < TRL_BEFORE."""
    from packaging.version import Version

    return Version(TRL_MIN) <= Version(trl_version) < Version(TRL_BEFORE)


def fused_output_fields() -> dict:
    """The fields of the installed TRL's fused LM head output ({} where it has none)."""
    try:
        from trl.trainer.utils import FusedCausalLMOutput
    except ImportError:
        return {}
    return getattr(FusedCausalLMOutput, "__dataclass_fields__", {})


class DeferredMetrics:
    """Mixed into a TRL trainer before it: `_takes_own_path(return_outputs)` and `_flush(mode)` are the
    trainer's; the pending rows, the gather, the token count and `log()` are shared."""

    _pending: dict[str, list[torch.Tensor]]
    _counts_input_tokens: bool

    def _start_deferring(self) -> None:
        """Called at the end of the trainer's __init__."""
        self._pending = {"train": [], "eval": []}
        # where every training micro-batch goes through the trainer's own path, the tokens seen (finetune's
        # tokens/s) are counted from the deferred sums instead of transformers' gather and .item() per micro-batch
        self._counts_input_tokens = self._takes_own_path(return_outputs=False)
        if self._counts_input_tokens:
            self.args.include_num_input_tokens_seen = "no"

    def _append_pending(self, mode: str, row: torch.Tensor) -> None:
        """One micro-batch's 1-D row of sums, left on the device."""
        rows = self._pending[mode]
        rows.append(row)
        if len(rows) >= COMPACT_AT:
            self._pending[mode] = [torch.cat([r.view(-1, row.numel()) for r in rows])]

    def _take_pending(self, mode: str, width: int) -> torch.Tensor | None:
        """The pending rows as one (micro-batches, width) tensor, None when there are none; emptied."""
        rows, self._pending[mode] = self._pending[mode], []
        return torch.cat([r.view(-1, width) for r in rows]) if rows else None

    def _sum_over_ranks(self, local: torch.Tensor) -> torch.Tensor:
        """`local` summed over the ranks, on the host: the one gather and the one sync of a log (on one process
        the gathered tensor is `local` itself). Every rank runs the same micro-batches, so every rank gathers."""
        return self.accelerator.gather(local.reshape(1, -1)).view(-1, *local.shape).sum(dim=0).cpu()

    def _add_trained_tokens(self, gathered: float) -> None:
        """Tokens trained, summed over the ranks: like TRL, the gathered count repeats each token once per
        tensor-parallel rank."""
        trained = int(gathered) // self._tp_size
        self._total_train_tokens += trained
        if self._counts_input_tokens:
            self.state.num_input_tokens_seen += trained

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self._flush("train" if self.model.training else "eval")  # the pending train tokens in either mode
        super().log(logs, start_time)

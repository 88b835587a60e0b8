"""train.deferred_metrics for DPO: finetune's DPOTrainer subclass (finetune/train/dpo.py) logs what TRL's
DPOTrainer logs (the loss, rewards, margins, log-probabilities, logits, entropy, token accuracy, num_tokens, in
training and evaluation) and trains the same weights, with gradient accumulation, padded and padding-free
pairs; its compute_loss makes no host sync and no gather, where TRL's makes a dozen of each per micro-batch."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.paths import SAMPLES
from tests.helpers.recipes import tiny_recipe, tiny_trainer
from tests.unit.train.test_sft_metrics import _SyncSpy

pytestmark = pytest.mark.slow
METRICS = (
    "loss",
    "entropy",
    "num_tokens",
    "mean_token_accuracy",
    "logits/chosen",
    "logits/rejected",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def _trainer(tmp_path, *, deferred: bool, packing: bool, loss_type: str = "sigmoid", reference: str = "auto"):
    pairs = {"path": str(SAMPLES / "preference.jsonl"), "format": "preference"}
    raw = tiny_recipe(
        method={"type": "dpo", "loss_type": loss_type, "reference": reference},
        data={"sources": [pairs], "eval_sources": [dict(pairs, max_samples=8)], "packing": packing, "max_length": 48},
        # 2 micro-batches per optimizer step, evaluated after step 2 and at the end
        train={
            "max_steps": 3,
            "global_batch_size": 4,
            "micro_batch_size": 2,
            "deferred_metrics": deferred,
            "eval_steps": 2,
        },
    )
    run_dir = tmp_path / ("deferred" if deferred else "trl") / ("pairs" if packing else "padded") / reference
    recipe, trainer = tiny_trainer(raw, run_dir=run_dir, has_eval=True)
    assert recipe.resolved.gradient_accumulation_steps == 2
    return trainer


def _logged(trainer) -> list[dict]:
    keep = METRICS + tuple(f"eval_{m}" for m in METRICS)
    return [{k: v for k, v in row.items() if k in keep} | {"step": row["step"]} for row in trainer.state.log_history]


@pytest.mark.parametrize(
    ("packing", "reference"),
    [(False, "auto"), (True, "auto"), (False, "precompute")],
    ids=["padded", "padding-free", "precomputed-reference"],
)
def test_same_losses_metrics_and_weights_as_trl(tmp_path, packing, reference):
    from finetune.train.dpo import DeferredMetricsDPOTrainer

    ours = _trainer(tmp_path, deferred=True, packing=packing, reference=reference)
    theirs = _trainer(tmp_path, deferred=False, packing=packing, reference=reference)
    assert isinstance(ours, DeferredMetricsDPOTrainer) and ours._takes_own_path(return_outputs=False)
    assert not isinstance(theirs, DeferredMetricsDPOTrainer)
    ours.train()
    theirs.train()

    mine, trl = _logged(ours), _logged(theirs)
    assert [sorted(r) for r in mine] == [sorted(r) for r in trl]
    assert sum("rewards/margins" in r for r in mine) == 3 and sum("eval_rewards/margins" in r for r in mine) == 2
    for a, b in zip(mine, trl, strict=True):
        # the loss is TRL's own operations on the same values; the metrics are summed in float64 on the device
        # instead of TRL's per-micro-batch float32 means, so they agree to float32's precision
        assert a.get("loss") == b.get("loss") and a.get("eval_loss") == b.get("eval_loss")
        assert a.get("num_tokens") == b.get("num_tokens")
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    assert all(r["num_tokens"] > 0 for r in mine if "num_tokens" in r)
    for (name, a), (_, b) in zip(ours.model.named_parameters(), theirs.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    # the tokens seen (finetune's tokens/s), counted from the deferred sums without transformers' per-micro-batch
    # gather: the same count as transformers' (the pad token is not the EOS token here)
    assert ours.args.include_num_input_tokens_seen == "no"
    assert ours.state.num_input_tokens_seen == theirs.state.num_input_tokens_seen > 0


def test_compacted_pending_rows_log_the_same(tmp_path, monkeypatch):
    """A long logging interval stacks the pending rows into one tensor (finetune/train/deferred.py: COMPACT_AT);
    what is logged is the same."""
    import finetune.train.deferred as deferred

    monkeypatch.setattr(deferred, "COMPACT_AT", 2)
    ours = _trainer(tmp_path, deferred=True, packing=False)
    theirs = _trainer(tmp_path, deferred=False, packing=False)
    ours.train()
    theirs.train()
    for a, b in zip(_logged(ours), _logged(theirs), strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)


def test_compute_loss_makes_no_host_sync_or_gather(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, deferred=True, packing=False)
    spy = _SyncSpy(trainer, monkeypatch)
    trainer.train()
    assert spy.compute_loss_calls > 3 * 2 and spy.calls == {}, spy.calls
    assert any("rewards/margins" in r for r in trainer.state.log_history)


def test_the_spy_sees_trls_syncs(tmp_path, monkeypatch):
    """The control: the same spy on TRL's DPOTrainer sees its per-micro-batch syncs and gathers."""
    trainer = _trainer(tmp_path, deferred=False, packing=False)
    spy = _SyncSpy(trainer, monkeypatch)
    trainer.train()
    calls = spy.compute_loss_calls
    assert spy.calls.get("item", 0) >= 10 * calls and spy.calls.get("gather_for_metrics", 0) >= 8 * calls, spy.calls


def test_other_losses_go_to_trl(tmp_path):
    trainer = _trainer(tmp_path, deferred=True, packing=False, loss_type="ipo")
    assert not trainer._takes_own_path(return_outputs=False)
    trainer.train()
    assert any("rewards/margins" in r for r in trainer.state.log_history)


def test_pairs_padded_to_a_multiple_train_as_unpadded(tmp_path):
    """resolved.row_multiple on padded DPO pairs (sdpa's padding mask, cuDNN on an NVIDIA GPU): TRL's collator pads
    each micro-batch to a multiple; the pads are masked, so the losses are those of the unpadded pairs."""
    pairs = {"path": str(SAMPLES / "preference.jsonl"), "format": "preference"}
    trainers = []
    from finetune.plan import PADDED_ROW_MULTIPLE

    for multiple in (None, PADDED_ROW_MULTIPLE):
        raw = tiny_recipe(
            method={"type": "dpo"},
            data={"sources": [pairs], "eval_sources": [], "packing": False, "max_length": 48},
            train={"max_steps": 2, "global_batch_size": 4, "micro_batch_size": 2},
        )
        _, trainer = tiny_trainer(
            raw, run_dir=tmp_path / str(multiple), has_eval=False, resolved={"row_multiple": multiple}
        )
        trainers.append(trainer)
    batch = next(iter(trainers[1].get_train_dataloader()))
    ids = [k for k in batch if k.endswith("input_ids")]
    assert ids and all(batch[k].shape[-1] % PADDED_ROW_MULTIPLE == 0 for k in ids), {
        k: tuple(v.shape) for k, v in batch.items()
    }
    for trainer in trainers:
        trainer.train()
    losses = [[r["loss"] for r in t.state.log_history if "loss" in r] for t in trainers]
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-4)

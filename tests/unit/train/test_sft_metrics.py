"""train.deferred_metrics: finetune's SFTTrainer subclass (finetune/train/sft.py) logs what TRL's SFTTrainer
logs (the loss, entropy, mean_token_accuracy, num_tokens, in training and evaluation) and trains the same
weights bit for bit, with gradient accumulation, padded and padding-free batches; and its compute_loss makes
no host sync and no gather, where TRL's makes several per micro-batch."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.helpers.recipes import tiny_recipe, tiny_trainer

pytestmark = pytest.mark.slow
METRICS = ("loss", "entropy", "mean_token_accuracy", "num_tokens")
# what a host sync looks like from Python on any device: a tensor read into a Python value or copied to the
# host; boolean-mask indexing is not spied (the CPU path of TRL's fused head does not use it)
SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero")


def _trainer(tmp_path, *, deferred: bool, packing: bool, callbacks=(), pad_token: str | None = None):
    raw = tiny_recipe(
        data={"packing": packing, "max_length": 48},
        tokenizer={"pad_token": pad_token} if pad_token else {},
        # 4 micro-batches per optimizer step, evaluated after step 2 and at the end
        train={
            "max_steps": 3,
            "global_batch_size": 8,
            "micro_batch_size": 2,
            "deferred_metrics": deferred,
            "eval_steps": 2,
        },
    )
    run_dir = tmp_path / ("deferred" if deferred else "trl") / ("packed" if packing else "padded")
    recipe, trainer = tiny_trainer(raw, run_dir=run_dir, has_eval=True, callbacks=callbacks)
    assert recipe.resolved.gradient_accumulation_steps == 4
    return trainer


def _logged(trainer) -> list[dict]:
    keep = METRICS + tuple(f"eval_{m}" for m in METRICS)
    return [{k: v for k, v in row.items() if k in keep} | {"step": row["step"]} for row in trainer.state.log_history]


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "padding-free"])
def test_same_losses_metrics_and_weights_as_trl(tmp_path, packing):
    from trl import SFTTrainer

    from finetune.train.sft import DeferredMetricsSFTTrainer

    ours = _trainer(tmp_path, deferred=True, packing=packing)
    theirs = _trainer(tmp_path, deferred=False, packing=packing)
    assert isinstance(ours, DeferredMetricsSFTTrainer) and ours._deferred
    # TRL's own metrics (finetune's subclass adds only the DataLoader workers' signal handling)
    assert isinstance(theirs, SFTTrainer) and not isinstance(theirs, DeferredMetricsSFTTrainer)
    ours.train()
    theirs.train()

    mine, trl = _logged(ours), _logged(theirs)
    assert [sorted(r) for r in mine] == [sorted(r) for r in trl]
    # every optimizer step logged, and the evals after steps 2 and 3
    assert sum("entropy" in r for r in mine) == 3 and sum("eval_entropy" in r for r in mine) == 2
    # the same operations on the same values: equal, not merely close
    assert mine == trl
    assert all(r["num_tokens"] > 0 for r in mine if "num_tokens" in r)
    # the tokens seen (finetune's tokens/s): every token of the rows trained on, without transformers'
    # per-micro-batch gather; transformers' own count (non_padding) agrees where it sees every token
    assert ours.args.include_num_input_tokens_seen == "no"
    trained = [r["num_tokens"] for r in mine if "num_tokens" in r and "loss" in r]
    assert ours.state.num_input_tokens_seen == trained[-1] > 0
    assert ours.state.num_input_tokens_seen == theirs.state.num_input_tokens_seen


def test_tokens_seen_keep_the_eos_tokens_when_the_pad_token_is_eos(tmp_path):
    """transformers' non_padding rule (input_ids != pad) drops every EOS token of a padding-free row when the
    pad token is the EOS token; the deferred count keeps them, as TRL's num_tokens does."""
    ours = _trainer(tmp_path, deferred=True, packing=True, pad_token="<|end|>")
    theirs = _trainer(tmp_path / "trl", deferred=False, packing=True, pad_token="<|end|>")
    assert ours.processing_class.pad_token_id == ours.processing_class.eos_token_id
    ours.train()
    theirs.train()
    trained = [r["num_tokens"] for r in ours.state.log_history if "num_tokens" in r and "loss" in r]
    assert ours.state.num_input_tokens_seen == trained[-1]
    assert ours.state.num_input_tokens_seen > theirs.state.num_input_tokens_seen
    for (name, a), (_, b) in zip(ours.model.named_parameters(), theirs.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


class _SyncSpy:
    """Counts, per name, the host syncs and gathers the trainer's compute_loss makes outside the model's
    forward (transformers' mask building syncs inside it, with or without this trainer), and the
    compute_loss calls."""

    def __init__(self, trainer, monkeypatch):
        self.inside = False
        self.calls: dict[str, int] = {}
        self.compute_loss_calls = 0
        trainer.model.register_forward_pre_hook(lambda *_: self._set(False))
        trainer.model.register_forward_hook(lambda *_: self._set(True))
        for name in SYNCS:
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, getattr(torch.Tensor, name)))
        for name in ("gather", "gather_for_metrics", "reduce"):
            monkeypatch.setattr(trainer.accelerator, name, self._counting(name, getattr(trainer.accelerator, name)))
        compute_loss = trainer.compute_loss

        def spied(*args, **kwargs):
            with self._inside():
                return compute_loss(*args, **kwargs)

        monkeypatch.setattr(trainer, "compute_loss", spied)

    def _set(self, inside: bool) -> None:
        self.inside = inside

    @contextlib.contextmanager
    def _inside(self):
        self.compute_loss_calls += 1
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def _counting(self, name, real):
        def call(*args, **kwargs):
            if self.inside:
                self.calls[name] = self.calls.get(name, 0) + 1
            return real(*args, **kwargs)

        return call


def test_compute_loss_makes_no_host_sync_or_gather(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, deferred=True, packing=True)
    spy = _SyncSpy(trainer, monkeypatch)
    trainer.train()
    assert spy.compute_loss_calls > 3 * 4 and spy.calls == {}
    assert trainer.state.global_step == 3 and any("entropy" in r for r in trainer.state.log_history)


def test_the_training_loop_gathers_once_per_log_not_per_micro_batch(tmp_path, monkeypatch):
    """transformers' token count gathers on every micro-batch; with this trainer only the logs gather
    (gathers inside the evaluation loop, the same with either trainer, are not counted)."""
    for deferred in (True, False):
        trainer = _trainer(tmp_path / str(deferred), deferred=deferred, packing=True)
        gathers, evaluating = [], []
        real_gather, real_evaluate = trainer.accelerator.gather, trainer.evaluate

        def gather(tensor, real=real_gather, evaluating=evaluating, gathers=gathers):
            if not evaluating:
                gathers.append(1)
            return real(tensor)

        def evaluate(*args, real=real_evaluate, evaluating=evaluating, **kwargs):
            evaluating.append(1)
            try:
                return real(*args, **kwargs)
            finally:
                evaluating.pop()

        monkeypatch.setattr(trainer.accelerator, "gather", gather)
        monkeypatch.setattr(trainer, "evaluate", evaluate)
        trainer.train()
        logs = sum("loss" in r or "train_runtime" in r for r in trainer.state.log_history)
        if deferred:
            assert 0 < len(gathers) <= logs, (len(gathers), logs)
        else:
            assert len(gathers) >= 3 * 4, len(gathers)  # one per micro-batch: 3 steps x 4


def test_the_spy_sees_trls_syncs(tmp_path, monkeypatch):
    """The control: the same spy on TRL's SFTTrainer sees its per-micro-batch syncs and gathers."""
    trainer = _trainer(tmp_path, deferred=False, packing=True)
    spy = _SyncSpy(trainer, monkeypatch)
    trainer.train()
    calls = spy.compute_loss_calls
    assert calls > 3 * 4
    # entropy and accuracy read with .item() and tested with `num_valid > 0`, three gathers, on every call
    assert spy.calls.get("item", 0) >= 2 * calls and spy.calls.get("__bool__", 0) >= 2 * calls, spy.calls
    assert spy.calls.get("gather_for_metrics", 0) >= 3 * calls, spy.calls


def test_return_outputs_goes_to_trl_and_the_loss_is_the_same(tmp_path):
    """A path the subclass does not re-implement (return_outputs) is TRL's own: its metrics go straight into
    `_metrics`; the subclass's path gives the same loss on the same batch and defers its metrics to log()."""
    trainer = _trainer(tmp_path, deferred=True, packing=False)
    trainer.model.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    with pytest.warns(FutureWarning, match="return_outputs=True"):
        trl_loss, outputs = trainer.compute_loss(trainer.model, dict(inputs), return_outputs=True)
    assert outputs.logits is not None
    assert len(trainer._metrics["train"]["entropy"]) == 1 and trainer._pending["train"] == []
    trl_entropy = trainer._metrics["train"]["entropy"][0]

    loss = trainer.compute_loss(trainer.model, dict(inputs))
    assert torch.equal(loss, trl_loss)
    assert len(trainer._metrics["train"]["entropy"]) == 1 and len(trainer._pending["train"]) == 1
    trainer.log({})
    # the same batch twice: TRL's value and the deferred one are equal, and so is their mean
    assert trainer._pending["train"] == [] and trainer.state.log_history[-1]["entropy"] == trl_entropy
    assert trainer.state.log_history[-1]["num_tokens"] == 2 * int(inputs["attention_mask"].sum())


def test_version_guard():
    """TRL's own compute_loss runs where TRL is not the version this trainer follows, or where its fused
    head lacks a field the metrics read."""
    from trl.trainer.utils import FusedCausalLMOutput

    from finetune.train.sft import FUSED_FIELDS, deferred_metrics_supported, follows

    assert deferred_metrics_supported()  # the installed TRL
    assert follows("1.16.0", FUSED_FIELDS) and follows("1.99.1", FusedCausalLMOutput.__dataclass_fields__)
    assert not follows("1.15.2", FUSED_FIELDS) and not follows("2.0.0", FUSED_FIELDS)
    assert not follows("1.16.0", [f for f in FUSED_FIELDS if f != "is_top1"])


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_rows_padded_to_a_multiple_train_and_count_as_unpadded(tmp_path, packing):
    """resolved.row_multiple (the planner's choice where cuDNN's masked attention meets the rows): the collator
    pads each padding-free row, or each padded micro-batch, to a multiple; a packed row's pads are one-token
    examples without labels and a padded batch's are masked, so the losses and the weights are those of the
    unpadded rows, and the tokens seen count the real tokens only."""
    from finetune.plan import PADDED_ROW_MULTIPLE

    trainers = []
    for multiple in (None, PADDED_ROW_MULTIPLE):
        raw = tiny_recipe(data={"packing": packing, "max_length": 48}, train={"max_steps": 2, "global_batch_size": 4})
        _, trainer = tiny_trainer(
            raw, run_dir=tmp_path / str(multiple), has_eval=False, resolved={"row_multiple": multiple}
        )
        trainers.append(trainer)
    plain, padded = trainers
    batch = next(iter(padded.get_train_dataloader()))
    assert batch["input_ids"].shape[1] % PADDED_ROW_MULTIPLE == 0
    if packing:
        assert batch["position_ids"][0, -1] == 0
    else:
        assert batch["attention_mask"].shape[0] > 1 and not batch["attention_mask"][:, -1].any()
    plain.train()
    padded.train()
    losses = [[r["loss"] for r in t.state.log_history if "loss" in r] for t in trainers]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
    seen = [t.state.num_input_tokens_seen for t in trainers]
    print("tokens seen, unpadded and padded:", seen)
    # the real tokens only (a packed row ending in a one-token example would count one short)
    micro_batches = 2 * padded.args.gradient_accumulation_steps
    assert seen[0] > 0 and 0 <= seen[0] - seen[1] <= micro_batches

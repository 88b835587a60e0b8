"""Padding-free DPO pairs (finetune/train/dpo_pairs.py): through the real tiny model with TRL's fused LM head
and a PEFT adapter, the hooked call returns the padded call's per-token log-probabilities and gradients, for
pairs of different lengths (TRL's own collator pads them)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.paths import TINY_MODEL


def _model():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32, attn_implementation="sdpa")
    add_fused_lm_head(base)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(base, config)


def _batch():
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    examples = [
        {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9, 10, 11], "rejected_ids": [12]},
        {"prompt_ids": [13], "chosen_ids": [14, 15], "rejected_ids": [16, 17, 18, 19, 20, 21]},
        {"prompt_ids": [22, 23, 24, 25, 26], "chosen_ids": [27], "rejected_ids": [28, 29]},
    ]
    batch = DataCollatorForPreference(pad_token_id=0)(examples)
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    return batch, labels


def _log_probs(model, batch, labels):
    model.zero_grad()
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        labels=labels,
        fused_lm_head=True,
        use_cache=False,
    )
    out.log_probs.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.log_probs.detach(), grads


def test_padding_free_pairs_give_the_padded_log_probs_and_gradients():
    from finetune.train.dpo_pairs import PaddingFreePairs

    model = _model()
    batch, labels = _batch()
    padded, padded_grads = _log_probs(model, batch, labels)
    assert padded.shape == (6, batch["input_ids"].shape[1] - 1)

    pairs = PaddingFreePairs()
    pairs.attach(model)
    seen = {}  # what the model is called with, after the pairs' hook (pre-hooks run in registration order)
    model.register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    free, free_grads = _log_probs(model, batch, labels)
    real = int(batch["attention_mask"].sum())
    # the model saw one row of the real tokens, with the boundaries the varlen kernel reads
    assert seen["input_ids"].shape == (1, real) and "attention_mask" not in seen
    assert seen["cu_seq_lens_q"].tolist() == [0, *batch["attention_mask"].sum(1).cumsum(0).tolist()]
    assert seen["position_ids"][0, :7].tolist() == list(range(7))  # the first pair's chosen: prompt 3 + 4
    assert free.shape == padded.shape
    torch.testing.assert_close(free, padded, rtol=1e-5, atol=1e-5)
    assert padded_grads.keys() == free_grads.keys() and padded_grads
    for name, grad in padded_grads.items():
        scale = float(grad.abs().max())  # fp32 summation order differs between the layouts
        torch.testing.assert_close(free_grads[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)
    assert pairs.layouts == []  # nothing left over between calls
    # the reference's call gets the same mask: its layout is the policy's, read from the host once
    first = pairs.layout(batch["attention_mask"])
    assert pairs.layout(batch["attention_mask"]) is first
    assert pairs.layout(batch["attention_mask"].clone()) is not first


@pytest.mark.parametrize("fused", [False])
def test_other_calls_pass_through_unchanged(fused):
    """generate() and plain forwards (no fused LM head) are not the DPO loss's calls: nothing is repacked."""
    from finetune.train.dpo_pairs import PaddingFreePairs

    model = _model()
    batch, _ = _batch()
    before = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    PaddingFreePairs().attach(model)
    after = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(after, before)


def test_pairs_row_padded_to_a_multiple_gives_the_same_log_probs_and_gradients():
    """resolved.row_multiple on padding-free pairs (layers on sdpa's masked kernel): the row ends in one-token
    sequences up to the multiple, which change no real token's log-probability or gradient."""
    from finetune.train.dpo_pairs import PaddingFreePairs

    model = _model()
    batch, labels = _batch()
    padded, padded_grads = _log_probs(model, batch, labels)
    pairs = PaddingFreePairs(multiple=16)
    pairs.attach(model)
    seen = {}
    model.register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    free, free_grads = _log_probs(model, batch, labels)
    real = int(batch["attention_mask"].sum())
    width = -(-real // 16) * 16
    assert width > real and seen["input_ids"].shape == (1, width)
    ends = batch["attention_mask"].sum(1).cumsum(0).tolist()
    assert seen["cu_seq_lens_q"].tolist() == [0, *ends, *range(real + 1, width + 1)]
    assert seen["position_ids"][0, real:].tolist() == [0] * (width - real)
    assert (seen["shift_labels"][0, real - 1 :] == -100).all()
    torch.testing.assert_close(free, padded, rtol=1e-5, atol=1e-5)
    for name, grad in padded_grads.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(free_grads[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_pairs_on_finetunes_attention_build_no_packed_row_mask_and_give_the_padded_log_probs():
    """A full fine-tune's DPO: the pairs' hook and finetune's mask hooks on the same module (the model loaded with
    finetune's attention, whose mask hooks come first at load): the pairs' hook runs first, so the forward gets the
    bounds, transformers builds no mask (each layer on CPU falls back to sdpa over the mask built from the bounds),
    and the log-probabilities are the padded call's."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from finetune.train import attention
    from finetune.train.dpo_pairs import PaddingFreePairs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32, attn_implementation="sdpa")
    add_fused_lm_head(model)
    batch, labels = _batch()
    padded, _ = _log_probs(model, batch, labels)

    model.set_attn_implementation(attention.register())
    attention.skip_packed_row_masks(model)
    attention.skip_packed_row_masks(model)  # once a model
    PaddingFreePairs().attach(model)
    masks: list = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, a, kw: masks.append(kw["attention_mask"]), with_kwargs=True)
    free, _ = _log_probs(model, batch, labels)
    assert masks and all(m is None for m in masks)
    torch.testing.assert_close(free, padded, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_full_fine_tunes_reference_under_deepspeed_gets_the_pairs_and_no_mask(tmp_path):
    """TRL wraps a full fine-tune's reference copy in a DeepSpeedEngine in its __init__ (whose `config` is
    DeepSpeed's dict): finetune's hooks go on the model inside it, which then gets each packed row's bounds and
    builds no mask, and the run's losses are the padded run's (DeepSpeed ZeRO-2 on its CPU accelerator, one
    process, in a child: DeepSpeed initializes torch.distributed for the whole process)."""
    import json
    import socket
    import subprocess
    import sys

    from tests.helpers.paths import ROOT
    from tests.helpers.processes import env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "tests.helpers.deepspeed_dpo_pairs", str(port), str(tmp_path)]
    done = subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert result["reference_type"] == "DeepSpeedEngine"
    pairs, padded = result["pairs"], result["padded"]
    assert pairs["reference_bounds"] and all(pairs["reference_bounds"])
    assert pairs["masks"] and not any(pairs["masks"])
    assert any(padded["masks"])  # the padded run's reference got a padding mask: the check can see one
    assert len(pairs["losses"]) == 2 and pairs["losses"] == pytest.approx(padded["losses"], abs=1e-5)

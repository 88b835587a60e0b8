"""When each part of a step's memory is alive (plan/memory.py), from the memory profiles of real steps
(logging.memory_profile_step, docs/validation.md twelfth session): a single process's gradients and the
optimizer step's temporaries come after the activations are freed; ZeRO's step casts its flat gradient
partition to fp32; an fp32 model under bf16 autocast keeps an fp32 residual stream and a cast per linear."""

from __future__ import annotations

import dataclasses

import pytest

from finetune.plan.memory import (
    activation_bytes_per_token_layer,
    autocast_fp32_model,
    footprint,
    gradients_held_through_forward,
    norm_output_readers,
    state_bytes,
    zero_gradient_cast_bytes,
)
from finetune.registry.detect import parse_nvidia_smi, synthesize_preset
from finetune.strategies import ZERO3_SUB_GROUP_ELEMENTS
from tests.helpers.recipes import shape_job


def _preset(gpus: int):
    return synthesize_preset(parse_nvidia_smi("\n".join(["NVIDIA H200, 143771 MiB"] * gpus)), ram_gib=1024)


def _job(*, gpus=1, global_batch=8, strategy="ddp", **kw):
    return shape_job(
        "llama-3.2-3b",
        "full",
        _preset(gpus),
        global_batch=global_batch,
        data__packing=True,
        train__liger="on",
        train__activation_checkpointing="off",
        distributed__strategy=strategy,
        **kw,
    )


def test_only_accumulation_ddp_buckets_and_sharded_backends_keep_gradients_through_a_forward():
    assert not gradients_held_through_forward(_job(), strategy="ddp", micro_batch=8)
    assert gradients_held_through_forward(_job(), strategy="ddp", micro_batch=4)  # 4 x 2: accumulation
    assert gradients_held_through_forward(_job(gpus=2, global_batch=16), strategy="ddp", micro_batch=8)
    assert gradients_held_through_forward(_job(strategy="zero2"), strategy="zero2", micro_batch=8)


def test_a_single_process_gradients_replace_the_activations_they_follow():
    job = _job()
    alone = footprint(job, strategy="ddp", micro_batch=8, checkpointing=False).memory
    accumulating = footprint(job, strategy="ddp", micro_batch=4, checkpointing=False).memory
    grads = state_bytes(job, "ddp").gradients
    assert alone.gradients == 0 and accumulating.gradients == grads
    # 6 GiB of gradients against ~40 GiB of activations at micro-batch 8: nothing of them adds to the peak
    assert alone.activations + alone.logits > grads
    # one sequence of 64 tokens: activations and loss head smaller than the gradients, whose excess adds
    tiny = dataclasses.replace(_job(global_batch=1), seq_len=64)
    small = footprint(tiny, strategy="ddp", micro_batch=1, checkpointing=False).memory
    assert small.gradients == 0 and small.activations + small.logits < grads
    assert small.total > small.weights + small.optimizer + grads


def test_zero_casts_the_flat_gradient_partition_to_fp32_in_its_step():
    one = _job(strategy="zero2")
    n = state_bytes(one, "zero2").trainable_params
    assert zero_gradient_cast_bytes(one, strategy="zero2", trainable_params=n) == pytest.approx(6 * n)
    four = _job(gpus=4, global_batch=32, strategy="zero2")
    assert zero_gradient_cast_bytes(four, strategy="zero2", trainable_params=n) == pytest.approx(6 * n / 4)
    # ZeRO-3 steps one sub-group of sub_group_size elements at a time
    big = shape_job("llama-3.1-70b", "full", _preset(4), global_batch=8, distributed__strategy="zero3")
    big_n = state_bytes(big, "zero3").trainable_params
    assert zero_gradient_cast_bytes(big, strategy="zero3", trainable_params=big_n) == pytest.approx(
        6 * ZERO3_SUB_GROUP_ELEMENTS
    )


def test_an_fp32_model_under_autocast_keeps_an_fp32_stream_and_a_cast_per_linear():
    job = _job(model__dtype="float32")
    assert autocast_fp32_model(job, strategy="ddp") and not autocast_fp32_model(job, strategy="fsdp2")
    h = job.arch.hidden_size
    assert norm_output_readers(job.arch) == [h] * 5  # q, k, v, gate, up
    bf16 = activation_bytes_per_token_layer(job)
    fp32 = activation_bytes_per_token_layer(job, fp32_stream=True)
    # the residual stream in fp32 (+2 bytes x h for each of the two norms' inputs), five 16-bit casts of the
    # norm outputs in place of the two shared outputs: the memory profile's 120,832 against 90,112 bytes
    assert fp32 - bf16 == 2 * 2 * h + (5 - 2) * 2 * h == 30_720

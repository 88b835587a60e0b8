"""What the planner and compile resolve for speed: the attention kernel, Liger, YAML on/off switches."""

from __future__ import annotations

import pytest

from finetune.errors import RecipeError
from finetune.plan import attention_implementation, attention_kind, liger_enabled
from finetune.recipe import load_recipe
from finetune.registry import get_model, get_preset


def _recipe(**over):
    raw = {"model": {"name": "llama-3.1-8b", "arch": "llama-3.1-8b"}, "data": {"path": "train.jsonl", "packing": True}}
    for section, values in over.items():
        raw[section] = {**raw.get(section, {}), **values}
    return load_recipe(raw)


def test_auto_attention_is_varlen_only_for_packed_sft_on_nvidia():
    gpu, cpu = get_preset("server-8xh100"), get_preset("cpu")
    assert attention_implementation(_recipe(), gpu) == "varlen"
    assert attention_implementation(_recipe(), cpu) == "sdpa"
    assert attention_implementation(_recipe(data={"packing": False}), gpu) == "sdpa"
    dpo = _recipe(method={"type": "dpo"}, data={"packing": False, "format": "preference"})
    assert attention_implementation(dpo, gpu) == "sdpa"
    assert attention_implementation(_recipe(model={"attn_implementation": "eager"}), gpu) == "eager"


def test_varlen_without_packing_is_planned_as_sdpa():
    assert attention_kind("varlen", packed=True) == "varlen"
    assert attention_kind("varlen", packed=False) == "sdpa"
    assert attention_kind("flash_attention_2", packed=False) == "flash"


def test_liger_switch():
    gpu, cpu, llama = get_preset("server-8xh100"), get_preset("cpu"), get_model("llama-3.1-8b")
    assert liger_enabled(_recipe(train={"liger": "on"}), gpu, arch=llama) is True
    assert liger_enabled(_recipe(train={"liger": "off"}), gpu, arch=llama) is False
    assert liger_enabled(_recipe(), cpu, arch=llama) is False
    with pytest.raises(RecipeError) as err:
        liger_enabled(_recipe(train={"liger": "on"}), cpu, arch=llama)
    assert err.value.key == "train.liger"


def test_liger_is_planned_only_for_the_model_types_it_patches():
    """For another model type the Trainer's use_liger_kernel changes nothing: auto plans without Liger's
    smaller activations, and a pinned `on` is refused."""
    gpu = get_preset("server-8xh100")
    unpatched = get_model("llama-3.1-8b").model_copy(update={"family": "qwen2_moe"})
    assert liger_enabled(_recipe(train={"liger": "off"}), gpu, arch=unpatched) is False
    with pytest.raises(RecipeError, match="no kernels for model type qwen2_moe") as err:
        liger_enabled(_recipe(train={"liger": "on"}), gpu, arch=unpatched)
    assert err.value.key == "train.liger"
    # auto: whatever liger-kernel's presence says for a patched type, never on for this one
    assert liger_enabled(_recipe(), gpu, arch=unpatched) is False


def test_yaml_bare_on_off_mean_the_words(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        "model: {name: llama-3.1-8b}\ndata: {path: t.jsonl}\ntrain: {activation_checkpointing: off, liger: on}\n"
    )
    recipe = load_recipe(path)
    assert (recipe.train.activation_checkpointing, recipe.train.liger) == ("off", "on")


def test_rows_are_padded_only_where_cudnns_masked_attention_meets_them():
    """plan.row_multiple: packed SFT rows that reach sdpa's masked kernel on an NVIDIA GPU (here attention
    dropout, which the varlen kernel does not run) are padded to a multiple of MASKED_ROW_MULTIPLE tokens, padded
    sequences to PADDED_ROW_MULTIPLE; the plan counts the padding in the step's tokens and its peak; varlen rows
    and CPU runs are not padded."""
    from dataclasses import replace

    from finetune.plan import (
        MASKED_ROW_MULTIPLE,
        PADDED_ROW_MULTIPLE,
        job_from_recipe,
        pads_rows,
        plan_job,
        row_multiple,
    )
    from finetune.plan.workload import (
        computed_tokens_per_micro_batch,
        executed_attention_positions,
        peak_sequence_tokens,
        peak_tokens_per_micro_batch,
    )

    gpu, cpu = get_preset("server-8xh100"), get_preset("cpu")
    llama = get_model("llama-3.1-8b")
    dropout = llama.model_copy(update={"attention_dropout": 0.1})

    def job(recipe, arch, preset):
        return job_from_recipe(recipe, arch=arch, preset=preset)

    sequences = {"mean": 1500.0, "longest": 2000, "std": 300.0}
    masked = job(_recipe(data={"max_length": 2000, "sequence_tokens": sequences}), dropout, gpu)
    assert masked.attention == "sdpa" and masked.row_multiple == MASKED_ROW_MULTIPLE == row_multiple(masked)
    assert job(_recipe(), llama, gpu).row_multiple is None  # every layer on the varlen kernel
    assert job(_recipe(), dropout, cpu).row_multiple is None
    # sequences padded to a micro-batch's longest get sdpa's padding mask where a micro-batch holds several: padded
    # to PADDED_ROW_MULTIPLE, the data's longest rounded up in the plan; one sequence alone is not padded
    padded = job(_recipe(data={"packing": False, "max_length": 2000, "sequence_tokens": sequences}), dropout, gpu)
    assert padded.row_multiple == PADDED_ROW_MULTIPLE
    assert peak_sequence_tokens(padded) == 2048 and pads_rows(padded, micro_batch=2)
    assert not pads_rows(padded, micro_batch=1) and pads_rows(masked, micro_batch=1)
    assert job(_recipe(data={"packing": False}), llama, cpu).row_multiple is None
    # the plan (and its kernels line) says what the run pads at the chosen micro-batch
    assert plan_job(masked).row_multiple == MASKED_ROW_MULTIPLE and "multiple of 512" in plan_job(masked).kernels
    one = plan_job(replace(padded, micro_batch=1))
    assert one.micro_batch_size == 1 and one.row_multiple is None and "padded to a multiple" not in one.kernels
    # DPO's padding-free pairs row (train/dpo_pairs.py) and its padded pairs, likewise
    dpo = {"method": {"type": "dpo"}, "data": {"format": "preference", "packing": True}}
    assert job(_recipe(**dpo), dropout, gpu).row_multiple == MASKED_ROW_MULTIPLE
    assert job(_recipe(**dpo), llama, gpu).row_multiple is None  # the pairs on the varlen kernel
    dpo["data"]["packing"] = False
    assert job(_recipe(**dpo), llama, gpu).row_multiple == PADDED_ROW_MULTIPLE
    # KTO's and the reward trainer's padded rows too (TRL's collators take the multiple); ORPO's cannot be padded
    kto = {"method": {"type": "kto"}, "data": {"format": "unpaired", "packing": False}}
    assert job(_recipe(**kto), llama, gpu).row_multiple == PADDED_ROW_MULTIPLE
    orpo = {"method": {"type": "orpo"}, "data": {"format": "preference", "packing": False}}
    assert job(_recipe(**orpo), llama, gpu).row_multiple is None
    # the peak is rounded up to the multiple, the step's work adds half a multiple to rows of varying length
    assert peak_tokens_per_micro_batch(masked, 4) % MASKED_ROW_MULTIPLE == 0
    assert computed_tokens_per_micro_batch(masked, 4) == pytest.approx(4 * 1500 + MASKED_ROW_MULTIPLE / 2)
    # every layer's masked kernel computes the whole padded row for each query
    row = 4 * 1500 + MASKED_ROW_MULTIPLE / 2
    assert executed_attention_positions(masked, micro_batch=4) == pytest.approx(dropout.num_layers * row)


def test_padded_sequences_cost_their_micro_batchs_longest_not_the_datas():
    """Unpacked sequences are padded to their micro-batch's longest: with the data's lengths measured the step
    plans the expected largest of the micro-batch's n sequences (mean + std x expected_largest_of(n), plus half a
    row multiple where the rows are padded), one alone its mean; the peak memory still plans the data's longest."""
    from finetune.plan import PADDED_ROW_MULTIPLE, job_from_recipe
    from finetune.plan.workload import (
        computed_tokens_per_micro_batch,
        executed_attention_positions,
        expected_largest_of,
        peak_tokens_per_micro_batch,
    )

    llama = get_model("llama-3.1-8b")
    sequences = {"mean": 400.0, "longest": 1500, "std": 100.0}
    job = job_from_recipe(
        _recipe(data={"packing": False, "sequence_tokens": sequences}), arch=llama, preset=get_preset("server-8xh100")
    )
    assert job.row_multiple == PADDED_ROW_MULTIPLE
    assert computed_tokens_per_micro_batch(job, 1) == pytest.approx(400)  # no padding, no mask
    eight = 400 + 100 * expected_largest_of(8) + PADDED_ROW_MULTIPLE / 2
    assert computed_tokens_per_micro_batch(job, 8) == pytest.approx(8 * eight)
    assert 570 < eight < 610  # 1.43 sigma: the largest of eight
    # the masked kernel over a padded micro-batch computes its full square; one sequence runs causal
    assert executed_attention_positions(job, micro_batch=8) == pytest.approx(llama.num_layers * eight)
    assert executed_attention_positions(job, micro_batch=1) == pytest.approx(llama.num_layers * 400 / 2)
    assert peak_tokens_per_micro_batch(job, 8) == 8 * 1536  # the longest, rounded up to the multiple


def test_packed_rows_that_ligers_kernels_see_whole_are_padded_to_16():
    """plan.row_multiple: on the varlen kernel (no mask, so no cuDNN plans) a packed row is still padded to
    LIGER_ROW_MULTIPLE where Liger's Triton kernels run, whose RoPE takes the row's length as an integer argument
    that Triton specializes on its divisibility by 16 (a second compile mid-run); not without Liger, not on CPU."""
    from finetune.plan import LIGER_ROW_MULTIPLE, PADDED_ROW_MULTIPLE, job_from_recipe, plan_job

    llama = get_model("llama-3.1-8b")
    gpu = get_preset("server-8xh100")
    on = job_from_recipe(_recipe(train={"liger": "on"}), arch=llama, preset=gpu)
    assert on.attention == "varlen" and on.row_multiple == LIGER_ROW_MULTIPLE == 16
    assert "padded to a multiple of 16 tokens: Triton compiles Liger's kernels" in plan_job(on).kernels
    assert job_from_recipe(_recipe(train={"liger": "off"}), arch=llama, preset=gpu).row_multiple is None
    unpacked = _recipe(train={"liger": "on"}, data={"packing": False})
    assert job_from_recipe(unpacked, arch=llama, preset=gpu).row_multiple == PADDED_ROW_MULTIPLE  # the mask's own


def test_compiled_kernels_the_plan_times_as_eager_are_said():
    from finetune.plan import plan

    def warnings(**over):
        raw = {"model": {"name": "llama-3.1-8b", "arch": "llama-3.1-8b"}, "data": {"path": "t.jsonl"}}
        raw.update(hardware="server-8xh100", train={"liger": "off", **over.pop("train", {})}, **over)
        return " ".join(plan(load_recipe(raw)).warnings)

    assert "compil" not in warnings()
    assert "train.compile: regions is planned as eager" in warnings(train={"compile": "regions"})
    flex = warnings(model={"name": "llama-3.1-8b", "arch": "llama-3.1-8b", "attn_implementation": "flex_attention"})
    assert "flex_attention is planned as flash attention" in flex
    assert "profile" not in warnings()
    profiled = warnings(logging={"profile_steps": [3, 5]})
    assert "logging.profile_steps [3, 5): the profiler's event buffers held 0.3-3 GiB more host RAM" in profiled

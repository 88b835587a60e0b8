"""distributed.sync_each_batch: when FSDP2 reduce-scatters the accumulated gradients. Under the Trainer's no_sync
every layer's unsharded 16-bit gradients stay on each GPU until a step's last micro-batch
(memory.fsdp_accumulated_gradients); syncing each batch frees them for one reduce-scatter per micro-batch
instead of one per step. The planner weighs both for the FSDP2 tiers with accumulation and takes the faster
setting that fits, no_sync on equal time; a pin is planned as it says; a resolved recipe without the key ran
under no_sync and is planned so. The presets are what `--hardware auto` makes on H100s."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune.errors import RecipeError
from finetune.plan import job_from_recipe, plan_on, render_plan_table
from finetune.plan.choose import best_for_strategy, evaluate, sync_options
from finetune.plan.memory import FRAGMENTATION, fsdp_accumulated_gradients
from finetune.plan.timing import OVERLAP_LEAK, allgather_time_s
from finetune.plan.types import GIB
from finetune.plan.workload import count_params
from finetune.recipe import load_recipe
from finetune.registry import get_model
from tests.helpers.calibration_rows import preset_for
from tests.helpers.paths import ROOT

H100 = "NVIDIA H100 80GB HBM3"
FOUR = preset_for(H100, gpus_per_node=4)
ARCH = get_model("llama-3.1-8b")
# the run: full 8B, 4096-token rows, global batch 16 on 4 x H100
LONG = ["data.max_length=4096", "train.global_batch_size=16"]


def _recipe(name: str, *overrides: str):
    return load_recipe(ROOT / "recipes" / name, overrides=[*LONG, *overrides])


def _plan(name: str, *overrides: str, preset=FOUR):
    return plan_on(_recipe(name, *overrides), arch=ARCH, preset=preset, source="test")


def test_full_8b_on_4_h100_reduces_every_micro_batch_under_fsdp2():
    job = job_from_recipe(_recipe("llama8b-full.yaml"), arch=ARCH, preset=FOUR)
    assert job.sync_each_batch is None  # auto: searched
    # FSDP2's fastest fitting setting either way: under no_sync the held gradients push it to micro-batch 4
    # (no accumulation, so nothing held) with 25 of 32 layers checkpointed; syncing each batch fits micro-batch
    # 2 x 2 with 16 checkpointed, 3.5% faster (planned here without Liger, which this machine lacks, so with the
    # unfused norms' passes, plan/unfused_time.py: micro-batch 1 x 4 without checkpointing fits too, but is slower)
    held = best_for_strategy(replace(job, sync_each_batch=False), "fsdp2")
    synced = best_for_strategy(replace(job, sync_each_batch=True), "fsdp2")
    assert (held.micro_batch_size, held.gradient_accumulation_steps, held.checkpoint_layers) == (4, 1, 25)
    assert held.sync_each_batch is None and held.step_time_s == pytest.approx(2.633, abs=1e-3)
    assert (synced.micro_batch_size, synced.gradient_accumulation_steps, synced.checkpoint_layers) == (2, 2, 16)
    assert synced.sync_each_batch is True and synced.step_time_s == pytest.approx(2.542, abs=1e-3)
    assert synced.bottleneck == "compute"
    unchecked = evaluate(job, strategy="fsdp2", micro_batch=1, checkpointing=0, sync_each_batch=True)
    assert unchecked.fits and unchecked.step_time_s > synced.step_time_s

    # at one setting the two differ by exactly the held gradients (with their fragmentation share) in memory,
    # and by three more reduce-scatters of the 16-bit gradients in communication, hidden under the compute
    # but for the overlap leak
    kept = evaluate(job, strategy="fsdp2", micro_batch=1, checkpointing=0, sync_each_batch=False)
    freed = unchecked
    grads = fsdp_accumulated_gradients(job)
    assert grads == 2 * count_params(ARCH).total and 14.9 < grads / GIB < 15.0
    assert kept.memory.gradients - freed.memory.gradients == grads
    assert kept.memory.total - freed.memory.total == pytest.approx(grads * (1 + FRAGMENTATION))
    assert not kept.fits and freed.fits  # 84.4 GiB against 71.2 usable; 68.7 with the gradients freed
    reduce_scatter = allgather_time_s(grads, n=4, bus_bandwidth_gbps=FOUR.intra_node_bandwidth_gbps)
    assert freed.comm_time_s - kept.comm_time_s == pytest.approx(3 * reduce_scatter)
    assert freed.step_time_s - kept.step_time_s == pytest.approx(OVERLAP_LEAK * 3 * reduce_scatter)

    # the choice: fsdp2 syncing each batch (2.49 s/step), over zero2 and zero3
    plan = _plan("llama8b-full.yaml")
    assert (plan.strategy, plan.sync_each_batch, plan.micro_batch_size, plan.checkpoint_layers) == (
        "fsdp2",
        True,
        2,
        16,
    )
    assert plan.step_time_s == pytest.approx(synced.step_time_s)
    assert plan.to_json()["sync_each_batch"] is True
    assert "15.0 GiB of unsharded gradients" in plan.why and "takes 2.63 s/step" in plan.why
    table = render_plan_table(plan)
    assert "gradients reduce-scattered every micro-batch (sync_each_batch)" in table
    fsdp2_row = next(line for line in table.splitlines() if line.startswith("fsdp2 "))
    assert " each " in fsdp2_row and "<- chosen" in fsdp2_row
    pinned_off = _plan("llama8b-full.yaml", "distributed.sync_each_batch=false")
    # under no_sync fsdp2's best (2.63 s/step) is the fastest strategy too
    assert pinned_off.strategy == "fsdp2" and pinned_off.step_time_s == pytest.approx(2.633, abs=1e-3)
    assert (pinned_off.micro_batch_size, pinned_off.checkpoint_layers) == (4, 25)


def test_lora_keeps_no_sync_its_gradients_are_small():
    # LoRA r16 under FSDP2 on 4 x H100, micro-batch 2 x 2: syncing each batch would free 0.08 GiB and only cost
    # time (another reduce-scatter of the adapter's gradients)
    pins = ("distributed.strategy=fsdp2", "train.micro_batch_size=2")
    plan = _plan("llama8b-lora.yaml", *pins)
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps, plan.sync_each_batch) == (2, 2, False)
    job = job_from_recipe(_recipe("llama8b-lora.yaml", *pins), arch=ARCH, preset=FOUR)
    setting = dict(strategy="fsdp2", micro_batch=2, checkpointing=plan.checkpoint_layers)
    kept, freed = (evaluate(job, **setting, sync_each_batch=s) for s in (False, True))
    assert kept.fits and freed.fits and freed.step_time_s > kept.step_time_s
    assert kept.memory.gradients - freed.memory.gradients == fsdp_accumulated_gradients(job) < 0.1 * GIB
    assert "no_sync" in render_plan_table(plan) and "sync_each_batch" not in plan.why


def test_on_equal_time_the_trainers_no_sync_stays():
    # one GPU: the reduce-scatters cost nothing, so both settings take the same time and no_sync is kept (at
    # micro-batch 2, where the LoRA gradients syncing would free buy no faster setting; unpinned, they let one
    # more layer go uncheckpointed and syncing wins on time)
    one = preset_for(H100, gpus_per_node=1)
    pins = ("distributed.strategy=fsdp2", "train.micro_batch_size=2")
    plan = _plan("llama8b-lora.yaml", *pins, preset=one)
    assert plan.gradient_accumulation_steps > 1 and plan.sync_each_batch is False
    job = job_from_recipe(_recipe("llama8b-lora.yaml", *pins), arch=ARCH, preset=one)
    setting = dict(strategy="fsdp2", micro_batch=plan.micro_batch_size, checkpointing=plan.checkpoint_layers)
    kept, freed = (evaluate(job, **setting, sync_each_batch=s) for s in (False, True))
    assert kept.fits and freed.fits and kept.step_time_s == freed.step_time_s


def test_a_pin_is_planned_as_it_says():
    pins = ("distributed.strategy=fsdp2", "train.micro_batch_size=2")  # 2 x 2: accumulation to sync or not
    synced = _plan("llama8b-lora.yaml", *pins, "distributed.sync_each_batch=true")
    held = _plan("llama8b-lora.yaml", *pins)
    assert synced.sync_each_batch is True and synced.step_time_s > held.step_time_s
    assert "distributed.sync_each_batch: true, as pinned" in synced.why
    full = _plan("llama8b-full.yaml", "distributed.strategy=fsdp2", "distributed.sync_each_batch=false")
    assert full.sync_each_batch is None  # no_sync pinned: FSDP2's best is micro-batch 4, no accumulation
    assert (full.micro_batch_size, full.checkpoint_layers) == (4, 25)


def test_no_setting_under_other_tiers_or_without_accumulation():
    job = job_from_recipe(_recipe("llama8b-full.yaml"), arch=ARCH, preset=FOUR)
    for strategy in ("ddp", "zero2", "zero3", "zero3-optim-offload", "fsdp2-offload", "zero3-offload"):
        assert sync_options(job, strategy=strategy, micro_batch=1) == (None,), strategy
    assert sync_options(job, strategy="fsdp2", micro_batch=4) == (None,)  # 16 / 4 ranks / 4: no accumulation
    assert sync_options(job, strategy="fsdp2", micro_batch=1) == (False, True)
    assert sync_options(replace(job, sync_each_batch=True), strategy="fsdp2-hybrid", micro_batch=2) == (True,)
    plan = _plan("llama8b-full.yaml")
    assert {c.strategy for c in plan.candidates if c.sync_each_batch is not None} == {"fsdp2"}
    # true with the strategy left to the planner applies where it is a setting: on one GPU ddp has none
    one = _plan("llama8b-lora.yaml", "distributed.sync_each_batch=true", preset=preset_for(H100, gpus_per_node=1))
    assert one.strategy == "ddp" and one.sync_each_batch is None


def test_true_under_a_pinned_tier_without_no_sync_is_refused():
    with pytest.raises(RecipeError) as info:
        _recipe("llama8b-full.yaml", "distributed.strategy=zero3", "distributed.sync_each_batch=true")
    text = info.value.render()
    assert "distributed.sync_each_batch: distributed.strategy zero3 has no sync_each_batch setting" in text
    assert "set it to auto" in text


def test_a_resolved_recipe_without_the_key_ran_under_no_sync(tmp_path):
    """compile writes the choice; a resolved recipe from before the key existed (auto) is planned under no_sync,
    as it ran: the calibration rows' recipes (tests/unit/plan/test_calibration.py) are such recipes."""
    import yaml

    from finetune.compile.compiler import prepare_recipe
    from finetune.rundir import RESOLVED_RECIPE

    preset = tmp_path / "4xh100.yaml"  # the preset file `finetune plan --hardware FILE` reads
    preset.write_text(yaml.safe_dump(FOUR.model_dump(mode="json")))
    compiled = prepare_recipe(
        _recipe("llama8b-full.yaml", "logging.report_to=[none]"), run_dir=tmp_path / "run", hardware=str(preset)
    )
    raw = yaml.safe_load(compiled.texts[RESOLVED_RECIPE])
    assert raw["distributed"]["sync_each_batch"] is True and raw["distributed"]["strategy"] == "fsdp2"
    resolved = load_recipe(raw, allow_resolved=True)
    assert job_from_recipe(resolved, arch=ARCH, preset=FOUR).sync_each_batch is True
    again = plan_on(resolved, arch=ARCH, preset=FOUR, source="test")  # a resume or --measure plans the same
    assert (again.strategy, again.sync_each_batch, again.micro_batch_size) == ("fsdp2", True, 2)
    assert again.per_gpu_memory_gib == pytest.approx(compiled.plan.per_gpu_memory_gib)

    del raw["distributed"]["sync_each_batch"]  # as written before the key existed
    older = load_recipe(raw, allow_resolved=True)
    assert older.distributed.sync_each_batch == "auto"
    assert job_from_recipe(older, arch=ARCH, preset=FOUR).sync_each_batch is False
    held = plan_on(older, arch=ARCH, preset=FOUR, source="test")
    # the same pinned micro-batch 2 (16 layers checkpointed), with no_sync's 15 GiB of gradients: it does not fit
    assert held.sync_each_batch is False and not held.fits
    assert held.per_gpu_memory_gib - again.per_gpu_memory_gib == pytest.approx(
        fsdp_accumulated_gradients(job_from_recipe(older, arch=ARCH, preset=FOUR)) * (1 + FRAGMENTATION) / GIB
    )


def test_a_pinned_no_sync_that_does_not_fit_is_told_what_syncing_would_do():
    plan = _plan(
        "llama8b-full.yaml",
        "distributed.strategy=fsdp2",
        "distributed.sync_each_batch=false",
        "train.micro_batch_size=1",
        "train.activation_checkpointing=off",
    )
    assert not plan.fits and "84.4 GiB per GPU" in plan.why
    assert "distributed.sync_each_batch: auto fits at 68.7 GiB/GPU with fsdp2" in plan.suggestions

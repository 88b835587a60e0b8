"""The swap disk's read bandwidth (registry/disk.py) and how an NVMe plan uses it (plan.swap_disk)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune.compile.deepspeed import _common
from finetune.errors import RecipeError
from finetune.plan import plan, plan_job, plan_on
from finetune.plan.memory import state_bytes, weight_bytes
from finetune.plan.offload_time import ASSUMED_NVME_GBPS, nvme_read_gbps, offload_seconds
from finetune.prelaunch import check_swap_disk
from finetune.recipe import load_recipe
from finetune.registry import get_preset, resolve_model
from finetune.registry.disk import (
    AIO_BLOCK_BYTES,
    AIO_QUEUE_DEPTH,
    PROBE_PREFIX,
    RAM_FILESYSTEMS,
    filesystem_type,
    nearest_existing,
    probe_dir,
    probe_readers,
    read_gbps,
)
from tests.helpers.recipes import shape_job

MIB = 1 << 20


def test_the_probe_reads_the_directory_s_filesystem_and_leaves_nothing_behind(tmp_path):
    swap = tmp_path / "not-made-yet"  # DeepSpeed makes the swap folder: its parent is read
    assert probe_dir(swap) == tmp_path and nearest_existing(swap / "deeper") == tmp_path
    gbps = read_gbps(str(swap), 64 * MIB)
    assert gbps is not None and gbps > 0.01
    assert not list(tmp_path.glob(PROBE_PREFIX + "*")) and not swap.exists()
    assert read_gbps(str(swap), 64 * MIB) == gbps  # measured once per path and process
    # a path naming nothing two levels up is not measured: the plan writes nowhere it was not pointed at
    assert probe_dir(tmp_path / "a" / "b") is None and read_gbps(str(tmp_path / "a" / "b"), 64 * MIB) is None


def test_a_path_with_no_room_for_the_probe_is_not_measured(tmp_path):
    assert read_gbps(str(tmp_path), 1 * MIB) is None  # below the probe's smallest file: not a measurement


def _nvme_recipe(tmp_path):
    return load_recipe(
        "recipes/llama8b-lora.yaml",
        overrides=["distributed.strategy=zero3-nvme", f"distributed.nvme_path={tmp_path / 'swap'}"],
    )


def test_an_nvme_plan_for_this_machine_measures_the_swap_disk_and_a_named_preset_uses_its_figure(tmp_path):
    recipe = _nvme_recipe(tmp_path)
    arch, preset = resolve_model(recipe.model), get_preset("server-8xh100")
    local = plan_on(recipe, arch=arch, preset=preset, source="auto")
    measured = read_gbps(str(tmp_path / "swap"))
    assert measured and local.nvme_read_gbps == pytest.approx(measured)
    assert f"read at {measured:.2f} GB/s (measured" in local.disk and str(tmp_path / "swap") in local.disk
    named = plan_on(recipe, arch=arch, preset=preset, source="server-8xh100")
    assert named.nvme_read_gbps == preset.nvme_bandwidth_gbps == 20
    assert "(preset server-8xh100)" in named.disk
    # the disk is the step's bottleneck here: the slower disk plans the slower step
    assert (local.step_time_s > named.step_time_s) == (measured < preset.nvme_bandwidth_gbps)
    bare = plan_on(recipe, arch=arch, preset=preset.model_copy(update={"nvme_bandwidth_gbps": 0}), source="x")
    assert bare.nvme_read_gbps == ASSUMED_NVME_GBPS and "assumed" in bare.disk and "preset file" in bare.disk
    other = load_recipe("recipes/llama8b-lora.yaml")
    assert plan_on(other, arch=arch, preset=preset, source="auto").disk == ""  # no swap disk, nothing measured


def test_each_step_reads_the_weights_twice_at_the_swap_disk_s_bandwidth():
    job = replace(shape_job("llama-3.1-8b", "lora", "server-8xh100"), host_threads_per_rank=1, strategy="zero3-nvme")
    slow, fast = replace(job, nvme_read_gbps=2.0), replace(job, nvme_read_gbps=4.0)
    assert nvme_read_gbps(slow) == 2.0 and nvme_read_gbps(job) == job.preset.nvme_bandwidth_gbps
    extra = offload_seconds(slow, strategy="zero3-nvme", grad_accum=1)[1]
    extra -= offload_seconds(fast, strategy="zero3-nvme", grad_accum=1)[1]
    states = state_bytes(job, "zero3-nvme")
    weights = 2 * weight_bytes(job)  # read for the forward and again for the backward, once per node
    optimizer = 2 * (states.trainable + states.optimizer)  # the fp32 adapter and its moments, read and written
    assert extra == pytest.approx((weights + optimizer) / job.preset.nodes * (1 / 2e9 - 1 / 4e9))
    assert plan_job(slow).step_time_s > plan_job(fast).step_time_s and plan_job(slow).nvme_read_gbps == 2.0


def test_the_compiled_aio_settings_are_the_probe_s(tmp_path):
    plan = plan_job(shape_job("llama-3.1-8b", "lora", "server-8xh100"))
    aio = _common(_nvme_recipe(tmp_path), plan, {}, nvme=True)["aio"]
    assert (aio["block_size"], aio["queue_depth"]) == (AIO_BLOCK_BYTES, AIO_QUEUE_DEPTH)


def test_a_disk_is_read_with_deepspeed_s_queue_depth_and_a_ram_filesystem_with_one_reader(tmp_path):
    assert filesystem_type("/proc/self") == "proc"  # the longest mount point above the path decides
    if filesystem_type(tmp_path) not in RAM_FILESYSTEMS:
        assert probe_readers(filesystem_type(tmp_path)) == AIO_QUEUE_DEPTH
    if filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm here")
    assert probe_readers(filesystem_type("/dev/shm/swap/not-made-yet")) == 1


def test_a_swap_directory_in_ram_is_planned_with_a_warning_that_names_the_key_and_the_tier():
    if filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm here")
    recipe = load_recipe(
        "recipes/llama8b-lora.yaml",
        overrides=["distributed.strategy=zero3-nvme", "distributed.nvme_path=/dev/shm/finetune-test-swap"],
    )
    plan = plan_on(recipe, arch=resolve_model(recipe.model), preset=get_preset("server-8xh100"), source="auto")
    assert "1 x 1 MiB in flight" in plan.disk
    (warning,) = [w for w in plan.warnings if "is in RAM" in w]
    assert "distributed.nvme_path: /dev/shm/finetune-test-swap" in warning and "zero3-offload" in warning


def _swap_plan(recipe_file: str, swap, *, adapter: str | None = None):
    overrides = ["distributed.strategy=zero3-nvme", f"distributed.nvme_path={swap}"]
    recipe = load_recipe(recipe_file, overrides=overrides + ([f"adapter.type={adapter}"] if adapter else []))
    return recipe, plan(recipe, hardware="server-8xh100")  # a named preset: no probe


def test_a_swap_directory_without_room_or_that_cannot_be_made_is_refused_before_launch(tmp_path):
    recipe, plan = _swap_plan("recipes/llama405b-lora.yaml", tmp_path / "swap", adapter="full")
    assert plan.chosen.nvme_bytes > 2**40  # a 405B's weights, fp32 master and moments: terabytes a node
    with pytest.raises(RecipeError) as info:
        check_swap_disk(plan, recipe)
    assert info.value.key == "distributed.nvme_path" and "not enough free disk" in str(info.value)

    (tmp_path / "a-file").write_text("")
    recipe, plan = _swap_plan("recipes/quickstart.yaml", tmp_path / "a-file" / "swap")
    with pytest.raises(RecipeError) as info:
        check_swap_disk(plan, recipe)
    assert info.value.key == "distributed.nvme_path" and "is a file" in str(info.value)

    recipe, plan = _swap_plan("recipes/quickstart.yaml", tmp_path / "swap" / "not-made-yet")
    check_swap_disk(plan, recipe)  # a tiny model's states fit; DeepSpeed makes the folders
    assert not (tmp_path / "swap").exists()

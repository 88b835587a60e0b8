"""The launch's output checks (finetune/prelaunch.py check_disk): a full fine-tune's checkpoint holds its fp32 masters
where the strategy keeps them, and an output directory on a RAM disk is refused when the outputs and the run's own
host RAM at its peak exceed the memory the host has available (a RAM disk's files hold that memory)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune.errors import RecipeError
from finetune.prelaunch import check_disk, output_bytes
from finetune.recipe import load_recipe
from finetune.registry.detect import available_ram_gib
from finetune.registry.disk import RAM_FILESYSTEMS, filesystem_type
from tests.helpers.recipes import tiny_recipe


def _plan(*, host_ram_gib: float = 0.0, strategy: str = "ddp", params: int = 1000):
    return SimpleNamespace(total_params=params, trainable_params=params, strategy=strategy, host_ram_gib=host_ram_gib)


def test_a_full_fine_tune_s_checkpoint_holds_its_fp32_masters_where_the_strategy_keeps_them():
    full = load_recipe(tiny_recipe(adapter={"type": "full"}, model={"dtype": "bfloat16"}))
    final, ddp = output_bytes(_plan(strategy="ddp"), full)
    assert final == 2 * 1000 and ddp == final + 8 * 1000  # bf16 weights, fp32 Adam moments
    assert output_bytes(_plan(strategy="fsdp2"), full)[1] == final + 12 * 1000  # and fp32 masters
    lora = load_recipe(tiny_recipe())
    assert output_bytes(_plan(strategy="fsdp2"), lora) == (4 * 1000, 12 * 1000)  # fp32 adapter and its moments


@pytest.fixture
def ram_disk():
    shm = Path("/dev/shm")
    if not shm.is_dir() or filesystem_type(shm) not in RAM_FILESYSTEMS or available_ram_gib() is None:
        pytest.skip("no RAM disk at /dev/shm, or no /proc/meminfo, on this machine")
    folder = Path(tempfile.mkdtemp(dir=shm))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_outputs_on_a_ram_disk_count_against_the_host_s_available_memory(ram_disk):
    recipe = load_recipe(tiny_recipe())
    run_dir = ram_disk / "run"
    check_disk(run_dir, plan=_plan(host_ram_gib=1.0), recipe=recipe)  # small: fits
    with pytest.raises(RecipeError) as info:
        check_disk(run_dir, plan=_plan(host_ram_gib=available_ram_gib() * 2), recipe=recipe)
    assert info.value.key == "output.dir"
    assert "is in RAM" in str(info.value) and "final save included" in str(info.value)
    assert not run_dir.exists()  # nothing written


def test_a_disk_is_not_asked_about_host_memory(tmp_path):
    if filesystem_type(tmp_path) in RAM_FILESYSTEMS:
        pytest.skip(f"{tmp_path} is itself a RAM disk here")
    check_disk(tmp_path / "run", plan=_plan(host_ram_gib=10**6), recipe=load_recipe(tiny_recipe()))

"""Out-of-memory recovery: the re-planning decision (pure), the rank's recognition of a real allocator
failure, resume across a changed micro-batch, and the whole loop through the real CLI, launcher and
trainer on CPU, where a rank's address space is capped (RLIMIT_AS, FINETUNE_TEST_MEMORY_LIMIT_MIB) so
that a too-large pinned micro-batch fails inside torch's allocator."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import replace

import pytest

from finetune.api import compile as compile_run
from finetune.checkpoints.fields import recipe_fields
from finetune.checkpoints.marker import write_marker
from finetune.checkpoints.resume import check_resume
from finetune.errors import RecipeError
from finetune.plan import job_from_recipe
from finetune.plan.choose import HEADROOM
from finetune.plan.replan import OomEvidence, activation_term, replan
from finetune.plan.types import GIB
from finetune.recipe import load_recipe
from finetune.registry import get_model
from finetune.registry.detect import parse_nvidia_smi, synthesize_preset
from finetune.rundir import OOM_RETRIES, read_oom_records
from finetune.train.run import run_rank
from tests.helpers.paths import ROOT
from tests.helpers.processes import cli_argv, env
from tests.helpers.recipes import resolve_recipe, tiny_recipe, write_recipe


def _job(**train):
    recipe = load_recipe(
        {
            "model": {"name": "meta-llama/Llama-3.1-8B", "arch": "llama-3.1-8b"},
            "adapter": {"type": "lora"},
            "data": {"path": "x.jsonl", "max_length": 2048},
            "train": {"global_batch_size": 16, **train},
            "distributed": {"strategy": "ddp"},
            "hardware": "auto",
        }
    )
    # the preset `--hardware auto` makes on one H100 80GB
    preset = synthesize_preset(parse_nvidia_smi("NVIDIA H100 80GB HBM3, 81559 MiB"), ram_gib=1024)
    return job_from_recipe(recipe, arch=get_model("llama-3.1-8b"), preset=preset)


def _evidence(*, micro_batch, checkpointing=False, requested_gib=1.0, baseline=0.0):
    """A rank that filled an 80 GB card (max reserved 0.5 GiB under its capacity) and then asked for
    `requested_gib` more."""
    capacity = 79.1 * GIB
    return OomEvidence(
        rank=0,
        micro_batch=micro_batch,
        checkpointing=checkpointing,
        peak_bytes=capacity - 0.5 * GIB,
        capacity_bytes=capacity,
        requested_bytes=requested_gib * GIB,
        baseline_bytes=baseline,
    )


def test_replan_scales_the_activation_term_to_the_measured_peak():
    job = _job(micro_batch_size=4)  # planned at 70.2 GiB of 71.2 usable: "fits"
    ev = _evidence(micro_batch=4)
    out = replan(job, strategy="ddp", evidence=[ev])
    total, act = activation_term(job, strategy="ddp", micro_batch=4, checkpointing=False)
    # the scaled model reproduces what the failed setting needed
    assert (total - act) + out.scale * act == pytest.approx(ev.demand_bytes)
    assert out.scale > 1
    # same global batch: micro-batch x accumulation = 16 on one GPU; the prediction fits the card. A smaller
    # micro-batch or checkpointing, never a larger micro-batch than the one that ran out (here the same one
    # with checkpointing: at micro-batch 2 the host's launching, plan/host_time.py, makes it slower)
    assert out.micro_batch <= 4 and (out.micro_batch < 4 or out.checkpointing)
    assert out.micro_batch * out.gradient_accumulation_steps == 16
    assert out.predicted_bytes <= HEADROOM * ev.capacity_bytes == out.limit_bytes
    # it is the largest micro-batch without checkpointing that the scaled model lets fit
    bigger = 2 * out.micro_batch
    if not out.checkpointing and bigger < 4:
        t, a = activation_term(job, strategy="ddp", micro_batch=bigger, checkpointing=False)
        assert t - a + out.scale * a > out.limit_bytes
    assert f"micro-batch {out.micro_batch}" in out.text and "same global batch" in out.text


def test_replan_never_proposes_a_setting_already_tried_and_turns_checkpointing_on():
    job = _job(micro_batch_size=1)
    ev = _evidence(micro_batch=1, requested_gib=40)
    out = replan(job, strategy="ddp", evidence=[ev])
    assert (out.micro_batch, out.checkpointing) != (1, False)
    assert out.checkpointing  # micro-batch 1 is the smallest: only checkpointing is left
    again = replan(
        job,
        strategy="ddp",
        evidence=[replace(ev, checkpointing=True)],
        tried=((1, False, False), (out.micro_batch, True, False)),
    )
    assert again.micro_batch is None or (again.micro_batch, again.checkpointing) not in {(1, False), (1, True)}


def test_replan_says_when_no_setting_can_fit():
    job = _job(micro_batch_size=4)
    ev = _evidence(micro_batch=4, baseline=78 * GIB)  # what the rank held before any activation
    out = replan(job, strategy="ddp", evidence=[ev])
    assert out.micro_batch is None and "no other micro-batch or checkpointing setting" in out.text


def test_a_failure_before_the_first_step_is_not_retried():
    job = _job(micro_batch_size=4)
    out = replan(job, strategy="ddp", evidence=[replace(_evidence(micro_batch=4), before_training=True)])
    assert out.micro_batch is None and "before the first step" in out.text


def test_a_gpu_shared_with_another_process_is_not_replanned():
    """The 70B QLoRA run that met a finishing job's 85 GiB on its GPU: the record's other_bytes says the card
    was not the run's alone, so no smaller setting is proposed; a rank's own context is not counted as that."""
    from finetune.plan.replan import SHARED_DEVICE_BYTES

    job = _job(micro_batch_size=4)
    shared = replace(_evidence(micro_batch=4), rank=1, other_bytes=85.25 * GIB)
    out = replan(job, strategy="ddp", evidence=[_evidence(micro_batch=4), shared])
    assert out.micro_batch is None
    assert out.text.startswith("rank 1's GPU was shared: other processes held 85.25 GiB")
    own_context = replace(_evidence(micro_batch=4), other_bytes=SHARED_DEVICE_BYTES - 0.1 * GIB)
    assert replan(job, strategy="ddp", evidence=[own_context]).micro_batch is not None


def test_the_device_check_fails_only_when_others_take_what_the_plan_needs():
    from finetune.train.occupancy import others_bytes, shortfall

    total = 139.8 * GIB
    assert not shortfall(free=139.3 * GIB, total=total, planned=125.4 * GIB)  # only this rank's context
    assert shortfall(free=54.0 * GIB, total=total, planned=125.4 * GIB)  # another run holds 85 GiB
    assert not shortfall(free=54.0 * GIB, total=total, planned=50.0 * GIB)  # shared, but there is room
    # planned for a bigger card than this one: running out re-plans it; this check does not refuse it
    assert not shortfall(free=70.0 * GIB, total=79.1 * GIB, planned=125.4 * GIB)
    assert others_bytes(54.0 * GIB, total, 0.5 * GIB) == pytest.approx(85.3 * GIB)


def test_the_worst_rank_decides():
    job = _job(micro_batch_size=4)
    mild = _evidence(micro_batch=4)
    bad = replace(_evidence(micro_batch=4, requested_gib=20), rank=3)
    assert replan(job, strategy="ddp", evidence=[mild, bad]).text.startswith("rank 3 ")


def test_an_fsdp2_run_out_of_memory_under_no_sync_is_replanned_to_reduce_every_micro_batch():
    """Full 8B at 4096 tokens, global batch 16 under FSDP2 on 4 x H100: the failed run held no_sync's
    unsharded gradients (a record from before the key says nothing: the Trainer's default); the same
    micro-batch and checkpointing reduce-scattering every micro-batch is the fastest setting expected to fit.
    When that runs out too, it is not proposed again."""
    from tests.helpers.calibration_rows import preset_for

    recipe = load_recipe(
        ROOT / "recipes" / "llama8b-full.yaml",
        overrides=["data.max_length=4096", "train.global_batch_size=16", "distributed.strategy=fsdp2"],
    )
    job = job_from_recipe(
        recipe, arch=get_model("llama-3.1-8b"), preset=preset_for("NVIDIA H100 80GB HBM3", gpus_per_node=4)
    )
    record = {"rank": 0, "micro_batch_size": 1, "activation_checkpointing": False}
    record |= {"peak_bytes": 78.6 * GIB, "capacity_bytes": 79.1 * GIB, "requested_bytes": 1.0 * GIB}
    ev = OomEvidence.from_record(record)
    assert ev.sync_each_batch is False and OomEvidence.from_record(record | {"sync_each_batch": True}).sync_each_batch
    out = replan(job, strategy="fsdp2", evidence=[ev])
    assert (out.micro_batch, out.checkpointing, out.gradient_accumulation_steps, out.sync_each_batch) == (
        1,
        False,
        4,
        True,
    )
    # the failed setting is modelled as it ran (with the held gradients): the scaled model reproduces its demand
    total, act = activation_term(job, strategy="fsdp2", micro_batch=1, checkpointing=False, sync_each_batch=False)
    assert (total - act) + out.scale * act == pytest.approx(ev.demand_bytes)
    assert "reduce-scattered every micro-batch (sync_each_batch)" in out.text
    again = replan(job, strategy="fsdp2", evidence=[replace(ev, sync_each_batch=True)], tried=((1, False, False),))
    assert again.micro_batch is not None
    assert (again.micro_batch, again.checkpointing, again.sync_each_batch) not in {(1, False, True), (1, False, False)}


@pytest.mark.slow
def test_a_real_allocator_failure_is_recognised_and_its_request_read():
    """torch's CPU allocator refusing an allocation under an address-space cap (in a child process,
    so the cap does not stay on the test runner)."""
    code = (
        "import resource, torch\n"
        "from finetune.train.oom import out_of_memory_error, requested_bytes\n"
        "resource.setrlimit(resource.RLIMIT_AS, (int(open('/proc/self/status').read().split('VmSize:')[1]"
        ".split()[0]) * 1024 + 200 * 2**20, resource.RLIM_INFINITY))\n"
        "try:\n    torch.ones(2**28)\n"
        "except Exception as exc:\n"
        "    try:\n        raise ValueError('wrapped') from exc\n"
        "    except ValueError as outer:\n"
        "        found = out_of_memory_error(outer)\n"
        "        print(type(found).__name__, int(requested_bytes(str(found))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), timeout=120)
    assert proc.stdout.split() == ["RuntimeError", str(2**28 * 4)], proc.stderr[-2000:]
    from finetune.train.oom import out_of_memory_error, requested_bytes

    assert out_of_memory_error(ValueError("not memory")) is None
    assert requested_bytes("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity") == 2.5 * GIB


def test_resume_accepts_another_micro_batch_and_checkpointing_with_the_same_global_batch(tmp_path):
    saved = load_recipe(
        resolve_recipe(tiny_recipe(train={"global_batch_size": 8, "micro_batch_size": 8}), run_dir=tmp_path / "run"),
        allow_resolved=True,
    )
    ckpt = tmp_path / "run" / "checkpoints" / "checkpoint-2"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    write_marker(ckpt, step=2, world_size=1, strategy="ddp", fields=recipe_fields(saved))
    smaller = saved.model_copy(deep=True)
    smaller.train.micro_batch_size, smaller.resolved.gradient_accumulation_steps = 2, 4
    smaller.train.activation_checkpointing = "on"
    notes = check_resume(ckpt, smaller)
    assert any(n.startswith("train.micro_batch_size (8 -> 2)") for n in notes), notes
    assert any("train.activation_checkpointing" in n for n in notes)
    larger_batch = smaller.model_copy(deep=True)
    larger_batch.train.global_batch_size = 16
    with pytest.raises(RecipeError, match="train.global_batch_size"):
        check_resume(ckpt, larger_batch)


def _rows(path, n=64, seed=0):
    """Rows of ~110 tokens (the tiny tokenizer is character-level): the micro-batch decides the memory."""
    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(n):
            text = " ".join("".join(rng.choice("abcdefgh") for _ in range(5)) for _ in range(20))
            fh.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": text[:50]},
                            {"role": "assistant", "content": text[50:100]},
                        ]
                    }
                )
                + "\n"
            )
    return path


# Measured on this recipe (VmPeak over the size at train begin, two malloc arenas): micro-batch 32 ~520
# MiB (TRL's fused loss head alone allocates tokens x 32768 fp32), 16 ~310, 8 ~180, 4 ~110; the cap lies
# between 32 and the rest. Two malloc arenas: glibc reserves 64 MiB of address space per arena, up to 8
# per core, which would make the cap depend on the machine's cores.
LIMIT_MIB = "350"


def _run(argv, *, timeout=400):
    limited = {**env(), "FINETUNE_TEST_MEMORY_LIMIT_MIB": LIMIT_MIB, "MALLOC_ARENA_MAX": "2"}
    return subprocess.run(argv, cwd=ROOT, env=limited, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_rank_out_of_memory_is_replanned_and_resumed_from_the_last_checkpoint(tmp_path):
    data = _rows(tmp_path / "rows.jsonl")
    recipe = write_recipe(
        tmp_path / "r.yaml",
        data={"sources": [{"path": str(data)}], "max_length": 128},
        train={"epochs": None, "max_steps": 2, "global_batch_size": 32, "micro_batch_size": 8},
        output={"save_every": 2, "keep": 2},
    )
    run_dir = tmp_path / "run"
    # two steps at micro-batch 8, committed as checkpoint-2 (compiled as `finetune run` does, trained in
    # this process to save a launch)
    compile_run(str(recipe), output=run_dir)
    run_rank(run_dir / "recipe.resolved.yaml", resume="never")
    assert (run_dir / "checkpoints" / "checkpoint-2" / "finetune_complete.json").is_file()

    # micro-batch 32 cannot fit under the cap: with retries off the run fails at once and says what to set
    big = ("--set", "train.max_steps=4", "--set", "train.micro_batch_size=32")
    off = _run(cli_argv(recipe, run_dir, *big, "--set", "train.oom_retries=0"))
    text = off.stdout + off.stderr
    assert off.returncode == 4, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    assert "out of memory after 1 attempt(s)" in text and "1) micro-batch 32, activation checkpointing off" in text
    assert "fix: set train.micro_batch_size:" in text

    # with retries: re-planned from the measured peak, recompiled, resumed from checkpoint-2
    on = _run(cli_argv(recipe, run_dir, *big))
    text = on.stdout + on.stderr
    assert on.returncode == 0, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    history = json.loads((run_dir / OOM_RETRIES).read_text())
    assert len(history) == 1 and history[0]["micro_batch_size"] == 32
    rec = history[0]["records"][0]
    assert rec["peak_kind"] == "address space (VmPeak)" and rec["baseline_bytes"] > 0
    assert rec["capacity_bytes"] >= rec["baseline_bytes"]
    chosen = history[0]["next"]["micro_batch_size"]
    assert chosen < 32 and f"out of memory: retry 1 of 2: micro-batch {chosen}" in text
    resolved = load_recipe(run_dir / "recipe.resolved.yaml", allow_resolved=True)
    assert resolved.train.micro_batch_size == chosen and resolved.train.global_batch_size == 32
    assert resolved.resolved.gradient_accumulation_steps == 32 // chosen
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["resumed_from"].endswith("checkpoint-2")
    assert not read_oom_records(run_dir)  # the successful attempt left no record


def test_a_tight_plan_that_ran_out_names_the_strategy_that_fits_within_the_usual_headroom():
    # the 14B full fine-tune on 4 x 80 GB is planned as ZeRO-3 within 95% of GPU memory (a tight fit); if it
    # still runs out with the states alone leaving no room, no micro-batch helps, and the answer names
    # what the planner chooses within 90%: optimizer offload. Under the Trainer's no_sync, as that run was
    # planned (syncing each batch, FSDP2 fits tightly too: tests/unit/plan/test_plan.py)
    from finetune.launch import _oom_hint
    from finetune.plan.choose import search

    recipe = load_recipe(
        {
            "model": {"name": "Qwen/Qwen2.5-14B", "arch": "qwen2.5-14b"},
            "adapter": {"type": "full"},
            "data": {"path": "x.jsonl", "max_length": 2048},
            "train": {"global_batch_size": 16},
            "distributed": {"sync_each_batch": False},
            "hardware": "auto",
        }
    )
    preset = synthesize_preset(parse_nvidia_smi("\n".join(["NVIDIA H100 80GB HBM3, 81559 MiB"] * 4)), ram_gib=1024)
    job = job_from_recipe(recipe, arch=get_model("qwen2.5-14b"), preset=preset)
    chosen, _ = search(job)
    assert chosen.tight and chosen.strategy == "zero3"
    # what the rank held before any activation: the states alone leave no room
    ev = _evidence(micro_batch=chosen.micro_batch_size, checkpointing=True, baseline=76 * GIB)
    out = replan(job, strategy="zero3", evidence=[ev])
    assert out.micro_batch is None and out.other_strategy == "zero3-optim-offload"
    assert "within 90% of GPU memory the planner chooses zero3-optim-offload" in out.text
    assert "set distributed.strategy: zero3-optim-offload" in _oom_hint(out)

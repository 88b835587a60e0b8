"""NaN/Inf: a non-finite loss or gradient stops the run by default (step and rank named); with
train.on_nonfinite: skip, up to train.max_bad_steps such steps are skipped without touching the
weights, and the run stops at the next one. The NaN comes from real data: the tiny model's embedding
row of one character is NaN, so exactly the batches holding that character go bad. The same under
DeepSpeed, where the engine skips the step itself and the callback counts it."""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from finetune import rundir
from finetune.errors import TrainingFailed
from tests.helpers.deepspeed_launch import launch_rank
from tests.helpers.once import once_per_session
from tests.helpers.paths import TINY_MODEL
from tests.helpers.recipes import resolve_recipe, tiny_recipe

pytestmark = pytest.mark.slow
BAD = "~"


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    """A copy of the tiny model whose embedding of BAD is NaN, and 16 examples, 4 of them with BAD."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("nan")
    model_dir = root / "model"
    shutil.copytree(TINY_MODEL, model_dir)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    bad_id = AutoTokenizer.from_pretrained(TINY_MODEL).convert_tokens_to_ids(BAD)
    # untie the output head first (the tiny model ties it to the embedding), so that only inputs
    # holding BAD go non-finite, not every logit
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with torch.no_grad():
        model.get_input_embeddings().weight[bad_id] = float("nan")
    model.save_pretrained(model_dir)
    words = [
        "abc",
        "dog",
        "sun",
        "map",
        "kit",
        "fox",
        "owl",
        "bee",
        "cat",
        "elk",
        "gnu",
        "yak",
        "ram",
        "hen",
        "ant",
        "eel",
    ]
    rows = [
        {
            "messages": [
                {"role": "user", "content": w + (BAD if i % 4 == 1 else "")},
                {"role": "assistant", "content": w.upper()},
            ]
        }
        for i, w in enumerate(words)
    ]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, data


def _recipe(model_dir, data, **train):
    return tiny_recipe(
        model={"name": str(model_dir)},
        data={"sources": [{"path": str(data)}], "eval_sources": [], "max_length": 32},
        train={"max_steps": 8, "global_batch_size": 2, "micro_batch_size": 2, "weight_decay": 0.1, **train},
    )


class WeightProbe(TrainerCallback):
    """Records, per optimizer step, whether any trainable weight changed."""

    def __init__(self):
        self.changed: dict[int, bool] = {}
        self._before = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._before = [p.detach().clone() for p in model.parameters() if p.requires_grad]

    def on_step_end(self, args, state, control, model=None, **kwargs):
        after = [p.detach() for p in model.parameters() if p.requires_grad]
        self.changed[state.global_step] = any(not torch.equal(a, b) for a, b in zip(self._before, after))
        assert all(torch.isfinite(p).all() for p in after), f"non-finite weights after step {state.global_step}"


def test_skip_leaves_weights_untouched_on_bad_steps_only(poisoned, tmp_path):
    from accelerate import PartialState

    from finetune.recipe.load import load_recipe
    from finetune.train.callbacks import NonFiniteCallback
    from finetune.train.model import load_model, load_tokenizer
    from finetune.train.preflight import prepare_data
    from finetune.train.trainers import build_trainer, training_args

    recipe = load_recipe(
        resolve_recipe(_recipe(*poisoned, on_nonfinite="skip", max_bad_steps=8), run_dir=tmp_path / "run"),
        allow_resolved=True,
    )
    tokenizer = load_tokenizer(recipe)
    data = prepare_data(recipe, tokenizer, state=PartialState(cpu=True))
    nonfinite, probe = NonFiniteCallback(policy="skip", max_bad_steps=8), WeightProbe()
    trainer = build_trainer(
        recipe,
        args=training_args(recipe, run_dir=tmp_path / "run", has_eval=False),
        model=load_model(recipe),
        tokenizer=tokenizer,
        data=data,
        callbacks=[nonfinite, probe],
    )
    trainer.train()
    assert trainer.state.global_step == 8
    skipped = set(nonfinite.skipped)
    assert skipped and len(skipped) < 8, skipped  # some batches hold BAD, some do not (seeded order)
    # each bad step counted once: the logged loss stays NaN after the first (the Trainer's running sum)
    assert nonfinite.bad == len(skipped), (nonfinite.bad, sorted(skipped))
    for step, changed in probe.changed.items():
        assert changed == (step not in skipped), (step, changed, sorted(skipped))


def test_skip_stops_after_max_bad_steps(poisoned, tmp_path):
    from finetune.train.run import run_rank

    with pytest.raises(TrainingFailed) as info:
        run_rank(
            resolve_recipe(_recipe(*poisoned, on_nonfinite="skip", max_bad_steps=1), run_dir=tmp_path / "run"),
            resume="never",
        )
    text = info.value.render()
    assert "2 bad step(s)" in text and "max_bad_steps=1" in text and "(rank 0 of 1)" in text, text
    assert "non-finite loss=nan" in text


def test_stop_is_the_default_and_names_the_step(poisoned, tmp_path):
    from finetune.train.run import run_rank

    with pytest.raises(TrainingFailed) as info:
        run_rank(resolve_recipe(_recipe(*poisoned), run_dir=tmp_path / "run"), resume="never")
    text = info.value.render()
    assert "1 bad step(s), policy train.on_nonfinite=stop" in text and "(rank 0 of 1)" in text, text
    assert info.value.exit_code == 4
    # nothing was saved after the bad step: the run stops before the save of that step
    assert not list((tmp_path / "run").glob("checkpoints/checkpoint-*"))
    # the bad step's micro-batches are kept for its reproduction, and they hold the poisoned token
    kept = re.search(r"its micro-batches: (\S+\.pt)", text)
    assert kept, text
    record = torch.load(kept.group(1), weights_only=True)
    from transformers import AutoTokenizer

    bad_id = AutoTokenizer.from_pretrained(poisoned[0]).convert_tokens_to_ids(BAD)
    ids = torch.cat([mb["input_ids"].flatten() for mb in record["micro_batches"]])
    assert record["rank"] == 0 and f"step {record['step']} " in text and (ids == bad_id).any()
    assert Path(kept.group(1)).parent == tmp_path / "run" / rundir.NONFINITE_DIR
    assert not list(Path(kept.group(1)).parent.glob("*.tmp"))


def test_anomaly_mode_names_the_backward_function_that_made_the_nan(poisoned, tmp_path, monkeypatch):
    """FINETUNE_DETECT_ANOMALY: torch's anomaly mode stops at the first backward function that returns a NaN, and the
    rank's error names it (with the key and a hint), not as an internal error."""
    from finetune.train.run import DETECT_ANOMALY, run_rank

    monkeypatch.setenv(DETECT_ANOMALY, "1")
    try:
        with pytest.raises(TrainingFailed) as info:
            run_rank(resolve_recipe(_recipe(*poisoned), run_dir=tmp_path / "run"), resume="never")
    finally:
        torch.autograd.set_detect_anomaly(False)  # the mode is the process's: the rank's, here this worker's
    text = info.value.render()
    assert "the backward made a NaN: Function '" in text and "returned nan values" in text, text
    assert "train.on_nonfinite" in text and info.value.exit_code == 4


# DeepSpeed runs here on its CPU accelerator (gloo), through the real ZeRO optimizers. `finetune run` starts a
# DeepSpeed plan only where nvidia-smi lists a GPU, so the recipe is compiled for a one-GPU preset (the run's
# own ds_config.json and accelerate.yaml) and the compiled `accelerate launch` command is run as the launcher
# runs it.
def _deepspeed(poisoned, run_dir: Path, *, strategy: str, module: str | None = None, extra=(), **train):
    raw = {**_recipe(*poisoned, **train), "distributed": {"strategy": strategy}, "logging": {"report_to": ["none"]}}
    return launch_rank(raw, run_dir, module=module, extra=extra)


def _deepspeed_rank(resolved: str, out: str) -> None:
    """One rank of a DeepSpeed run started by the test below (`accelerate launch -m` this module): the
    run's trainer with NonFiniteCallback and WeightProbe; what they saw goes to `out` as JSON."""
    from accelerate import PartialState

    from finetune.recipe.load import load_recipe
    from finetune.train.callbacks import NonFiniteCallback
    from finetune.train.model import load_tokenizer, load_training_model
    from finetune.train.preflight import prepare_data
    from finetune.train.trainers import build_trainer, training_args

    recipe = load_recipe(resolved, allow_resolved=True)
    state = PartialState()
    tokenizer = load_tokenizer(recipe)
    data = prepare_data(recipe, tokenizer, state=state)
    args = training_args(recipe, run_dir=Path(resolved).parent, has_eval=False)
    t = recipe.train
    nonfinite, probe = NonFiniteCallback(policy=t.on_nonfinite, max_bad_steps=t.max_bad_steps), WeightProbe()
    model = load_training_model(recipe, args=args)
    trainer = build_trainer(
        recipe, args=args, model=model, tokenizer=tokenizer, data=data, callbacks=[nonfinite, probe]
    )
    trainer.train()
    if state.is_main_process:
        seen = {
            "steps": trainer.state.global_step,
            "skipped": nonfinite.skipped,
            "bad": nonfinite.bad,
            "changed": probe.changed,
            "deepspeed_skipped": trainer.model_wrapped.skipped_steps,  # the engine's own count
        }
        Path(out).write_text(json.dumps(seen))
    state.destroy_process_group()


def test_deepspeed_skips_bad_steps_itself_and_they_are_counted(poisoned, tmp_path):
    """ZeRO-2: DeepSpeed steps inside accelerator.backward(), before the Trainer's pre-step hook, with the
    gradients in its own partitions; it skips each NaN step (weights unchanged) and the callback counts
    exactly those steps, while the others train."""
    out = tmp_path / "seen.json"
    done, log = _deepspeed(
        poisoned,
        tmp_path / "run",
        strategy="zero2",
        module=__name__,
        extra=[str(out)],
        on_nonfinite="skip",
        max_bad_steps=8,
    )
    assert done.returncode == 0, log
    seen = json.loads(out.read_text())
    assert seen["steps"] == 8, seen
    skipped = set(seen["skipped"])
    assert skipped and len(skipped) < 8, seen  # some batches hold BAD, some do not (seeded order)
    assert seen["deepspeed_skipped"] == seen["bad"] == len(skipped), seen
    for step, changed in seen["changed"].items():
        assert changed == (int(step) not in skipped), (step, changed, sorted(skipped))


def test_deepspeed_stop_names_the_step(poisoned, tmp_path):
    """ZeRO-3 through the real rank entry point: the default policy stops at the first bad step, naming it."""
    from finetune.rundir import read_metrics, read_rank_error

    run_dir = tmp_path / "run"
    done, log = _deepspeed(poisoned, run_dir, strategy="zero3")
    assert done.returncode != 0, log
    error = read_rank_error(run_dir)
    assert error.get("exit_code") == 4, log
    text = error["message"]
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    bad = rows[-1]  # DeepSpeed reports a skipped step's gradient norm as inf
    assert bad["grad_norm"] == math.inf and all(math.isfinite(r["grad_norm"]) for r in rows[:-1]), rows
    assert f"at step {bad['step']} (DeepSpeed's gradients" in text, text
    assert "1 bad step(s), policy train.on_nonfinite=stop" in text, text
    assert not list(run_dir.glob("checkpoints/checkpoint-*"))


def _bf16_engine_rank(resolved: str, out: str) -> None:
    """DeepSpeed's engine on the run's compiled ds_config.json under bf16, which the Trainer runs on GPUs only
    (DeepSpeed's CPU accelerator runs it): three steps, the second one on a NaN input."""
    import deepspeed

    config = json.loads((Path(resolved).parent / "ds_config.json").read_text())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    changed, finite = {}, True
    for step in (1, 2, 3):
        before = [p.detach().clone() for p in engine.module.parameters()]
        x = torch.randn(config["train_micro_batch_size_per_gpu"], 8, dtype=torch.bfloat16)
        if step == 2:
            x[0, 0] = float("nan")
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        after = [p.detach() for p in engine.module.parameters()]
        changed[step] = any(not torch.equal(a, b) for a, b in zip(before, after))
        finite = finite and all(bool(torch.isfinite(a).all()) for a in after)
    Path(out).write_text(json.dumps({"changed": changed, "finite": finite, "skipped_steps": engine.skipped_steps}))


def test_compiled_ds_config_makes_deepspeed_skip_a_bf16_nan_step(poisoned, tmp_path):
    """bf16 under ZeRO-2 is the one case where DeepSpeed skips a non-finite step only when asked to
    (bf16.check_grad_overflow): the compiled config asks, and the NaN step leaves every weight as it was."""
    out = tmp_path / "seen.json"
    done, log = _deepspeed(
        poisoned, tmp_path / "run", strategy="zero2", module=__name__, extra=[str(out), "bf16-engine"], precision="bf16"
    )
    assert done.returncode == 0, log
    seen = json.loads(out.read_text())
    assert seen == {"changed": {"1": True, "2": False, "3": True}, "finite": True, "skipped_steps": 1}, seen


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_bad_element_anywhere_is_found(bad, dtype):
    from finetune.train.callbacks import all_finite

    grads = [torch.randn(1000, dtype=dtype), torch.randn(64, 64, dtype=dtype)]
    assert all_finite(grads)
    grads[1][17, 5] = bad
    assert not all_finite(grads)


def test_finite_values_whose_sum_overflows_are_finite():
    from finetune.train.callbacks import all_finite

    # the fast path's per-tensor sum overflows to inf; the elements are tested then, and all are finite
    assert all_finite([torch.full((1000,), 3e38), torch.full((8,), 3e38, dtype=torch.bfloat16)])
    assert all_finite([])


if __name__ == "__main__":  # a rank of the DeepSpeed tests: RESOLVED OUT [trainer | bf16-engine]
    resolved, out, *mode = sys.argv[1:]
    {"trainer": _deepspeed_rank, "bf16-engine": _bf16_engine_rank}[mode[0] if mode else "trainer"](resolved, out)


# rank 1's gradient in each case (rank 0's is all ones), and whether both ranks drop the step
TWO_RANK_CASES = {
    # one rank's NaN: both ranks drop the step
    "nan-on-rank-1": (torch.full((4, 4), float("nan")), True),
    # a sum that overflows on finite values: no rank drops it
    "overflowing-sum-on-rank-1": (torch.full((4, 4), 3e38), False),
}


def _two_rank_verdicts(rank: int, port: int, rank1_grads: dict, out) -> None:
    """One rank: for each case in turn, a fresh callback's verdict on this rank's gradient."""
    import torch.distributed as dist
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from finetune.train.callbacks import NonFiniteCallback

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for case, rank1_grad in rank1_grads.items():
            model = torch.nn.Linear(4, 4, bias=False)
            model.weight.grad = (rank1_grad if rank == 1 else torch.ones(4, 4)).clone()
            callback = NonFiniteCallback(policy="skip", max_bad_steps=5)
            args = TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
            callback.on_pre_optimizer_step(args, TrainerState(), TrainerControl(), model=model, optimizer=None)
            out.put((case, rank, model.weight.grad is None, list(callback.skipped)))
    finally:
        dist.destroy_process_group()


def _spawn_two_ranks(_root) -> dict[str, list[tuple]]:
    """Both ranks' verdicts, case -> [(rank, dropped, skipped steps)]: one pair of processes for every case."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rank1_grads = {case: grad for case, (grad, _) in TWO_RANK_CASES.items()}
    procs = [ctx.Process(target=_two_rank_verdicts, args=(r, port, rank1_grads, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results: dict[str, list[tuple]] = {case: [] for case in TWO_RANK_CASES}
    for _ in range(len(procs) * len(TWO_RANK_CASES)):
        case, *verdict = out.get(timeout=120)
        results[case].append(tuple(verdict))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return {case: sorted(verdicts) for case, verdicts in results.items()}


@pytest.fixture(scope="module")
def two_rank_verdicts(tmp_path_factory):
    # two processes that import the training stack (spawned): started once for both cases and both xdist workers
    return once_per_session(tmp_path_factory, "nonfinite-two-ranks", _spawn_two_ranks)


@pytest.mark.parametrize("case", list(TWO_RANK_CASES))
def test_two_ranks_agree_on_one_rank_s_bad_gradients(case, two_rank_verdicts):
    """DDP/FSDP2: each rank's verdict meets the other's in one all-reduce (the sums first, then, only where
    a sum was not finite, the elements), and every rank skips or keeps the step alike."""
    skipped = TWO_RANK_CASES[case][1]
    results = two_rank_verdicts[case]
    assert [rank for rank, _, _ in results] == [0, 1]
    assert [dropped for _, dropped, _ in results] == [skipped, skipped]
    assert [steps for _, _, steps in results] == ([[1], [1]] if skipped else [[], []])

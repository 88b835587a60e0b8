"""Problems that used to surface as a traceback inside a rank are found before launch, naming the key or
file and the fix (exit 2): damaged weights, missing tokenizer files, an out-of-range seed, a chat template
that raises, a model that needs remote code, a GPU preset without GPUs. What can only fail inside a rank
is reported as one paragraph with advice that fits the cause."""

from __future__ import annotations

import errno
import json
import shutil

import pytest

from finetune.cli import main
from finetune.errors import DataError, RecipeError, TrainingFailed
from finetune.registry.detect import query_gpus
from finetune.train.failure import as_finetune_error
from tests.helpers.paths import TINY_MODEL
from tests.helpers.processes import cli_argv, run
from tests.helpers.recipes import write_recipe


def _model(tmp_path, **change):
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL, model)
    return model


def _refused(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "fix:" in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.mark.parametrize("size", [0, 4, 1000])
def test_damaged_weights_are_refused_before_launch(tmp_path, capsys, size):
    model = _model(tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:size])
    recipe = write_recipe(tmp_path / "recipe.yaml", model={"name": str(model)})
    _refused(
        capsys,
        ["run", str(recipe), "--output", str(tmp_path / "run"), "--dry-run"],
        "model.name",
        "empty" if size == 0 else "truncated" if size == 4 else "model.safetensors",
    )
    assert not (tmp_path / "run").exists()


def test_a_model_directory_without_tokenizer_files_is_refused(tmp_path, capsys):
    model = _model(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    recipe = write_recipe(tmp_path / "recipe.yaml", model={"name": str(model)})
    _refused(capsys, ["run", str(recipe), "--output", str(tmp_path / "run"), "--dry-run"], "no tokenizer files")


@pytest.mark.parametrize("seed", [-1, 2**70])
def test_seed_out_of_range_is_refused(tmp_path, capsys, seed):
    recipe = write_recipe(tmp_path / "recipe.yaml", train={"seed": seed})
    _refused(capsys, ["validate", str(recipe)], "train.seed")


def test_a_chat_template_that_raises_is_found_on_the_first_row(tmp_path, capsys):
    recipe = write_recipe(
        tmp_path / "recipe.yaml", data={"chat_template": "{{ raise_exception('this template takes no user turns') }}"}
    )
    _refused(
        capsys,
        ["run", str(recipe), "--output", str(tmp_path / "run"), "--dry-run"],
        "data.chat_template",
        "row 1",
        "this template takes no user turns",
    )


def test_a_model_that_needs_remote_code_is_refused_by_key(tmp_path, capsys):
    model = _model(tmp_path)
    config = json.loads((model / "config.json").read_text())
    config.update(
        model_type="my_own_arch", auto_map={"AutoConfig": "my_arch.MyConfig", "AutoModelForCausalLM": "my_arch.MyModel"}
    )
    (model / "config.json").write_text(json.dumps(config))
    recipe = write_recipe(tmp_path / "recipe.yaml", model={"name": str(model), "arch": "tiny-llama"})
    _refused(capsys, ["run", str(recipe), "--output", str(tmp_path / "run"), "--dry-run"], "model.trust_remote_code")


@pytest.mark.skipif(bool(query_gpus()), reason="this machine has GPUs")
def test_a_gpu_preset_on_a_machine_without_gpus_is_refused_before_launch(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "recipe.yaml", train={"precision": "bf16"}, model={"dtype": "bfloat16"})
    _refused(
        capsys,
        ["run", str(recipe), "--output", str(tmp_path / "run"), "--hardware", "workstation-1x4090"],
        "no NVIDIA GPU",
        "--hardware cpu",
    )
    assert not (tmp_path / "run").exists()


def test_errors_inside_a_rank_become_one_paragraph_with_fitting_advice(tmp_path):
    full = as_finetune_error(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x")), run_dir=tmp_path)
    assert isinstance(full, TrainingFailed) and "disk full" in full.render() and "starts from step 0" in full.render()
    other = as_finetune_error(RuntimeError("boom\nat line 2"), run_dir=tmp_path).render()
    assert other.startswith("RuntimeError: boom at line 2") and "FINETUNE_DEBUG=1" in other
    assert "resume" not in other.split("fix:")[0]
    assert isinstance(as_finetune_error(ValueError("set trust_remote_code=True"), run_dir=tmp_path), RecipeError)


def test_a_nan_that_anomaly_mode_traced_to_cudnn_attention_points_at_the_attention_settings(tmp_path):
    """The message torch's anomaly mode raised on an H200 (FINETUNE_DETECT_ANOMALY, docs/validation.md thirty-first
    session): cuDNN's attention backward gets the attention keys and their fix; any other function the NaN key."""
    cudnn = as_finetune_error(
        RuntimeError("Function 'ScaledDotProductCudnnAttentionBackward0' returned nan values in its 0th output."),
        run_dir=tmp_path,
    ).render()
    assert cudnn.startswith("model.attn_implementation: the backward made a NaN in cuDNN's attention kernel"), cudnn
    assert "data.packing: true" in cudnn and "model.attn_implementation: eager" in cudnn
    other = as_finetune_error(
        RuntimeError("Function 'LogSoftmaxBackward0' returned nan values in its 0th output."), run_dir=tmp_path
    ).render()
    assert other.startswith("train.on_nonfinite: the backward made a NaN: Function 'LogSoftmaxBackward0'"), other
    assert "FINETUNE_DEBUG" not in other


@pytest.mark.slow
def test_a_rank_error_prints_one_paragraph_without_a_traceback(tmp_path):
    # the template fails only on a row the pre-launch render does not try: the rank reports it
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}" + (" forbidden" if i == 5 else "")},
                {"role": "assistant", "content": f"answer {i}"},
            ]
        }
        for i in range(1, 9)
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = (
        "{% for m in messages %}{% if 'forbidden' in m['content'] %}{{ raise_exception('row too long "
        "for this template') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    recipe = write_recipe(tmp_path / "recipe.yaml", data={"chat_template": template, "sources": [{"path": str(data)}]})
    done = run(cli_argv(recipe, tmp_path / "run"), cache=tmp_path / "cache")
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "internal error" not in out, out[-4000:]
    assert "row too long for this template" in out and "data.chat_template" in out and "fix:" in done.stderr
    assert "rerun to resume" not in out
    assert isinstance(as_finetune_error(DataError("x"), run_dir=tmp_path), DataError)


def test_a_write_error_that_is_not_enospc_on_a_full_disk_is_reported_as_disk_full(tmp_path, monkeypatch):
    """torch.save's C++ writer reports a full disk as a RuntimeError ("basic_ios::clear: iostream
    error"), not as OSError(ENOSPC): with the run directory's filesystem full, the cause is the disk."""
    import finetune.train.failure as failure

    error = RuntimeError("basic_ios::clear: iostream error")
    monkeypatch.setattr(failure, "free_bytes", lambda path: 0)
    err = as_finetune_error(error, run_dir=tmp_path)
    assert isinstance(err, TrainingFailed) and err.key == "output.dir"
    assert "disk full" in err.message and "iostream error" in err.message and "free disk space" in err.hint
    monkeypatch.setattr(failure, "free_bytes", lambda path: 10 << 30)  # room: not the disk
    assert "disk full" not in as_finetune_error(error, run_dir=tmp_path).message

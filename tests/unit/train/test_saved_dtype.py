"""A full fine-tune's final weights are written in model.dtype even when the Trainer gathered fp32 master
weights for the save (FSDP2's upcast: measured on H100s, a 3.2B model saved as 14.4 GB of F32), while a
checkpoint's save (no final dtype set) is left as gathered. The Trainer here is finetune's real trainer
class on the shipped tiny model; the state dict is handed to `_save` exactly as transformers' FSDP branch
of `Trainer.save_model` hands it (`self._save(output_dir, state_dict=state_dict)`)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.recipes import tiny_recipe, tiny_trainer

pytestmark = pytest.mark.slow


def _full_bf16_trainer(tmp_path):
    raw = tiny_recipe(model={"dtype": "bfloat16"}, adapter={"type": "full"}, train={"precision": "bf16"})
    return tiny_trainer(raw, run_dir=tmp_path / "run", has_eval=False)


def _saved(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_the_final_save_of_fp32_master_weights_is_written_in_the_model_dtype(tmp_path):
    from finetune.train.saved_dtype import final_save_dtype

    recipe, trainer = _full_bf16_trainer(tmp_path)
    assert final_save_dtype(recipe) is torch.bfloat16
    masters = {k: v.detach().float() for k, v in trainer.model.state_dict().items()}
    assert {v.dtype for v in masters.values()} == {torch.float32}

    checkpoint = tmp_path / "checkpoint"
    trainer._save(str(checkpoint), state_dict=dict(masters))  # a checkpoint: as gathered
    assert {v.dtype for v in _saved(checkpoint).values()} == {torch.float32}

    final = tmp_path / "final"
    trainer.final_dtype = torch.bfloat16
    trainer._save(str(final), state_dict=dict(masters))
    saved = _saved(final)
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}
    for key, value in saved.items():
        assert torch.equal(value, masters[key].to(torch.bfloat16)), key
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    # half the bytes of the fp32 save: what finetune.prelaunch.output_bytes plans for the disk check
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))  # noqa: E731
    assert size(final) < 0.55 * size(checkpoint)


def test_modules_a_model_keeps_in_fp32_stay_fp32():
    from finetune.train.saved_dtype import cast_state_dict

    state = {
        "model.layers.0.mlp.gate.weight": torch.ones(2, dtype=torch.float32),
        "model.layers.0.mlp.gate_proj.weight": torch.ones(2, dtype=torch.float32),
        "model.layers.0.mlp.wo.weight": torch.ones(2, dtype=torch.float32),
        "model.norm.step": torch.ones(2, dtype=torch.int64),
    }
    out = cast_state_dict(state, torch.bfloat16, keep=("wo", "gate"))
    assert out["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    assert out["model.layers.0.mlp.wo.weight"].dtype == torch.float32
    assert out["model.layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16  # "gate" names a module, not a prefix
    assert out["model.norm.step"].dtype == torch.int64


def test_adapter_runs_and_fp32_models_are_not_cast():
    from types import SimpleNamespace

    from finetune.train.saved_dtype import final_save_dtype

    recipe = lambda adapter, dtype: SimpleNamespace(  # noqa: E731
        adapter=SimpleNamespace(type=adapter), model=SimpleNamespace(dtype=dtype)
    )
    assert final_save_dtype(recipe("lora", "bfloat16")) is None  # peft saves its fp32 adapter as trained
    assert final_save_dtype(recipe("full", "float32")) is None
    assert final_save_dtype(recipe("full", "float16")) is torch.float16

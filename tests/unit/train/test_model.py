"""Weights load from safetensors only unless allowed; remote code runs only when the recipe says so."""

from __future__ import annotations

import shutil

import pytest
import torch

from finetune.errors import RecipeError
from finetune.recipe import load_recipe
from finetune.train.model import load_model
from tests.helpers.paths import TINY_MODEL
from tests.helpers.recipes import resolve_recipe, tiny_recipe

pytestmark = pytest.mark.slow


def _model_dir(tmp_path, *, pickled: bool, remote_code: bool = False):
    out = tmp_path / "model"
    shutil.copytree(TINY_MODEL, out)
    if pickled:
        from safetensors.torch import load_file

        torch.save(load_file(out / "model.safetensors"), out / "pytorch_model.bin")
        (out / "model.safetensors").unlink()
    if remote_code:
        marker = tmp_path / "remote-code-ran"
        (out / "modeling_evil.py").write_text(
            f"open({str(marker)!r}, 'w').write('ran')\n"
            "from transformers import LlamaForCausalLM\n"
            "class EvilForCausalLM(LlamaForCausalLM):\n    pass\n"
        )
        import json

        config = json.loads((out / "config.json").read_text())
        config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
        (out / "config.json").write_text(json.dumps(config))
    return out


def _resolved(tmp_path, model_dir, **model):
    raw = tiny_recipe(model={"name": str(model_dir), **model})
    return load_recipe(resolve_recipe(raw, run_dir=tmp_path / "run"), allow_resolved=True)


def test_pickled_weights_are_refused_by_default(tmp_path):
    recipe = _resolved(tmp_path, _model_dir(tmp_path, pickled=True))
    with pytest.raises(RecipeError) as info:
        load_model(recipe)
    assert "allow_pickle" in info.value.render()


def test_pickled_weights_load_when_allowed(tmp_path):
    recipe = _resolved(tmp_path, _model_dir(tmp_path, pickled=True), allow_pickle=True)
    model = load_model(recipe)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_remote_code_does_not_run_unless_trusted(tmp_path):
    model_dir = _model_dir(tmp_path, pickled=False, remote_code=True)
    model = load_model(_resolved(tmp_path, model_dir))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not (tmp_path / "remote-code-ran").exists()
    model = load_model(_resolved(tmp_path, model_dir, trust_remote_code=True))
    assert type(model).__name__ == "EvilForCausalLM"
    assert (tmp_path / "remote-code-ran").exists()


@pytest.mark.parametrize("tied", [True, False])
def test_empty_random_build_has_the_main_ranks_parameters(tied):
    """model.init: random under FSDP: the non-main ranks' meta build must list the same parameters as the
    main rank's real one (accelerate maps them by name after fully_shard), tied embeddings included."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from finetune.tiny import MODEL_SHAPE
    from finetune.train.model import build_from_config

    config = LlamaConfig(**MODEL_SHAPE, vocab_size=64, tie_word_embeddings=tied)
    real = build_from_config(AutoModelForCausalLM, config, {}, empty=False)
    empty = build_from_config(AutoModelForCausalLM, config, {}, empty=True)
    assert [n for n, _ in empty.named_parameters()] == [n for n, _ in real.named_parameters()]
    assert all(p.is_meta for p in empty.parameters())
    assert (empty.lm_head.weight is empty.model.embed_tokens.weight) is tied


@pytest.mark.parametrize(
    ("quantization", "loader"),
    [
        ({"quant_method": "mxfp4"}, "Mxfp4Config"),
        ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}, "FineGrainedFP8Config"),
    ],
)
def test_a_checkpoint_published_quantized_loads_through_transformers_dequantizing_config(
    tmp_path, quantization, loader
):
    """transformers keeps MXFP4 experts packed on a GPU unless told to dequantize (only a CPU load dequantizes by
    itself), and FP8 linears in FP8; neither trains: finetune always passes the dequantizing config for such a
    checkpoint, and a random build from its config drops the quantization the saved model would otherwise claim."""
    import json

    from finetune.train.model import base_config, dequantizing_config, model_kwargs

    folder = tmp_path / "model"
    shutil.copytree(TINY_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    recipe = load_recipe(tiny_recipe(model={"name": str(folder), "dtype": "bfloat16"}))
    quant = model_kwargs(recipe)["quantization_config"]
    assert type(quant).__name__ == loader and quant.dequantize
    plain = load_recipe(tiny_recipe())
    assert "quantization_config" not in model_kwargs(plain) and dequantizing_config(base_config(plain)) is None
    random = load_recipe(tiny_recipe(model={"name": str(folder), "dtype": "bfloat16", "init": "random"}))
    assert "quantization_config" not in model_kwargs(random)

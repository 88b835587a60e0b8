"""Property-based planning: recipes drawn across methods, adapters, strategies, presets, registry shapes, batch
sizes and pins, planned in-process as `finetune plan` plans them (the data read and measured first). Each either
plans or is refused as a recipe error (a FinetuneError naming a key and a fix); a plan's figures are finite and
positive, its MFU at most 1, its batch is micro-batch x accumulation x world, and what fits is within its card. An
odd per-GPU batch for KTO once crashed here (min() of no micro-batch options)."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from finetune.api import plan
from finetune.errors import FinetuneError
from finetune.recipe.schema import METHOD_FORMATS
from finetune.registry import get_preset, list_presets
from finetune.strategies import NAMES as STRATEGIES
from tests.helpers.paths import ROOT

SAMPLES = ROOT / "data" / "samples"
DATA = {"messages": "sharegpt.jsonl", "preference": "preference.jsonl", "unpaired": "unpaired.jsonl"}
DATA |= {"text": "text.jsonl", "alpaca": "alpaca.jsonl", "sharegpt": "sharegpt.jsonl"}
DATA |= {"prompt_completion": "prompt_completion.jsonl"}
SHAPES = ("llama-3.2-1b", "llama-3.1-8b", "qwen2.5-14b", "gemma-2-9b", "mixtral-8x7b", "llama-3.1-70b")
PLANS = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))


@st.composite
def recipes(draw):
    method = draw(st.sampled_from(sorted(METHOD_FORMATS)))
    fmt = draw(st.sampled_from([f for f in METHOD_FORMATS[method] if f in DATA]))
    adapter = draw(st.sampled_from(["lora", "qlora", "full"]))
    train: dict = {"global_batch_size": draw(st.sampled_from([1, 2, 3, 7, 8, 24, 120, 1000]))}
    pin = draw(st.sampled_from([None, 1, 2, 3, 8]))
    if pin is not None:
        train["micro_batch_size"] = pin
    train["activation_checkpointing"] = draw(st.sampled_from(["auto", "on", "off"]))
    return {
        "model": {"name": "org/any", "arch": draw(st.sampled_from(SHAPES))},
        "method": {"type": method},
        "adapter": {"type": adapter, **({"dora": True} if adapter == "lora" and draw(st.booleans()) else {})},
        "data": {
            "sources": [{"path": str(SAMPLES / DATA[fmt]), "format": fmt}],
            "max_length": draw(st.sampled_from([256, 2048, 8192, 131072])),
            "allow_outside": True,
            "packing": draw(st.booleans()),
            # the packed examples' measured length (as `finetune run` measures it with the model's tokenizer)
            **({"example_tokens": 300.0} if draw(st.booleans()) else {}),
        },
        "train": train,
        "distributed": {"strategy": draw(st.sampled_from(["auto", *STRATEGIES]))},
    }


@PLANS
@given(recipe=recipes(), hardware=st.sampled_from(sorted(p.name for p in list_presets())))
def test_every_drawn_recipe_plans_or_is_refused_as_a_recipe_error(recipe, hardware):
    try:
        result = plan(recipe, hardware=hardware)
    except FinetuneError as err:  # refused: a key and a fix, never another exception
        assert err.render().strip(), err
        return
    preset = get_preset(hardware)
    numbers = (result.tokens_per_second, result.step_time_s, result.per_gpu_memory_gib, result.mfu)
    assert all(math.isfinite(x) and x >= 0 for x in numbers), result.to_json()
    # useful FLOPs never outrun the card: short examples packed into a long row attend within themselves
    assert result.mfu <= 1.0, result.to_json()
    assert result.micro_batch_size >= 1 and result.gradient_accumulation_steps >= 1
    world = preset.world_size
    assert result.global_batch_size == result.micro_batch_size * result.gradient_accumulation_steps * world
    if result.fits:
        assert result.tokens_per_second > 0 and result.per_gpu_memory_gib <= preset.gpu_memory_gib

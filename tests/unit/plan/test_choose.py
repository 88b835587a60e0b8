"""The choice across strategies: a later tier (strategies.NAMES order) must be modelled more than
CLEARLY_FASTER faster than every earlier one that fits to be chosen (plan/choose.simplest_near_fastest)."""

from __future__ import annotations

import pytest

from finetune.plan import plan
from finetune.plan.choose import CLEARLY_FASTER, simplest_near_fastest
from finetune.plan.types import Candidate, MemoryBreakdown
from finetune.recipe import load_recipe
from finetune.strategies import offload_level


def _candidate(strategy: str, step_s: float) -> Candidate:
    return Candidate(
        strategy=strategy,
        micro_batch_size=1,
        activation_checkpointing=False,
        memory=MemoryBreakdown(),
        fits=True,
        step_time_s=step_s,
    )


def test_an_earlier_tier_within_the_margin_is_kept():
    fitting = [_candidate("zero2", 1.0), _candidate("fsdp2", 1.0 * (1 + CLEARLY_FASTER) - 1e-9), _candidate("ddp", 1.2)]
    assert simplest_near_fastest(fitting).strategy == "fsdp2"


def test_a_later_tier_wins_when_it_is_clearly_faster_than_every_earlier_one():
    fitting = [_candidate("zero2", 1.0), _candidate("fsdp2", 1.0 * (1 + CLEARLY_FASTER) + 1e-6), _candidate("ddp", 1.5)]
    assert simplest_near_fastest(fitting).strategy == "zero2"


def test_the_order_not_the_list_position_decides():
    fitting = [_candidate("zero3", 1.02), _candidate("fsdp2", 1.05), _candidate("zero2", 1.0)]
    assert simplest_near_fastest(fitting).strategy == "fsdp2"


def test_8b_full_on_8_h100s_chooses_fsdp2_where_zero2_is_not_clearly_faster():
    # zero2 fits too; its host time (DeepSpeed's gradient hook per tensor and micro-batch, plan/host_time.py)
    # keeps it from being clearly faster, so the simpler tier stays
    raw = {
        "model": {"name": "x", "arch": "llama-3.1-8b"},
        "adapter": "full",
        "data": {"path": "t.jsonl"},
        "train": {"global_batch_size": 64},
        "hardware": "server-8xh100",
    }
    result = plan(load_recipe(raw))
    by_name = {c.strategy: c for c in result.candidates}
    assert by_name["zero2"].fits
    assert by_name["fsdp2"].step_time_s < by_name["zero2"].step_time_s * (1 + CLEARLY_FASTER)
    assert result.strategy == "fsdp2"


def test_offload_levels_come_before_the_margin():
    # 1B full on one 4090: only offload tiers fit; fsdp2-offload (parameters too) is modelled more than
    # CLEARLY_FASTER faster than zero3-optim-offload, but the planner takes the least offload that fits
    raw = {
        "model": {"name": "x", "arch": "llama-3.2-1b"},
        "adapter": "full",
        "data": {"path": "t.jsonl"},
        "train": {"global_batch_size": 64},
        "hardware": "workstation-1x4090",
    }
    result = plan(load_recipe(raw))
    chosen = result.chosen
    fitting = [c for c in result.candidates if c.fits]
    assert offload_level(result.strategy) == min(offload_level(c.strategy) for c in fitting) == 1
    more = [c for c in fitting if offload_level(c.strategy) > offload_level(result.strategy)]
    assert any(c.step_time_s * (1 + CLEARLY_FASTER) < chosen.step_time_s for c in more)


def test_an_adapter_never_gets_zero2_or_optimizer_offload_unasked_but_a_pin_is_planned():
    """They gain an adapter little, so the planner does not pick them; a user's pin (an axolotl or
    LLaMA-Factory ZeRO-2 file with LoRA) works, so it is planned rather than refused."""
    for strategy in ("zero2", "zero3-optim-offload"):
        raw = {
            "model": {"name": "x", "arch": "llama-3.1-8b"},
            "adapter": "lora",
            "data": {"path": "t.jsonl"},
            "train": {"global_batch_size": 16},
            "hardware": "server-8xh100",
        }
        auto = plan(load_recipe(raw))
        assert auto.strategy != strategy and strategy not in {c.strategy for c in auto.candidates if c.fits}
        pinned = plan(load_recipe({**raw, "distributed": {"strategy": strategy}}))
        assert pinned.fits and pinned.strategy == strategy


def test_8bit_weights_are_planned_unsharded_and_a_pinned_sharding_is_refused():
    """adapter.load_in_8bit: from_pretrained quantizes the whole base onto each rank's GPU and neither FSDP2 nor
    ZeRO-3 shards bitsandbytes' Int8Params, so the planner never shards them (it once planned 70B's int8 weights
    split eight ways under fsdp2) and says why where the strategy is pinned."""
    from finetune.strategies import info
    from tests.helpers.paths import ROOT

    raw = load_recipe(ROOT / "recipes" / "llama8b-lora.yaml").model_dump(mode="json")
    raw["adapter"]["load_in_8bit"] = True
    raw["train"]["liger"] = "off"
    raw["hardware"] = "server-8xh100"
    result = plan(load_recipe(raw))
    assert result.fits and not info(result.strategy).shards_params
    assert all(not info(c.strategy).shards_params for c in result.candidates)
    raw["distributed"]["strategy"] = "fsdp2"
    pinned = plan(load_recipe(raw))
    assert not pinned.fits and "adapter.load_in_8bit weights are not sharded" in pinned.why
    # and its table shows what each rank would hold: the whole 8-bit base, as under ddp
    ddp = next(c for c in result.candidates if c.strategy == "ddp")
    assert pinned.chosen.memory.weights == pytest.approx(ddp.memory.weights)


def test_bitsandbytes_optimizers_are_never_planned_under_fsdp2_and_a_pin_is_refused_by_name():
    """bitsandbytes' 8-bit and paged optimizers fail at FSDP2's first step (its DTensor parameters; blind draw
    blind2-13 on 2 H200s): the planner leaves the FSDP2 tiers out for them, and the recipe check refuses the pin
    before anything loads, naming train.optimizer and the fix."""
    from finetune.errors import RecipeError
    from finetune.strategies import BNB_UNDER_FSDP_REFUSAL, is_fsdp
    from tests.helpers.paths import ROOT

    raw = load_recipe(ROOT / "recipes" / "llama8b-lora.yaml").model_dump(mode="json")
    raw["adapter"]["type"] = "qlora"
    raw["train"]["optimizer"] = "adamw_8bit"
    raw["hardware"] = "server-8xh100"
    raw["distributed"]["strategy"] = "auto"
    result = plan(load_recipe(raw))
    assert result.fits and not is_fsdp(result.strategy)
    assert not any(is_fsdp(c.strategy) for c in result.candidates if c.fits)
    raw["distributed"]["strategy"] = "fsdp2"
    with pytest.raises(RecipeError) as refused:
        load_recipe(raw)
    assert "train.optimizer" in str(refused.value) and BNB_UNDER_FSDP_REFUSAL in str(refused.value)
    raw["train"]["optimizer"] = "adamw"
    assert plan(load_recipe(raw)).strategy == "fsdp2"

"""finetune.hostprobe: this machine's host time a kernel, timed as the difference of two depths of a tiny LoRA model
over the kernels the planner counts for them. On CPU the code path runs (the figure is the CPU's compute there);
on a GPU machine the planner uses it for a host-bound plan made for that machine (`--hardware auto`)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from finetune import hostprobe
from finetune.plan.host_time import (
    KERNELS_PER_ADAPTED_LINEAR,
    KERNELS_PER_LAYER,
    KERNELS_WITHOUT_LIGER_PER_LAYER,
)
from finetune.plan.workload import ALL_LINEAR
from tests.helpers.paths import ROOT


def test_the_probe_divides_by_the_planners_own_count_of_a_layers_kernels():
    with_liger = KERNELS_PER_LAYER + len(ALL_LINEAR) * KERNELS_PER_ADAPTED_LINEAR
    assert hostprobe.planned_kernels_per_layer(liger=True) == pytest.approx(with_liger)
    assert hostprobe.planned_kernels_per_layer(liger=False) == pytest.approx(
        with_liger + KERNELS_WITHOUT_LIGER_PER_LAYER
    )


def test_the_probe_runs_a_real_lora_forward_and_backward_at_two_depths_on_cpu():
    probe = hostprobe.measure("cpu", iterations=1, repeats=1)
    assert not probe.liger  # Liger's kernels are GPU kernels
    assert probe.kernels_per_layer == pytest.approx(hostprobe.planned_kernels_per_layer(liger=False))
    assert probe.seconds_per_layer > 0 and probe.s_per_kernel == pytest.approx(
        probe.seconds_per_layer / probe.kernels_per_layer
    )
    assert probe.device_name == "cpu"


def test_without_a_gpu_the_planner_gets_no_figure_and_keeps_its_floor():
    # the real child process: CUDA is not available on this machine, so the probe fails and says nothing
    hostprobe.measured_s_per_kernel.cache_clear()
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU: the probe measures it")
        assert hostprobe.measured_s_per_kernel() is None
    finally:
        hostprobe.measured_s_per_kernel.cache_clear()


GEMMA3_1B = ROOT / "tests" / "data" / "hub_configs" / "gemma-3-1b" / "config.json"


def test_the_probe_shrinks_the_runs_own_architecture_and_keeps_its_layer():
    """Gemma-3-1B's config.json at the probe's widths: its family, head width, windows and norms stay what the
    family builds (the layer whose host time is measured), the widths and the token ids are the probe's."""
    model = json.loads(GEMMA3_1B.read_text())
    shallow, deep = (hostprobe.probe_config(layers, model) for layers in hostprobe.PROBE_DEPTHS)
    assert deep["model_type"] == "gemma3_text" and deep["num_hidden_layers"] == hostprobe.PROBE_DEPTHS[1]
    assert deep["hidden_size"] == hostprobe.PROBE_SHAPE["hidden_size"]
    assert deep["head_dim"] == hostprobe.PROBE_OPTIONAL_WIDTHS["head_dim"]  # 256 in the checkpoint
    assert deep["sliding_window"] == model["sliding_window"]
    # the class lays its 5-sliding-1-global pattern over the probe's depth
    assert deep["layer_types"].count("full_attention") == 1 and len(shallow["layer_types"]) == 2
    assert deep["eos_token_id"] is None  # the checkpoint's ids lie beyond the probe's vocabulary
    # Gemma-3's q/k norms and four norms a layer: more kernels a layer than Llama's, counted by the planner
    assert hostprobe.planned_kernels_per_layer(liger=False, model=model) > hostprobe.planned_kernels_per_layer(
        liger=False
    )


def test_the_probe_of_a_family_runs_that_familys_model_on_cpu():
    model = json.loads(GEMMA3_1B.read_text())
    probe = hostprobe.measure("cpu", model=model, iterations=1, repeats=1)
    assert probe.family == "gemma3_text" and not probe.liger
    assert probe.kernels_per_layer == pytest.approx(hostprobe.planned_kernels_per_layer(liger=False, model=model))
    assert probe.s_per_kernel == pytest.approx(probe.seconds_per_layer / probe.kernels_per_layer)


def test_the_planner_probes_the_recipes_own_model(tmp_path):
    """plan_on hands the probe the run's config.json where this machine has it, the registry's for a model.arch
    key (which stands in for whatever model.name points at)."""
    from finetune.plan import lookup, model_config_text
    from finetune.registry.hfconfig import hf_config
    from tests.helpers.recipes import shape_recipe

    folder = tmp_path / "gemma-3-1b"
    folder.mkdir()
    (folder / "config.json").write_text(GEMMA3_1B.read_text())
    local = shape_recipe(str(folder), "lora")
    arch, _, _ = lookup(local, hardware="server-8xh100")
    assert model_config_text(local, arch) == GEMMA3_1B.read_text()
    keyed = shape_recipe("llama-3.1-8b", "lora", model__arch="llama-3.1-8b")
    arch, _, _ = lookup(keyed, hardware="server-8xh100")
    assert json.loads(model_config_text(keyed, arch)) == hf_config(arch)


def test_the_4bit_probe_loads_its_base_as_a_qlora_run_does_and_counts_the_dequantization():
    """A QLoRA run's probe layer: the probe's random weights saved and loaded again through bitsandbytes in 4 bits
    with the recipe's QLoRA defaults, and divided by the planner's count for a QLoRA layer, which adds
    bitsandbytes' dequantization kernels to LoRA's."""
    import torch
    from bitsandbytes.nn import Linear4bit

    qlora = hostprobe.ProbeLayer(adapter="qlora")
    model = hostprobe.build_probe_model(2, liger=False, device=torch.device("cpu"), layer=qlora)
    assert isinstance(model.base_model.model.model.layers[0].self_attn.q_proj.base_layer, Linear4bit)
    assert hostprobe.planned_kernels_per_layer(liger=False, layer=qlora) > hostprobe.planned_kernels_per_layer(
        liger=False
    )
    probe = hostprobe.measure("cpu", layer=qlora, iterations=1, repeats=1)
    assert probe.layer["adapter"] == "qlora" and probe.kernels_per_layer == pytest.approx(
        hostprobe.planned_kernels_per_layer(liger=False, layer=qlora)
    )


def test_the_probe_builds_the_runs_layer_settings_and_the_planner_counts_the_same_layer():
    """The run's targets, dropout, fused LoRA groups, checkpointing and a packed row: built through finetune's own
    training code (its LoRA config, its checkpointing switch, its varlen attention), timed (on CPU only the code
    path), and divided by the planner's count for that layer: the recompute and the dropout add to it."""
    import torch

    from finetune.train.fused_lora import FusedLoraLinear

    run = hostprobe.ProbeLayer(
        targets=("q_proj", "k_proj", "v_proj", "o_proj"),
        dropout=0.05,
        fused_lora=True,
        fused_lora_groups=True,
        checkpointing=True,
        packed=True,
    )
    model = hostprobe.build_probe_model(2, liger=False, device=torch.device("cpu"), layer=run)
    layer = model.base_model.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, FusedLoraLinear) and layer.self_attn.q_proj._shared_input_group
    assert not hasattr(layer.mlp.gate_proj, "lora_A")  # the run's targets only
    assert layer.gradient_checkpointing and model.training
    assert model.config._attn_implementation == "finetune_varlen"
    unchecked = hostprobe.planned_kernels_per_layer(liger=False, layer=replace(run, checkpointing=False))
    assert hostprobe.planned_kernels_per_layer(liger=False, layer=run) > unchecked  # the recomputed forward
    assert hostprobe.planned_kernels_per_layer(liger=False, layer=replace(run, checkpointing=False, dropout=0.0)) < (
        unchecked  # dropout's kernels
    )
    probe = hostprobe.measure("cpu", layer=run, iterations=1, repeats=1)
    assert probe.kernels_per_layer == pytest.approx(hostprobe.planned_kernels_per_layer(liger=False, layer=run))
    assert hostprobe.ProbeLayer.from_json(run.to_json()) == run


def test_a_host_bound_plan_probes_its_own_layer_settings():
    """probe_layer: what the chosen plan runs (a QLoRA job's 4-bit base and targets, its checkpointing when at least
    half the layers recompute, its packed rows on the varlen kernel)."""
    from finetune.plan import job_from_recipe, lookup
    from tests.helpers.recipes import shape_recipe

    recipe = shape_recipe(
        "qwen2.5-7b", "qlora", seq=1024, model__arch="qwen2.5-7b", adapter__dropout=0.05,
        adapter__target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], data__packing=True,
        train__micro_batch_size=1, train__activation_checkpointing="on",
    )  # fmt: skip
    arch, preset, _ = lookup(recipe, hardware="server-8xh100")
    job = job_from_recipe(recipe, arch=arch, preset=preset)
    layer = hostprobe.probe_layer(job, checkpointed_layers=arch.num_layers)
    assert layer.adapter == "qlora" and layer.targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert layer.dropout == 0.05 and layer.checkpointing and job.attention == "varlen" and layer.packed
    few = hostprobe.probe_layer(job, checkpointed_layers=arch.num_layers // 4)
    assert not few.checkpointing


def test_a_run_without_liger_is_probed_without_it():
    """The probe's layer carries the run's Liger choice (Job.liger): with train.liger off the probe times the eager
    norms, RoPE and activation the planner counts for it, never Liger's kernels because they are installed."""
    import torch

    from finetune.plan import job_from_recipe, lookup
    from tests.helpers.recipes import shape_recipe

    recipe = shape_recipe("llama-3.1-8b", "lora", model__arch="llama-3.1-8b", train__liger="off")
    arch, preset, _ = lookup(recipe, hardware="server-8xh100")
    job = job_from_recipe(recipe, arch=arch, preset=preset)
    layer = hostprobe.probe_layer(job, checkpointed_layers=0)
    assert not job.liger and not layer.liger
    assert hostprobe.ProbeLayer.from_json(layer.to_json()) == layer  # what the planner's child process receives
    # whatever is installed, on any device: the choice short-circuits before liger-kernel or the GPU is asked
    assert not hostprobe.probe_liger(torch.device("cuda"), None, layer)
    assert hostprobe.PLAIN_LORA.liger  # the plain probe (python -m finetune.hostprobe) runs Liger where installed


def test_the_plan_records_the_host_figure_its_step_time_used():
    """Plan.host_s_per_kernel: the probed figure where the plan used one (scripts/gpu_validate.py keeps it as the
    row's), 0 at the floor."""
    from finetune.plan import job_from_recipe, lookup, plan_job
    from tests.helpers.recipes import shape_recipe

    recipe = shape_recipe("llama-3.1-8b", "lora", model__arch="llama-3.1-8b", train__micro_batch_size=1)
    arch, preset, _ = lookup(recipe, hardware="server-8xh100")
    probed = preset.model_copy(update={"host_s_per_kernel": 40e-6})
    assert plan_job(job_from_recipe(recipe, arch=arch, preset=probed)).to_json()["host_s_per_kernel"] == 40e-6
    assert plan_job(job_from_recipe(recipe, arch=arch, preset=preset)).host_s_per_kernel == 0.0

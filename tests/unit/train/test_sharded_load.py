"""LoRA and QLoRA under FSDP2 built straight into each rank's shard (finetune/train/sharded_load.py).

Two real ranks on gloo (FSDP2's fully_shard on a CPU mesh, bitsandbytes quantizing on the CPU) load the
shipped tiny Llama with the FSDP settings finetune compiles for a 2-GPU fsdp2 run (accelerate's own
launcher turns that accelerate.yaml into the ranks' FSDP_* variables); the model the whole-model path
builds (from_pretrained, with a BitsAndBytesConfig for QLoRA, then peft) is the reference. The GPU path
itself (NCCL, CUDA bitsandbytes, the Trainer's accelerate FSDP2 preparation) is not run here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.recipe.load import load_recipe
from finetune.recipe.schema import sharded_load_blocker
from finetune.rundir import ACCELERATE_YAML, RESOLVED_RECIPE
from finetune.train import sharded_load
from tests.helpers.once import once_per_session
from tests.helpers.paths import ROOT
from tests.helpers.processes import env
from tests.helpers.recipes import resolve_recipe, tiny_recipe, write_preset

slow = pytest.mark.slow
QLORA = {
    "model": {"dtype": "bfloat16"},
    "adapter": {"type": "qlora", "r": 8, "alpha": 16},
    "train": {"precision": "bf16", "lr": 1e-2},
}
LORA = {**QLORA, "adapter": {"type": "lora", "r": 8, "alpha": 16}}
FULL = {**QLORA, "adapter": {"type": "full"}}


def _gpu_recipe(tmp_path: Path, **sections) -> Path:
    """The tiny QLoRA recipe resolved for two GPUs; keyword sections merged over it."""
    return _compiled(tmp_path / "gpu", hardware="workstation-2x4090", **sections) / RESOLVED_RECIPE


def test_applies_to_lora_and_qlora_under_every_fsdp2_strategy_on_gpus(tmp_path):
    def gpu(**sections):
        return load_recipe(_gpu_recipe(tmp_path, **sections), allow_resolved=True)

    for adapter in ("qlora", "lora"):
        fsdp2 = gpu(adapter={"type": adapter}, distributed={"strategy": "fsdp2"})
        assert sharded_load.applies(fsdp2) and sharded_load_blocker(fsdp2) == ""
        off = gpu(adapter={"type": adapter}, distributed={"strategy": "fsdp2", "sharded_load": False})
        assert not sharded_load.applies(off)
    assert not sharded_load.applies(gpu(distributed={"strategy": "ddp"}))
    full = gpu(adapter={"type": "full"}, distributed={"strategy": "fsdp2"})
    assert sharded_load.applies(full) and sharded_load_blocker(full) == ""
    cpu = load_recipe(resolve_recipe(tiny_recipe(**QLORA), run_dir=tmp_path / "cpu"), allow_resolved=True)
    assert not sharded_load.applies(cpu)


@pytest.mark.parametrize(
    ("shipped", "strategy", "hardware"),
    [
        ("llama70b-qlora.yaml", "fsdp2", "server-8xh100"),
        ("llama70b-qlora.yaml", "fsdp2-hybrid", "cluster-2x8xh100"),
        ("llama70b-lora.yaml", "fsdp2", "server-8xh100"),
        ("llama8b-full.yaml", "fsdp2", "server-8xh100"),
    ],
)
def test_the_shipped_recipes_load_sharded(shipped, strategy, hardware, tmp_path):
    """The shipped FSDP2 recipes: nothing in them sends them back to the whole-model load."""
    from finetune.compile.compiler import prepare_recipe

    overrides = [f"distributed.strategy={strategy}", f"hardware={hardware}"]
    compiled = prepare_recipe(
        load_recipe(ROOT / "recipes" / shipped, overrides=overrides), run_dir=tmp_path, hardware=None
    )
    (tmp_path / RESOLVED_RECIPE).write_text(compiled.texts[RESOLVED_RECIPE])
    recipe = load_recipe(tmp_path / RESOLVED_RECIPE, allow_resolved=True)
    assert sharded_load.applies(recipe) and sharded_load_blocker(recipe) == ""


def test_what_needs_the_whole_base_is_named(tmp_path):
    dora = load_recipe(
        _gpu_recipe(tmp_path, adapter={"type": "qlora", "dora": True}, distributed={"strategy": "fsdp2"}),
        allow_resolved=True,
    )
    assert "adapter.dora" in sharded_load_blocker(dora)
    saved = load_recipe(
        _gpu_recipe(
            tmp_path, adapter={"type": "qlora", "modules_to_save": ["lm_head"]}, distributed={"strategy": "fsdp2"}
        ),
        allow_resolved=True,
    )
    assert "adapter.modules_to_save" in sharded_load_blocker(saved)


def _compiled(run_dir: Path, **sections) -> Path:
    """The tiny QLoRA recipe compiled for GPUs by `finetune compile` (planning needs no GPU): RUN_DIR with its
    recipe.resolved.yaml and accelerate.yaml."""
    from finetune.compile.compiler import prepare_recipe
    from finetune.recipe.load import deep_merge

    recipe = tiny_recipe(**deep_merge(QLORA, {"logging": {"report_to": ["none"]}, **sections}))
    compiled = prepare_recipe(load_recipe(recipe), run_dir=run_dir, hardware=None)
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in (RESOLVED_RECIPE, ACCELERATE_YAML):
        (run_dir / name).write_text(compiled.texts[name])
    return run_dir


def _launch_env(run_dir: Path, *launch_args: str) -> dict:
    """The FSDP_* / PARALLELISM_CONFIG_* / ACCELERATE_MIXED_PRECISION variables `accelerate launch` exports to
    the ranks of RUN_DIR's accelerate.yaml (accelerate's own launcher code, run on this machine)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    argv = ["--config_file", str(run_dir / ACCELERATE_YAML), *launch_args, "unused.py"]
    exported = prepare_multi_gpu_env(_validate_launch_command(launch_command_parser().parse_args(argv))[0])
    keep = ("FSDP_", "PARALLELISM_CONFIG_", "ACCELERATE_USE_PARALLELISM_CONFIG", "ACCELERATE_MIXED_PRECISION")
    return {k: v for k, v in exported.items() if k.startswith(keep)}


def _ranks(tmp: Path, resolved: Path, launch_env: dict, *, n: int, mode: tuple[str, ...] = ()):
    """Launch `n` ranks of tests/helpers/sharded_load_rank.py on RESOLVED; (each rank's record, its tensors)."""
    out = _launch(tmp, resolved, launch_env, n=n, mode=mode)
    return _records(out, n), _tensors(out, n)


def _launch(tmp: Path, resolved: Path, launch_env: dict, *, n: int, mode: tuple[str, ...] = ()) -> Path:
    out = tmp / f"out-{n}{''.join(mode)}"
    out.mkdir()
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n)]
    argv += ["-m", "tests.helpers.sharded_load_rank", str(resolved), str(out), *mode]
    done = subprocess.run(
        argv,
        cwd=ROOT,
        env={**env(tmp / "cache"), **launch_env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return out


def _records(out: Path, n: int) -> list[dict]:
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(n)]


def _tensors(out: Path, n: int) -> list[dict]:
    import torch

    return [torch.load(out / f"rank-{r}.pt", weights_only=False) for r in range(n)]


def _two_ranks(tmp_path_factory, sections: dict, name: str):
    """Both ranks' records and tensors, and the CPU-resolved recipe they loaded; the FSDP settings are those
    finetune compiles for the same recipe on two GPUs under fsdp2. Launched once per session (for both
    pytest-xdist workers, tests/helpers/once.py): the tests only read what the ranks wrote."""

    def build(tmp: Path) -> tuple[Path, Path]:
        resolved = resolve_recipe(tiny_recipe(**sections), run_dir=tmp / "run")
        gpu = _compiled(
            tmp / "gpu", hardware="workstation-2x4090", adapter=sections["adapter"], distributed={"strategy": "fsdp2"}
        )
        return _launch(tmp, resolved, _launch_env(gpu), n=2), resolved

    out, resolved = once_per_session(tmp_path_factory, name, build)
    return _records(out, 2), _tensors(out, 2), resolved


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _two_ranks(tmp_path_factory, QLORA, "sharded-qlora")


@pytest.fixture(scope="module")
def two_ranks_full(tmp_path_factory):
    """A full fine-tune (bf16 weights, bf16 mixed precision)."""
    return _two_ranks(tmp_path_factory, FULL, "sharded-full")


@pytest.fixture(scope="module")
def two_ranks_lora(tmp_path_factory):
    return _two_ranks(tmp_path_factory, LORA, "sharded-lora")


def _whole(tmp_path_factory, sections: dict):
    """The model as the whole-model path loads it (from_pretrained, quantizing for QLoRA), peft's adapter on
    it, and its logits."""
    import torch
    from peft import get_peft_model

    from finetune.train.model import load_model, lora_config

    resolved = resolve_recipe(tiny_recipe(**sections), run_dir=tmp_path_factory.mktemp("whole") / "run")
    recipe = load_recipe(resolved, allow_resolved=True)
    model = get_peft_model(load_model(recipe), lora_config(recipe))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.arange(3, 3 + 2 * 12).reshape(2, 12)).logits
    return model, logits


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return _whole(tmp_path_factory, QLORA)


@pytest.fixture(scope="module")
def whole_lora(tmp_path_factory):
    return _whole(tmp_path_factory, LORA)


def _bytes(tensor):
    import torch

    return tensor.contiguous().view(torch.uint8)


def _four_bit_bytes(model) -> int:
    import bitsandbytes as bnb

    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))


@slow
def test_each_rank_holds_half_the_4bit_weights(two_ranks, whole):

    records, _, _ = two_ranks
    model, _ = whole
    one_process = _four_bit_bytes(model)
    for r in records:
        print(f"rank {r['rank']}: 4-bit {r['four_bit_bytes']} of {one_process} bytes, all weights {r['local_bytes']}")
        assert r["four_bit_bytes"] == pytest.approx(one_process / 2, rel=0.02)
    assert sum(r["four_bit_bytes"] for r in records) == one_process
    assert len(records[0]["quantized"]) == 14  # every Linear of the 2 decoder layers


@slow
def test_sharded_logits_equal_the_whole_model(two_ranks, whole):
    import torch

    _, tensors, _ = two_ranks
    _, reference = whole
    for t in tensors:
        diff = (t["logits"].float() - reference.float()).abs().max().item()
        print(f"max |logits - whole model's| = {diff}")
        torch.testing.assert_close(t["logits"], reference, rtol=1e-2, atol=1e-2)


@slow
def test_each_rank_keeps_the_whole_weights_quant_state(two_ranks, whole):
    import bitsandbytes as bnb
    import torch

    _, tensors, _ = two_ranks
    model, _ = whole
    expected = {
        name.removeprefix("base_model.model.").removesuffix(".base_layer"): m.weight.quant_state
        for name, m in model.named_modules()
        if isinstance(m, bnb.nn.Linear4bit)
    }
    for t in tensors:
        assert set(t["quant_states"]) == set(expected)
        for name, qs in t["quant_states"].items():
            assert qs["shape"] == tuple(expected[name].shape)
            torch.testing.assert_close(qs["absmax"], expected[name].absmax, rtol=0, atol=0)
            torch.testing.assert_close(qs["nested_absmax"], expected[name].state2.absmax, rtol=0, atol=0)
    whole_states = sum(t.numel() * t.element_size() for qs in expected.values() for t in (qs.absmax, qs.state2.absmax))
    assert [r["replicated_bytes"] for r in two_ranks[0]] == [whole_states] * 2


@slow
def test_the_adapter_is_peft_initialised_alike_on_every_rank(two_ranks):
    """lora_A from peft's kaiming init, lora_B zero, seeded by train.seed: the whole tensors the ranks hold
    between them are the same seen from either rank, and the same when loaded again."""
    import torch

    _, tensors, _ = two_ranks
    adapter = tensors[0]["adapter"]
    assert len(adapter) == 2 * 14
    for name, value in adapter.items():
        torch.testing.assert_close(value, tensors[1]["adapter"][name], rtol=0, atol=0)
        if "lora_B" in name:
            assert not value.any(), name
        else:
            assert value.float().std() > 0 and value.dtype == torch.bfloat16, name


@slow
def test_loading_holds_one_tensor_at_a_time(two_ranks):
    from safetensors import safe_open

    records, _, resolved = two_ranks
    recipe = load_recipe(resolved, allow_resolved=True)
    _, index = sharded_load.checkpoint(recipe)
    quantized = set(records[0]["quantized"])
    largest = whole_model = 0
    for key, file in index.items():
        with safe_open(file, framework="pt") as f:
            rows, *rest = f.get_slice(key).get_shape()
        numel = rows * (rest[0] if rest else 1)
        bf16 = 2 * numel
        whole_model += bf16
        if key in quantized:  # the whole bf16 matrix and its packed quarter; other tensors go from host RAM
            largest = max(largest, bf16 + bf16 // 4)
    for r in records:
        print(f"rank {r['rank']}: at most {r['peak_transient_bytes']} bytes held at once, model {whole_model}")
        # the tiny model's MLP matrix is an eighth of it; a 70B's is a 1/240th
        assert r["peak_transient_bytes"] == largest < whole_model / 4
        assert r["tensors"] == len(index)


@slow
def test_finetunes_trainer_keeps_the_adapter_and_the_loss_falls(two_ranks):
    records, _, _ = two_ranks
    for r in records:
        print(f"rank {r['rank']}: losses {r['losses']}")
        assert r["trainer_model_is_loaded_model"]
        assert r["lora_layers_after"] == r["lora_layers_before"] == 14  # TRL added no second adapter
        assert {(dtype, kind) for _, dtype, kind in r["trainable"]} == {("torch.bfloat16", "DTensor")}
        assert r["losses"][-1] < r["losses"][0]
    assert records[0]["losses"] == records[1]["losses"]  # one model: the same batch gives the same loss


@slow
def test_activation_checkpointing_applied_before_sharding_changes_nothing(two_ranks):
    """FSDP's activation checkpointing (FSDP_ACTIVATION_CHECKPOINTING) is applied by the loader, before it
    shards, as accelerate applies it: the same loss and adapter gradients as without it."""
    records, _, _ = two_ranks
    for r in records:
        changes = r["checkpointing_changes"]
        print(f"rank {r['rank']}: checkpointing {changes}")
        assert changes["wrapped"] == 2
        assert changes["loss"] <= 1e-6 and changes["grad"] <= 1e-3 * changes["grad_scale"]


@slow
def test_the_trainers_accelerator_has_nothing_left_to_wrap(two_ranks):
    """accelerate's prepare looks the decoder-layer class up by name before it shards (and returns an FSDP2
    model unchanged); FSDP2 renamed that class, so the plugin the Trainer gets names no class to wrap."""
    records, _, _ = two_ranks
    for r in records:
        assert (
            "Could not find the transformer layer class LlamaDecoderLayer" in r["accelerate_wrap_error_with_env_plugin"]
        )
        assert r["accelerate_wrap_error_with_trainer_plugin"] == ""


@slow
def test_hybrid_shard_shards_within_a_node_and_replicates_across(tmp_path, whole, two_ranks):
    """fsdp2-hybrid on 2 "nodes" of 2: the 2-D (replicate, shard) mesh that accelerate's ParallelismConfig
    builds from the compiled accelerate.yaml; each rank holds half the 4-bit weights, and every rank's model
    is the whole model's."""
    import torch

    preset = write_preset(
        tmp_path / "two-nodes.yaml",
        like="workstation-2x4090",
        name="two-nodes-2x4090",
        nodes=2,
        inter_node_fabric="ethernet",
        inter_node_bandwidth_gbps=25,
    )
    gpu = _compiled(tmp_path / "gpu", hardware=str(preset), distributed={"strategy": "fsdp2-hybrid"})
    launch_env = _launch_env(gpu, "--machine_rank", "0", "--main_process_ip", "127.0.0.1")
    records, tensors = _ranks(tmp_path, gpu / RESOLVED_RECIPE, launch_env, n=4, mode=("hybrid",))
    model, reference = whole
    one_process = _four_bit_bytes(model)
    for r, t in zip(records, tensors, strict=True):
        print(f"rank {r['rank']}: mesh {r['mesh']} {r['mesh_shape']} {r['placements']}, 4-bit {r['four_bit_bytes']}")
        assert r["mesh"] == ["dp_replicate", "dp_shard_cp"] and r["mesh_shape"] == [2, 2]
        assert r["placements"] == ["R", "S(0)"]  # replicated across nodes, dim 0 sharded within one
        assert r["handed_over"] == [2, 2] and r["same_mesh"]  # the Trainer's Accelerator gets this mesh
        assert r["four_bit_bytes"] == pytest.approx(one_process / 2, rel=0.02)
        torch.testing.assert_close(t["logits"], reference, rtol=1e-2, atol=1e-2)
    assert records[0]["four_bit_bytes"] + records[1]["four_bit_bytes"] == one_process  # one replica's shards
    two_rank_adapter = two_ranks[1][0]["adapter"]
    for t in tensors:  # peft's initialisation, seeded by train.seed on whole tensors: the same on any mesh
        assert t["adapter"].keys() == two_rank_adapter.keys()
        for name, value in t["adapter"].items():
            torch.testing.assert_close(value, two_rank_adapter[name], rtol=0, atol=0)


@slow
def test_lora_each_rank_reads_and_holds_half_the_bf16_base(two_ranks_lora, whole_lora):
    """A bf16 LoRA base: each rank reads only its own rows of every tensor (nothing held beyond its shards)
    and ends with half the base bytes."""
    records, _, _ = two_ranks_lora
    model, _ = whole_lora
    base = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    for r in records:
        print(
            f"rank {r['rank']}: base {r['frozen_bytes']} of {base} bytes, "
            f"held beyond its shards {r['peak_transient_bytes']}"
        )
        assert r["frozen_bytes"] == pytest.approx(base / 2, rel=0.02)
        assert r["peak_transient_bytes"] == 0 and r["quantized"] == [] and r["four_bit_bytes"] == 0
    assert sum(r["frozen_bytes"] for r in records) == base


@slow
def test_the_final_save_gathers_the_adapter_alone(two_ranks_lora):
    """finetune's final save of a LoRA run under FSDP2 (finetune/train/adapter_save.py): rank 0 gathers the
    trained parameters only, not the frozen base the Trainer's FULL_STATE_DICT save would gather, and the
    adapter it writes holds their trained values."""
    import torch
    from safetensors.torch import load_file

    records, _, run_yaml = two_ranks_lora
    saves = {r["rank"]: r["final_save"] for r in records}
    assert all(s["gathers_trained_only"] for s in saves.values())
    assert saves[1]["gathered_keys"] == []  # the full tensors land on rank 0 alone
    keys = saves[0]["gathered_keys"]
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)  # not the LM head tied to the embedding
    # the keys torch's distributed checkpoint gives the same parameters (what the Trainer's save gathered)
    assert set(keys) < set(saves[0]["dcp_keys"])
    assert len(keys) == 2 * 14  # A and B of the 7 projections in each of the 2 layers
    final = run_yaml.parent.parent / "out-2" / "final"  # where the ranks wrote (_launch)
    saved = load_file(final / "adapter_model.safetensors")
    trained = torch.load(final / "trained.pt")
    assert saves[0]["gathered_bytes"] == sum(t.numel() * t.element_size() for t in trained.values())
    # peft's file names drop the adapter's name ("default")
    assert {k.replace(".default", "") for k in trained} == set(saved)
    for name, value in trained.items():
        torch.testing.assert_close(saved[name.replace(".default", "")], value, rtol=0, atol=0)


@slow
def test_lora_logits_equal_the_whole_model_and_the_loss_falls(two_ranks_lora, whole_lora):
    """The same model as the whole-model path: its logits; the adapter in float32 (peft's upcast, the dtype
    accelerate's FSDP2 preparation would give it) and trained by finetune's Trainer setup."""
    import torch

    records, tensors, _ = two_ranks_lora
    _, reference = whole_lora
    for t in tensors:
        torch.testing.assert_close(t["logits"], reference, rtol=0, atol=0)
    for r in records:
        print(f"rank {r['rank']}: losses {r['losses']}")
        assert r["trainer_model_is_loaded_model"] and r["lora_layers_after"] == r["lora_layers_before"] == 14
        assert {(dtype, kind) for _, dtype, kind in r["trainable"]} == {("torch.float32", "DTensor")}
        assert r["losses"][-1] < r["losses"][0]
        changes = r["checkpointing_changes"]
        assert changes["loss"] <= 1e-6 and changes["grad"] <= 1e-3 * changes["grad_scale"]
    assert records[0]["losses"] == records[1]["losses"]


@pytest.mark.parametrize("sections", [QLORA, LORA], ids=["qlora", "lora"])
@slow
def test_random_weights_are_built_shard_by_shard_alike_on_every_rank(sections, tmp_path, two_ranks, two_ranks_lora):
    """model.init: random through the sharded load: no checkpoint is read; each tensor is initialised whole by
    the model's own _init_weights, seeded alike on every rank (4-bit weights quantized as loaded ones are), so
    the ranks hold one model between them, the same bytes per rank as a loaded one, and it trains."""
    import torch

    gpu = _compiled(
        tmp_path / "gpu",
        hardware="workstation-2x4090",
        model={"dtype": "bfloat16", "init": "random"},
        adapter=sections["adapter"],
        distributed={"strategy": "fsdp2"},
    )
    records, tensors = _ranks(tmp_path, gpu / RESOLVED_RECIPE, _launch_env(gpu), n=2, mode=("random",))
    loaded = (two_ranks if sections is QLORA else two_ranks_lora)[0]
    for r, t in zip(records, tensors, strict=True):
        print(f"rank {r['rank']}: losses {r['losses']}, 4-bit {r['four_bit_bytes']}, base {r['frozen_bytes']}")
        assert r["losses"][-1] < r["losses"][0]
        assert r["four_bit_bytes"] == loaded[r["rank"]]["four_bit_bytes"]
        assert r["frozen_bytes"] == loaded[r["rank"]]["frozen_bytes"]
        torch.testing.assert_close(t["logits"], tensors[0]["logits"], rtol=0, atol=0)
        for name, value in t["whole"].items():  # bitwise: packed 4-bit storage read as bf16 holds NaN patterns
            assert torch.equal(_bytes(value), _bytes(tensors[0]["whole"][name])), name
    whole = tensors[0]["whole"]
    (embed,) = [v for n, v in whole.items() if "embed_tokens" in n]
    norms = [v for n, v in whole.items() if n.endswith("norm.weight")]
    assert embed.float().std().item() == pytest.approx(records[0]["initializer_range"], rel=0.1)
    assert norms and all(bool((v == 1).all()) for v in norms)  # Llama's RMSNorm init, from _init_weights


@slow
def test_a_full_fine_tune_loads_sharded_as_accelerate_would_shard_it(two_ranks_full, tmp_path_factory):
    """A full fine-tune: every parameter trainable, as fp32 master weights (accelerate's FSDP2 upcast under
    mixed precision), each rank holding half of them; the logits are the whole bf16 model's (FSDP casts
    the weights, read from bf16, back to bf16 for compute) and the loss falls alike on both ranks, also
    accumulating two micro-batches with a reduce-scatter after each (sync_each_batch)."""
    import torch

    from finetune.train.model import load_model

    records, tensors, _ = two_ranks_full
    resolved = resolve_recipe(tiny_recipe(**FULL), run_dir=tmp_path_factory.mktemp("whole-full") / "run")
    whole = load_model(load_recipe(resolved, allow_resolved=True)).eval()
    with torch.no_grad():
        reference = whole(input_ids=torch.arange(3, 3 + 2 * 12).reshape(2, 12)).logits
    fp32_bytes = 4 * sum(p.numel() for p in whole.parameters())
    for r, t in zip(records, tensors, strict=True):
        print(f"rank {r['rank']}: {r['local_bytes']} of {fp32_bytes} fp32 bytes, losses {r['losses']}")
        print(f"rank {r['rank']} accumulating: {r['accumulation']}")
        assert r["frozen_bytes"] == 0 and r["local_bytes"] == pytest.approx(fp32_bytes / 2, rel=0.02)
        assert {(dtype, kind) for _, dtype, kind in r["trainable"]} == {("torch.float32", "DTensor")}
        assert r["trainer_model_is_loaded_model"] and r["losses"][-1] < r["losses"][0]
        torch.testing.assert_close(t["logits"], reference, rtol=0, atol=0)
        # accumulating two micro-batches (distributed.sync_each_batch): reduce-scattering each leaves every
        # parameter's sharded gradient after the first, no_sync none (FSDP2 holds them unsharded until the
        # last: the planner's memory.fsdp_accumulated_gradients); both sum the same gradients, and training
        # with a reduce-scatter per micro-batch lowers the loss
        acc = r["accumulation"]
        assert acc["reduced_after_first"] == {"each": acc["trained"], "last": 0} and acc["trained"] > 0
        assert acc["grad_diff"] <= 1e-2 * acc["grad_scale"], acc
        assert acc["losses"][-1] < acc["losses"][0], acc["losses"]
    assert records[0]["losses"] == records[1]["losses"]
    assert records[0]["accumulation"]["losses"] == records[1]["accumulation"]["losses"]


@slow
def test_dpo_loads_sharded_only_with_a_reference_finetune_loads_itself(tmp_path):
    """The 70B DPO recipe's case. TRL's DPO trainer, handed a model that already carries its adapter and no
    reference, adds a "ref" copy of the adapter (unsharded params on a sharded model: it fails); so DPO with
    the implicit reference loads the whole model, and with `reference: copy` (finetune loads the reference
    itself) the sharded adapter trains, its loss falling from ln 2 alike on both ranks."""
    from tests.helpers.paths import SAMPLES

    def recipe(reference: str) -> dict:
        return {
            **LORA,
            "method": {"type": "dpo", "beta": 0.1, "reference": reference},
            "data": {
                "sources": [{"path": str(SAMPLES / "preference.jsonl"), "format": "preference", "max_samples": 16}],
                "eval_sources": [],
            },
            "train": {"precision": "bf16", "lr": 5e-3},
        }

    def gpu(reference: str, name: str) -> Path:
        sections = {k: recipe(reference)[k] for k in ("adapter", "method", "data")}
        return _compiled(tmp_path / name, hardware="workstation-2x4090", distributed={"strategy": "fsdp2"}, **sections)

    implicit = load_recipe(gpu("implicit", "implicit") / RESOLVED_RECIPE, allow_resolved=True)
    assert "makes its reference from the model it is given" in sharded_load_blocker(implicit)
    compiled = gpu("copy", "copy")
    assert sharded_load_blocker(load_recipe(compiled / RESOLVED_RECIPE, allow_resolved=True)) == ""
    resolved = resolve_recipe(tiny_recipe(**recipe("copy")), run_dir=tmp_path / "run")
    records, _ = _ranks(tmp_path, resolved, _launch_env(compiled), n=2, mode=("dpo",))
    for r in records:
        print(f"rank {r['rank']}: {r['trainer']}, reference {r['ref_model']}, losses {r['losses']}")
        assert r["trainer_model_is_loaded_model"] and r["ref_model"] and r["lora_layers"] == 14
        # ln 2 up to bf16 rounding: the reference copy computes unsharded, the policy through FSDP2
        assert r["losses"][0] == pytest.approx(0.6931, abs=0.01) and r["losses"][-1] < r["losses"][0]
    assert records[0]["losses"] == records[1]["losses"]

"""The launch compiler: golden run directories, and the files read back by accelerate and DeepSpeed
with their own parsers. Regenerate the goldens with UPDATE_GOLDEN=1 and review the diff."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from finetune import strategies
from finetune.compile import compile_run
from finetune.compile.compiler import compile_recipe
from finetune.errors import DoesNotFitError, FinetuneError, RecipeError
from finetune.plan import plan as real_plan
from finetune.plan.types import Plan
from finetune.recipe import load_recipe
from finetune.registry import get_model, get_preset, list_presets
from finetune.strategies import is_deepspeed
from tests.helpers.paths import GOLDEN, ROOT

GOLDEN_FILES = ("accelerate.yaml", "ds_config.json", "launch.sh", "job.sbatch", "recipe.resolved.yaml")
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
ULTRACHAT = {
    "sources": [{"path": "HuggingFaceH4/ultrachat_200k", "split": "train_sft"}],
    "max_length": 4096,
    "packing": True,
}


def make_plan(preset, *, strategy, mbs, gas, ckpt, peak, model="m", device="cuda") -> Plan:
    world = preset.gpus_per_node * preset.nodes
    return Plan(
        model=model,
        hardware=preset.name,
        adapter="lora",
        method="sft",
        strategy=strategy,
        fits=True,
        micro_batch_size=mbs,
        gradient_accumulation_steps=gas,
        activation_checkpointing=ckpt,
        per_gpu_memory_gib=peak,
        world_size=world,
        num_nodes=preset.nodes,
        gpus_per_node=preset.gpus_per_node,
        seq_len=4096,
        global_batch_size=world * mbs * gas,
        tokens_per_step=world * mbs * gas * 4096,
        step_time_s=1.0,
        tokens_per_second=1.0,
        mfu=0.3,
        why="test plan",
        device=device,
    )


# name -> (recipe dict, model key, preset, plan kwargs); plans are hand-made so each strategy
# is pinned whatever the planner would choose today
CASES = {
    "llama8b-lora-workstation-1x4090": (
        {
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
            "data": ULTRACHAT,
            "train": {"epochs": 1, "global_batch_size": 16},
        },
        "llama-3.1-8b",
        "workstation-1x4090",
        dict(strategy="ddp", mbs=1, gas=16, ckpt=True, peak=21.3),
    ),
    "llama70b-lora-server-8xh100-fsdp2": (
        {
            "model": {"name": "meta-llama/Llama-3.3-70B-Instruct"},
            "data": ULTRACHAT,
            "train": {"epochs": 1, "lr": 1e-4, "global_batch_size": 64},
        },
        "llama-3.3-70b",
        "server-8xh100",
        dict(strategy="fsdp2", mbs=2, gas=4, ckpt=False, peak=61.0),
    ),
    "llama70b-full-server-8xh100-zero3-offload": (
        {
            "model": {"name": "meta-llama/Llama-3.1-70B"},
            "adapter": "full",
            "data": ULTRACHAT,
            "train": {
                "epochs": 1,
                "lr": 5e-6,
                "weight_decay": 0.1,
                "optimizer": "adamw_8bit",
                "global_batch_size": 128,
            },
        },
        "llama-3.1-70b",
        "server-8xh100",
        dict(strategy="zero3-offload", mbs=1, gas=16, ckpt=True, peak=55.0),
    ),
    "llama8b-full-workstation-2x4090-zero3-nvme": (
        {
            "model": {"name": "meta-llama/Llama-3.1-8B"},
            "adapter": "full",
            "data": ULTRACHAT,
            "train": {"max_steps": 1000, "lr": 1e-5, "precision": "bf16", "global_batch_size": 32},
        },
        "llama-3.1-8b",
        "workstation-2x4090",
        dict(strategy="zero3-nvme", mbs=1, gas=16, ckpt=True, peak=18.0),
    ),
    "llama70b-full-cluster-2x8xh100-hybrid": (
        {
            "model": {"name": "meta-llama/Llama-3.1-70B"},
            "adapter": "full",
            "data": ULTRACHAT,
            "train": {"epochs": 1, "lr": 5e-6, "global_batch_size": 128},
        },
        "llama-3.1-70b",
        "cluster-2x8xh100",
        dict(strategy="fsdp2-hybrid", mbs=1, gas=8, ckpt=True, peak=70.2),
    ),
    "llama70b-lora-cluster-2x8xh100-zero3": (
        {
            "model": {"name": "meta-llama/Llama-3.3-70B-Instruct"},
            "data": ULTRACHAT,
            "train": {"epochs": 1, "precision": "fp16"},
            "model_dtype": "float16",
        },
        "llama-3.3-70b",
        "cluster-2x8xh100",
        dict(strategy="zero3", mbs=1, gas=1, ckpt=True, peak=40.0),
    ),
    "qwen14b-full-server-8xh100-zero2": (
        {
            "model": {"name": "Qwen/Qwen2.5-14B"},
            "adapter": "full",
            "data": ULTRACHAT,
            "train": {"epochs": 1, "lr": 1e-5, "global_batch_size": 64},
        },
        "qwen2.5-14b",
        "server-8xh100",
        dict(strategy="zero2", mbs=1, gas=8, ckpt=True, peak=60.0),
    ),
    "qwen14b-full-server-8xh100-zero3-optim-offload": (
        {
            "model": {"name": "Qwen/Qwen2.5-14B"},
            "adapter": "full",
            "data": ULTRACHAT,
            "train": {"epochs": 1, "lr": 1e-5, "optimizer": "adamw_8bit", "global_batch_size": 64},
        },
        "qwen2.5-14b",
        "server-8xh100",
        dict(strategy="zero3-optim-offload", mbs=2, gas=4, ckpt=False, peak=64.0),
    ),
    "llama70b-full-server-8xh100-fsdp2-offload": (
        {
            "model": {"name": "meta-llama/Llama-3.1-70B"},
            "adapter": "full",
            "data": ULTRACHAT,
            "train": {"epochs": 1, "lr": 5e-6, "global_batch_size": 64},
        },
        "llama-3.1-70b",
        "server-8xh100",
        dict(strategy="fsdp2-offload", mbs=1, gas=8, ckpt=True, peak=40.0),
    ),
}


def normalize(text: str, *, run_dir: Path, recipe_dir: Path) -> str:
    # job.sbatch activates the environment it was compiled in: this machine's Python prefix
    return (
        text.replace(str(run_dir), "RUN_DIR").replace(str(recipe_dir), "RECIPE_DIR").replace(sys.prefix, "PYTHON_ENV")
    )


def _compile_case(name: str, tmp_path: Path, *, train: dict | None = None):
    raw, model_key, preset_name, plan_kwargs = CASES[name]
    raw = json.loads(json.dumps(raw))
    raw.setdefault("train", {}).update(train or {})
    if raw.pop("model_dtype", None):
        raw["model"]["dtype"] = "float16"
    raw["hardware"] = preset_name
    recipe_dir = tmp_path / "recipes"
    recipe_dir.mkdir()
    path = recipe_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    recipe = load_recipe(path)
    preset = get_preset(preset_name)
    plan = make_plan(preset, model=model_key, **plan_kwargs)
    run_dir = tmp_path / "run"
    spec = compile_run(recipe, plan, run_dir=run_dir, arch=get_model(model_key), preset=preset)
    return recipe, plan, spec, run_dir.resolve(), recipe_dir.resolve()


def check_golden(name: str, run_dir: Path, recipe_dir: Path) -> None:
    golden = GOLDEN / name
    produced = {
        f: normalize((run_dir / f).read_text(), run_dir=run_dir, recipe_dir=recipe_dir)
        for f in GOLDEN_FILES
        if (run_dir / f).exists()
    }
    if UPDATE:
        shutil.rmtree(golden, ignore_errors=True)
        golden.mkdir(parents=True)
        for f, text in produced.items():
            (golden / f).write_text(text)
    expected = {p.name: p.read_text() for p in golden.iterdir()} if golden.is_dir() else {}
    assert expected, f"no golden files for {name}; run with UPDATE_GOLDEN=1"
    assert sorted(produced) == sorted(expected), "a different set of files was written"
    for f in produced:
        assert produced[f] == expected[f], f"{name}/{f} differs from the golden file"


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_run_dir(name, tmp_path):
    _, _, _, run_dir, recipe_dir = _compile_case(name, tmp_path)
    check_golden(name, run_dir, recipe_dir)


@pytest.mark.parametrize("name", sorted(CASES))
def test_resolved_recipe_reloads_equal(name, tmp_path):
    recipe, plan, spec, run_dir, _ = _compile_case(name, tmp_path)
    again = load_recipe(run_dir / "recipe.resolved.yaml", allow_resolved=True)
    expected = yaml.safe_load((run_dir / "recipe.resolved.yaml").read_text())
    assert again.model_dump(mode="json") == expected
    # planner decisions are concrete; nothing is left "auto"
    assert again.distributed.strategy == plan.strategy
    assert again.train.micro_batch_size == plan.micro_batch_size
    assert again.train.activation_checkpointing == ("on" if plan.activation_checkpointing else "off")
    assert again.output.dir == str(run_dir)
    assert again.resolved.world_size == plan.world_size
    assert again.resolved.gradient_accumulation_steps == plan.gradient_accumulation_steps
    assert again.train.global_batch_size == plan.world_size * plan.micro_batch_size * plan.gradient_accumulation_steps
    assert again.adapter.target_modules == (None if recipe.adapter.type == "full" else again.resolved.lora_targets)
    # compiling again gives the same files (deterministic, idempotent)
    before = {f: (run_dir / f).read_text() for f in GOLDEN_FILES if (run_dir / f).exists()}
    compile_run(recipe, plan, run_dir=run_dir, arch=get_model(CASES[name][1]), preset=get_preset(CASES[name][2]))
    assert before == {f: (run_dir / f).read_text() for f in before}


def test_local_paths_made_absolute_hub_ids_kept(tmp_path):
    recipe_dir = tmp_path / "proj"
    (recipe_dir / "data").mkdir(parents=True)
    (recipe_dir / "data" / "train.jsonl").write_text('{"text": "hi"}\n')
    model_dir = recipe_dir / "models" / "tiny"
    model_dir.mkdir(parents=True)
    shutil.copy(ROOT / "data" / "tiny-llama" / "config.json", model_dir / "config.json")
    (recipe_dir / "r.yaml").write_text(
        yaml.safe_dump(
            {
                "model": {"name": "models/tiny"},
                "hardware": "cpu",
                "data": {
                    "sources": [
                        {"path": "data/train.jsonl", "format": "text"},
                        {"path": "org/hub-dataset", "format": "text"},
                    ]
                },
            }
        )
    )
    recipe = load_recipe(recipe_dir / "r.yaml")
    preset = get_preset("cpu")
    plan = make_plan(preset, strategy="ddp", mbs=4, gas=4, ckpt=False, peak=0.4, device="cpu")
    run_dir = tmp_path / "run"
    # pre-existing outputs of an earlier run must survive a recompile untouched
    (run_dir / "checkpoint-10").mkdir(parents=True)
    (run_dir / "adapter_model.safetensors").write_bytes(b"weights")
    compile_run(recipe, plan, run_dir=run_dir, arch=get_model("tiny-llama"), preset=preset)
    resolved = load_recipe(run_dir / "recipe.resolved.yaml", allow_resolved=True)
    assert resolved.model.name == str(model_dir.resolve())
    assert resolved.data.sources[0].path == str((recipe_dir / "data" / "train.jsonl").resolve())
    assert resolved.data.sources[1].path == "org/hub-dataset"
    assert (run_dir / "adapter_model.safetensors").read_bytes() == b"weights"
    assert (run_dir / "checkpoint-10").is_dir()
    assert not list(run_dir.glob(".*.tmp"))
    acc = yaml.safe_load((run_dir / "accelerate.yaml").read_text())
    assert acc["distributed_type"] == "NO" and acc["use_cpu"] is True
    assert not (run_dir / "ds_config.json").exists()
    sbatch = (run_dir / "job.sbatch").read_text()  # a one-node run can go to Slurm too
    assert "#SBATCH --nodes=1" in sbatch and "--gpus-per-node" not in sbatch and "--partition" not in sbatch


def _walk(value, path=""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, f"{path}.{k}" if path else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, value


@pytest.mark.parametrize("name", [n for n in sorted(CASES) if is_deepspeed(CASES[n][3]["strategy"])])
def test_ds_config_concrete_and_valid_for_deepspeed(name, tmp_path):
    deepspeed_config = pytest.importorskip("deepspeed.runtime.config")
    import deepspeed.runtime.constants as ds_constants
    import deepspeed.runtime.swap_tensor.constants as aio_constants
    import deepspeed.runtime.zero.config as zero_constants
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    recipe, plan, _, run_dir, _ = _compile_case(name, tmp_path)
    cfg = json.loads((run_dir / "ds_config.json").read_text())
    autos = [p for p, v in _walk(cfg) if v == "auto" or v is None]
    assert autos == [], f"unresolved values: {autos}"
    # every top-level key is one DeepSpeed reads (its config ignores unknown ones silently)
    known = {
        v
        for mod in (ds_constants, aio_constants, zero_constants)
        for n, v in vars(mod).items()
        if n.isupper() and isinstance(v, str)
    }
    assert set(cfg) <= known, set(cfg) - known
    # the ZeRO section is strict (extra="forbid"): unknown or misspelt keys raise here
    zero = DeepSpeedZeroConfig(**cfg["zero_optimization"])
    tier = strategies.info(plan.strategy)
    assert zero.stage == tier.zero_stage
    assert zero.gather_16bit_weights_on_model_save == (tier.zero_stage == 3)
    assert cfg["train_batch_size"] == (plan.world_size * plan.micro_batch_size * plan.gradient_accumulation_steps)
    # DeepSpeed's full parser; without a process group it assumes world size 1, so it derives
    # train_batch_size itself from micro-batch x accumulation
    single = {k: v for k, v in cfg.items() if k != "train_batch_size"}
    parsed = deepspeed_config.DeepSpeedConfig(single)
    assert parsed.train_micro_batch_size_per_gpu == plan.micro_batch_size
    assert parsed.gradient_accumulation_steps == plan.gradient_accumulation_steps
    assert parsed.gradient_clipping == recipe.train.max_grad_norm
    assert parsed.bfloat16_config.enabled == (recipe.train.precision == "bf16")
    assert parsed.float16_config.enabled == (recipe.train.precision == "fp16")
    arch = get_model(CASES[name][1])
    assert parsed.zero_config.reduce_bucket_size == arch.hidden_size**2
    if tier.offload == "cpu":
        # parameters stay on the GPUs unless the tier offloads them; the optimizer always goes
        params = parsed.zero_config.offload_param
        assert (params is not None and params.device == "cpu") == tier.offload_params
        assert parsed.zero_config.offload_optimizer.device == "cpu"
        assert parsed.optimizer_name == "adamw"
        resolved = yaml.safe_load((run_dir / "recipe.resolved.yaml").read_text())
        assert resolved["train"]["optimizer"] == "adamw"  # bitsandbytes' 8-bit cannot step on the CPU
    if tier.zero_stage == 2:
        assert parsed.zero_config.allgather_bucket_size == arch.hidden_size**2
        assert parsed.zero_optimization_stage == 2
    if tier.offload == "nvme":
        nvme = get_preset(CASES[name][2]).nvme_path
        assert str(parsed.zero_config.offload_param.nvme_path) == nvme
        assert parsed.zero_config.offload_param.buffer_size >= arch.vocab_size * arch.hidden_size
        assert parsed.aio_config["block_size"] == 1 << 20


def _accelerate_env(run_dir: Path, argv: list[str]) -> dict:
    """What `accelerate launch` would export to the ranks for this argv, computed by
    accelerate's own argument parser and env builders, without starting anything."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    assert argv[:2] == ["accelerate", "launch"]
    args = launch_command_parser().parse_args(argv[2:])
    args, _, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = (
            "deepspeed_config_file,deepspeed_multinode_launcher,zero3_init_flag"
        )
        cmd, env = prepare_deepspeed_cmd_env(args)
        assert cmd is None, "the multi-node DeepSpeed launch must be torchrun per node, not pdsh"
        return env
    return prepare_multi_gpu_env(args)


@pytest.mark.parametrize("name", [n for n in sorted(CASES) if n != "llama8b-lora-workstation-1x4090"])
def test_accelerate_reads_config_and_builds_plugins(name, tmp_path, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file

    _, plan, spec, run_dir, _ = _compile_case(name, tmp_path)
    loaded = load_config_from_file(str(run_dir / "accelerate.yaml"))
    assert loaded.num_processes == plan.world_size and loaded.num_machines == plan.num_nodes
    argv = spec.argv(node_rank=plan.num_nodes - 1, main_address="10.0.0.1", main_port=29999)
    env = _accelerate_env(run_dir, argv)
    ranks_env = {k: v for k, v in env.items() if k not in os.environ or os.environ[k] != v}
    for key, value in ranks_env.items():
        monkeypatch.setenv(key, value)
    if strategies.is_fsdp(plan.strategy):
        from accelerate.utils import FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import CPUOffloadPolicy

        fsdp = FullyShardedDataParallelPlugin()  # reads FSDP_* exactly as a rank does
        assert fsdp.fsdp_version == 2 and fsdp.reshard_after_forward is True
        assert fsdp.transformer_cls_names_to_wrap == [get_model(CASES[name][1]).decoder_layer_class]
        # fsdp2-offload: the CPUOffloadPolicy that fully_shard gets (params, grads, optimizer step on CPU)
        assert isinstance(fsdp.cpu_offload, CPUOffloadPolicy) == strategies.offloads_params(plan.strategy)
        assert fsdp.cpu_ram_efficient_loading is True
        assert "SHARDED_STATE_DICT" in str(fsdp.state_dict_type)
        assert fsdp.activation_checkpointing == plan.activation_checkpointing
    if strategies.is_hybrid(plan.strategy):
        from accelerate import ParallelismConfig

        pc = ParallelismConfig()  # what the Accelerator builds when the env asks for it
        assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
        assert (pc.dp_replicate_size, pc.dp_shard_size) == (plan.num_nodes, plan.gpus_per_node)
        assert pc.total_size == plan.world_size
    if strategies.is_deepspeed(plan.strategy):
        from accelerate.utils import DeepSpeedPlugin

        ds = DeepSpeedPlugin()  # loads ds_config.json, refuses conflicting accelerate fields
        stage = strategies.zero_stage(plan.strategy)
        assert ds.zero_stage == stage and ds.zero3_init_flag is (stage == 3)
        assert ds.gradient_accumulation_steps == plan.gradient_accumulation_steps
        assert ds.zero3_save_16bit_model is (stage == 3)


def _fresh(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


@pytest.mark.parametrize("name", ["llama8b-lora-workstation-1x4090", "llama70b-lora-server-8xh100-fsdp2"])
def test_regional_compilation_reaches_the_ranks_accelerator(name, tmp_path, monkeypatch):
    """train.compile: regions -> accelerate.yaml's dynamo_config -> the ACCELERATE_DYNAMO_* variables that
    `accelerate launch` exports -> the TorchDynamoPlugin the Trainer builds (it passes no backend of its
    own unless TrainingArguments.torch_compile is set, so the plugin reads them)."""
    from accelerate.utils import DynamoBackend, TorchDynamoPlugin

    for setting, backend in (("regions", DynamoBackend.INDUCTOR), ("off", DynamoBackend.NO)):
        for var in [k for k in os.environ if k.startswith("ACCELERATE_DYNAMO_")]:
            monkeypatch.delenv(var)
        _, plan, spec, run_dir, _ = _compile_case(name, _fresh(tmp_path / setting), train={"compile": setting})
        argv = spec.argv(node_rank=0, main_address="10.0.0.1", main_port=29999)
        for key, value in _accelerate_env(run_dir, argv).items():
            if key.startswith("ACCELERATE_DYNAMO_"):
                monkeypatch.setenv(key, value)
        dynamo = TorchDynamoPlugin(backend=None, mode=None, dynamic=None)  # as transformers' Trainer builds it
        assert dynamo.backend == backend
        assert dynamo.use_regional_compilation is (setting == "regions")


def test_sbatch_partition_account_time_and_environment(tmp_path):
    preset = get_preset("cluster-2x8xh100").model_copy(update={"slurm_partition": "gpu", "slurm_time": "2-00:00:00"})
    recipe = load_recipe(
        {
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
            "data": {"path": "d.jsonl"},
            "slurm": {"account": "proj-42", "time": "12:00:00"},
        }
    )
    run_dir = tmp_path / "run"
    compile_run(recipe, real_plan(recipe, hardware="cluster-2x8xh100"), run_dir=run_dir, preset=preset)
    sbatch = (run_dir / "job.sbatch").read_text()
    # the recipe's time wins over the preset's; the preset's partition fills in
    for line in ("#SBATCH --partition=gpu", "#SBATCH --account=proj-42", "#SBATCH --time=12:00:00"):
        assert line in sbatch.splitlines()
    activate = Path(sys.prefix) / "bin" / "activate"
    expected = f"source {activate}" if activate.is_file() else f"export PATH={Path(sys.prefix) / 'bin'}:"
    assert expected in sbatch and sbatch.index(expected) < sbatch.index("srun ")
    with pytest.raises(RecipeError, match="slurm.time"):
        load_recipe({"model": {"name": "x/y"}, "data": {"path": "d.jsonl"}, "slurm": {"time": "two days"}})


def test_multi_node_argv_and_sbatch(tmp_path):
    _, plan, spec, run_dir, _ = _compile_case("llama70b-full-cluster-2x8xh100-hybrid", tmp_path)
    argv = spec.argv(node_rank=1, main_address="node-a", main_port=29400, extra_args=["--x"])
    assert argv[argv.index("--machine_rank") + 1] == "1"
    assert argv[argv.index("--main_process_ip") + 1] == "node-a"
    assert argv[argv.index("--main_process_port") + 1] == "29400"
    assert argv[-3:] == ["finetune.train", str(run_dir / "recipe.resolved.yaml"), "--x"]
    with pytest.raises(FinetuneError, match="out of range"):
        spec.argv(node_rank=2)
    sbatch = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in sbatch and "#SBATCH --gpus-per-node=8" in sbatch
    assert "#SBATCH --requeue" in sbatch and "#SBATCH --signal=USR1@120" in sbatch
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in sbatch
    assert "-eq 75 ]" in sbatch
    for text in (sbatch, (run_dir / "launch.sh").read_text()):
        assert 'NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"' in text
        proc = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
        assert proc.returncode == 0, proc.stderr
    instructions = spec.node_instructions()
    assert "NODE_RANK=1" in instructions and "job.sbatch" in instructions


def test_launch_sh_requires_node_rank_on_multi_node(tmp_path):
    _, _, spec, run_dir, _ = _compile_case("llama70b-lora-cluster-2x8xh100-zero3", tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "MAIN_ADDRESS")}
    proc = subprocess.run(["bash", str(run_dir / "launch.sh")], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "NODE_RANK" in proc.stderr


def test_refusals(tmp_path):
    preset = get_preset("server-8xh100")
    recipe = load_recipe({"model": {"name": "meta-llama/Llama-3.1-8B"}, "data": {"path": "d.jsonl"}})
    no_fit = make_plan(preset, strategy="fsdp2", mbs=1, gas=1, ckpt=True, peak=200)
    no_fit.fits, no_fit.suggestions = False, ["use adapter: qlora"]
    with pytest.raises(DoesNotFitError, match="nothing fits"):
        compile_run(recipe, no_fit, run_dir=tmp_path / "a", arch=get_model("llama-3.1-8b"), preset=preset)
    bare = preset.model_copy(update={"nvme_path": None})
    nvme = make_plan(bare, strategy="zero3-nvme", mbs=1, gas=1, ckpt=True, peak=20)
    with pytest.raises(RecipeError) as info:
        compile_run(recipe, nvme, run_dir=tmp_path / "b", arch=get_model("llama-3.1-8b"), preset=bare)
    assert info.value.key == "distributed.nvme_path"
    assert not (tmp_path / "b" / "recipe.resolved.yaml").exists()


def test_hardware_auto_is_detected_once_per_compile(tmp_path):
    # a stand-in nvidia-smi on PATH that counts its calls: plan and compile share one lookup
    calls = tmp_path / "calls"
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(f"#!/bin/sh\necho called >> {calls}\necho '0, GPU-1234, NVIDIA H100 80GB HBM3, 81559 MiB'\n")
    smi.chmod(0o755)
    code = (
        "import json\n"
        "from finetune.compile.compiler import compile_recipe\n"
        f"spec = compile_recipe({str(ROOT / 'recipes' / 'llama8b-lora.yaml')!r}, "
        f"run_dir={str(tmp_path / 'run')!r}, hardware='auto')\n"
        "print(json.dumps({'device': spec.device, 'world': spec.world_size}))\n"
    )
    env = {**os.environ, "PATH": f"{smi.parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"device": "cuda", "world": 1}
    assert calls.read_text().count("called") == 1


# --- through the real planner -------------------------------------------------------------------

REAL = {
    "llama70b-lora-server-8xh100-planned": ("llama70b-lora.yaml", "server-8xh100"),
    "llama70b-full-cluster-2x8xh100-planned": ("llama70b-full.yaml", "cluster-2x8xh100"),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_golden_through_real_plan(name, tmp_path):
    recipe_file, hardware = REAL[name]
    recipe_dir = tmp_path / "recipes"
    shutil.copytree(ROOT / "recipes", recipe_dir)
    spec = compile_recipe(recipe_dir / recipe_file, run_dir=tmp_path / "run", hardware=hardware)
    assert spec.world_size == get_preset(hardware).world_size
    check_golden(name, (tmp_path / "run").resolve(), recipe_dir.resolve())


RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))
PRESETS = [p.name for p in list_presets()]


@pytest.mark.parametrize("recipe_path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_compiles_or_is_refused_on_every_preset(recipe_path, tmp_path):
    recipe = load_recipe(recipe_path)
    compiled = 0
    for hardware in PRESETS:
        run_dir = tmp_path / hardware
        try:
            plan = real_plan(recipe, hardware=hardware)
            spec = compile_run(recipe, plan, run_dir=run_dir)
        except DoesNotFitError as err:
            assert err.render().strip(), hardware
            assert not (run_dir / "recipe.resolved.yaml").exists()
            continue
        compiled += 1
        assert load_recipe(run_dir / "recipe.resolved.yaml", allow_resolved=True).resolved
        assert Path(spec.files["launch.sh"]).is_file()
        assert (run_dir / "ds_config.json").exists() == is_deepspeed(spec.strategy)
    assert compiled, f"{recipe_path.name} fits none of the presets"


@pytest.mark.parametrize(("sync", "expected"), [("auto", True), ("false", False)])
def test_the_training_arguments_carry_the_plans_sync_each_batch(sync, expected, tmp_path):
    """The planner's sync_each_batch (full 8B at 4096 tokens, global batch 16 on 4 x H100: FSDP2 reducing every
    micro-batch; pinned false: no_sync) -> recipe.resolved.yaml -> the rank's TrainingArguments -> the Trainer's
    Accelerator, whose gradient_state.plugin_kwargs the Trainer's accumulation loop reads to skip no_sync."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from finetune.rundir import RESOLVED_RECIPE
    from finetune.train.trainers import common_args
    from tests.helpers.calibration_rows import preset_for
    from tests.helpers.paths import TINY_MODEL

    preset = tmp_path / "4xh100.yaml"
    preset.write_text(yaml.safe_dump(preset_for("NVIDIA H100 80GB HBM3", gpus_per_node=4).model_dump(mode="json")))
    overrides = ["data.max_length=4096", "train.global_batch_size=16", f"distributed.sync_each_batch={sync}"]
    if sync == "false":  # no_sync's fastest setting takes no accumulation: pin some (it fits with checkpointing)
        overrides.append("train.micro_batch_size=2")
    run_dir = tmp_path / "run"
    spec = compile_recipe(
        ROOT / "recipes" / "llama8b-full.yaml", run_dir=run_dir, hardware=str(preset), overrides=overrides
    )
    assert ("gradients reduce-scattered every micro-batch (sync_each_batch)" in spec.summary) is expected
    resolved = load_recipe(run_dir / RESOLVED_RECIPE, allow_resolved=True)
    assert resolved.distributed.sync_each_batch is expected
    assert resolved.resolved.gradient_accumulation_steps > 1
    args = common_args(resolved, run_dir=run_dir, has_eval=False)
    assert args["accelerator_config"] == {"gradient_accumulation_kwargs": {"sync_each_batch": expected}}
    # the arguments as a GPU rank builds them, but for the device: this machine has no GPU (TrainingArguments
    # refuses bf16 and a CUDA rank without one)
    cpu = TrainingArguments(**{**args, "use_cpu": True, "bf16": False, "report_to": [], "dataloader_pin_memory": False})
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(TINY_MODEL), args=cpu)
    assert trainer.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False) is expected


def test_a_model_read_from_its_config_json_is_read_again_from_the_resolved_recipe(tmp_path):
    """An architecture derived from config.json has a key no registry entry has; the resolved recipe leaves
    model.arch unset for it, so what re-plans a run from that recipe (the OOM recovery, --measure) finds the
    model again (it once wrote the derived key, and re-planning failed with 'unknown model architecture')."""
    from finetune.registry import resolve_model
    from finetune.rundir import RESOLVED_RECIPE

    model_dir = tmp_path / "granite-like"
    model_dir.mkdir()
    shutil.copy(ROOT / "tests/data/hub_configs/granite-3.1-3b-a800m/config.json", model_dir / "config.json")
    (tmp_path / "train.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "r.yaml").write_text(
        yaml.safe_dump({"model": {"name": str(model_dir)}, "data": {"path": "train.jsonl", "format": "text"}})
    )
    run_dir = tmp_path / "run"
    compile_recipe(tmp_path / "r.yaml", run_dir=run_dir, hardware="server-8xh100")
    resolved = load_recipe(run_dir / RESOLVED_RECIPE, allow_resolved=True)
    assert resolved.model.arch is None
    assert resolve_model(resolved.model).family == "granitemoe"
    real_plan(resolved.model_copy(update={"resolved": None}), hardware="server-8xh100")

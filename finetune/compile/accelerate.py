"""accelerate.yaml for accelerate 1.15's `accelerate launch --config_file`.

Keys follow accelerate's ClusterConfig (commands/config/config_args.py). `accelerate launch`
copies `fsdp_config.*`, `deepspeed_config.*` and `parallelism_config.*` onto its argparse
namespace by name and exports them as FSDP_* / ACCELERATE_DEEPSPEED_* / PARALLELISM_CONFIG_*
environment variables that the Accelerator in each rank reads.
"""

from __future__ import annotations

from finetune import strategies
from finetune.plan.types import Plan
from finetune.recipe.schema import COMPILE_BACKEND, Recipe
from finetune.registry.schema import ModelArch

MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}


def accelerate_config(
    recipe: Recipe, plan: Plan, *, arch: ModelArch, main_port: int, ds_config_path: str | None = None
) -> dict:
    strategy = plan.strategy
    cfg: dict = {"compute_environment": "LOCAL_MACHINE"}
    if plan.device == "cpu":
        cfg["distributed_type"] = "MULTI_CPU" if plan.world_size > 1 else "NO"
        cfg["use_cpu"] = True
    elif strategies.is_deepspeed(strategy):
        cfg["distributed_type"] = "DEEPSPEED"
        cfg["deepspeed_config"] = {
            "deepspeed_config_file": ds_config_path,
            # torchrun on every node (our launcher / srun starts one per node); the default
            # `pdsh` would ssh into the other nodes from node 0.
            "deepspeed_multinode_launcher": "standard",
            # ZeRO-3 builds the model already partitioned: a 70B model never materialises per rank
            # (ZeRO-2 keeps whole parameters on every rank; accelerate refuses the flag below stage 3)
            "zero3_init_flag": strategies.is_zero3(strategy),
        }
    elif strategies.is_fsdp(strategy):
        cfg["distributed_type"] = "FSDP"
        cfg["fsdp_config"] = fsdp_config(plan, arch=arch)
        if strategies.is_hybrid(strategy):
            # HSDP: replicate across nodes, shard within a node. accelerate 1.15 builds a
            # (dp_replicate, dp_shard) device mesh from its ParallelismConfig, which it reads
            # from these keys (exported as PARALLELISM_CONFIG_DP_*_SIZE).
            cfg["parallelism_config"] = {
                "parallelism_config_dp_replicate_size": plan.num_nodes,
                "parallelism_config_dp_shard_size": plan.gpus_per_node,
            }
    elif strategies.info(strategy).backend == "ddp":
        cfg["distributed_type"] = "MULTI_GPU" if plan.world_size > 1 else "NO"
    else:
        raise ValueError(f"no accelerate config for strategy {strategy!r}")

    # DeepSpeed takes precision from ds_config.json; accelerate refuses a mixed_precision key
    # next to a deepspeed_config_file ("will be ignored ... specify them in the DeepSpeed config").
    if cfg["distributed_type"] != "DEEPSPEED":
        cfg["mixed_precision"] = MIXED_PRECISION[recipe.train.precision]
    if recipe.train.compile == "regions":
        # exported by `accelerate launch` as ACCELERATE_DYNAMO_*; the Trainer's Accelerator reads them and
        # compiles the repeated blocks (after FSDP2 wrapping / inside the DeepSpeed engine)
        cfg["dynamo_config"] = {"dynamo_backend": COMPILE_BACKEND.upper(), "dynamo_use_regional_compilation": True}
    cfg["num_processes"] = plan.world_size
    cfg["num_machines"] = plan.num_nodes
    cfg["machine_rank"] = 0  # placeholder: each node passes --machine_rank K
    if plan.num_nodes == 1:
        # 0 = accelerate picks a free port, so two runs on one host (e.g. 2 x 4 GPUs of a server) do not
        # both try the default rendezvous port
        cfg["main_process_port"] = 0
    else:
        # main_process_ip is left out on purpose: each node passes --main_process_ip
        cfg["main_process_port"] = main_port
        # static rendezvous on node 0 (MASTER_ADDR/MASTER_PORT): node ranks are the ones given
        cfg["rdzv_backend"] = "static"
        cfg["same_network"] = True
    return cfg


def fsdp_config(plan: Plan, *, arch: ModelArch) -> dict:
    return {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": True,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": arch.decoder_layer_class,
        # rank 0 loads the weights, the others get them by broadcast: 8 ranks never hold
        # 8 host copies (and QLoRA's 4-bit weights are not all placed on GPU 0, TRL #3436)
        "fsdp_cpu_ram_efficient_loading": True,
        # `accelerate launch` refuses cpu_ram_efficient_loading without it; FSDP2 ignores it
        "fsdp_sync_module_states": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        # FSDP applies activation checkpointing per wrapped layer; the trainer then must not
        # also set gradient_checkpointing (see resolved.activation_checkpointing_by)
        "fsdp_activation_checkpointing": checkpointing_owner(plan) == "fsdp",
        # CPUOffloadPolicy: sharded params and grads live in pinned host RAM, the optimizer steps there
        "fsdp_offload_params": strategies.offloads_params(plan.strategy),
    }


def partial_checkpointing(plan: Plan) -> bool:
    """Some but not all decoder layers checkpointed (the planner's k of L)."""
    return 0 < plan.checkpoint_layers < plan.num_layers


def checkpointing_owner(plan: Plan) -> str:
    """Who applies activation checkpointing: the FSDP plugin (every layer), the trainer (transformers'
    per-layer flags, which also serve FSDP2 when only k of L layers are checkpointed), or nobody."""
    if not plan.activation_checkpointing:
        return "none"
    if plan.device == "cuda" and strategies.is_fsdp(plan.strategy) and not partial_checkpointing(plan):
        return "fsdp"
    return "trainer"

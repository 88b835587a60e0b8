"""ds_config.json for ZeRO-2, ZeRO-3, ZeRO-3 with the optimizer (or everything) in host RAM and
ZeRO-Infinity (NVMe), every value concrete.

Keys are DeepSpeed 0.19's (runtime/config.py, runtime/zero/config.py, offload_config.py,
swap_tensor/constants.py). Where transformers' HfTrainerDeepSpeedConfig would fill an
"auto", we compute the same value here (bucket sizes from the hidden size) or take it from
the recipe and plan, so the file alone says exactly what runs. The trainer must build its
TrainingArguments from the same resolved recipe: HF checks that batch size, gradient
accumulation, clipping, precision and optimizer hyper-parameters match this file.
"""

from __future__ import annotations

from finetune import strategies
from finetune.errors import RecipeError
from finetune.plan.memory import NVME_OPTIMIZER_BUFFERS, NVME_PARAM_BUFFERS, nvme_param_buffer_elements
from finetune.plan.types import Plan
from finetune.recipe.schema import Recipe
from finetune.registry.disk import AIO_SETTINGS
from finetune.registry.schema import HardwarePreset, ModelArch


def nvme_path_for(recipe: Recipe, preset: HardwarePreset) -> str:
    path = recipe.distributed.nvme_path or preset.nvme_path
    if not path:
        raise RecipeError(
            f"zero3-nvme needs an NVMe directory and preset {preset.name!r} names none",
            key="distributed.nvme_path",
            hint="set distributed.nvme_path: /local/nvme/ds_swap (a fast local disk, not NFS)",
        )
    return path


def optimizer_in_ds_config(plan: Plan) -> bool:
    """Offloaded optimizer states are stepped by DeepSpeed's CPU Adam, so the optimizer is
    declared here; a torch optimizer on offloaded states is refused by DeepSpeed
    (zero_force_ds_cpu_optimizer) and would be an order of magnitude slower anyway."""
    return strategies.is_deepspeed(plan.strategy) and strategies.offloads_optimizer(plan.strategy)


def ds_config(recipe: Recipe, plan: Plan, *, arch: ModelArch, preset: HardwarePreset) -> dict:
    if not strategies.is_deepspeed(plan.strategy):
        raise ValueError(f"no DeepSpeed config for strategy {plan.strategy!r}")
    tier = strategies.info(plan.strategy)
    h = arch.hidden_size
    if tier.zero_stage == 2:
        zero2 = {
            "stage": 2,
            "overlap_comm": True,
            "contiguous_gradients": True,
            # the buckets the planner counts (plan/memory.py): h x h elements each
            "reduce_bucket_size": h * h,
            "allgather_bucket_size": h * h,
            "reduce_scatter": True,
            "allgather_partitions": True,
        }
        return _common(recipe, plan, zero2)
    zero: dict = {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        # the values transformers would put in place of "auto" for these three
        "reduce_bucket_size": h * h,
        "stage3_prefetch_bucket_size": int(0.9 * h * h),
        "stage3_param_persistence_threshold": strategies.zero3_persistence_threshold(h),
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        "sub_group_size": strategies.ZERO3_SUB_GROUP_ELEMENTS,
        # without it a LoRA adapter saved under ZeRO-3 is empty (TRL #4416)
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    if tier.offload == "cpu":
        if tier.offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    elif tier.offload == "nvme":
        path = nvme_path_for(recipe, preset)
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": path,
            "pin_memory": True,
            "buffer_count": NVME_PARAM_BUFFERS,
            "buffer_size": nvme_param_buffer_elements(arch),
            "max_in_cpu": 1_000_000_000,
        }
        zero["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": path,
            "pin_memory": True,
            "buffer_count": NVME_OPTIMIZER_BUFFERS,
            "fast_init": False,
        }
        # optimizer states are swapped per sub-group; 1e8 keeps the pinned swap buffers at
        # ~1.6 GB per rank instead of ~16 GB with the 1e9 default (ZeRO-Infinity tutorial)
        zero["sub_group_size"] = strategies.ZERO3_NVME_SUB_GROUP_ELEMENTS
        # a parameter gathered from NVMe holds one of the `buffer_count` swap buffers until it is
        # released. From the second step on (once DeepSpeed has traced the module order) a reuse
        # distance of 1e9 elements keeps the last ~4 layers of an 8B model gathered across the
        # forward/backward turn: ~28 parameters for 5 buffers, and step 2 fails with "Not enough
        # buffers 0 for swapping 1" (LoRA 8B on 2 x H200 and a tiny LoRA model on CPU, deepspeed
        # 0.19.8). Released at once, the next parameters come in through DeepSpeed's NVMe prefetch,
        # which is bounded by the free buffers; with 0 both trained (docs/validation.md, third pass).
        zero["stage3_max_reuse_distance"] = 0
    return _common(recipe, plan, zero, nvme=tier.offload == "nvme")


def _common(recipe: Recipe, plan: Plan, zero: dict, *, nvme: bool = False) -> dict:
    t = recipe.train
    mbs, gas, world = plan.micro_batch_size, plan.gradient_accumulation_steps, plan.world_size
    config: dict = {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": gas,
        "train_batch_size": mbs * gas * world,
        "gradient_clipping": float(t.max_grad_norm),
        # DeepSpeed skips a step whose gradient norm is not finite, before the optimizer sees it, and
        # train.on_nonfinite counts those steps (NonFiniteCallback). fp32 and ZeRO-3 skip always; bf16
        # under ZeRO-2 only with this on: off, one NaN step wrote NaN into every weight (deepspeed 0.19.8,
        # tests/unit/train/test_nonfinite.py). On is 0.19's default, spelled out because we rely on it.
        "bf16": {"enabled": t.precision == "bf16", "check_grad_overflow": True},
        "fp16": {
            "enabled": t.precision == "fp16",
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "zero_optimization": zero,
        "steps_per_print": 1_000_000_000,  # the trainer logs; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
    }
    if optimizer_in_ds_config(plan):
        config["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": t.lr,
                "betas": [t.adam_beta1, t.adam_beta2],
                "eps": t.adam_epsilon,
                "weight_decay": t.weight_decay,
            },
        }
    if nvme:
        # libaio settings for the swap files (registry/disk.py probes the disk the same way)
        config["aio"] = {**AIO_SETTINGS, "use_gds": False}
    return config

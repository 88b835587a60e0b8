"""The final model of a full fine-tune is saved in model.dtype, the dtype it was loaded in.

Under FSDP2, accelerate upcasts the trained parameters to fp32 master weights (bf16 compute through the
mixed-precision policy), and the Trainer's save gathers that fp32 state dict and hands it to
`save_pretrained`, which writes what it is given: measured on H100s (docs/validation.md), a 3.2B model's
final save was 14.4 GB of F32 tensors, twice the bf16 checkpoint it was loaded from, twice what the disk
check (`finetune.prelaunch.output_bytes`) planned, and its config.json still said bfloat16. The master
weights are a training device; what a user loads afterwards is the model in its own dtype, as a DDP or
DeepSpeed run saves it. Checkpoints are not touched: a resume restores the fp32 masters as they were.

Modules the model keeps in fp32 on purpose (transformers' `_keep_in_fp32_modules`) stay fp32.
"""

from __future__ import annotations

from finetune.plan.workload import DTYPE_BYTES


def final_save_dtype(recipe):
    """The torch dtype a full fine-tune's final weights are written in, None when nothing is cast (an
    adapter run: peft saves its fp32 adapter as it trained it; an fp32 model)."""
    if recipe.adapter.type != "full" or DTYPE_BYTES.get(recipe.model.dtype) != 2:
        return None
    from finetune.train.model import torch_dtype

    return torch_dtype(recipe.model.dtype)


def kept_in_fp32(model) -> tuple[str, ...]:
    """Module names the model class keeps in fp32 whatever dtype it is loaded in."""
    names: list[str] = []
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        names += list(getattr(model, attr, None) or ())
    return tuple(names)


def cast_state_dict(state_dict: dict, dtype, *, keep: tuple[str, ...] = ()) -> dict:
    """fp32 floating tensors of `state_dict` cast to `dtype`, in place (each fp32 tensor is released as
    soon as its copy exists, so the host holds at most one extra tensor), except those under `keep`."""
    import torch

    for key, value in list(state_dict.items()):
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
            continue
        if any(f".{name}." in f".{key}." for name in keep):
            continue
        state_dict[key] = value.to(dtype)
    return state_dict


class SavesFinalModelInItsDtype:
    """Trainer mixin: while `final_dtype` is set (finetune sets it around the final save only), the state
    dict the Trainer gathered for `save_pretrained` is cast to it first."""

    final_dtype = None

    def _save(self, output_dir=None, state_dict=None):
        if self.final_dtype is not None and state_dict:
            model = self.accelerator.unwrap_model(self.model)
            state_dict = cast_state_dict(state_dict, self.final_dtype, keep=kept_in_fp32(model))
        return super()._save(output_dir, state_dict=state_dict)

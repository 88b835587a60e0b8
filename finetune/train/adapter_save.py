"""A LoRA run's final save under FSDP2 gathers only the trained parameters to rank 0.

transformers' Trainer.save_model under FSDP with a FULL_STATE_DICT gathers the whole model's state dict to
rank 0's host (accelerate's get_state_dict: every frozen base weight as well), and peft's save_pretrained then
keeps only the adapter's keys of it: at 70B that was 135 GiB of host RAM on rank 0 for an adapter of well under
a gigabyte (docs/validation.md). Here the trained parameters alone are gathered, one at a time, as transformers
already asks DeepSpeed to for ZeRO-3 (exclude_frozen_parameters).

Only where peft writes no frozen weight (recipe/schema.py final_save_gathers_trained_only, which the planner's
host RAM of the final save reads too).
"""

from __future__ import annotations

# what wrappers put into parameter names and state-dict keys leave out (torch's distributed checkpoint drops
# them the same way): activation checkpointing's wrapper, torch.compile's
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def state_dict_key(name: str) -> str:
    """A parameter's name as its state-dict key: without the wrappers' prefixes."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def trained_state_dict(model) -> dict:
    """The full (unsharded) tensors of `model`'s trained parameters on rank 0's CPU, {} on the other ranks;
    a collective: every rank calls it. Parameter by parameter, so nothing frozen is gathered (torch's
    get_model_state_dict with ignore_frozen_params still gathers a frozen weight under its second, tied name:
    the LM head of a model with tied embeddings)."""
    import torch.distributed as dist

    main = not dist.is_initialized() or dist.get_rank() == 0
    out = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        value = param.detach()
        if hasattr(value, "full_tensor"):  # a DTensor shard: all-gathered on the mesh's device
            mesh_device = value.device_mesh.device_type
            if value.device.type != mesh_device:  # FSDP2's CPU offload keeps the shard on the host
                value = value.to(mesh_device)
            value = value.full_tensor()
        if main:
            out[state_dict_key(name)] = value.to("cpu", copy=True)
    return out


class SavesTrainedParametersOnlyUnderFSDP:
    """Trainer mixin: where `gathers_trained_only` (set per recipe by finetune.train.subclass), a save with
    FSDP's FULL_STATE_DICT (finetune's final save) hands save_pretrained the trained parameters alone."""

    gathers_trained_only = False

    def save_model(self, output_dir=None, _internal_call=False):
        full = self.is_fsdp_enabled and "FULL_STATE_DICT" in str(self.accelerator.state.fsdp_plugin.state_dict_type)
        if not (self.gathers_trained_only and full):
            return super().save_model(output_dir, _internal_call)
        self.save_trained_parameters(output_dir if output_dir is not None else self.args.output_dir)

    def save_trained_parameters(self, output_dir) -> None:
        """save_pretrained (through the Trainer's _save) with the gathered trained parameters; every rank."""
        self._save(output_dir, state_dict=trained_state_dict(self.model))

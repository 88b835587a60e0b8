"""Per-layer activation checkpointing: the planner's k of L decoder layers (resolved.checkpoint_layers).

transformers marks each decoder layer (a GradientCheckpointingLayer) with its own `gradient_checkpointing`
flag; `activation_checkpointing_enable`, which the Trainer calls at the start of `train()`, sets it on
every layer. This callback runs right after (on_train_begin) and leaves it on for the first k layers only.
The first k, not any k: the backward reaches them last, after the un-checkpointed layers above have freed
their activations, so no recompute adds to the peak (finetune/plan/memory.py activation_bytes).

Whatever calls `activation_checkpointing_enable` again during training sets the flag on every layer once more: TRL's
DPO and KTO reference passes (trl.models.utils.disable_gradient_checkpointing: disable, the pass, enable) did so
after the first micro-batch, and every later step recomputed all L layers (a full 3B DPO on an H200: k = 3 planned,
all 28 ran). So the first k are set again by a forward pre-hook on the model before each forward that records
gradients (the reference passes run without, and a pass with checkpointing off stays off).
"""

from __future__ import annotations

from transformers import TrainerCallback

# torch's non-reentrant checkpointing: the Trainer's (trainers.py _checkpointing_args) and the host probe's
CHECKPOINTING_KWARGS = {"use_reentrant": False}


def decoder_layers(model) -> list:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _checkpoint_first(layers: list, k: int) -> list[bool]:
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index < k
    return [layer.gradient_checkpointing for layer in layers]


def enable_checkpointing(model) -> None:
    """Checkpointing on every decoder layer of `model`, non-reentrant, as the Trainer turns it on from its arguments
    (trainers.py _checkpointing_args; transformers 5.24 renamed gradient_checkpointing_enable)."""
    kwargs = dict(CHECKPOINTING_KWARGS)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpoint_first_layers(model, k: int) -> list[bool]:
    """Checkpoint the first `k` decoder layers of `model` (checkpointing already enabled); the flags set."""
    return _checkpoint_first(decoder_layers(model), k)


def keep_first_layers_checkpointed(model, k: int):
    """Checkpoint the first `k` decoder layers now and before every forward of `model` that records gradients while
    checkpointing is on (module docstring); the hook's handle, to remove it when training ends."""
    import torch

    layers = decoder_layers(model)  # found once: the hook runs every forward
    _checkpoint_first(layers, k)

    def before(module, args):
        # some flag on: checkpointing is enabled (turned off altogether, every flag is off and stays so)
        if torch.is_grad_enabled() and module.training and any(layer.gradient_checkpointing for layer in layers):
            _checkpoint_first(layers, k)

    return model.register_forward_pre_hook(before)


class PartialCheckpointing(TrainerCallback):
    def __init__(self, layers: int):
        self.layers = layers
        self.hook = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and self.hook is None:
            self.hook = keep_first_layers_checkpointed(model, self.layers)

    def on_train_end(self, args, state, control, **kwargs):
        if self.hook is not None:
            self.hook.remove()
            self.hook = None

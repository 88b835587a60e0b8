"""Per-layer activation checkpointing: the planner's k of L decoder layers (resolved.checkpoint_layers).

transformers marks each decoder layer (a GradientCheckpointingLayer) with its own `gradient_checkpointing`
flag; `activation_checkpointing_enable`, which the Trainer calls at the start of `train()`, sets it on
every layer. This callback runs right after (on_train_begin) and leaves it on for the first k layers only.
The first k, not any k: the backward reaches them last, after the un-checkpointed layers above have freed
their activations, so no recompute adds to the peak (finetune/plan/memory.py activation_bytes).
"""

from __future__ import annotations

from transformers import TrainerCallback


def decoder_layers(model) -> list:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def checkpoint_first_layers(model, k: int) -> list[bool]:
    """Checkpoint the first `k` decoder layers of `model` (checkpointing already enabled); the flags set."""
    flags = []
    for index, layer in enumerate(decoder_layers(model)):
        layer.gradient_checkpointing = index < k
        flags.append(layer.gradient_checkpointing)
    return flags


class PartialCheckpointing(TrainerCallback):
    def __init__(self, layers: int):
        self.layers = layers

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            checkpoint_first_layers(model, self.layers)

"""DoRA on a bitsandbytes-quantized base: peft's adapted layer returns its output in the input's dtype.

TRL keeps DoRA's magnitude vector in fp32 on a quantized model (its updates would round to zero in bf16) and
casts the LoRA matrices to bf16. peft's bitsandbytes layers (tuners/lora/bnb.py, Linear4bit and Linear8bitLt
forward) cast their result back to the input's dtype only when CUDA autocast is off; under the Trainer's bf16
autocast the DoRA term, scaled by the fp32 magnitude, is fp32, and so is every adapted module's output: the
attention's projections, the residual stream and the MLP behind them then run and keep their activations in
fp32. A QLoRA DoRA Llama-3.1-8B on an H200 held 6 GiB more than planned at micro-batch 2 x 2,048 tokens and ran
out of memory at 4 x 2,048, 18 GiB over the plan (docs/validation.md, twenty-eighth session). The bitsandbytes
base layer itself returns the input's dtype, as peft's 16-bit Linear casts its result to the base output's dtype
in every case; these subclasses do the same for the quantized layers. They are registered through LoraConfig's
custom-module mapping (as train/fused_lora.py is), keep peft's parameters, state dict and merging, and change
nothing but the dtype of what the layer returns.
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch
from peft.tuners.lora.bnb import Linear4bit, Linear8bitLt


class _InputDtypeOutput:
    """The adapted layer's forward, its result cast to the dtype of its input (the base layer's output dtype)."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = super().forward(x, *args, **kwargs)  # type: ignore[misc]
        if result.dtype != x.dtype and x.is_floating_point():
            result = result.to(x.dtype)
        return result


class QuantizedDoraLinear4bit(_InputDtypeOutput, Linear4bit):
    """peft's LoRA layer over a bitsandbytes 4-bit linear (QLoRA), its output in its input's dtype."""


class QuantizedDoraLinear8bitLt(_InputDtypeOutput, Linear8bitLt):
    """peft's LoRA layer over a bitsandbytes 8-bit linear (adapter.load_in_8bit), its output in its input's dtype."""


def custom_modules() -> dict[type, type]:
    """LoraConfig._register_custom_module's mapping: bitsandbytes' 4- and 8-bit linears to these subclasses."""
    return {bnb.nn.Linear4bit: QuantizedDoraLinear4bit, bnb.nn.Linear8bitLt: QuantizedDoraLinear8bitLt}

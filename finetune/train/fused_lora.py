"""adapter.fused_lora: peft's LoRA Linear as one autograd function whose adds and scales ride in the GEMMs.

peft computes `result + lora_B(lora_A(dropout(x))) * scaling` with autograd: after the two small matmuls one
elementwise pass scales the (tokens x out_features) product and another adds it to the base output; the
backward scales the gradient in a third pass and adds the adapter's input gradient to the base's in a
fourth, over (tokens x in_features). On 8B LoRA those passes are ~10% of an H100's step (docs/benchmarks.md).
Here one `torch.autograd.Function` runs the base linear and the adapter together:
- forward: `out = x W^T (+ bias)`, then `out.addmm_(x A^T, B^T, alpha=scaling)`, in place on the base
  output (an out-of-place addmm copies it first);
- backward: the scale goes into the small (tokens x r) and (out x r) products, and the input gradient is
  `g W` with `(g B s) A` accumulated into it by `addmm_` (without dropout: with it, the adapter's input
  is another tensor, whose gradient autograd adds).
It saves what autograd saves for peft's graph (the input, the (tokens x r) product, the weights) and
computes no gradient nobody asked for.

It is a subclass of peft's `lora.Linear` registered through LoraConfig's custom-module mapping (peft's
documented extension point), with the same parameters and state dict, so checkpoints, adapters and merging
are peft's. Anything but plain LoRA on a plain nn.Linear (DoRA or another variant, merged or disabled
adapters, mixed-adapter batches, a LoRA bias, peft's input cast, a base layer or adapter with hooks of its
own, ZeRO-3's partitioned parameters, which only a submodule's own forward gathers) takes peft's forward.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn


class _FusedLora(torch.autograd.Function):
    """(x, x_adapter | None, W, bias | None, A, B, scaling) -> x W^T + bias + scaling (x_adapter A^T) B^T, on
    2-D tensors of one dtype; x_adapter None means the adapter reads x itself (no dropout)."""

    @staticmethod
    def forward(ctx, x, x_adapter, weight, bias, lora_a, lora_b, scaling):
        adapter_in = x if x_adapter is None else x_adapter
        out = nn.functional.linear(x, weight, bias)
        h = adapter_in @ lora_a.t()
        out.addmm_(h, lora_b.t(), alpha=scaling)
        ctx.scaling, ctx.shared_input = scaling, x_adapter is None
        ctx.save_for_backward(adapter_in, weight, lora_a, lora_b, h)
        return out

    @staticmethod
    def backward(ctx, grad):
        adapter_in, weight, lora_a, lora_b, h = ctx.saved_tensors
        need_x, need_xa, _, need_bias, need_a, need_b, _ = ctx.needs_input_grad
        s = ctx.scaling
        grad_h = (grad @ lora_b).mul_(s) if (need_x or need_xa or need_a) else None
        grad_a = grad_h.t() @ adapter_in if need_a else None
        grad_b = (grad.t() @ h).mul_(s) if need_b else None
        grad_bias = grad.sum(0) if need_bias else None
        grad_x = grad_xa = None
        if need_x:
            grad_x = grad @ weight
            if ctx.shared_input:
                grad_x.addmm_(grad_h, lora_a)
        if need_xa and not ctx.shared_input:
            grad_xa = grad_h @ lora_a
        return grad_x, grad_xa, None, grad_bias, grad_a, grad_b, None


class FusedLoraLinear(LoraLinear):
    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapter = self._plain_adapter(x, args, kwargs)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        self._check_forward_args(x, *args, **kwargs)
        base: nn.Linear = self.base_layer
        lora_a, lora_b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        dropout = self.lora_dropout[adapter]
        device = x.device.type
        # what autocast would run F.linear and the adapter's matmuls in; then every operand in that dtype
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        x_adapter = None if isinstance(dropout, nn.Identity) else dropout(x)
        flat = [t.reshape(-1, t.shape[-1]).to(dtype) if t is not None else None for t in (x, x_adapter)]
        bias = base.bias.to(dtype) if base.bias is not None else None
        with torch.autocast(device, enabled=False):
            out = _FusedLora.apply(
                flat[0],
                flat[1],
                base.weight.to(dtype),
                bias,
                lora_a.to(dtype),
                lora_b.to(dtype),
                float(self.scaling[adapter]),
            )
        return out.view(*x.shape[:-1], out.shape[-1])

    def _plain_adapter(self, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
        """The one active adapter when this call is plain LoRA on a plain Linear, else None (peft's forward)."""
        if args or kwargs or self.disable_adapters or self.merged:
            return None  # extra arguments (adapter_names: mixed batches) are peft's to handle
        base = self.base_layer
        if type(base) is not nn.Linear or _has_hooks(base):
            return None
        active = [a for a in self.active_adapters if a in self.lora_A]
        if len(active) != 1 or active[0] in self.lora_variant:
            return None
        lora_a, lora_b = self.lora_A[active[0]], self.lora_B[active[0]]
        if lora_b.bias is not None or _has_hooks(lora_a) or _has_hooks(lora_b):
            return None
        if lora_a.weight.dtype != x.dtype and getattr(self, "cast_input_dtype_enabled", True):
            return None  # peft casts the input to the adapter's dtype (adapter.cast_adapter_inputs): its path
        if hasattr(lora_b.weight, "ds_id"):  # a ZeRO-3 partition: gathered only by lora_B's own forward
            return None
        return active[0]


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks)

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

Linears that read one input (a decoder layer's q/k/v projections, its gate/up projections) also run as one
group (adapter.fused_lora_groups, `group_shared_inputs`): the first of them to be called computes them all in
one autograd function, and the others take their outputs when they are called with the same tensor. One GEMM
reads the input for every adapter's A, and in the backward the input gradients of the base GEMMs accumulate
into one tensor inside the GEMMs (`addmm_`), where autograd would add each module's gradient to the others'
in an elementwise pass, and one GEMM adds every adapter's share. A member called with another input than
the one its output was computed from (cross-attention's k/v) turns its group off for good: each module then
runs alone, as above.

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

from finetune.plan.lora_time import SHARED_INPUT_NAMES


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


class _FusedLoraGroup(torch.autograd.Function):
    """(scalings, ranks, x, A, W_1..W_n, bias_1..bias_n, B_1..B_n) -> the n outputs x W_i^T + bias_i +
    scaling_i (x A_i^T) B_i^T, where A stacks the n adapters' A matrices (rows ranks[i] each), on 2-D tensors
    of one dtype. The frozen W_i get no gradient (as in _FusedLora)."""

    @staticmethod
    def forward(ctx, scalings, ranks, x, lora_a, *rest):
        n = len(ranks)
        weights, biases, lora_bs = rest[:n], rest[n : 2 * n], rest[2 * n :]
        h = x @ lora_a.t()  # one read of x for every adapter
        outs, offset = [], 0
        for weight, bias, lora_b, s, r in zip(weights, biases, lora_bs, scalings, ranks):
            out = nn.functional.linear(x, weight, bias)
            out.addmm_(h[:, offset : offset + r], lora_b.t(), alpha=s)
            outs.append(out)
            offset += r
        ctx.scalings, ctx.ranks = scalings, ranks
        ctx.save_for_backward(x, lora_a, h, *weights, *lora_bs)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, lora_a, h, *saved = ctx.saved_tensors
        n = len(ctx.ranks)
        weights, lora_bs = saved[:n], saved[n:]
        need = ctx.needs_input_grad
        need_x, need_a = need[2], need[3]
        need_bias, need_b = need[4 + n : 4 + 2 * n], need[4 + 2 * n :]
        grad_h = None
        if need_x or need_a:
            grad_h = torch.cat([(g @ b).mul_(s) for g, b, s in zip(grads, lora_bs, ctx.scalings)], dim=1)
        grad_a = grad_h.t() @ x if need_a else None
        grad_x = None
        if need_x:  # the base GEMMs accumulate into one tensor, then one GEMM adds every adapter's share
            grad_x = grads[0] @ weights[0]
            for g, weight in zip(grads[1:], weights[1:]):
                grad_x.addmm_(g, weight)
            grad_x.addmm_(grad_h, lora_a)
        grad_biases = [g.sum(0) if need_it else None for g, need_it in zip(grads, need_bias)]
        grad_bs, offset = [], 0
        for g, s, r, need_it in zip(grads, ctx.scalings, ctx.ranks, need_b):
            grad_bs.append((g.t() @ h[:, offset : offset + r]).mul_(s) if need_it else None)
            offset += r
        return None, None, grad_x, grad_a, *([None] * n), *grad_biases, *grad_bs


class FusedLoraLinear(LoraLinear):
    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        group: SharedInputGroup | None = getattr(self, "_shared_input_group", None)
        if group is not None and not args and not kwargs:
            out = group.output(self, x)
            if out is not None:
                return out
        adapter = self._plain_adapter(x, args, kwargs)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        self._check_forward_args(x, *args, **kwargs)
        base: nn.Linear = self.base_layer
        lora_a, lora_b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        dropout = self.lora_dropout[adapter]
        device = x.device.type
        dtype = _compute_dtype(x)
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


class SharedInputGroup:
    """Fused LoRA linears that read one input, computed together (module docstring). Not an nn.Module: it
    adds no parameters or state-dict keys to its members."""

    def __init__(self, members: list[FusedLoraLinear]):
        self.members = members
        self.enabled = True
        self._input: torch.Tensor | None = None
        self._key: tuple = ()
        self._pending: dict[int, torch.Tensor] = {}

    def output(self, member: FusedLoraLinear, x: torch.Tensor) -> torch.Tensor | None:
        """`member`'s output for input `x`, computed with its siblings' (or taken from that computation),
        or None where the group does not apply (the member then runs alone)."""
        if not self.enabled:
            return None
        index = self.members.index(member)
        key = (x._version, torch.is_grad_enabled(), torch.is_autocast_enabled(x.device.type))
        if self._input is x and self._key == key and index in self._pending:
            out = self._pending.pop(index)
            if not self._pending:
                self._input = None
            return out.view(*x.shape[:-1], out.shape[-1])
        if index in self._pending:  # called with another input than its output was computed from
            self.enabled = False
            self._input, self._pending = None, {}
            return None
        outs = self._compute(x)
        if outs is None:
            return None
        self._input, self._key = x, key
        self._pending = {i: out for i, out in enumerate(outs) if i != index}
        return outs[index].view(*x.shape[:-1], outs[index].shape[-1])

    def _compute(self, x: torch.Tensor) -> tuple | None:
        adapters = []
        for m in self.members:  # the first that is not plain ends it (a DPO reference pass: the first of all)
            adapter = m._plain_adapter(x, (), {})
            if adapter is None:
                return None
            adapters.append(adapter)
        bases = [m.base_layer for m in self.members]
        dropout = not all(isinstance(m.lora_dropout[a], nn.Identity) for m, a in zip(self.members, adapters))
        if dropout or any(b.weight.requires_grad for b in bases):
            # dropout gives each adapter its own input; the fused functions give the frozen base no gradient.
            # Neither changes during training: the group stays off, its members run alone.
            self.enabled = False
            return None
        device, dtype = x.device.type, _compute_dtype(x)
        lora_as = [m.lora_A[a].weight for m, a in zip(self.members, adapters)]
        lora_bs = [m.lora_B[a].weight.to(dtype) for m, a in zip(self.members, adapters)]
        with torch.autocast(device, enabled=False):
            return _FusedLoraGroup.apply(
                tuple(float(m.scaling[a]) for m, a in zip(self.members, adapters)),
                tuple(w.shape[0] for w in lora_as),
                x.reshape(-1, x.shape[-1]).to(dtype),
                torch.cat(lora_as).to(dtype),
                *[b.weight.to(dtype) for b in bases],
                *[b.bias.to(dtype) if b.bias is not None else None for b in bases],
                *lora_bs,
            )


def group_shared_inputs(model: nn.Module) -> int:
    """Put each set of fused LoRA linears of SHARED_INPUT_NAMES under one parent into a SharedInputGroup
    (adapter.fused_lora_groups); returns how many groups were made."""
    groups = 0
    for parent in model.modules():
        children = dict(parent.named_children())
        for names in SHARED_INPUT_NAMES:
            members = [children.get(name) for name in names]
            if all(isinstance(m, FusedLoraLinear) for m in members):
                group = SharedInputGroup(members)
                for m in members:
                    m._shared_input_group = group
                groups += 1
    return groups


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """What autocast would run F.linear and the adapter's matmuls in; every operand is cast to it."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks)

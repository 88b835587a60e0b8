"""Counting the kernels a module launches, on CPU: the non-view aten ops it dispatches (a view only re-describes a
tensor, no kernel on a GPU). The host-time model's per-op kernel counts are read this way (plan/host_time.py)."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class KernelOps(TorchDispatchMode):
    """`with KernelOps() as ops:` ... then `ops.ops`: each non-view aten op's name and how many times it ran."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

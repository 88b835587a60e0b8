"""adapter.fused_lora: peft's LoRA Linear with the scale and the add folded into the second matmul.

peft computes `result + lora_B(lora_A(dropout(x))) * scaling`: after the two small matmuls, one elementwise
pass scales the (tokens x out_features) product and another adds it to the base output, and the backward
runs the scale's gradient as a third; on 8B LoRA those passes and the residual adds are ~20% of a step's
GPU time (docs/benchmarks.md). Here the second matmul is `torch.addmm(result, a, B^T, alpha=scaling)`: the
GEMM reads the base output and scales in its epilogue, and its backward scales inside the GEMMs too, so no
pass over the (tokens x out_features) tensor is left but the GEMM's own read of `result`.

It is a subclass of peft's `lora.Linear` registered through LoraConfig's custom-module mapping (peft's
documented extension point), with the same parameters and state dict, so checkpoints, adapters and merging
are peft's. Anything but plain LoRA on a plain Linear (DoRA or another variant, merged or disabled adapters,
mixed-adapter batches, a LoRA bias, an input cast, ZeRO-3's partitioned parameters, which only a submodule's
own forward gathers) takes peft's forward unchanged.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear as LoraLinear


class FusedLoraLinear(LoraLinear):
    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapter = self._plain_adapter(x, kwargs)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        self._check_forward_args(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        lora_a, lora_b = self.lora_A[adapter], self.lora_B[adapter]
        a = lora_a(self.lora_dropout[adapter](x))
        out = torch.addmm(
            result.reshape(-1, result.shape[-1]),
            a.reshape(-1, a.shape[-1]),
            lora_b.weight.t(),
            alpha=self.scaling[adapter],
        )
        return out.view(result.shape)

    def _plain_adapter(self, x: torch.Tensor, kwargs: dict) -> str | None:
        """The one active adapter when this call is plain LoRA, else None (peft's forward runs)."""
        if self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None:
            return None
        active = [a for a in self.active_adapters if a in self.lora_A]
        if len(active) != 1 or active[0] in self.lora_variant:
            return None
        lora_a, lora_b = self.lora_A[active[0]], self.lora_B[active[0]]
        if lora_b.bias is not None:
            return None
        if lora_a.weight.dtype != x.dtype and getattr(self, "cast_input_dtype_enabled", True):
            return None  # peft casts the input to the adapter's dtype (adapter.cast_adapter_inputs): its path
        if hasattr(lora_b.weight, "ds_id"):  # a ZeRO-3 partition: gathered only by lora_B's own forward
            return None
        return active[0]

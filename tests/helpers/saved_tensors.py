"""What autograd keeps for the backward of one decoder layer, measured on CPU with real transformers/peft
layers: saved-tensor hooks record every tensor saved during the layer's forward; those still alive after
it (weak references; parameters left out) are what the backward holds. Differences between two token
counts give bytes per token to compare with the planner's activation terms."""

from __future__ import annotations

import gc
import weakref


def retained_bytes(model, *, tokens: int, vocab: int = 1000) -> int:
    """Bytes autograd keeps after the forward of the first decoder layer of a peft-wrapped causal LM,
    under bf16 autocast, for one row of `tokens` tokens."""
    import torch

    refs = {}

    def pack(t):
        refs[t.untyped_storage().data_ptr()] = (weakref.ref(t), t.untyped_storage().nbytes())
        return t

    inner = model.base_model.model.model
    ids, pos = torch.randint(0, vocab, (1, tokens)), torch.arange(tokens)[None]
    hidden = inner.embed_tokens(ids).detach().requires_grad_(True)
    rope = inner.rotary_emb(hidden, pos)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        out = inner.layers[0](hidden, position_embeddings=rope, position_ids=pos)
    gc.collect()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = sum(n for ptr, (ref, n) in refs.items() if ref() is not None and ptr not in params)
    del out
    return kept


def per_token_bytes(make_model, *, tokens: tuple[int, int] = (256, 512)) -> float:
    """Retained bytes per token: the difference between two token counts (fixed costs cancel)."""
    small, large = tokens
    return (retained_bytes(make_model(), tokens=large) - retained_bytes(make_model(), tokens=small)) / (large - small)


def block_kept_bytes(model, block, x) -> int:
    """Bytes autograd saves during `block(x)` under bf16 autocast, leaving out `model`'s parameters and `x`
    itself (what the planner counts elsewhere): the block's own activations for its backward."""
    import torch

    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    kept: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        block(x)
    return sum(kept.values())


def backward_peak_bytes(output, gradient) -> int:
    """The peak bytes of the tensors `output.backward(gradient)` creates and holds at once (each storage counted
    while it is alive: a dispatch mode records every op's outputs, weak finalizers their release)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    state = {"live": 0, "peak": 0}
    seen: set[int] = set()

    class Live(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.is_view:  # a view shares its base's storage
                return out
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor):
                    continue
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if not size or key in seen:
                    continue
                seen.add(key)
                state["live"] += size
                state["peak"] = max(state["peak"], state["live"])

                def released(size=size, key=key):
                    state["live"] -= size
                    seen.discard(key)

                weakref.finalize(storage, released)
            return out

    with Live():
        output.backward(gradient)
    return state["peak"]

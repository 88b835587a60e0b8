"""Packed (padding-free) attention on PyTorch's own flash-attention varlen kernel.

With packing, TRL's collator concatenates a micro-batch into one row and passes the example
boundaries as `cu_seq_lens_q/k` and `max_length_q/k`. transformers' `sdpa` turns those into a
block-diagonal (row x row) mask, which no flash kernel takes: the masked kernel then computes the
whole square, ~10x the work of the examples' own triangles on 300-token examples in a 4096 row.
`flash_attention_2` skips it but needs the flash-attn package, which has no wheel for most
torch/CUDA pairs. `torch.nn.attention.varlen.varlen_attn` ships with torch (seen in 2.11 and 2.13)
and runs the same varlen flash kernel, so finetune registers it with transformers' public AttentionInterface
under the name below. Batches without example boundaries (unpacked, padded rows, DPO, generation
with a KV cache) go to transformers' own sdpa path unchanged, so the name is safe to select for
any model that supports sdpa.

Long examples run on cuDNN's causal kernel instead where it is faster (`register`'s long_examples_on_cudnn,
finetune/kernels.py's CUDNN_MIN_EXAMPLE_TOKENS): each through sdpa over its own rows, zero-padded at its end
to one of a few lengths (`cudnn_padded_length`), which causal attention keeps every real token from seeing.

Sliding-window layers (Gemma-3's local layers, Mistral-7B-v0.1, Phi-3) run on the same kernel with its window
(`window_size`), so they too skip the packed row's mask; soft-capped and sink layers run their model's eager
attention (`needs_model_eager`), which neither kernel computes.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings

from finetune.kernels import CUDNN_COMPUTE_MAJOR, CUDNN_MIN_EXAMPLE_TOKENS, VARLEN_WINDOW_RELEASE, cudnn_padded_length

NAME = "finetune_varlen"


@functools.lru_cache(maxsize=1)
def _varlen():
    """(varlen_attn, its keyword arguments for causal + GQA), or None when torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    # the causal switch changed between torch releases: is_causal=True, later window_size=(-1, 0)
    if "is_causal" in params:
        causal = {"is_causal": True}
    elif "window_size" in params:
        causal = {"window_size": (-1, 0)}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params


def takes_windows() -> bool:
    """This torch's varlen kernel runs sliding windows (`window_size`: torch 2.11 and later). The planner reads the
    same from torch's version without importing it (finetune.kernels.torch_runs_varlen_windows) and plans the sliding
    layers over the masked packed row where it is False."""
    kernel = _varlen()
    return kernel is not None and "window_size" in kernel[1]


def window_arguments(sliding_window: int | None, max_length: int) -> dict:
    """The varlen kernel's causal keyword arguments for a layer of `sliding_window` (None: a full layer) over examples
    of at most `max_length` tokens. transformers' window of w lets a query see itself and the w - 1 keys before it
    (masking_utils.sliding_window_overlay); flash-attention's (left, right) sees left keys before and right after, so
    the window is (w - 1, 0). A window no example outgrows is plain causal attention, the kernel's causal path."""
    causal = _varlen()[1]
    if sliding_window is None or sliding_window >= max_length:
        return causal
    return {"window_size": (sliding_window - 1, 0)}


def available() -> bool:
    """The kernel exists in this torch and a CUDA device can run it."""
    import torch

    return _varlen() is not None and torch.cuda.is_available()


# where examples of at least CUDNN_MIN_EXAMPLE_TOKENS go to cuDNN (register's switch; off until a run asks)
_LONG_ON_CUDNN: dict[str, bool] = {"on": False}


def cudnn_runs_long_examples() -> bool:
    """This process's GPU runs sdpa's cuDNN attention and is one it was measured faster on (compute capability 9:
    H100/H200, finetune/kernels.py)."""
    import torch

    return (
        torch.cuda.is_available()
        and torch.backends.cuda.cudnn_sdp_enabled()
        and torch.cuda.get_device_capability()[0] == CUDNN_COMPUTE_MAJOR
    )


def register(*, long_examples_on_cudnn: bool = False) -> str:
    """Make NAME a valid `attn_implementation` (idempotent). Returns NAME. `long_examples_on_cudnn`: packed
    examples of at least CUDNN_MIN_EXAMPLE_TOKENS run on cuDNN's causal kernel (the recipe's
    model.cudnn_long_examples, where `cudnn_runs_long_examples`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    _LONG_ON_CUDNN["on"] = long_examples_on_cudnn
    AttentionInterface.register(NAME, varlen_attention_forward)
    # the fallback path is sdpa, so it gets sdpa's masks, but for a packed row's (`packed_row_mask`)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, packed_row_mask)
    return NAME


# whether the forward running now is of one packed row whose example bounds (cu_seq_lens_q) the layers get: set by
# the hooks `skip_packed_row_masks` puts on the model, read by `packed_row_mask`
_PACKED_FORWARD: dict[str, bool] = {"on": False}
# how many packed-row masks transformers did not build (the run's memory report says whether any)
_SKIPPED = {"masks": 0}


def packed_row_mask(*args, **kwargs):
    """NAME's mask function (masking_utils' mask interface, called once a forward for each kind of layer): nothing
    for a packed row whose bounds every layer gets, else sdpa's mask. transformers would build the row's
    block-diagonal boolean mask (row x row bytes: 4 GiB at a 64k-token row, one per kind of layer) and hold it
    through the layers, though the varlen kernel reads the bounds instead; a layer that falls back builds the same
    mask from the bounds when it runs (`_bounds_mask`). Only the plain causal packed row qualifies: no padding mask,
    no cache, and no mask overlay of the model's own (transformers builds those with vmap: Gemma-3's bidirectional
    image tokens)."""
    from transformers.masking_utils import sdpa_mask

    if (
        _PACKED_FORWARD["on"]
        and not args
        and kwargs.get("attention_mask") is None
        and kwargs.get("batch_size") == 1
        and kwargs.get("q_length") == kwargs.get("kv_length")
        and not kwargs.get("q_offset")
        and not kwargs.get("kv_offset")
        and not kwargs.get("use_vmap")
    ):
        _SKIPPED["masks"] += 1
        return None
    return sdpa_mask(*args, **kwargs)


def skip_packed_row_masks(model) -> None:
    """Hooks on the model (public nn.Module hooks) that tell `packed_row_mask` when a forward is given a packed row's
    example bounds (TRL's padding-free collator, finetune's DPO pairs), so transformers builds no mask for it. Once a
    model: a second call adds nothing."""
    if getattr(model, "_finetune_skips_row_masks", False):
        return
    model._finetune_skips_row_masks = True

    def before(module, args, kwargs):
        _PACKED_FORWARD["on"] = kwargs.get("cu_seq_lens_q") is not None

    def after(module, args, kwargs, output):
        _PACKED_FORWARD["on"] = False
        _BOUNDS_MASK.clear()  # autograd keeps what the backward needs; a recompute builds it again

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True, always_call=True)


def skipped_packed_row_masks() -> bool:
    """This process ran forwards without transformers' packed-row masks (`packed_row_mask`)."""
    return _SKIPPED["masks"] > 0


# the masks falling-back layers build from the bounds, kept for the forward's other such layers: for one bounds
# tensor, by row length and window (Gemma-2 alternates a window and none)
_BOUNDS_MASK: dict[object, object] = {}


def _bounds_mask(cu_seq_lens, total: int, window: int | None, device):
    """(1, 1, total, total) booleans: each query sees the keys of its own example at or before it (and within
    `window` of it): the mask transformers builds for a packed row (masking_utils' packed sequence and sliding window
    functions), built from the example bounds."""
    import torch

    if _BOUNDS_MASK.get("bounds") is not cu_seq_lens:
        _BOUNDS_MASK.clear()
        _BOUNDS_MASK["bounds"] = cu_seq_lens
    key = (total, window)
    if key not in _BOUNDS_MASK:
        cu = cu_seq_lens.to(device=device, dtype=torch.long)
        example = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=device), cu.diff(), output_size=total)
        pos = torch.arange(total, device=device)
        mask = (example[:, None] == example[None, :]) & (pos[None, :] <= pos[:, None])
        if window:
            mask &= pos[None, :] > pos[:, None] - window
        _BOUNDS_MASK[key] = mask[None, None]
    return _BOUNDS_MASK[key]


def _packed_bounds(query, key, kwargs) -> tuple | None:
    """(cu_seq_lens, max_length) when the batch is one padding-free packed row, else None."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is None or cu_k is None or max_q is None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return None
    if cu_k is not cu_q and (cu_k.shape != cu_q.shape or max_k != max_q):
        return None  # a cache or cross attention: not the training layout
    return cu_q, int(max_q)


def needs_model_eager(kwargs: dict) -> bool:
    """The layer's scores need what neither the varlen kernel nor sdpa computes: logit soft-capping
    (Gemma-2's `softcap`) or attention sinks (GPT-OSS's `s_aux`, a learned logit per head in the softmax).
    Dropping either would train a different model silently."""
    return kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None


def layer_window(kwargs: dict) -> int | None:
    """The layer's sliding window (transformers passes `sliding_window` to the attention function of the layers that
    have one), None for a full layer. The planner's count of such layers is ModelArch.sliding_layers."""
    return kwargs.get("sliding_window") or None


def layer_falls_back(kwargs: dict) -> bool:
    """The layer asks for what the varlen kernel does not do: logit soft-capping or attention sinks, or a sliding window
    where this torch's kernel has none (`takes_windows`). The planner's torch-free copy of this rule is
    finetune.plan.workload.varlen_fallback_layers (it plans those layers over the masked packed row; the windows by
    torch's version); change both together."""
    return needs_model_eager(kwargs) or (layer_window(kwargs) is not None and not takes_windows())


def _model_eager(module, query, key, value, attention_mask, **kwargs):
    """A layer with soft-capping or sinks (`needs_model_eager`) runs its model's own eager attention (newer
    transformers refuse sdpa for them, older ones dropped the soft-cap silently; when varlen was asked for
    explicitly), with the additive float mask eager expects in place of sdpa's boolean one (or of none,
    which sdpa reads as plain causal)."""
    import torch

    eager = importlib.import_module(type(module).__module__).eager_attention_forward
    mask = attention_mask
    if mask is None:
        q_len, k_len = query.shape[2], key.shape[2]
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)[None, None]
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min
        )
    return eager(module, query, key, value, mask, **kwargs)


def varlen_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """AttentionInterface signature: q/k/v are (batch, heads, seq, head_dim); returns (b, s, h, d)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kernel = _varlen()
    bounds = _packed_bounds(query, key, kwargs)
    sliding = layer_window(kwargs)
    causal = is_causal if is_causal is not None else module.is_causal
    plain = (
        kernel is None
        or bounds is None
        or not query.is_cuda
        or dropout
        or query.dtype not in (torch.bfloat16, torch.float16)
        or layer_falls_back(kwargs)
        or not causal
    )
    if sliding is not None and bounds is not None and not takes_windows():
        warnings.warn(  # shown once: the same call site every layer
            f"this torch's varlen kernel has no sliding window (torch {VARLEN_WINDOW_RELEASE} and "
            "later have one): the sliding-window "
            "layers run sdpa over the masked packed row, as `finetune plan` plans them with this torch (a plan made "
            "where torch has the window assumed it)",
            stacklevel=2,
        )
    if plain and causal and attention_mask is None and bounds is not None:  # the mask `packed_row_mask` did not build
        attention_mask = _bounds_mask(bounds[0], query.shape[2], sliding, query.device)
    if plain and needs_model_eager(kwargs):
        return _model_eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    cu_seq_lens, max_length = bounds
    # (1, h, t, d) -> (t, h, d): a view; the kernel needs only the last dimension contiguous
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    head_dim, value_dim = q.shape[-1], v.shape[-1]
    if value_dim != head_dim:
        # the flash kernel takes one head size for q, k and v: MLA's values (DeepSeek-V2/V3: 128 against the
        # queries' 192) are padded with zeros to it and the output cropped back, as transformers' flash path does
        out, _ = varlen_attention_forward(
            module,
            query,
            key,
            torch.nn.functional.pad(value, [0, head_dim - value_dim]),
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
        return out[..., :value_dim], None
    cu = cu_seq_lens.to(device=q.device, dtype=torch.int32)
    # cuDNN's causal kernel has no window: a sliding layer's long examples stay on the varlen kernel
    if _LONG_ON_CUDNN["on"] and max_length >= CUDNN_MIN_EXAMPLE_TOKENS and sliding is None:
        return _with_long_examples_on_cudnn(query, key, value, cu, _example_bounds(cu_seq_lens), scaling), None
    window = window_arguments(sliding, max_length)
    return _varlen_call(q, k, v, cu, max_length, scaling, causal=window).unsqueeze(0), None


def _varlen_call(q, k, v, cu, max_length: int, scaling, *, causal: dict | None = None):
    """The varlen kernel on (t, h, d) queries, keys and values of examples bounded by `cu`: (t, h, d). `causal`: the
    kernel's causal (or sliding-window) arguments, `window_arguments`; plain causal by default."""
    varlen_attn, plain_causal, has_gqa = _varlen()
    causal = causal or plain_causal
    args = (cu, cu, max_length, max_length)
    gqa = {}
    if k.shape[1] != q.shape[1]:
        if has_gqa:
            gqa = {"enable_gqa": True}
        elif _KV_HEADS_TAKEN.get("native", True):
            # torch without the enable_gqa switch: its flash kernel takes fewer key/value heads (flash-attn 2's
            # GQA) unless the Python wrapper refuses them; repeating them costs two copies of a query-sized
            # tensor per layer, their kept copies and a sum over the groups in the backward
            try:
                out = varlen_attn(q, k, v, *args, scale=scaling, **causal)
                _KV_HEADS_TAKEN["native"] = True
                return out
            except ValueError:  # the head-count check, raised before any kernel runs
                _KV_HEADS_TAKEN["native"] = False
        if not gqa:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return varlen_attn(q, k, v, *args, scale=scaling, **causal, **gqa)


# the example bounds of the micro-batch being run: cu_seq_lens is one device tensor that every layer (and a
# checkpointed layer's recompute) gets, so its bounds are read to the host once a micro-batch, not once a layer
_BOUNDS: dict[str, object] = {}


def _example_bounds(cu_seq_lens) -> list[int]:
    if _BOUNDS.get("tensor") is not cu_seq_lens:
        _BOUNDS.update(tensor=cu_seq_lens, bounds=[int(b) for b in cu_seq_lens.tolist()])
    return _BOUNDS["bounds"]  # type: ignore[return-value]


def _with_long_examples_on_cudnn(query, key, value, cu, bounds: list[int], scaling):
    """A packed row's attention with each example of at least CUDNN_MIN_EXAMPLE_TOKENS on cuDNN's causal kernel and
    each run of shorter ones on the varlen kernel, in row order: (1, t, h, d). query/key/value: (1, h, t, d)."""
    import torch
    import torch.nn.functional as F  # noqa: N812
    from torch.nn.attention import SDPBackend, sdpa_kernel

    parts, start = [], 0  # `start`: the first example of the run of short ones not yet computed
    edges = list(zip(bounds, bounds[1:]))

    def short_run(upto: int) -> None:
        if upto > start:
            lo, hi = edges[start][0], edges[upto - 1][1]
            # copies, not views: the varlen kernel keeps its inputs for the backward, and a view would keep the
            # whole row's queries, keys and values alive beside the long examples' padded copies
            q, k, v = (x[0, :, lo:hi].transpose(0, 1).clone() for x in (query, key, value))
            longest = max(b - a for a, b in edges[start:upto])
            parts.append(_varlen_call(q, k, v, cu[start : upto + 1] - lo, longest, scaling))

    for i, (lo, hi) in enumerate(edges):
        tokens = hi - lo
        if tokens < CUDNN_MIN_EXAMPLE_TOKENS:
            continue
        short_run(i)
        start = i + 1
        pad = cudnn_padded_length(tokens) - tokens
        # the example's rows token-major (1, t, h, d), zero-padded at the end, seen as (1, h, t, d): the layout the
        # output projection reads, where cuDNN writes its output in its query's
        q, k, v = (
            F.pad(x.transpose(1, 2)[:, lo:hi], (0, 0, 0, 0, 0, pad)).transpose(1, 2) for x in (query, key, value)
        )
        # cuDNN first; flash-attention 2 (the varlen kernel's algorithm) where cuDNN does not take the shape
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scaling, enable_gqa=k.shape[1] != q.shape[1]
            )
        parts.append(out.transpose(1, 2)[0, :tokens])
    short_run(len(edges))
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).unsqueeze(0)


# whether this torch's varlen_attn (one without enable_gqa) took fewer key/value heads than query heads;
# learned on the first such call of the process
_KV_HEADS_TAKEN: dict[str, bool] = {}


# how a run's memory report and its calibration row name the two paths (the planner's Job.varlen_repeats_kv)
KV_HEADS_NATIVE, KV_HEADS_REPEATED = "native", "repeated"
# how they say transformers built no packed-row mask (`packed_row_mask`; the planner's Job.builds_packed_row_mask)
PACKED_ROW_MASKS_SKIPPED = "skipped"


def native_gqa() -> bool | None:
    """Grouped key/value heads go to the kernel as they are (True) or repeated (False); None: not yet known."""
    kernel = _varlen()
    if kernel is not None and kernel[2]:
        return True
    return _KV_HEADS_TAKEN.get("native")


def kv_heads() -> str | None:
    """KV_HEADS_NATIVE or KV_HEADS_REPEATED for this process so far; None: not yet known."""
    native = native_gqa()
    return None if native is None else KV_HEADS_NATIVE if native else KV_HEADS_REPEATED

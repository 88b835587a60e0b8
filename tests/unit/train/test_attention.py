"""finetune/train/attention.py: packed rows on torch's varlen flash kernel, everything else on sdpa.

The kernel needs CUDA, so the equivalence test is in tests/gpu/test_attention.py; the routing (which batches take the
varlen path, that the fallback is transformers' own sdpa) is checked on CPU with a real Llama layer.
"""

from __future__ import annotations

import torch

from finetune.train import attention
from tests.helpers.attention import AttentionModule, packed
from tests.helpers.paths import TINY_MODEL


def test_bounds_only_for_one_packed_row():
    q, k, _, kwargs = packed([3, 5])
    assert attention._packed_bounds(q, k, kwargs)[1] == 5
    assert attention._packed_bounds(q, k, {}) is None  # no boundaries: not packed
    assert attention._packed_bounds(q.expand(2, -1, -1, -1), k, kwargs) is None  # padded batch of rows
    assert attention._packed_bounds(q[:, :, :1], k, kwargs) is None  # one query against a cache


def test_without_boundaries_it_is_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v, _ = packed([6])
    ours, _ = attention.varlen_attention_forward(AttentionModule(), q, k, v, None, scaling=0.25)
    theirs, _ = sdpa_attention_forward(AttentionModule(), q, k, v, None, scaling=0.25)
    torch.testing.assert_close(ours, theirs)


def test_registered_name_loads_a_model():
    from transformers import AutoModelForCausalLM

    name = attention.register()
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, attn_implementation=name)
    assert model.config._attn_implementation == name
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():  # CPU: the fallback path, same logits as sdpa
        ours = model(ids).logits
        model.set_attn_implementation("sdpa")
        assert torch.allclose(ours, model(ids).logits, atol=1e-5)


def test_a_layer_with_attention_sinks_runs_its_models_eager_attention():
    """GPT-OSS passes its sinks as `s_aux`: sdpa and the varlen kernel would drop them and train another
    model silently, so such a layer takes the model's own eager attention (on CUDA too: layer_falls_back)."""
    from transformers import GptOssConfig
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, eager_attention_forward

    config = GptOssConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1
    )
    module = GptOssAttention(config, 0)
    torch.nn.init.normal_(module.sinks, std=2.0)
    q, k, v = (torch.randn(1, heads, 6, 16) for heads in (4, 2, 2))
    causal = torch.zeros(1, 1, 6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    kwargs = dict(scaling=0.25, s_aux=module.sinks)
    assert attention.layer_falls_back(kwargs) and attention.needs_model_eager(kwargs)
    ours, _ = attention.varlen_attention_forward(module, q, k, v, None, **kwargs)
    theirs, _ = eager_attention_forward(module, q, k, v, causal, **kwargs)
    torch.testing.assert_close(ours, theirs)
    without_sinks, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.25, is_causal=True)
    assert not torch.allclose(ours, without_sinks, atol=1e-3)  # the sinks change the output


def test_a_sliding_window_reaches_the_kernel_as_flash_attentions_left_window():
    """transformers' window w lets a query see itself and w - 1 keys before it (masking_utils'
    sliding_window_overlay: kv > q - w); flash-attention's (left, right) window sees `left` keys before, so w - 1.
    A window no example of the row outgrows is the kernel's plain causal path."""
    from transformers.masking_utils import sliding_window_overlay

    if not attention.takes_windows():
        import pytest

        pytest.skip(f"torch {torch.__version__}'s varlen_attn has no window_size")
    assert attention.window_arguments(1024, 4096) == {"window_size": (1023, 0)}
    assert attention.window_arguments(4096, 4096) == attention.window_arguments(None, 4096) == {"window_size": (-1, 0)}
    seen = [k for k in range(10) if sliding_window_overlay(4)(0, 0, 9, k)]
    left = attention.window_arguments(4, 10)["window_size"][0]
    assert seen == list(range(9 - left, 10))  # the same keys: the query's own and `left` before it
    # a sliding layer takes the kernel; a soft-capped or sink layer does not
    assert attention.layer_window({"sliding_window": 1024}) == 1024 and attention.layer_window({}) is None
    assert not attention.layer_falls_back({"sliding_window": 1024})
    assert attention.layer_falls_back({"softcap": 50.0})


def test_a_bounds_mask_is_built_for_causal_layers_only():
    """A falling-back layer with a packed row's bounds and no mask gets the block-diagonal causal mask built from
    the bounds; a non-causal layer (no mask from transformers: a bidirectional one) is left to sdpa as it was."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tests.helpers.attention import block_causal_reference

    q, k, v, kwargs = packed([3, 5])
    ours, _ = attention.varlen_attention_forward(AttentionModule(), q, k, v, None, scaling=0.25, **kwargs)
    torch.testing.assert_close(ours, block_causal_reference(q, k, v, [3, 5]))  # 0.25: sdpa's own scale at 16

    class Bidirectional(AttentionModule):
        is_causal = False

    ours, _ = attention.varlen_attention_forward(Bidirectional(), q, k, v, None, scaling=0.25, **kwargs)
    theirs, _ = sdpa_attention_forward(Bidirectional(), q, k, v, None, scaling=0.25)
    torch.testing.assert_close(ours, theirs)

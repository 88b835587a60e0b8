"""DoRA on a bitsandbytes 4-bit base (finetune/train/quantized_dora.py): finetune registers peft's 4-/8-bit LoRA
layers' subclasses that return the input's dtype. On CPU, where peft's bnb layers already cast back (CUDA autocast
is off), the subclass must be exactly peft's layer: same outputs, gradients, parameters and saved adapter; the case
it exists for (CUDA autocast) is tests/gpu/test_gpu.py's."""

from __future__ import annotations

import pytest
import torch

from finetune.recipe import load_recipe
from finetune.train.model import lora_config
from tests.helpers.quantized_dora import quantized_dora
from tests.helpers.recipes import tiny_recipe

bnb = pytest.importorskip("bitsandbytes")


@pytest.mark.parametrize(
    ("section", "registered"),
    [
        ({"type": "qlora", "dora": True}, True),
        ({"type": "lora", "dora": True, "load_in_8bit": True}, True),
        ({"type": "qlora"}, False),
        ({"type": "lora", "dora": True}, False),
    ],
)
def test_registered_for_dora_on_a_quantized_base_only(section, registered):
    from finetune.train.quantized_dora import QuantizedDoraLinear4bit, QuantizedDoraLinear8bitLt

    config = lora_config(load_recipe(tiny_recipe(adapter=section | {"compute_dtype": "float32"})))
    custom = config._custom_modules or {}
    assert (custom.get(bnb.nn.Linear4bit) is QuantizedDoraLinear4bit) is registered
    assert (custom.get(bnb.nn.Linear8bitLt) is QuantizedDoraLinear8bitLt) is registered


def test_it_is_peft_s_layer_on_cpu(tmp_path):
    from finetune.train.quantized_dora import QuantizedDoraLinear4bit

    models = {ours: quantized_dora(tmp_path, ours=ours) for ours in (True, False)}
    adapted = [m for m in models[True].modules() if isinstance(m, QuantizedDoraLinear4bit)]
    assert len(adapted) == 2 * 7
    assert {n: p.dtype for n, p in models[True].named_parameters()} == {
        n: p.dtype for n, p in models[False].named_parameters()
    }
    ids = torch.randint(3, 120, (2, 16), generator=torch.Generator().manual_seed(2))
    outputs, grads = {}, {}
    for ours, model in models.items():
        torch.manual_seed(3)  # the same dropout masks
        logits = model(input_ids=ids).logits
        logits.float().sum().backward()
        outputs[ours] = logits
        grads[ours] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    torch.testing.assert_close(outputs[True], outputs[False])
    assert grads[True].keys() == grads[False].keys()
    for name in grads[True]:
        torch.testing.assert_close(grads[True][name], grads[False][name])
    models[True].save_pretrained(tmp_path / "adapter")
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    plain = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    assert not any(isinstance(m, QuantizedDoraLinear4bit) for m in plain.modules())

"""finetune/compat: each upstream workaround still needed, and working."""

import os
import warnings

import pytest
import torch

from finetune.compat import bnb_cpu_packing

bnb_affected = pytest.mark.skipif(not bnb_cpu_packing.affected(), reason="bitsandbytes not affected")


def _qlora_model(tiny_model_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=torch.float32,
    )
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, quantization_config=quant, dtype=torch.float32)
    return base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")


def _eval_then_train(model) -> tuple[list[str], torch.Tensor]:
    ids = torch.randint(3, 300, (2, 16))
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)  # an evaluation: bitsandbytes may repack the weights here
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=ids, labels=ids).loss.backward()
    first_layer_grad = next(
        p.grad for n, p in model.named_parameters() if "layers.0." in n and "lora_B" in n and "q_proj" in n
    )  # lora_A grads are 0 at init
    return [str(w.message) for w in caught], first_layer_grad


def _cpu_repacks(base) -> bool:
    import bitsandbytes as bnb

    return any(
        getattr(m, "support_avx512bf16_for_cpu", False) for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)
    )


@bnb_affected
def test_upstream_still_repacks_after_eval(tiny_model_path):
    """If this fails, bitsandbytes fixed it: delete finetune/compat/bnb_cpu_packing.py."""
    from peft import get_peft_model

    base, lora = _qlora_model(tiny_model_path)
    if not _cpu_repacks(base):
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes never repacks here")
    messages, _ = _eval_then_train(get_peft_model(base, lora))
    assert any("gemv_4bit" in m for m in messages)


@bnb_affected
def test_keep_trainable_layout_gives_gradients_after_eval(tiny_model_path):
    from peft import get_peft_model

    base, lora = _qlora_model(tiny_model_path)
    assert bnb_cpu_packing.keep_trainable_layout(base) > 0
    model = get_peft_model(base, lora)
    messages, grad = _eval_then_train(model)
    assert not any("gemv_4bit" in m for m in messages)
    assert grad is not None and grad.abs().sum() > 0


def test_deepspeed_reads_the_arch_list_after_the_workaround(monkeypatch):
    """deepspeed_arch_list: DeepSpeed's JIT builder fails on "9.0a" (a Hopper image's value) and reads
    the rewritten list; lists it can read already are left as they are."""
    from finetune.compat import deepspeed_arch_list as compat

    if not compat.affected():
        pytest.skip("deepspeed not installed or newer than the affected versions")
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder

    class Probe(CUDAOpBuilder):  # the real arch-list code path, on a builder with nothing to compile
        def __init__(self):
            super().__init__(name="probe")
            self.jit_mode = True

        def absolute_name(self):
            return "probe"

        def sources(self):
            return []

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a 10.0f+PTX;9.0")
    with pytest.raises(ValueError, match="0a"):
        Probe().compute_capability_args()  # still needed: remove the module once this stops raising
    note = compat.make_arch_list_readable()
    assert note and "9.0a" in note
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0;10.0+PTX"
    Probe().compute_capability_args()
    assert compat.make_arch_list_readable() is None  # readable now: untouched
    assert compat.readable_arch_list("7.5;8.6+PTX") is None

"""finetune.merging on a real tiny Llama + real peft adapters (LoRA and DoRA), offline."""

from __future__ import annotations

import json
import os
import shutil

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from finetune.merging import MergeError, merge  # noqa: E402
from tests.helpers.run_dirs import tree_hashes, variant_run  # noqa: E402


@pytest.fixture(scope="module")
def runs(tiny_runs):
    return tiny_runs


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _reference_and_merged(runs, run, out, dtype):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    base = AutoModelForCausalLM.from_pretrained(runs["base"], dtype=torch_dtype)
    ids = torch.randint(4, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    plain = _logits(base, ids)
    peft_model = PeftModel.from_pretrained(base, str(run))
    reference = _logits(peft_model, ids)
    merge(run, out, dtype=dtype, max_shard_size="200KB")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch_dtype)
    return plain, reference, _logits(merged, ids)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_merged_logits_match_peft_fp32(runs, tmp_path, kind):
    import torch

    plain, reference, merged = _reference_and_merged(runs, runs[kind], tmp_path / "out", "float32")
    # the adapter really changes the model, so matching it is not trivially true
    assert (reference - plain).abs().max() > 1e-2
    torch.testing.assert_close(merged, reference, atol=1e-4, rtol=1e-4)


def test_merged_logits_match_peft_bf16(runs, tmp_path):
    import torch

    plain, reference, merged = _reference_and_merged(runs, runs["lora"], tmp_path / "out", "bfloat16")
    assert (reference - plain).abs().max() > 5e-2
    # bf16 has 8 mantissa bits; merged vs unmerged differ by rounding of W + BA vs W x + BAx
    torch.testing.assert_close(merged, reference, atol=5e-2, rtol=2e-2)
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "out").dtype in ("bfloat16", torch.bfloat16)


def test_output_is_a_plain_sharded_model(runs, tmp_path):
    out = merge(runs["lora"], tmp_path / "merged", max_shard_size="100KB")
    names = sorted(p.name for p in out.iterdir())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = {p for p in names if p.startswith("model-") and p.endswith(".safetensors")}
    assert len(shards) > 1 and set(index["weight_map"].values()) == shards
    assert not any("lora" in key for key in index["weight_map"])
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(names)
    assert "adapter_config.json" not in names
    # the tokenizer is copied byte for byte from the run
    assert (out / "tokenizer.json").read_bytes() == (runs["lora"] / "tokenizer.json").read_bytes()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out)("hello world")["input_ids"]


def test_run_dir_is_untouched_and_no_temp_left(runs, tmp_path):
    before = tree_hashes(runs["lora"])
    merge(runs["lora"], tmp_path / "merged")
    assert tree_hashes(runs["lora"]) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


def test_refuses_full_fine_tune(runs, tmp_path):
    with pytest.raises(MergeError) as info:
        merge(runs["full"], tmp_path / "out")
    text = info.value.render()
    assert "nothing to merge" in text and "full fine-tune" in text and "finetune push" in text
    assert not (tmp_path / "out").exists()


def test_refuses_non_empty_output_and_keeps_it(runs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(MergeError, match="already exists"):
        merge(runs["lora"], out)
    assert (out / "keep.txt").read_text() == "mine"


def test_failure_leaves_no_partial_output(runs, tmp_path):
    broken = tmp_path / "run"
    shutil.copytree(runs["lora"], broken)
    # a truncated adapter: loading fails after the base model is already in memory
    data = (broken / "adapter_model.safetensors").read_bytes()
    (broken / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(MergeError, match="cannot load the adapter"):
        merge(broken, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_refuses_to_write_over_the_run_dir(runs):
    for target in (runs["lora"], runs["lora"] / "checkpoints" / "merged"):
        with pytest.raises(MergeError, match="overwrite the run's own files"):
            merge(runs["lora"], target)


def test_qlora_merges_into_unquantized_base_in_compute_dtype(runs, tmp_path):
    """QLoRA: the base is loaded unquantised in adapter.compute_dtype (bf16 here) and merged."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = variant_run(
        runs["lora"],
        tmp_path / "run-qlora",
        adapter={"type": "qlora", "compute_dtype": "bfloat16"},
        train={"precision": "bf16"},
    )
    out = merge(run, tmp_path / "out")
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.dtype == torch.bfloat16  # the recipe's model.dtype is float32: compute dtype won
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    ids = torch.randint(4, merged.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(5))
    base = AutoModelForCausalLM.from_pretrained(runs["base"], dtype=torch.bfloat16)
    reference = _logits(PeftModel.from_pretrained(base, str(run)), ids)
    torch.testing.assert_close(_logits(merged, ids), reference, atol=5e-2, rtol=2e-2)


def _peft_adapter_run(runs, run_dir, **lora):
    """A run dir holding a non-trivial peft adapter (B != 0) made directly with peft on the tiny base."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(runs["base"], dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora))
    model.save_pretrained(run_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(runs["lora"] / name, run_dir / name)
    return run_dir


def test_streaming_merge_honours_rslora_and_rank_patterns(runs, tmp_path):
    """rsLoRA scaling and per-module rank/alpha patterns come from peft's own layers, not our arithmetic."""
    import torch

    run = _peft_adapter_run(
        runs,
        tmp_path / "run",
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"down_proj": 4},
        alpha_pattern={"v_proj": 3},
    )
    plain, reference, merged = _reference_and_merged(runs, run, tmp_path / "out", "float32")
    assert (reference - plain).abs().max() > 1e-2
    torch.testing.assert_close(merged, reference, atol=1e-4, rtol=1e-4)


def test_merge_streams_tensor_by_tensor(runs, tmp_path):
    """The default path never builds the model: every targeted module is merged from the shards."""
    from finetune import merge_stream

    out = tmp_path / "out"
    out.mkdir()
    n = merge_stream.merge_checkpoint(
        base_dir=runs["base"], run_dir=runs["lora"], out=out, dtype="float32", max_shard_size="100KB"
    )
    adapter = json.loads((runs["lora"] / "adapter_config.json").read_text())
    layers = json.loads((runs["base"] / "config.json").read_text())["num_hidden_layers"]
    assert n == layers * len(adapter["target_modules"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # shards were cut at max_shard_size


def test_modules_to_save_falls_back_to_peft_whole_model_merge(runs, tmp_path):
    import torch

    run = _peft_adapter_run(runs, tmp_path / "run", r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    plain, reference, merged = _reference_and_merged(runs, run, tmp_path / "out", "float32")
    torch.testing.assert_close(merged, reference, atol=1e-4, rtol=1e-4)

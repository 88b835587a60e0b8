"""Registries: every YAML validates, preset names, config.json derivation, user preset files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.errors import RecipeError
from finetune.recipe.schema import ModelSection
from finetune.registry import (
    REGISTRY_DIR,
    get_model,
    get_preset,
    list_models,
    list_presets,
    load_yaml_as,
    resolve_model,
)
from finetune.registry.detect import parse_nvidia_smi, synthesize_preset, visible_gpus
from finetune.registry.schema import HardwarePreset, ModelArch
from tests.helpers.paths import ROOT

PRESET_NAMES = {
    "cpu",
    "workstation-1x4090",
    "workstation-2x4090",
    "workstation-4x4090",
    "workstation-1x5090",
    "workstation-2x5090",
    "workstation-4xrtxpro6000",
    "server-8xh100",
    "server-8xh200",
    "server-8xb200",
    "server-8xmi300x",
    "cluster-2x8xh100",
    "cluster-4x8xh100",
    "cluster-2x8xrtxpro6000",
}
ALL_YAML = sorted(REGISTRY_DIR.rglob("*.yaml"))


def test_registry_has_yaml_files():
    assert len(ALL_YAML) >= 21 + len(PRESET_NAMES)


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: str(p.relative_to(REGISTRY_DIR)))
def test_every_registry_yaml_validates(path):
    schema = HardwarePreset if "hardware" in path.parts else ModelArch
    entry = load_yaml_as(path, schema)
    # the file name is the key, so `finetune models`/`presets` and file names never disagree
    assert path.stem == (entry.name if schema is HardwarePreset else entry.key)


def test_preset_names_are_exactly_the_listed_ones():
    assert {p.name for p in list_presets()} == PRESET_NAMES


def test_presets_are_self_consistent():
    for p in list_presets():
        assert (p.nodes > 1) == (p.inter_node_fabric != "none"), p.name
        assert (p.nodes > 1) == (p.inter_node_bandwidth_gbps > 0), p.name
        assert "NCCL_NVLS_ENABLE" not in p.nccl_env or p.nccl_env["NCCL_NVLS_ENABLE"] == "0"
        if p.nvme_path:
            assert p.nvme_bandwidth_gbps > 0, p.name
    cpu = get_preset("cpu")
    assert cpu.vendor == "cpu" and cpu.gpus_per_node == 1 and cpu.nvme_path is None


def test_published_model_numbers():
    # spot checks against the models' config.json (the numbers people get wrong most often)
    l8 = get_model("llama-3.1-8b")
    assert (l8.vocab_size, l8.num_kv_heads, l8.intermediate_size, l8.tied_embeddings) == (128256, 8, 14336, False)
    assert get_model("llama-3.2-1b").tied_embeddings and get_model("llama-3.2-3b").tied_embeddings
    assert get_model("qwen2.5-7b").vocab_size == 152064 and get_model("qwen3-8b").vocab_size == 151936
    assert get_model("qwen2.5-72b").intermediate_size == 29568
    assert get_model("gemma-2-9b").head_dim == 256 and get_model("gemma-3-27b").vocab_size == 262208
    assert get_model("mixtral-8x7b").num_experts == 8
    assert get_model("llama-3.1-405b").num_layers == 126
    # Llama 3 is 3.1's shape with an 8k context; Mistral v0.1 slides a 4k window over every layer (v0.3 does not)
    assert get_model("llama-3-8b").max_position_embeddings == 8192 == get_model("llama-3-70b").max_position_embeddings
    assert (get_model("mistral-7b-v0.1").vocab_size, get_model("mistral-7b-v0.1").sliding_window) == (32000, 4096)
    assert len(list_models()) == 24


def test_hub_id_matching_is_case_insensitive(tmp_path):
    arch = resolve_model(ModelSection(name="META-LLAMA/llama-3.1-70b-instruct"), base_dir=tmp_path)
    assert arch.key == "llama-3.1-70b"
    assert resolve_model(ModelSection(name="whatever", arch="qwen3-14b"), base_dir=tmp_path).key == "qwen3-14b"


def _write_config(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_derive_llama_config_defaults_kv_heads(tmp_path):
    _write_config(
        tmp_path / "my-llama",
        {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 256,
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "intermediate_size": 688,
            "vocab_size": 1000,
        },
    )
    arch = resolve_model(ModelSection(name="my-llama"), base_dir=tmp_path)
    assert arch.key == "my-llama" and arch.family == "llama"
    assert arch.num_kv_heads == 8  # no num_key_value_heads: multi-head attention
    assert arch.decoder_layer_class == "LlamaDecoderLayer" and not arch.tied_embeddings
    assert arch.checkpoint_dtype is None  # config.json says nothing: the planner counts a converted copy


@pytest.mark.parametrize(
    ("keys", "stored"),
    [
        ({"torch_dtype": "bfloat16"}, "bfloat16"),  # transformers 4's key
        ({"dtype": "float32"}, "float32"),  # transformers 5's
        ({"torch_dtype": "float8_e4m3fn"}, None),  # an FP8 checkpoint: no model loads in it
    ],
)
def test_derive_reads_the_dtype_the_weights_are_stored_in(tmp_path, keys, stored):
    config = {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "intermediate_size": 688,
        "vocab_size": 1000,
    }
    _write_config(tmp_path / "m", {**config, **keys})
    assert resolve_model(ModelSection(name="m"), base_dir=tmp_path).checkpoint_dtype == stored


def test_derive_qwen2_config(tmp_path):
    _write_config(
        tmp_path / "q",
        {
            "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"],
            "hidden_size": 896,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "intermediate_size": 4864,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
        },
    )
    arch = resolve_model(ModelSection(name=str(tmp_path / "q")), base_dir=Path("/"))
    assert (arch.num_kv_heads, arch.tied_embeddings, arch.attention_bias) == (2, True, True)
    assert arch.decoder_layer_class == "Qwen2DecoderLayer"


def test_derive_gemma3_text_config_nesting(tmp_path):
    _write_config(
        tmp_path / "g3",
        {
            "model_type": "gemma3",
            "architectures": ["Gemma3ForConditionalGeneration"],
            "text_config": {
                "model_type": "gemma3_text",
                "hidden_size": 3840,
                "num_hidden_layers": 48,
                "num_attention_heads": 16,
                "num_key_value_heads": 8,
                "head_dim": 256,
                "intermediate_size": 15360,
                "vocab_size": 262208,
            },
            "vision_config": {"hidden_size": 1152},
        },
    )
    arch = resolve_model(ModelSection(name="g3"), base_dir=tmp_path)
    registry = get_model("gemma-3-12b")
    for field in (
        "hidden_size",
        "num_layers",
        "num_attention_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "tied_embeddings",
        "decoder_layer_class",
    ):
        assert getattr(arch, field) == getattr(registry, field), field


def test_derive_gemma2_and_mixtral(tmp_path):
    _write_config(
        tmp_path / "g2",
        {
            "model_type": "gemma2",
            "hidden_size": 3584,
            "num_hidden_layers": 42,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 256,
            "intermediate_size": 14336,
            "vocab_size": 256000,
        },
    )
    g2 = resolve_model(ModelSection(name="g2"), base_dir=tmp_path)
    assert g2.tied_embeddings and g2.head_dim == 256 and g2.decoder_layer_class == "Gemma2DecoderLayer"
    _write_config(
        tmp_path / "mx",
        {
            "model_type": "mixtral",
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "vocab_size": 32000,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
        },
    )
    mx = resolve_model(ModelSection(name="mx"), base_dir=tmp_path)
    assert (mx.num_experts, mx.experts_per_token) == (8, 2)


def test_tiny_llama_registry_agrees_with_its_config_json():
    config = ROOT / "data" / "tiny-llama" / "config.json"
    if not config.is_file():
        pytest.skip("data/tiny-llama not built")
    derived = resolve_model(ModelSection(name="data/tiny-llama"), base_dir=ROOT)
    registry = get_model("tiny-llama")
    assert derived.key == "tiny-llama"
    for field in (
        "family",
        "hidden_size",
        "num_layers",
        "num_attention_heads",
        "num_kv_heads",
        "intermediate_size",
        "vocab_size",
        "tied_embeddings",
        "decoder_layer_class",
    ):
        assert getattr(derived, field) == getattr(registry, field), field


def test_unknown_model_error_names_the_key_and_suggests(tmp_path):
    with pytest.raises(RecipeError) as err:
        resolve_model(ModelSection(name="meta-llama/Llama-3.1-8B-Instruc"), base_dir=tmp_path)
    text = err.value.render()
    assert "model.name" in text and "Llama-3.1-8B-Instruc" in text
    assert "did you mean meta-llama/Llama-3.1-8B-Instruct?" in text and "model.arch" in text
    with pytest.raises(RecipeError, match="did you mean llama-3.1-8b"):
        get_model("llama-3.1-8")


def test_unknown_preset_did_you_mean():
    with pytest.raises(RecipeError) as err:
        get_preset("server-8xh10")
    assert err.value.key == "hardware" and "did you mean server-8xh100?" in err.value.render()


def test_user_preset_file(tmp_path):
    (tmp_path / "lab.yaml").write_text(
        "name: lab-2xa100\ngpu_model: NVIDIA A100 80GB\ngpu_memory_gib: 79\ngpus_per_node: 2\n"
        "intra_node_bandwidth_gbps: 200\nhost_ram_gib: 512\npeak_bf16_tflops: 312\n"
    )
    preset = get_preset("lab.yaml", base_dir=tmp_path)
    assert (preset.name, preset.world_size) == ("lab-2xa100", 2)


def test_bad_user_preset_file_names_file_and_key(tmp_path):
    good = (
        "name: x\ngpu_model: y\ngpu_memory_gib: 80\ngpus_per_node: 2\n"
        "intra_node_bandwidth_gbps: 200\nhost_ram_gib: 512\npeak_bf16_tflops: 312\n"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text(good + "nvme_pth: /scratch\n")
    with pytest.raises(RecipeError) as err:
        get_preset(str(bad))
    assert err.value.file == str(bad) and err.value.key == "nvme_pth"
    assert "did you mean nvme_path?" in err.value.render()
    wrong_type = tmp_path / "wrong.yaml"
    wrong_type.write_text(good.replace("gpu_memory_gib: 80", "gpu_memory_gib: lots"))
    with pytest.raises(RecipeError) as err:
        get_preset("wrong.yaml", base_dir=tmp_path)
    assert err.value.file.endswith("wrong.yaml") and err.value.key == "gpu_memory_gib"
    with pytest.raises(RecipeError, match="not found"):
        get_preset("missing.yaml", base_dir=tmp_path)


def test_auto_detection_maps_gpus_to_preset_numbers():
    gpus = parse_nvidia_smi("NVIDIA H100 80GB HBM3, 81559 MiB\nNVIDIA H100 80GB HBM3, 81559 MiB\n")
    preset = synthesize_preset(gpus, ram_gib=1000)
    h100 = get_preset("server-8xh100")
    assert preset.gpus_per_node == 2 and abs(preset.gpu_memory_gib - 79.1) < 0.2
    assert preset.peak_bf16_tflops == h100.peak_bf16_tflops and preset.intra_node_link == "nvlink"
    unknown = synthesize_preset([("Some Future GPU", 48.0)], ram_gib=64)
    assert unknown.gpu_memory_gib == 47.5 and unknown.peak_bf16_tflops > 0
    cpu = synthesize_preset([], ram_gib=32)
    assert cpu.name == "cpu" and cpu.vendor == "cpu" and cpu.gpu_memory_gib <= 32


def test_a_node_of_mixed_gpus_is_planned_as_its_smallest_and_slowest_card():
    """Every rank waits for the slowest GPU at each collective, and the plan must fit the smallest: a 4090 (24 GB)
    with a 5090 (32 GB) is planned as two 4090s, over PCIe (NVLink does not join different models)."""
    gpus = parse_nvidia_smi("NVIDIA GeForce RTX 5090, 32607 MiB\nNVIDIA GeForce RTX 4090, 24564 MiB\n")
    preset = synthesize_preset(gpus, ram_gib=128)
    rtx4090 = get_preset("workstation-1x4090")
    assert preset.gpus_per_node == 2 and preset.gpu_memory_gib == pytest.approx(23.5, abs=0.1)
    assert preset.peak_bf16_tflops == rtx4090.peak_bf16_tflops and preset.intra_node_link == "pcie"
    assert preset.gpu_model == "NVIDIA GeForce RTX 4090" and preset.name.endswith("-mixed")
    assert "1 x NVIDIA GeForce RTX 5090" in preset.description and "planned as 2 x" in preset.description
    h100s = synthesize_preset(parse_nvidia_smi("NVIDIA H100 80GB HBM3, 81559 MiB\n" * 2), ram_gib=1000)
    with_unknown = synthesize_preset([("NVIDIA H100 80GB HBM3", 79.6), ("Some Future GPU", 96.0)], ram_gib=1000)
    assert h100s.intra_node_link == "nvlink" and not h100s.name.endswith("-mixed")
    assert with_unknown.peak_bf16_tflops < h100s.peak_bf16_tflops and with_unknown.gpu_memory_gib < 79.6


def test_auto_detection_honours_cuda_visible_devices():
    """nvidia-smi lists the whole host; a job pinned to some GPUs must plan and launch for those only."""
    rows = [(str(i), f"GPU-{i}aaa-uuid", "NVIDIA H100 80GB HBM3", 79.6) for i in range(4)]
    assert len(visible_gpus(rows, None)) == 4
    assert len(visible_gpus(rows, "0,1")) == 2
    assert len(visible_gpus(rows, "3, GPU-2aaa")) == 2  # indices and UUID prefixes, in CUDA's order
    assert visible_gpus(rows, "") == [] and visible_gpus(rows, "-1") == []  # no GPU: the cpu preset
    assert len(visible_gpus(rows, "1,7,2")) == 1  # CUDA stops at the first entry naming no GPU
    assert len(visible_gpus(rows, "MIG-abc")) == 4  # MIG instances: nvidia-smi cannot tell, no filter
    assert synthesize_preset(visible_gpus(rows, "2,3"), ram_gib=500).gpus_per_node == 2


def test_a_config_without_the_keys_that_size_the_model_is_refused_naming_them(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(RecipeError) as err:
        resolve_model(ModelSection(name=str(tmp_path)), base_dir=tmp_path)
    assert err.value.key == "model.name" and err.value.file.endswith("config.json")
    text = err.value.render()
    assert "lacks num_hidden_layers, num_attention_heads, intermediate_size, vocab_size" in text and "fix:" in text


@pytest.mark.parametrize(
    "config,said",
    [
        (("qwen2.5-7b", {"num_attention_heads": None}), "lacks num_attention_heads"),
        (("deepseek-v2-lite", {"kv_lora_rank": "drop"}), "lacks 'kv_lora_rank'"),
        (("gemma-3-27b", {"text_config.hidden_size": None}), "lacks hidden_size"),
        (("qwen2.5-7b", {"num_attention_heads": "many"}), "cannot use"),
    ],
    ids=["null-heads", "mla-without-kv-rank", "gemma3-null-hidden", "string-heads"],
)
def test_a_broken_hub_config_is_a_recipe_error_naming_model_name(tmp_path, config, said):
    raw = json.loads((ROOT / "tests" / "data" / "hub_configs" / config[0] / "config.json").read_text())
    for path, value in config[1].items():
        *parents, last = path.split(".")
        node = raw
        for part in parents:
            node = node[part]
        if value == "drop":
            del node[last]
        else:
            node[last] = value
    _write_config(tmp_path / "broken", raw)
    with pytest.raises(RecipeError) as err:
        resolve_model(ModelSection(name=str(tmp_path / "broken")), base_dir=tmp_path)
    assert err.value.key == "model.name" and said in err.value.render(), err.value.render()


def test_a_registry_key_as_model_name_says_which_hub_id_to_use(tmp_path):
    with pytest.raises(RecipeError) as err:
        resolve_model(ModelSection(name="llama-3.1-8b"), base_dir=tmp_path)
    text = err.value.render()
    assert "model registry" in text and "model.name: meta-llama/Llama-3.1-8B" in text
    assert "model.arch: llama-3.1-8b" in text and "did you mean" not in text


def test_a_preset_of_several_nodes_names_the_fabric_between_them():
    """Without it the collectives across nodes cannot be timed (the planner once assumed 1 GB/s silently)."""
    from pydantic import ValidationError

    fields = get_preset("server-8xh100").model_dump() | {"nodes": 2, "inter_node_fabric": "none"}
    with pytest.raises(ValidationError, match="inter_node_fabric"):
        HardwarePreset.model_validate(fields | {"inter_node_bandwidth_gbps": 50})
    with pytest.raises(ValidationError, match="inter_node_bandwidth_gbps"):
        HardwarePreset.model_validate(fields | {"inter_node_fabric": "infiniband", "inter_node_bandwidth_gbps": 0})
    assert HardwarePreset.model_validate(fields | {"inter_node_fabric": "infiniband", "inter_node_bandwidth_gbps": 50})


@pytest.mark.parametrize(
    "change,said",
    [
        ({"num_key_value_heads": 3}, "cannot share 3 key/value heads"),
        ({"hidden_size": 4100}, "not a whole number of heads"),
    ],
)
def test_a_config_whose_shapes_transformers_could_not_build_is_refused(tmp_path, change, said):
    raw = json.loads((ROOT / "tests" / "data" / "hub_configs" / "llama-3.1-8b" / "config.json").read_text())
    _write_config(tmp_path / "odd", raw | change)
    with pytest.raises(RecipeError) as err:
        resolve_model(ModelSection(name=str(tmp_path / "odd")), base_dir=tmp_path)
    assert err.value.key == "model.name" and said in err.value.render(), err.value.render()


@pytest.mark.parametrize(
    "name", ["google/gemma-3-270m-it", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "mistralai/Mixtral-8x22B-v0.1"]
)
def test_no_model_of_another_size_or_family_is_suggested(tmp_path, name):
    """difflib alone offered gemma-3-27b for gemma-3-270m and Llama-3.1-70B for TinyLlama-1.1B."""
    with pytest.raises(RecipeError) as err:
        resolve_model(ModelSection(name=name), base_dir=tmp_path)
    assert "did you mean" not in err.value.render()

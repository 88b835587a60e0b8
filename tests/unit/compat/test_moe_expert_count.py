"""finetune/compat/moe_expert_count.py: Granite's MoE configs get the `num_experts` TRL's chunked LM head
reads (the end-to-end run: tests/e2e/test_moe_families.py); configs that have it are left as they are."""

from __future__ import annotations

import pytest

from finetune.compat import moe_expert_count

transformers = pytest.importorskip("transformers")


class _Model:
    def __init__(self, config):
        self.config = config


@pytest.mark.skipif(not moe_expert_count.affected(), reason="the installed trl is past the affected versions")
def test_granite_moe_configs_get_the_count_under_the_name_trl_reads():
    from transformers import GraniteMoeConfig, GraniteMoeSharedConfig, MixtralConfig

    for cls in (GraniteMoeConfig, GraniteMoeSharedConfig):
        config = cls(num_local_experts=6)
        assert not hasattr(config, "num_experts")
        assert moe_expert_count.name_the_expert_count(_Model(config))
        assert config.num_experts == 6
    mixtral = MixtralConfig(num_local_experts=6)  # answers to both names already
    assert not moe_expert_count.name_the_expert_count(_Model(mixtral))
    llama = transformers.LlamaConfig()  # not a mixture of experts
    assert not moe_expert_count.name_the_expert_count(_Model(llama)) and not hasattr(llama, "num_experts")

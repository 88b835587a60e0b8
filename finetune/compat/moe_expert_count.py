"""TRL's chunked LM head reads a mixture of experts' expert count as `num_experts`, which Granite's MoE
configs do not have.

trl <= 1.16.0: the forward TRL installs for its chunked log-prob LM head (`_fused_forward` in
trl/trainer/utils.py) adds the router load-balancing loss with `text_config.num_experts` under
transformers 5 whenever the config's `router_aux_loss_coef` is not 0. GraniteMoeConfig and
GraniteMoeSharedConfig name the count `num_local_experts` only (MixtralConfig answers to both names), so
every training step of a granitemoe model with the auxiliary loss on (the class default, 0.001) raised
`AttributeError: 'GraniteMoeConfig' object has no attribute 'num_experts'`. TRL fixed the same read for
gpt_oss alone (huggingface/trl#5754).

The workaround sets that attribute on the loaded model's text config, equal to `num_local_experts`; no TRL
or transformers code is replaced. A full fine-tune's saved config.json then carries `num_experts` as well,
which transformers' Granite classes ignore and the planner's config reader accepts. Versions after 1.16.0
are left alone: if they still fail, this module's version bound is the one line to move.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

LAST_AFFECTED = Version("1.16.0")


def affected() -> bool:
    try:
        return Version(version("trl")) <= LAST_AFFECTED
    except PackageNotFoundError:
        return False


def name_the_expert_count(model) -> bool:
    """Give the model's text config the `num_experts` TRL reads, when it names the count only as
    num_local_experts; True when it did."""
    if not affected():
        return False
    text = model.config.get_text_config()
    experts = getattr(text, "num_local_experts", None)
    if not experts or hasattr(text, "num_experts"):
        return False
    text.num_experts = experts
    return True

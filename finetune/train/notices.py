"""Start-up notices of libraries about parts a run does not use, switched off before the libraries load.

DeepSpeed's and bitsandbytes' are printed when peft or accelerate is first imported, liger-kernel's when its
kernels are applied, so the rank's entrypoint calls this before it imports the training code
(finetune/train/__main__.py).
"""

from __future__ import annotations

import logging
import os

LIGER_BACKEND_REGISTRY = "liger_kernel.backends.registry"  # its logger (liger-kernel 0.8)


def quiet_unused_library_notices(*, device: str, adapter: str) -> None:
    """device: the resolved recipe's (cuda | cpu | ...); adapter: adapter.type."""
    cpu = device == "cpu"
    if cpu:
        # DeepSpeed (imported by accelerate and transformers) otherwise warns that it found no GPU and falls
        # back to its CPU accelerator, which is what a CPU run means: DeepSpeed's own switch says so
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not (cpu and adapter == "qlora"):
        # bitsandbytes (imported by peft) warns that its optional CPU 4-bit matmul kernel is not installed;
        # only QLoRA on a CPU would run it
        logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # liger-kernel warns, once per rank and op, that its optional CuTe-DSL and Ascend implementations cannot be
    # imported; it then runs its Triton kernels, the ones finetune plans and measures
    logging.getLogger(LIGER_BACKEND_REGISTRY).setLevel(logging.ERROR)

"""The planner's per-GPU peak and steady tokens/s against what real GPUs measured.

Every row of tests/data/gpu_calibration.json is one `finetune run` on an H100 80GB or H200 with
`--hardware auto`. Its plan is rebuilt here (tests/helpers/calibration_rows.py): from the run's whole
recipe.resolved.yaml where the row carries it (`resolved`), else from the few fields older rows kept, on
the preset `--hardware auto` synthesizes for that card and GPU count. The plan must reproduce the run's
configuration (strategy, micro-batch, accumulation, world size, checkpointed layers) before anything is
compared. Memory: the prediction lies in [0.95, 1.15] x the measured max reserved of the worst rank; speed:
in [0.75, 1.25] x the measured steady tokens/s; host RAM while training (rows that sampled the node's
PSS): in [0.95, 1.15] x the measured, plus an allowance per process (calibration_rows.host_miss).
Rows with an `excluded` key are superseded measurements;
a row with `speed_excluded` measured something other than training in its steady window, or lacks an input its
step time turns on (its reason says what, and which row measured the same setting without the fault), so only
its memory counts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.calibration_rows import (
    gathers_at_final_save,
    host_figures,
    host_miss,
    memory_figures,
    memory_miss,
    pin_mismatch,
    predict,
    save_figures,
    save_miss,
    speed_figures,
    speed_miss,
)

DATA = Path(__file__).resolve().parents[3] / "tests" / "data" / "gpu_calibration.json"


def _rows() -> list[dict]:
    return [r for r in json.loads(DATA.read_text()) if "excluded" not in r]


def _predict(row: dict):
    plan = predict(row)
    # the plan reproduces the run's configuration, or the comparison means nothing
    mismatch = pin_mismatch(row, plan)
    assert not mismatch, f"{row['name']}: the rebuilt plan is not the run's: {mismatch}"
    return plan


def test_calibration_data_is_present():
    rows = _rows()
    assert len(rows) >= 7
    assert {r["strategy"] for r in rows} >= {"ddp", "fsdp2", "fsdp2-hybrid", "zero3", "zero3-offload", "zero3-nvme"}
    assert {r["adapter"] for r in rows} >= {"full", "lora", "qlora"}


# --- steady tokens/s (within +-25% of the planner's tokens/s, the one step-time model of
# finetune/plan/timing.py) and the tighter memory bound (-5% / +15%), row by row: tests/helpers/calibration_rows.py.
# Rows the current models miss, by _row_id. Not fitted away: the models change only with new GPU data.
SPEED_MISSES = {
    "382-lora3b-attn-dropout-zero3": (
        "Llama-3.2-3B LoRA r16 on q/k/v/o with dropout under ZeRO-3 on 2 H200s, micro-batch 4 of 2,048 tokens, no "
        "checkpointing (the out-of-sample check of linears_keep_inputs: its memory 1.056, inside): host-bound on "
        "ZeRO-3's module hooks at the call's probe (37 us a planned kernel), 11,292 tokens/s against 15,731 planned. "
        "The probed ZeRO-3 rows spread 0.83-1.24 of their speed on the hooks' host share (rows 359-363); this one is "
        "the slowest against its plan, a 3B model's short layers with attention-only adapters. Not profiled"
    ),
    "299-blind2-04": (
        "second blind draw (Mistral-7B LoRA r32 at micro-batch 1 x 4 of 2,048 tokens, 1 H200), host-bound: 9,879 "
        "tokens/s against 5,889 planned at the floor's 63 us a kernel; that call's host was not probed, and at the "
        "planned kernels its step fits 29 us a kernel. The same setting on probed machines (rows 306 and 310) is "
        "inside the bound at the probes' figures (finetune/hostprobe.py, 36 and 38 us)"
    ),
    "298-blind2-03": (
        "second blind draw (QLoRA r64 with dropout on OLMo-2-7B, micro-batch 2 x 1 of 1,024 tokens, 1 H200), "
        "host-bound on a call without a probe: planned at the floor's 63 us a kernel. Its profile (row 317) counted "
        "6,920 launches a micro-batch beyond the optimizer step's, which the plan now has within 5% (lora dropout and "
        "OLMo-2's eager q/k norms, plan/host_time.py); at the planned count this host took 45 us a kernel, in the "
        "range the probes read (36-45 us on the calls of the same day)"
    ),
    "303-blind2-12": (
        "second blind draw (Qwen2.5-14B LoRA r8 with dropout on q/k/v/o, micro-batch 2 x 4 on 2 H200s, every layer "
        "checkpointed): 3.35 s a step planned, measured 2.51. The GPU work planned alone, 3.08 s, is longer than the "
        "measured step, so the compute model is what is over here (a 14B model's attention-only adapters with dropout, "
        "every layer recomputed), not the host: at the 36-45 us a kernel the day's probes read the plan is 0.79-0.80 "
        "of the measured speed. Not profiled"
    ),
    "320-blind2-06-eager": (
        "blind2-06 (Gemma-3-1B DPO, two padded pairs of up to 2,028 tokens, 1 H200) with the model's eager attention: "
        "planned host-bound at this call's probe (42 us a kernel); its sdpa twins of the next session (rows 326, 331, "
        "334) miss alike, so the gap is Gemma-3's layer on the host, not eager attention (row 332 below)"
    ),
    "326-blind2-06": (
        "blind2-06 at a multiple of 128 (Gemma-3-1B DPO, 1 H200): host-bound, 0.40 s a step against 0.25 planned at "
        "the call's probe (37 us a kernel, timed on a Llama layer). Its profile (row 332) counted 5,198 launches a "
        "micro-batch against 4,891 planned and 0.15 s of GPU work a step, so the count holds and the host took 65 us a "
        "planned kernel: scripts/host_launch_costs.py timed a Gemma-3 probe layer at 41-47 us a planned kernel where "
        "Llama's took 28-40 on the same host, Gemma-3 running 16 of Liger's Triton launches a layer to Llama's 8 (each "
        "6-10 probe kernels' worth of host time). At the unprobed floor (63 us) the plan is on (0.99); a term for the "
        "launches, proportional to the host's figure, put Gemma-2's and Qwen3's unprobed rows 0.67-0.69 off, so it "
        "was not taken; the probe of Gemma-3's own layer since (row 339) reads 1.11-1.18x a Llama layer's, a sixth "
        "of the gap"
    ),
    "331-blind2-06-memory": "row 326's setting, memory-profiled: the same host-bound miss (1.56)",
    "365-gemma3-1b-sft-padded": (
        "Gemma-3-1B LoRA SFT over padded ~1,760-token rows (micro-batch 4, 1 H200), its plan probing its own layer at "
        "38.5 us a planned kernel: 21,792 tokens/s against 28,653 planned. The same setting on the next call's host "
        "(row 370, over 40 steps) ran at 21,951, its probe reading 51.7 us, and is on its plan (1.043): the runs agree "
        "and the probe of one layer read a third apart on two hosts"
    ),
    "367-gemma3-1b-dpo-noliger": (
        "blind2-06's setting with train.liger off: the plan's probe timed Liger's layer (the run's choice never "
        "reached it) and read 57.1 us for each of the 303.6 kernels planned for the layer without Liger, 17.3 ms a "
        "layer where the whole step ran in 0.33-0.40 s. hostprobe.probe_liger takes the run's choice since; the same "
        "setting in the next call (row 369) at the no-Liger layer's figure timed there (26.6 us) is on its plan (1.143)"
    ),
    "334-blind2-06-nodropout": (
        "row 326's setting compiled without the dropout modules (the fused LoRA groups on): 18,709 tokens/s, 13% "
        "faster than row 326, against 27,110 planned at its call's probe; the same Gemma-3 host miss (0.99 at the "
        "floor's 63 us)"
    ),
    "339-blind2-06-family": (
        "blind2-06's setting again with the host probed on Gemma-3-1B's own layer (finetune/hostprobe.py --config): "
        "39.8-40.3 us a kernel where the Llama layer read 33.8-37.7 in the same call, so the family's layer explains "
        "a sixth of the gap (1.68 of the speed at the Llama figure, 1.58 at Gemma-3's). Row 332's profile had the "
        "host busy 0.37 s of its 0.40 s step (cudaStreamSynchronize 4 ms a step), 1.5x the planned host time at the "
        "probe (LigerRMSNormFunction took 186 us of host a call in the run). The same setting with its plan probing "
        "the run's own layer settings (hostprobe.probe_layer: the fused groups as DPO trains them; row 364) ran at "
        "1.199 of its plan at 52.5 us a planned kernel, inside the bound; this call's probe had the plain layer's "
        "settings (no fused groups)"
    ),
    "340-blind3-07-family": (
        "blind3-07's setting (Gemma-3-1B QLoRA SFT, micro-batch 4 of 4,096 tokens) with the Gemma-3 probe as row 339: "
        "1.28 of the speed with QLoRA's dequantization kernels counted (1.44 before; inside the bound at the unprobed "
        "floor). Its call probed Gemma-3's LoRA layer, not its 4-bit one: a Gemma-3 layer with the 4-bit base read "
        "52.0 and 56.9 us a planned kernel on a later call's host (docs/results/host-launch-costs-layers-2026-11-30-"
        "h200x2.json), at which this row would be at 1.07 and 1.00. The planner probes the run's 4-bit layer since "
        "(hostprobe.probe_layer); not measured again on this setting"
    ),
    "342-blind4-02": (
        "fourth blind draw (Qwen2.5-1.5B QLoRA r8 on q/k/v/o with dropout, micro-batch 1 x 8 of packed 1,024-token "
        "rows, every layer checkpointed, adamw_8bit, 1 H200; the plan warned that micro-batch 8 without checkpointing "
        "fits and is modelled 8.9x faster): 1,904 tokens/s against 4,077 planned at the call's Qwen2 probe (38 us), "
        "2,273 alone (row 347). Its profile (row 348: 5,855 kernels a micro-batch, 0.036 s of GPU work) showed "
        "QLoRA's three dequantization kernels a use of a 4-bit weight, now counted (1.69 of the speed, 2.14 "
        "before); the host still took 77 us a launched kernel where the probe's plain LoRA layer took 35-38. The "
        "probe of the run's own layer settings since (4-bit, q/k/v/o with dropout, checkpointed, packed: "
        "hostprobe.probe_layer) reads 1.4-1.7x the plain layer's on one host, and the setting's runs planned with it "
        "are at 0.89 and 0.75 (rows 353 and 357); this row's call probed the plain layer only"
    ),
    "347-blind4-02-alone": (
        "row 342's setting alone on its machine: 2,273 tokens/s against 3,412 planned at that call's Qwen2 probe "
        "(35 us): 1.50 of the speed, probed on the plain LoRA layer as row 342 (the run's own layer settings since: "
        "rows 353 and 357)"
    ),
    "357-blind4-02-layer-again": (
        "blind4-02's setting again with its plan probing the run's own layer (the 4-bit base, q/k/v/o with dropout, "
        "every layer checkpointed, a packed row: hostprobe.probe_layer): the probe read 62.2 us a planned kernel "
        "where the run's speed implies 44.1, 2,125 tokens/s planned against 2,851. The same probe read 45.8 in the "
        "call before (row 353: 0.894, inside) and 51.6-61.1 in three probes in a row on one host the same evening "
        "(docs/results/host-launch-costs-layers-2026-11-30-h200x2.json): this layer's probe varies by a sixth between "
        "processes and reads 1.1-1.4x what its runs imply, where the plain LoRA layer's read 0.8x (rows 342 and 347)"
    ),
    "350-blind4-08": (
        "fourth blind draw (Qwen3-30B-A3B LoRA r8 with dropout under ZeRO-3 on 2 H200s, micro-batch 2 x 1 of 1,024 "
        "tokens, every layer checkpointed, adamw_8bit), host-bound: 2.98 s a step against 2.09 planned at the "
        "unprobed floor (0.53 s of GPU work planned; the host's time is ZeRO-3's module hooks, 1.2 ms a use of a "
        "partitioned module, and the kernels). The call had no probe. Its profiled twin (row 354, the plan probing the "
        "run's own layer at 76 us a planned kernel: 1.23 of that run's speed) had the host busy through the step: 0.44 "
        "s a step in cudaEventSynchronize (ZeRO-3 waiting for its all-gathers, 865 a step at 2.3 ms each on the "
        "communication stream) and 12-13 ms of Python a layer pass inside the checkpointed layers, which run reentrant "
        "(TRL forces use_reentrant for PEFT under ZeRO-3), beyond the 1.2 ms a partitioned module's use planned: not "
        "modelled. Memory inside its bound (1.029), the allocator keeping 2.8 GiB beyond its allocation where OLMoE's "
        "ZeRO-3 row 289 kept 8.6"
    ),
    "281-blind1-01": (
        "blind draw (OLMoE LoRA r128, micro-batch 2 pinned, every layer checkpointed, 1 H200): 0.197 s a step against "
        "0.456 planned, which is the host floor (5,971 kernels a micro-batch at 63 us, plan/host_time.py). Its profile "
        "(row 293) made 6,274 launch calls a step (cudaLaunchKernel and cuLaunchKernelEx; 6,137 planned with the "
        "optimizer's) and 0.142 s of GPU work (0.203 planned: the grouped experts' GEMMs at 4,096 tokens ran faster "
        "than planned), so this host launched a kernel in 31 us or less, half the H100 hosts' 63; the plan says so "
        "(finetune plan's why). The same setting with its plan probing its own layer (row 358, another host: 39.9 us) "
        "ran at 1.002 of its plan"
    ),
    "286-blind1-08": (
        "blind draw (QLoRA Llama-3.1-8B r8, micro-batch 2 x 2 pinned, 1 H200): 0.289 s a micro-batch against the "
        "0.410 of the host floor planned; its profile (row 294) counted 5,220 launches a micro-batch against 5,239 "
        "planned, so the count holds and this host took 44 us a kernel or less, not 63"
    ),
    "288-blind1-10": (
        "blind draw (Qwen2.5-1.5B LoRA r64, micro-batch 4 x 2 pinned, every layer checkpointed, 1 H200): 0.265 s a "
        "micro-batch against the 0.395 of the host floor planned; its profile (row 295) counted 4,032 launches a "
        "micro-batch against 5,050 planned (1,500 of them the checkpointed layers' recomputed forwards at a third of a "
        "layer's kernels), and at the counted launches this host took 51 us a kernel or less"
    ),
    "292-blind1-14": (
        "blind draw (Llama-3.2-3B DoRA r64 under ZeRO-2 on 2 H200s, micro-batch 2 x 4, paged 8-bit AdamW): 1.65 s a "
        "step against 4.49 planned, the host floor's: 11,065 kernels a micro-batch at 63 us (DoRA's 33 a module, "
        "counted "
        "with fp32 adapters; ZeRO-2 trains bf16 ones, 25-27 measured by scripts/dora_rates.py) and DeepSpeed's "
        "gradient "
        "hook at 0.59 ms for each of the 588 trained tensors (0.35 s a micro-batch). With 1.30 s of GPU work planned, "
        "the host took 0.41 s a micro-batch or less: the hook's figure, measured on a full fine-tune's large tensors "
        "(row 88), does not hold for an adapter's small ones; no LoRA row under ZeRO-2 had run before"
    ),
    "228-gemma3-4b-lora-mb8": (
        "the A/B's baseline, the previous commit's tree: Gemma-3-4B's 29 sliding layers on sdpa's masked (cuDNN) "
        "kernel over a 16,384-token packed row at head_dim 256, 9,730 steady tokens/s against 13,409 planned. The "
        "masked kernel's slowdown (attention_time.MASKED_KERNEL_SLOWDOWN) was measured on 4k and 16k rows at head_dim "
        "64 and 128; its own planner picked 4 x 2 (row 175: 14,033, planned 16,208, inside the bound). Sliding "
        "layers run the varlen kernel since (row 229, the same call: 25,016); the masked path is left to attention "
        "dropout and torch without a varlen window"
    ),
    "101-dpo3b-pairs-fsdp2-profiled": (
        "row 96's setting on 2 H200s, profiled at steps 3-4: 2.15 s of wall for two steps, 1.08 s of it GPU "
        "compute (the one-GPU pairs run, row 104, is on the plan), 0.73 s with no kernel running and ~0.34 s of "
        "NCCL all-gathers alone: 204 gathers of 2.7 ms each where the SFT FSDP2 run (row 99) took 0.73 ms for the "
        "same layers, so each rank waits for the other. The host ran 1.67 s of operators (0.83 s a step against "
        "the 0.53 s host floor planned; row 99's SFT step: 0.38 s), aten::mm costing 118 us of host a call "
        "against 36 us in row 99; TRL's DPO loss gathers across the ranks 15 times and syncs 13 times a "
        "micro-batch, which the planner does not model. The same setting on another 2 x H200 machine two hours "
        "later (rows 105-107) ran at 35,651-37,508 tokens/s, inside the bound (ratios 1.17-1.23), with 0.39 s idle "
        "and 1.85 ms all-gathers in the same two profiled steps, and TRL's metric syncs made no difference there "
        "(row 106 against 105): the two-rank, host-bound step varies by a third between hosts"
    ),
    "102-dpo3b-pairs-zero3-profiled": (
        "row 100's setting, profiled at steps 3-4: 7.97 s of wall for two steps, 4.39 s with no kernel running, "
        "the host then in DeepSpeed's hooks (PreBackwardFunctionForModule 0.78 s, AccumulateGrad 0.27 s, "
        "LinearFunctionForZeroStage3's backward 0.26 s, all-gathers 0.22 s) and 1.98 s in no recorded operator; "
        "3.62 s a step in the steady window against the 2.55 s of the host floor with ZeRO-3's module hooks "
        "(row 100, unprofiled: 2.08): the profiler's own cost on the host is not planned"
    ),
    "108-full14b-qwen2.5": (
        "the planner's ZeRO-3 choice for full 14B on 4 H100s (micro-batch 2 x 2, 43 of 48 layers checkpointed): "
        "5.37 s a step against 3.84 planned, 2.27 s of it GPU compute. ZeRO-3's module hooks (plan/host_time.py, "
        "977 gathers and releases a micro-batch) took the plan from 2.33 s to 3.65 s, the soft maximum of the "
        "host's and the GPU's time to 3.84 s; the rest is not identified "
        "without a profile (candidates: the all-gathers of a checkpointed layer's recompute and the per-micro-batch "
        "reduce-scatter of 14.8e9 gradients left exposed while the host is in the hooks). The same setting on 4 "
        "H200s with every layer checkpointed (row 130, profiled) ran on its plan (1.056), so the H100 machine's "
        "host is the first suspect"
    ),
    "103-dpo3b-fsdp2-profiled": (
        "padded DPO pairs under FSDP2 on 2 H200s (sdpa with the padding mask): 1.23 s a step against 0.81 "
        "planned; the same two-rank coupling as row 101 (its profiled steps 3-4 ran at 3.1 s a step, cuDNN's "
        "first calls at new shapes, so they do not describe the steady window)"
    ),
    "170-lora8b-unpacked": (
        "unpacked LoRA 8B at micro-batch 4 x 2 on 1 H200, sequences of 407 tokens on average (the longest 682) "
        "padded to a multiple of 64: 0.50 s a step measured against 0.49 s of GPU compute planned, so the GPU "
        "model holds; the plan's host floor (0.70 s a step: 61 ms and 63 us a launched kernel a micro-batch, "
        "plan/host_time.py, measured on the H100 machines' hosts) was not reached on this machine's host, which "
        "launched the same kernels in at most 43 us each. The steps varied 4,474-8,308 tokens/s (each new padded "
        "length costs cuDNN a plan). A host faster than the calibrated ones has a lower floor, which the planner "
        "cannot see; `finetune plan --measure` times it"
    ),
    "136-lora3b-zero3-nvme-shm": (
        "the swap on tmpfs: DeepSpeed's async_io reads it on its one submitting thread at 3.6-3.9 GB/s "
        "(scripts/disk_aio_check.py, the same kind of machine) where the probe's one O_DIRECT reader measured "
        "5.1-5.6; the per-request cost of DeepSpeed's reader is not modelled (at its own rate the plan is "
        "1.22-1.28). The plan warns that a swap in RAM belongs to zero3-offload"
    ),
    "70-llama3b-full-fsdp2-offload": (
        "FSDP2 CPU offload, full 3B on 2 H100s, alone on the host, 32 threads per rank: 9.6 s a step. The "
        "profile (docs/results/profiles/full3b-fsdp2-offload-h100x2.txt) puts 12.7 s of the two profiled steps' "
        "22.7 s of host time in finetune's own non-finite check (isfinite().all() over the host gradients, "
        "since replaced by one sum per tensor, 20x cheaper on a core: train/callbacks.py all_finite, not yet "
        "re-measured on the H100 host; rows 74 and 93 measured it on the H200 host, in bounds); torch's CPU "
        "fused AdamW and clip_grad_norm_ take most of the rest"
    ),
}
MEMORY_MISSES = {
    "315-blind2-13-adamw": (
        "second blind draw's QLoRA DPO on Llama-3.1-8B under FSDP2 on 2 H200s (micro-batch 1 x 4 of up to "
        "3,948-token pairs, every layer checkpointed): 9.13 GiB reserved against 10.83 planned (11.15 while the plan "
        "counted the lora dropout DPO's trainer turns off). Its memory profile "
        "(row 319) peaked in the loss head: 2.81 GiB held from before the step (the 4-bit shards and the adapters' "
        "states, 2.84 planned), 2.07 of the root unit gathered at the embedding, 1.81 of checkpointed layer inputs "
        "and 0.98 of the lm_head that TRL's fused head gathers again (full_tensor of the DTensor weight, not "
        "planned); the plan holds 2.29 of FSDP2 buffers, 2.99 of activations at the longest pair (the real pairs "
        "averaged 3,305 tokens) and 2.54 of reserve and transients where the allocator kept 1.39. Every QLoRA FSDP2 "
        "row is over by 2.5-6.8 GiB, inside the bound only where its activations are large; a per-tier reserve split "
        "(adapters 1.4, full 3.2 GiB: the medians) moved three other rows out of their bounds and was not taken"
    ),
    "319-blind2-13-adamw-memory": (
        "row 315's setting, memory-profiled: the same 9.13 GiB reserved against 10.83 planned"
    ),
    "290-blind1-12": (
        "blind draw (QLoRA Qwen2.5-7B DPO under ZeRO-3 on 2 H200s): 9.36 GiB allocated and 13.35 reserved against "
        "12.34 planned: the allocator kept 4.0 GiB beyond the allocation where 2.0 is planned for a sharded tier. "
        "Inside its bound (0.959) while the plan counted lora dropout's copies, which DPO's trainer never made (its "
        "dropout modules ran at p = 0: the memory profile of row 331); the DPO rows under ZeRO-3 kept 4.0-5.6 GiB "
        "beyond their allocation (rows 100, 102 and this), the reference's forwards gathering and freeing the "
        "partitions between the policy's; not modelled"
    ),
    "289-blind1-11": (
        "blind draw (OLMoE LoRA r256 under ZeRO-3 on 2 H200s, 65,536 tokens a micro-batch, every layer checkpointed): "
        "29.9 GiB allocated at the peak against 28.3 planned, but 38.5 reserved: the allocator kept 8.6 GiB beyond its "
        "allocation, where 2.0 is planned for a sharded tier (the median; ZeRO-3 rows kept 1.3-5.6 before). The memory "
        "profile (row 297) shows the experts' grouped GEMM buffers (3.9 GiB at one site, 2.0 at three more) allocated "
        "and freed every layer between ZeRO-3's gathers; a reserve that grows with such transient buffers is not "
        "modelled"
    ),
    "297-blind1-11-memory": "row 289's setting, memory-profiled: 37.5 GiB reserved, 29.7 allocated, 28.3 planned",
    "226-phi3-mini-lora": (
        "Phi-3-mini LoRA at micro-batch 8 x 2,048 on 1 H200: 62.4 GiB allocated at the peak against 56.8 GiB of "
        "tensors "
        "planned, 5.7 GiB (10%) more, where its own planned activations are 48.8; the same model at micro-batch 4 "
        "(row 187) allocated 2.8 GiB more than planned and Phi-4-mini (row 260, fused qkv and gate_up as well) 3.7. "
        "On CPU, saved-tensor hooks on a Phi-3 layer (no Liger) keep 5% less per token than planned, so the excess is "
        "the GPU path's (Liger's Phi-3 SwiGLU over the fused gate_up's halves, or the fused qkv's split under the "
        "varlen kernel), not identified without a memory profile. The planned allocator reserve (0.5 GiB for a DDP "
        "rank, memory.ALLOCATOR_RESERVE_BYTES) no longer hides it, as the 1.5 GiB for every tier did: 0.947 of the "
        "measured 63.5 GiB"
    ),
    "50-dpo70b": (
        "DPO LoRA 70B on 4 GPUs, FSDP2: the data generator of row 01 (chosen and rejected of equal length, so no "
        "padding and no sdpa mask), while the planner plans a padded pair's mask. Row 01's setting measured again "
        "with unequal pairs (row 120) is inside the bound (1.087); the 70B run has not been repeated. It also "
        "likely checkpointed all 80 layers from step 2, not the 74 planned: TRL's DPO reference pass set "
        "checkpointing on every layer again (rows 235-238; train/checkpointing.py keeps the first k since)"
    ),
}

HOST_MISSES = {
    "301-blind2-10": (
        "second blind draw, full Llama-3.2-1B DPO under ZeRO-2 on 2 H200s: 4.14 GiB of PSS on the node, 2.1 a rank, "
        "against the 3.9 planned for a full fine-tune's DeepSpeed rank (memory.HOST_PER_DEEPSPEED_FULL_RANK_BYTES, the "
        "top of the 2.1-4.0 measured): over, the safe side"
    ),
    "291-blind1-13": (
        "blind draw, QLoRA DPO under ZeRO-2 on 2 H200s: 7.60 GiB of PSS on the node while training (7.01 anonymous), "
        "3.8 a rank, against the 3 GiB a process is planned at (memory.HOST_PER_PROCESS_BYTES; DeepSpeed's adapter "
        "ranks measured 1.9-2.2 before); the QLoRA ZeRO-3 run of the same call (row 290) held 2.25 a rank. Not "
        "identified"
    ),
    "348-blind4-02-profiled": (
        "row 342's setting with the profiler on for steps 3-4: 4.89 GiB of PSS against 1.68-1.72 for its unprofiled "
        "twins (rows 342 and 347): the profiler's event buffers (46,800 kernels a step), which the planner does not "
        "count (rows 176, 185, 296)"
    ),
    "354-blind4-08-profiled": (
        "row 350's setting (Qwen3-30B-A3B LoRA under ZeRO-3 on 2 H200s) with the profiler on for steps 3-4: 7.71 GiB "
        "of PSS on the node against 4.35 for the unprofiled run (row 350, inside its bound): the profiler's event "
        "buffers, which the planner does not count (rows 176, 185, 296, 348)"
    ),
    "296-blind1-14-profiled": (
        "row 292's setting with the profiler on for steps 3-4: 11.07 GiB of PSS against 6.01 for the unprofiled run "
        "(row 292, inside its bound): the profiler's event buffers, which the planner does not count (rows 176, 185)"
    ),
    "248-qwen2.5-1.5b-full": (
        "one full-fine-tune ZeRO-2 process on an H200 machine: 4.52 GiB of PSS (4.08 anonymous) against the planned "
        "3.9 GiB (plan/memory.py HOST_PER_DEEPSPEED_FULL_RANK_BYTES), where Qwen2.5-0.5B's in the same call held 2.12 "
        "(1.69) and the earlier such ranks 2.1-4.0 (Llama-3B's 2.1-3.8, Gemma-3-4B's 4.0). The 2.4 GiB between the two "
        "Qwen rows is about the difference of their bf16 weights (2.1 GB), as if a host copy of the loaded weights "
        "stayed resident, but the 3B rows (6.4 GB of weights) held less; not identified"
    ),
    "234-gemma3-12b-full-2gpu": (
        "full 12B under FSDP2 on 2 H200s through the sharded load: 2.93 GiB of PSS on the node while training (2.42 "
        "anonymous), 1.5 a rank, against the 5 GiB a full fine-tune's FSDP2 rank is planned at "
        "(memory.HOST_PER_FSDP_FULL_RANK_BYTES: 3.5-5.1 measured before, 3.2-3.3 on rows 217 and 222 of the same kind "
        "of machine). Over, the safe side; why this rank held less is not identified"
    ),
    "262-falcon3-7b-full-fsdp2": (
        "full Falcon3-7B under FSDP2 on 2 H200s (plan --measure --keep): 4.07 GiB of PSS on the node while training "
        "(3.44 anonymous), 2.0 a rank, against the 5 GiB a full fine-tune's FSDP2 rank is planned at, as row 234 "
        "(1.5 a rank); the full FSDP2 rows of 2026-11-29 (rows 215-253) held 1.5-4.3 a rank, the 3B rows of "
        "2026-11-27 (rows 72-82) 3.5-5.1. Over, the safe side; what sets a rank's anonymous memory is not identified"
    ),
    "108-full14b-qwen2.5": (
        "full 14B under ZeRO-3 on 4 H100s: 35.4 GiB of PSS on the node against 12.0, of which rank 0 held 29.5 "
        "(29.3 anonymous) and ranks 1-3 1.9 each. Rank 0 alone reads the checkpoint under ZeRO-3 (transformers "
        "loads the whole state dict on it), and this row's sample after loading caught it before it was freed: "
        "the same model under ZeRO-3 on 4 H200s (rows 111 and 114) peaked at 29.0 GiB of RSS on rank 0 while "
        "loading and held 9.1-9.4 GiB of PSS on the node at that sample and at every logged step"
    ),
    "102-dpo3b-pairs-zero3-profiled": "DPO LoRA 3B under ZeRO-3 on 2 H200s: 7.02 GiB of PSS against 6.00",
    "86-full3b-ddp-s512-mb1": (
        "one process on the H100 machine of this session: 4.8 GiB of PSS, 4.4 of it anonymous, where the same "
        "software on the 2 x H200 machine's host held 1.3-1.8 GiB anonymous for one process (rows 83-85); the "
        "planned per-process baseline is 3 GiB. The host's driver or CUDA library loading differs; not profiled"
    ),
    "87-lora8b-s512-mb1": (
        "as row 86, the same H100 host: 5.1 GiB of PSS (4.7 anonymous) for one process; rows 86 and 87 ran with the "
        "profiler on for steps 3-4, whose buffers the planner does not count (row 176)"
    ),
    "176-lora8b-s512-mb1": (
        "row 87's setting on an H200 machine, with the profiler on for steps 3-4 (logging.profile_steps): 3.93 GiB of "
        "PSS, 3.52 anonymous, where the same host's unprofiled one-process runs (rows 170, 175) held 2.05-2.09 "
        "(1.57-1.60 anonymous): the profiler's event buffers for the ~30,000 kernel launches a step and their "
        "operators, which the planner does not count"
    ),
    "88-llama3b-full-zero2-auto-h100": "as row 86, the same H100 host: 4.7 GiB of PSS (4.3 anonymous) for one process",
    "185-full3b-ddp-s512-mb1": (
        "row 86's setting on an H200 machine, profiled at steps 3-4 as row 176: 4.74 GiB of PSS (4.36 anonymous) "
        "against 1.7-2.5 for this session's unprofiled one-process runs (rows 179-183, 186-189). The profiler's "
        "buffers, which the planner does not count, are not proportional to the kernels the window launched: ~2.7 GiB "
        "here for ~33,000 kernels, ~1.9 GiB in row 176 for ~60,000"
    ),
    "58-full14b-qwen2.5": (
        "full 14B under FSDP2 on 4 H200s, measured before the sharded load: rank 0 loaded the whole "
        "checkpoint from its mapped files, and PSS counts mapped file pages (page cache the kernel can drop) "
        "with anonymous memory alike; the row recorded no split, so the ~11 GiB beyond the model is not "
        "identified"
    ),
    "67-full3b-fsdp2-sharded-load": (
        "full 3B under FSDP2 through the sharded load on 2 H100s: 13.0 GiB of PSS on the node against 10.0 "
        "planned, with a checkpoint save (step 5) inside the sampled window. The row recorded no split of PSS; "
        "the same run without the save (row 72) held 6.98 GiB, 6.37 of it anonymous, so the gap here is mostly "
        "the save, not the mapped checkpoint's pages"
    ),
}

SAVE_MISSES = {
    "234-gemma3-12b-full-2gpu": (
        "both ranks were SIGKILLed while saving (the 118 GB checkpoint on the RAM disk beside a 75.7 GiB planned save "
        "peak), so the RSS recorded is the training steps'"
    ),
}


def _indexed_rows() -> list[tuple[str, dict]]:
    return [(f"{i:02d}-{r['name']}", r) for i, r in enumerate(json.loads(DATA.read_text())) if "excluded" not in r]


def _params(rows: list[tuple[str, dict]], misses: dict[str, str], figures):
    out = []
    for row_id, row in rows:
        marks = ()
        if row_id in misses:
            marks = pytest.mark.xfail(reason=f"{misses[row_id]}: {figures(row)}", strict=False)
        out.append(pytest.param(row, id=row_id, marks=marks))
    return out


def _speed_figures(row: dict) -> str:
    return speed_figures(row, _predict(row))


def _memory_figures(row: dict) -> str:
    return memory_figures(row, _predict(row))


def _speed_rows():
    rows = [(i, r) for i, r in _indexed_rows() if r.get("steady_tokens_per_second") and "speed_excluded" not in r]
    return _params(rows, SPEED_MISSES, _speed_figures)


def _memory_rows():
    return _params(_indexed_rows(), MEMORY_MISSES, _memory_figures)


def _host_figures(row: dict) -> str:
    return host_figures(row, _predict(row))


def _host_rows():
    return _params([(i, r) for i, r in _indexed_rows() if r.get("host_pss_node_gib")], HOST_MISSES, _host_figures)


def test_every_listed_miss_is_a_row():
    ids = {i for i, _ in _indexed_rows()}
    assert all(set(misses) <= ids for misses in (SPEED_MISSES, MEMORY_MISSES, HOST_MISSES, SAVE_MISSES))
    assert len([r for _, r in _indexed_rows() if r.get("steady_tokens_per_second")]) >= 9


@pytest.mark.parametrize("row", _speed_rows())
def test_predicted_steady_tokens_per_second_within_25_percent(row):
    miss = speed_miss(row, _predict(row))
    assert not miss, miss


@pytest.mark.parametrize("row", _memory_rows())
def test_predicted_peak_within_minus_5_plus_15_percent_of_measured_reserved(row):
    miss = memory_miss(row, _predict(row))
    assert not miss, miss


@pytest.mark.parametrize("row", _host_rows())
def test_planned_host_ram_while_training_within_minus_5_plus_15_percent_of_measured(row):
    miss = host_miss(row, _predict(row))
    assert not miss, miss


def _save_rows():
    rows = [(i, r) for i, r in _indexed_rows() if gathers_at_final_save(r)]
    return _params(rows, SAVE_MISSES, save_figures)


@pytest.mark.parametrize("row", _save_rows())
def test_planned_host_ram_at_the_final_save_within_minus_5_plus_15_percent_of_rank_0s_peak(row):
    """A full fine-tune's final save under FSDP2 gathers the model on rank 0's host (plan/memory.py
    final_save_host_bytes): what the plan puts there against the rank's peak RSS, which the save set."""
    miss = save_miss(row)
    assert not miss, miss

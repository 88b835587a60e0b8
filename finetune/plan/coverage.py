"""What the planner's GPU calibration measured, and where a plan lies beyond it.

The memory and time models are checked against real runs (tests/data/gpu_calibration.json, listed in
docs/validation.md): peak memory within MEMORY_LOW/MEMORY_HIGH of the measured max reserved and steady tokens/s
within SPEED_LOW/SPEED_HIGH, on every row but the misses the calibration test names. Those runs are what the bounds
cover; a CPU plan has no such runs behind it. A plan on a card, a GPU count per node, a node count or a sequence
length beyond them is the same model fed the preset's datasheet figures (peak FLOPs, memory bandwidth,
interconnect), which no run has checked; the plan says so (Plan.basis). The figures here are a summary of the
calibration rows, which tests/unit/plan/test_coverage.py recomputes from them.
"""

from __future__ import annotations

from finetune.registry.schema import HardwarePreset

# the cards the calibration rows ran on (their torch device names, as presets and `--hardware auto` spell them)
MEASURED_CARDS = ("NVIDIA H100 80GB HBM3", "NVIDIA H200")
MEASURED_GPUS_PER_NODE = 4  # the most GPUs of one host any row used
# every row ran on one host: the two fsdp2-hybrid rows emulated two nodes on it (loopback), so no inter-node network
# was measured
MEASURED_NODES = 1
MEASURED_SEQ_LEN = 65536  # the longest data.max_length of a row
# the bounds the calibration test holds every row's plan to (predicted / measured; tests/unit/plan/test_calibration.py)
SPEED_LOW, SPEED_HIGH = 0.75, 1.25  # steady tokens/s (the step-time model of plan/timing.py)
MEMORY_LOW, MEMORY_HIGH = 0.95, 1.15  # max reserved of the worst rank


def _bounds(low: float, high: float) -> str:
    """A bound as the plan says it: -5%/+15%, or +-25% where it is symmetric."""
    down, up = round(100 * (1 - low)), round(100 * (high - 1))
    return f"+-{up}%" if down == up else f"-{down}%/+{up}%"


def extrapolations(preset: HardwarePreset, *, seq_len: int) -> list[str]:
    """What of this setting no calibration row measured (empty: all of it is within the rows' range)."""
    out: list[str] = []
    if preset.vendor == "cpu":  # basis_text says what a CPU's rate is
        return out
    if preset.gpu_model not in MEASURED_CARDS:
        out.append(f"the {preset.gpu_model} (its speed from the datasheet's peak and bandwidth)")
    if preset.gpus_per_node > MEASURED_GPUS_PER_NODE:
        out.append(f"{preset.gpus_per_node} GPUs per node (collective times from the preset's bandwidth)")
    if preset.nodes > MEASURED_NODES:
        out.append(f"{preset.nodes} nodes (the inter-node fabric's {preset.inter_node_bandwidth_gbps:g} GB/s)")
    if seq_len > MEASURED_SEQ_LEN:
        out.append(f"{seq_len:,}-token sequences")
    return out


def basis_text(preset: HardwarePreset, *, seq_len: int) -> str:
    """The plan's `basis:` line: within the calibration runs' range, or what it extrapolates to."""
    if preset.vendor == "cpu":
        # the quickstart's tiny model on 2 cores ran 1.7-2.3x its planned tokens/s (docs/validation.md, 27th session)
        return (
            "a CPU's speed is one blended rate over its cores' nominal FLOPs (plan/timing.py CPU_EFFICIENCY), not "
            "calibrated against CPU runs: a rough figure"
        )
    measured = (
        f"the measured range ({' and '.join(MEASURED_CARDS)}, 1-{MEASURED_GPUS_PER_NODE} GPUs on one node, up to "
        f"{MEASURED_SEQ_LEN:,}-token sequences)"
    )
    beyond = extrapolations(preset, seq_len=seq_len)
    if not beyond:
        return (
            f"within {measured}, where plans held memory to {_bounds(MEMORY_LOW, MEMORY_HIGH)} and tokens/s to "
            f"{_bounds(SPEED_LOW, SPEED_HIGH)} of real runs but for a few listed misses (docs/validation.md)"
        )
    return f"extrapolated beyond {measured} in {'; '.join(beyond)}: no run has checked that part of this estimate"

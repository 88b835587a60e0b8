"""`finetune plan --measure`: what a few real steps measured against what the planner predicted. Torch-free.

The run itself is started by finetune.api.measure (through the launcher); this module reads its run dir
(memory/rank-K.json, metrics.jsonl) and compares: the peak of every rank (max reserved on GPUs; host RSS
on the cpu preset, where PSS is shown too) against the predicted per-device peak and the device's usable
memory (HEADROOM of it), and the steady tokens/s (after the first steps' warm-up) against the planner's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from finetune.plan.choose import HEADROOM
from finetune.plan.render import sync_text
from finetune.rundir import read_memory_files, read_metrics

WARMUP_STEPS = 5  # scripts/gpu_validate.py's warm-up; a short measurement uses half its steps


def steady_rate(points: list[tuple[int, float, float]], warmup: int = WARMUP_STEPS) -> float | None:
    """Tokens/s between the end of step `warmup` and the last point, from (step, seconds, tokens seen),
    i.e. without the first steps' compilation and allocator warm-up."""
    after = [p for p in points if p[0] >= warmup]
    if len(after) < 2 or after[-1][1] <= after[0][1]:
        return None
    return (after[-1][2] - after[0][2]) / (after[-1][1] - after[0][1])


def steady_tokens_per_second(metrics: list[dict], warmup: int = WARMUP_STEPS) -> float | None:
    """steady_rate over metrics.jsonl's cumulative tokens_seen / elapsed_s."""
    points = []
    for m in metrics:
        if "elapsed_s" not in m:
            continue
        if points and m["elapsed_s"] < points[-1][1]:
            points = []  # a resumed process restarts the clock: use the last session's rows only
        points.append((m["step"], m["elapsed_s"], m["tokens_seen"]))
    return steady_rate(points, warmup)


@dataclass
class RankPeak:
    rank: int
    peak_gib: float  # max reserved (GPU) or host RSS peak (CPU)
    allocated_gib: float | None = None  # max allocated (GPU)
    pss_gib: float | None = None  # sampled host PSS peak (CPU)


@dataclass
class Measurement:
    steps: int
    device: str  # cuda | cpu
    peak_kind: str  # what peak_gib is
    predicted_gib: float
    usable_gib: float  # HEADROOM x the device's memory: above it the setting does not fit
    device_gib: float
    predicted_tokens_per_s: float
    tokens_per_s: float | None  # steady, after `warmup` steps
    warmup: int
    ranks: list[RankPeak] = field(default_factory=list)
    setting: str = ""  # strategy, micro-batch, accumulation, checkpointing
    run_dir: str = ""
    out_of_memory: str = ""  # a rank's out-of-memory message, when the setting did not even run

    @property
    def peak_gib(self) -> float | None:
        return max((r.peak_gib for r in self.ranks), default=None)

    @property
    def fits(self) -> bool:
        return not self.out_of_memory and self.peak_gib is not None and self.peak_gib <= self.usable_gib

    def to_json(self) -> dict:
        return {
            "steps": self.steps,
            "device": self.device,
            "peak_kind": self.peak_kind,
            "predicted_gib": round(self.predicted_gib, 3),
            "usable_gib": round(self.usable_gib, 3),
            "device_gib": self.device_gib,
            "measured_peak_gib": self.peak_gib,
            "fits": self.fits,
            "predicted_tokens_per_s": round(self.predicted_tokens_per_s, 1),
            "tokens_per_s": self.tokens_per_s,
            "warmup_steps": self.warmup,
            "setting": self.setting,
            "ranks": [r.__dict__ for r in self.ranks],
            "run_dir": self.run_dir,
            "out_of_memory": self.out_of_memory,
        }


def measurement_warmup(steps: int) -> int:
    return min(WARMUP_STEPS, steps // 2)


def read_measurement(run_dir: Path, *, plan, steps: int, usable_gib: float, device_gib: float) -> Measurement:
    """The figures of a finished measurement run against `plan` (the planner's Plan it ran)."""
    cpu = plan.device == "cpu"
    ranks = []
    for row in read_memory_files(run_dir):
        if cpu:
            ranks.append(RankPeak(row["rank"], row["host_rss_peak_gib"], pss_gib=row.get("host_pss_sampled_peak_gib")))
        elif "gpu_max_reserved_gib" in row:
            ranks.append(RankPeak(row["rank"], row["gpu_max_reserved_gib"], row.get("gpu_max_allocated_gib")))
    warmup = measurement_warmup(steps)
    return Measurement(
        steps=steps,
        device=plan.device,
        peak_kind="host RSS peak" if cpu else "max reserved",
        predicted_gib=plan.per_gpu_memory_gib,
        usable_gib=usable_gib,
        device_gib=device_gib,
        predicted_tokens_per_s=plan.tokens_per_second,
        tokens_per_s=steady_tokens_per_second(read_metrics(run_dir), warmup),
        warmup=warmup,
        ranks=ranks,
        setting=(
            f"{plan.strategy}, micro-batch {plan.micro_batch_size} x accumulation "
            f"{plan.gradient_accumulation_steps} x {plan.world_size} "
            f"{'process' if cpu else 'GPU'}{'es' if cpu and plan.world_size > 1 else ''}"
            f"{'s' if not cpu and plan.world_size > 1 else ''}, activation checkpointing "
            f"{'on' if plan.activation_checkpointing else 'off'}" + sync_text(plan)
        ),
        run_dir=str(run_dir),
    )


def _ratio(predicted: float, measured: float | None) -> str:
    return f"{predicted / measured:.3f}" if measured else "-"


def render_measurement(m: Measurement) -> str:
    unit = "process" if m.device == "cpu" else "GPU"
    lines = [f"measured {m.steps} steps at the planned setting: {m.setting}"]
    if m.out_of_memory:
        lines.append(f"  out of memory: {m.out_of_memory}")
    if m.ranks:
        extra = "  PSS peak" if m.device == "cpu" else "  allocated"
        lines.append(f"  rank  {m.peak_kind + ' GiB':>20}{extra}  predicted  predicted/measured")
        for r in m.ranks:
            other = r.pss_gib if m.device == "cpu" else r.allocated_gib
            lines.append(
                f"  {r.rank:>4}  {r.peak_gib:>20.2f}  {'-' if other is None else f'{other:8.2f}':>8}"
                f"  {m.predicted_gib:>9.2f}  {_ratio(m.predicted_gib, r.peak_gib):>18}"
            )
    if m.tokens_per_s:
        lines.append(
            f"  tokens/s (steady, after step {m.warmup}): measured {m.tokens_per_s:,.0f}, predicted "
            f"{m.predicted_tokens_per_s:,.0f}, predicted/measured "
            f"{_ratio(m.predicted_tokens_per_s, m.tokens_per_s)}"
        )
    else:
        lines.append(
            f"  tokens/s: too few logged steps after the warm-up ({m.warmup}) for a steady figure; "
            f"measure more steps (--steps)"
        )
    peak = m.peak_gib
    verdict = "fits" if m.fits else "DOES NOT FIT"
    shown = "no peak recorded" if peak is None else f"{peak:.2f} GiB"
    lines.append(
        f"  memory: worst {unit} {shown} of {m.usable_gib:.2f} GiB usable "
        f"({HEADROOM:.0%} of {m.device_gib:g} GiB): {verdict}"
    )
    if m.device == "cpu":
        lines.append("  (cpu preset: the peak is the process's host RSS; the planner's figure is RAM per process)")
    return "\n".join(lines)

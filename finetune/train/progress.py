"""One readable console line per logged step (rank 0), instead of the Trainer's dict dumps and a
carriage-return progress bar that turns into noise once the output goes through the launcher."""

from __future__ import annotations

import time

from transformers import TrainerCallback


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60:02d}:{rest % 60:02d}"


class ConsoleProgress(TrainerCallback):
    def __init__(self):
        self._start = time.perf_counter()
        self._start_step = 0
        self._last = (time.perf_counter(), 0)

    def on_train_begin(self, args, state, control, **kwargs):
        self._start, self._start_step = time.perf_counter(), state.global_step
        self._last = (self._start, state.num_input_tokens_seen or 0)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        step, total = state.global_step, state.max_steps
        if "eval_loss" in logs:
            where = f"step {step}/{total}" if total else "before training"
            print(f"[finetune] {where}  eval loss {logs['eval_loss']:.4f}", flush=True)
            return
        if "loss" not in logs:
            return
        now, seen = time.perf_counter(), state.num_input_tokens_seen or 0
        rate = (seen - self._last[1]) / (now - self._last[0]) if now > self._last[0] and seen else 0.0
        self._last = (now, seen)
        done = step - self._start_step
        eta = (now - self._start) / done * (total - step) if done else 0.0
        parts = [f"step {step}/{total}", f"loss {logs['loss']:.4f}"]
        if logs.get("grad_norm") is not None:
            parts.append(f"grad norm {logs['grad_norm']:.3g}")
        if logs.get("learning_rate") is not None:
            parts.append(f"lr {logs['learning_rate']:.3g}")
        if rate:
            parts.append(f"{rate:,.0f} tokens/s")
        parts.append(f"eta {_duration(eta)}")
        print("[finetune] " + "  ".join(parts), flush=True)

"""The wall-time budget of a run (`train.max_minutes`), Lightning's `max_time` in this app's terms.

The clock counts the training loop: its steps, periodic evaluations and checkpoints; setup before the
loop and the final evaluation and export after it are not counted. The time used so far is
`TrainingProgress.seconds_trained` (progress.json), so a resumed run goes on counting from its
checkpoint. Only the main process's clock decides: the loop hands that decision to the stop agreement
every step already makes for preemption (`runtime.PreemptionGuard.agree`), one collective for both, so
every process stops at the same step.
"""

from __future__ import annotations

import time

from finetune.core import faults


class TimeBudget:
    """Seconds used by the training loop (resumed from a checkpoint's count) against `max_minutes`."""

    def __init__(self, max_minutes: float | None, used_s: float = 0.0, step: int = 0) -> None:
        self.limit_s = None if max_minutes is None else max_minutes * 60.0
        self._base, self._step0, self._started = used_s, step, time.monotonic()

    def used(self, step: int) -> float:
        """Seconds used at optimizer step `step`: the count the run resumed with plus this process's time since."""
        fake = faults.value("clock_step_seconds")  # tests: a clock that advances per step, never by sleeping
        if fake is not None:
            return self._base + fake * (step - self._step0)
        return self._base + time.monotonic() - self._started

    def spent(self, used_s: float) -> bool:
        """True once `used_s` reaches the budget (never without one)."""
        return self.limit_s is not None and used_s >= self.limit_s

    def line(self, step: int, used_s: float) -> str:
        """The log line of a run the budget ended."""
        return (
            f"time budget of {self.limit_s / 60:g} minutes (train.max_minutes) spent at step {step} "
            f"({used_s / 60:.1f} minutes of training): stopping; final/ holds the best checkpoint "
            "(the run is finished: a larger budget on resume trains no further)"
        )

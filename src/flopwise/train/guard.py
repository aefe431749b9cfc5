"""Loss-spike and NaN guard: decide, from every rank's view of a step, whether to apply its update.

A non-finite loss or gradient norm skips the update (the weights and optimizer state do not move);
`guard.max_skips` such steps in a row, or a loss spike (one-sided z-score of the loss against the
running window of accepted losses, above `guard.spike_zscore`), rolls back to the last checkpoint
and skips data past the bad batch, PaLM's recipe (Chowdhery et al. 2022 §5.1: restart ~100 steps
before the spike, skip 200-500 batches). The rollbacks are capped. The window and counters are
saved in every checkpoint, so a resumed run judges spikes as the uninterrupted one would.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from enum import Enum

from flopwise.config.schema import GuardConfig
from flopwise.errors import TrainingStopped


class Verdict(Enum):
    APPLY = "apply"
    SKIP = "skip"
    ROLLBACK = "rollback"


class Guard:
    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.skips = 0
        self.rollbacks = 0

    def zscore(self, loss: float) -> float:
        """How far above the window's mean this loss is, in window std (floored at 1% of the mean,
        so a flat window does not turn noise into spikes); 0 until min_window losses are in."""
        if not self.cfg.enabled or len(self.losses) < self.cfg.min_window or not math.isfinite(loss):
            return 0.0
        mean = statistics.fmean(self.losses)
        std = max(statistics.pstdev(self.losses), 0.01 * abs(mean), 1e-8)
        return (loss - mean) / std

    def is_spike(self, loss: float) -> bool:
        return self.zscore(loss) > self.cfg.spike_zscore

    def decide(self, loss: float, nonfinite: bool, spike: bool) -> tuple[Verdict, str]:
        """The verdict on a step given what any rank saw (every rank calls this with the same flags)."""
        if not self.cfg.enabled:
            return Verdict.APPLY, ""
        if nonfinite:
            self.skips += 1
            if self.skips >= self.cfg.max_skips:
                return Verdict.ROLLBACK, f"{self.skips} consecutive non-finite steps"
            return Verdict.SKIP, "non-finite loss or gradient norm"
        if spike:
            return Verdict.ROLLBACK, f"loss spike {loss:.4f} (z={self.zscore(loss):.1f} > {self.cfg.spike_zscore:g})"
        self.skips = 0
        self.losses.append(loss)
        return Verdict.APPLY, ""

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "skips": self.skips, "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict | None, counters: bool = True) -> None:
        """Restore the loss window (and, on a resume, the counters; a rollback keeps counting)."""
        if not state:
            return
        self.losses = deque(state.get("losses", []), maxlen=self.cfg.window)
        if counters:
            self.skips, self.rollbacks = int(state.get("skips", 0)), int(state.get("rollbacks", 0))

    def rolled_back(self, reason: str, step: int) -> None:
        """Count a rollback; past the cap, stop with what to do about it."""
        self.rollbacks += 1
        self.skips = 0
        if self.rollbacks > self.cfg.max_rollbacks:
            raise TrainingStopped(
                f"stopped at step {step}: {reason}, after guard.max_rollbacks="
                f"{self.cfg.max_rollbacks} rollbacks; lower optim.lr, check the data "
                "recorded in skipped.jsonl, or raise guard.max_rollbacks"
            )

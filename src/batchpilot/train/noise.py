"""Gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training").

From the squared norms of two unbiased gradient estimates at batch sizes `b_small < b_big`:
    |G|^2 ~ (b_big |g_big|^2 - b_small |g_small|^2) / (b_big - b_small)
    S     ~ (|g_small|^2 - |g_big|^2) / (1 / b_small - 1 / b_big)
and `B_simple = S / |G|^2`, the critical batch size estimate. Both estimates are noisy, so they are
smoothed separately with bias-corrected exponential moving averages before taking the ratio.

The trainer gets the two norms for free: `g_small` is each rank's local gradient before the all-reduce
(or, on one rank, the first micro-batch's gradient; under fsdp the first pass over all ranks, under hsdp
over a node's ranks: train/step.py), `g_big` is the all-reduced global gradient. Both stay on the device
until the step's one host synchronisation (trainer.py); the arithmetic here is on host numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


def noise_terms(*, small_sq_norm: float, big_sq_norm: float, b_small: int, b_big: int) -> tuple[float, float]:
    """Unbiased single-step estimates (|G|^2, S)."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got {b_small}, {b_big}")
    g2 = (b_big * big_sq_norm - b_small * small_sq_norm) / (b_big - b_small)
    s = (small_sq_norm - big_sq_norm) / (1 / b_small - 1 / b_big)
    return g2, s


@dataclass
class NoiseScaleEMA:
    """Bias-corrected moving averages of |G|^2 and S; `value` is B_simple (None until measurable)."""

    decay: float = 0.95
    _g2: float = 0.0
    _s: float = 0.0
    _weight: float = 0.0

    def update(self, *, small_sq_norm: float, big_sq_norm: float, b_small: int, b_big: int) -> float | None:
        g2, s = noise_terms(
            small_sq_norm=small_sq_norm, big_sq_norm=big_sq_norm, b_small=b_small, b_big=b_big
        )
        return self.add(g2=g2, s=s)

    def add(self, *, g2: float, s: float) -> float | None:
        """Adds one step's unbiased estimates (`noise_terms`); returns the smoothed B_simple."""
        self._g2 = self.decay * self._g2 + (1 - self.decay) * g2
        self._s = self.decay * self._s + (1 - self.decay) * s
        self._weight = self.decay * self._weight + (1 - self.decay)
        return self.value

    def state_dict(self) -> dict[str, float]:
        """The moving averages, for checkpoints (the estimate continues exactly after a resume)."""
        return {"decay": self.decay, "g2": self._g2, "s": self._s, "weight": self._weight}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.decay, self._g2, self._s, self._weight = state["decay"], state["g2"], state["s"], state["weight"]

    @property
    def value(self) -> float | None:
        if self._weight == 0.0:
            return None
        g2 = self._g2 / self._weight
        s = self._s / self._weight
        return s / g2 if g2 > 0 and s > 0 else None

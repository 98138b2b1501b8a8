"""Learning rate as a function of consumed samples (never steps, so a ramp-up cannot shift it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

LRScaling = Literal["none", "linear", "sqrt"]
LRDecay = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True)
class LRSchedule:
    """Peak LR scaled by the global batch, linear warmup and decay, all in samples.

    Attributes:
        lr: peak learning rate at `reference_batch`.
        scaling: how the peak LR follows the global batch: none, linear (b/ref) or sqrt (sqrt(b/ref)).
        reference_batch: global batch size at which `lr` applies unscaled.
        warmup_samples: linear warmup from 0 over this many consumed samples.
        decay: shape after warmup until `decay_end_samples`.
        decay_end_samples: consumed samples at which the decay reaches `min_lr_ratio x peak`.
        min_lr_ratio: floor of the decay, as a fraction of the (scaled) peak.
    """

    lr: float
    scaling: LRScaling
    reference_batch: int
    warmup_samples: int
    decay: LRDecay
    decay_end_samples: int
    min_lr_ratio: float

    def peak(self, global_batch_size: int) -> float:
        """The peak LR for a stage at `global_batch_size` (the per-stage scaling rule)."""
        ratio = global_batch_size / self.reference_batch
        if self.scaling == "linear":
            return self.lr * ratio
        if self.scaling == "sqrt":
            return self.lr * math.sqrt(ratio)
        return self.lr

    def factor(self, consumed_samples: int) -> float:
        """Warmup/decay multiplier in [0, 1] at `consumed_samples`."""
        if consumed_samples < self.warmup_samples:
            return (consumed_samples + 1) / self.warmup_samples
        if self.decay == "constant" or self.decay_end_samples <= self.warmup_samples:
            return 1.0
        progress = min(
            1.0, (consumed_samples - self.warmup_samples) / (self.decay_end_samples - self.warmup_samples)
        )
        shape = 1.0 - progress if self.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape

    def at(self, *, consumed_samples: int, global_batch_size: int) -> float:
        """The LR of the optimizer step that starts at `consumed_samples` with `global_batch_size`."""
        return self.peak(global_batch_size) * self.factor(consumed_samples)

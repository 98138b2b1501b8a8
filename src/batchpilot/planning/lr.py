"""Learning rate as a function of consumed samples (never steps, so a ramp-up cannot shift it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

LRScaling = Literal["none", "linear", "sqrt", "seesaw"]
LRDecay = Literal["constant", "linear", "cosine", "wsd"]
WSDShape = Literal["linear", "cosine", "1-sqrt"]
WSD_DEFAULT_FRACTION = 0.2
WSD_DEFAULT_SHAPE: WSDShape = "1-sqrt"
"""Warmup-stable-decay's defaults: a cooldown over the last 20% of the span with a 1-sqrt shape, the setting
Hägele et al. (2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations") found to
match a cosine schedule's final loss."""


@dataclass(frozen=True)
class LRSchedule:
    """Peak LR scaled by the global batch, linear warmup and decay, all in samples.

    Attributes:
        lr: peak learning rate at `reference_batch`.
        scaling: how the peak LR follows the global batch: none, linear (b/ref), sqrt (sqrt(b/ref)) or seesaw
            (sqrt(ref/b): the batch grew where a step decay would have cut the LR; `ref` is the start batch).
        reference_batch: global batch size at which `lr` applies unscaled.
        warmup_samples: linear warmup from 0 over this many consumed samples.
        decay: shape after warmup until `decay_end_samples`; wsd (warmup-stable-decay) holds the peak until the
            last `wsd_fraction` of the span from the warmup's end to `decay_end_samples`, then decays with
            `wsd_shape`.
        decay_end_samples: consumed samples at which the decay reaches `min_lr_ratio x peak`.
        min_lr_ratio: floor of the decay, as a fraction of the (scaled) peak.
        wsd_fraction, wsd_shape: wsd's decay share and shape (None: the defaults above; unused otherwise).
        lr_cuts, lr_cut_factor: a step decay (Seesaw's cuts after its batch is at the target): the factor is
            divided by `lr_cut_factor` at each of these consumed samples (None: no cut).
    """

    lr: float
    scaling: LRScaling
    reference_batch: int
    warmup_samples: int
    decay: LRDecay
    decay_end_samples: int
    min_lr_ratio: float
    wsd_fraction: float | None = None
    wsd_shape: WSDShape | None = None
    lr_cuts: tuple[int, ...] | None = None
    lr_cut_factor: float | None = None

    def peak(self, global_batch_size: int) -> float:
        """The peak LR for a stage at `global_batch_size` (the per-stage scaling rule)."""
        ratio = global_batch_size / self.reference_batch
        if self.scaling == "linear":
            return self.lr * ratio
        if self.scaling == "sqrt":
            return self.lr * math.sqrt(ratio)
        if self.scaling == "seesaw":
            return self.lr / math.sqrt(ratio)
        return self.lr

    def factor(self, consumed_samples: int) -> float:
        """Warmup/decay multiplier in [0, 1] at `consumed_samples`."""
        if consumed_samples < self.warmup_samples:
            return (consumed_samples + 1) / self.warmup_samples
        if self.lr_cuts:  # a step decay (Seesaw's, config check keeps lr_decay constant beside it)
            assert self.lr_cut_factor is not None
            return float(self.lr_cut_factor ** -sum(1 for cut in self.lr_cuts if consumed_samples >= cut))
        if self.decay == "constant" or self.decay_end_samples <= self.warmup_samples:
            return 1.0
        start, kind = float(self.warmup_samples), str(self.decay)
        if self.decay == "wsd":  # stable at the peak, then the decay over the span's last part
            fraction = WSD_DEFAULT_FRACTION if self.wsd_fraction is None else self.wsd_fraction
            start = self.decay_end_samples - fraction * (self.decay_end_samples - self.warmup_samples)
            kind = self.wsd_shape or WSD_DEFAULT_SHAPE
            if consumed_samples < start:
                return 1.0
        progress = min(1.0, (consumed_samples - start) / (self.decay_end_samples - start))
        if kind == "linear":
            shape = 1.0 - progress
        elif kind == "1-sqrt":
            shape = 1.0 - math.sqrt(progress)
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape

    def at(self, *, consumed_samples: int, global_batch_size: int) -> float:
        """The LR of the optimizer step that starts at `consumed_samples` with `global_batch_size`."""
        return self.peak(global_batch_size) * self.factor(consumed_samples)

"""The gradient noise scale estimator recovers B_simple = tr(Sigma) / |G|^2."""

import random

import pytest

from batchpilot.train.noise import NoiseScaleEMA, noise_terms


def expected_sq_norm(*, g2: float, trace: float, batch: int) -> float:
    """E|g_B|^2 = |G|^2 + tr(Sigma) / B for an unbiased gradient estimate from B samples."""
    return g2 + trace / batch


def test_noise_terms_are_exact_on_expectations():
    g2, s = noise_terms(
        small_sq_norm=expected_sq_norm(g2=4.0, trace=800.0, batch=8),
        big_sq_norm=expected_sq_norm(g2=4.0, trace=800.0, batch=64),
        b_small=8,
        b_big=64,
    )
    assert g2 == pytest.approx(4.0)
    assert s == pytest.approx(800.0)


def test_ema_converges_on_noisy_measurements():
    rng = random.Random(0)
    ema = NoiseScaleEMA(decay=0.99)
    for _ in range(3000):
        small = expected_sq_norm(g2=2.0, trace=512.0, batch=16) * rng.uniform(0.7, 1.3)
        big = expected_sq_norm(g2=2.0, trace=512.0, batch=128) * rng.uniform(0.9, 1.1)
        ema.update(small_sq_norm=small, big_sq_norm=big, b_small=16, b_big=128)
    assert ema.value == pytest.approx(256.0, rel=0.15)


def test_needs_two_batch_sizes():
    with pytest.raises(ValueError):
        noise_terms(small_sq_norm=1, big_sq_norm=1, b_small=8, b_big=8)
    assert NoiseScaleEMA().value is None

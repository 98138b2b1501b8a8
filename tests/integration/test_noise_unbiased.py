"""#38: the noise scale from the data-parallel ranks' own gradients is unbiased, checked against exact
per-example gradients; and measuring changes no weight.

A population of 48 sequences; the tiny GPT's gradient of each, in one process, gives the true gradient G (their
mean) and the trace of the per-example covariance tr(Sigma) (the mean of |g_i - G|^2). Then 2 gloo processes
under fsdp, micro batch 1 x accumulation 2, run `accumulate_gradients` (the trainer's passes, the reduce-scatter
read included) on batches drawn with replacement from the population, the weights fixed: each step's |G|^2 and
S (`noise_terms` of the ranks' mean small-batch squared norm at batch 1 and the reduced gradient's at batch
4) average to the exact values within 4 standard errors of the steps' spread. An estimator that forgot the
accumulation's 1/2 on each pass, or took the small batch for the pass over all ranks, is off by 2x or more.
"""

from __future__ import annotations

import contextlib
import os
import statistics

import pytest
import torch
import torch.distributed as dist
from test_sharding_units import _join, already_real, build, mean_loss_gradient, spawn

from batchpilot.train.noise import noise_terms
from batchpilot.train.parallel import gradients, squared_norm_tensor, wrap_model
from batchpilot.train.step import accumulate_gradients

pytestmark = pytest.mark.slow

POPULATION, WORLD, MICRO, ACCUMULATION, STEPS = 48, 2, 1, 2, 100


def population() -> torch.Tensor:
    return torch.randint(0, 64, (POPULATION, 17), generator=torch.Generator().manual_seed(3))


def draws(step: int) -> torch.Tensor:
    """The step's global batch: indices drawn with replacement (every rank draws the same)."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, POPULATION, (MICRO * WORLD * ACCUMULATION,), generator=generator)


def _worker(rank: int, world_size: int, per_node: int, port: int, out: str) -> None:
    ctx = _join(rank, world_size, per_node, port)
    model = build("gpt")
    parallel = wrap_model(model, ctx, strategy="fsdp", bf16=False, materialize=already_real)
    samples, terms = population(), []
    for step in range(STEPS):
        chosen = samples[draws(step)]
        per_pass = MICRO * world_size
        passes = [
            chosen[a * per_pass + rank * MICRO : a * per_pass + (rank + 1) * MICRO]
            for a in range(ACCUMULATION)
        ]
        outcome = accumulate_gradients(
            model=model, parallel=parallel, micro_batches=passes, ctx=ctx, autocast=contextlib.nullcontext,
            measure_noise=True, measure_coherence=False,
        )  # fmt: skip
        small = outcome.small_sq_norm.clone()
        dist.all_reduce(small)  # the ranks' mean, as read_step takes it
        big = squared_norm_tensor(gradients(model), group=parallel.shard_group)
        terms.append(
            noise_terms(
                small_sq_norm=float(small) / world_size,
                big_sq_norm=float(big),
                b_small=outcome.small_batch,
                b_big=MICRO * world_size * ACCUMULATION,
            )
        )
        model.zero_grad(set_to_none=True)
    torch.save(terms, f"{out}.rank{rank}")
    dist.destroy_process_group()


def test_local_gradient_noise_terms_average_to_the_exact_ones(tmp_path):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)
    terms = spawn(_worker, WORLD, WORLD, tmp_path / "result")[0]
    model = build("gpt")
    per_example = [
        torch.cat([g.double().flatten() for g in mean_loss_gradient(model, sample[None])])
        for sample in population()
    ]
    mean = torch.stack(per_example).mean(0)
    exact_g2 = float(mean.pow(2).sum())
    exact_s = float(torch.stack([(g - mean).pow(2).sum() for g in per_example]).mean())
    for k, exact in ((0, exact_g2), (1, exact_s)):
        values = [t[k] for t in terms]
        error = statistics.stdev(values) / len(values) ** 0.5
        assert abs(statistics.fmean(values) - exact) < 4 * error, (k, statistics.fmean(values), exact, error)
    # The test can tell an estimator 2x off apart: S's spread is a small part of S.
    assert 4 * statistics.stdev(t[1] for t in terms) / len(terms) ** 0.5 < 0.5 * exact_s


def _same_weights_worker(rank: int, world_size: int, per_node: int, port: int, out: str) -> None:
    """Two copies of the model under fsdp, trained 3 steps on the same batches, one measuring: their shards
    must be bitwise equal."""
    ctx = _join(rank, world_size, per_node, port)
    trained = []
    for measure in (True, False):
        model = build("gpt")
        parallel = wrap_model(model, ctx, strategy="fsdp", bf16=False, materialize=already_real)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        samples = population()
        for step in range(3):
            chosen = samples[draws(step)]
            per_pass = MICRO * world_size
            passes = [chosen[a * per_pass + rank * MICRO :][:MICRO] for a in range(ACCUMULATION)]
            outcome = accumulate_gradients(
                model=model, parallel=parallel, micro_batches=passes, ctx=ctx, autocast=contextlib.nullcontext,
                measure_noise=measure, measure_coherence=False,
            )  # fmt: skip
            assert (outcome.small_sq_norm is not None) == measure
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        trained.append([p.detach().to_local().clone() for p in model.parameters()])
    torch.save(all(torch.equal(a, b) for a, b in zip(*trained, strict=True)), f"{out}.rank{rank}")
    dist.destroy_process_group()


def test_measuring_changes_no_weight(tmp_path):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)
    assert spawn(_same_weights_worker, WORLD, WORLD, tmp_path / "result") == [True] * WORLD

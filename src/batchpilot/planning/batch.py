"""Batch arithmetic: global = micro x data_parallel x accumulation, loading hosts, pipeline microbatches."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from batchpilot.errors import BatchpilotError


class Problems(BatchpilotError):
    """Several problems found at once; printed one `field: problem (fix: ...)` line each.

    `field`, `problem` and `fix` are the first problem's, so code that reads one error still works.
    """

    def __init__(self, problems: Sequence[BatchpilotError]) -> None:
        assert problems, "Problems needs at least one problem"
        self.problems: tuple[BatchpilotError, ...] = tuple(
            line
            for problem in problems
            for line in (problem.problems if isinstance(problem, Problems) else (problem,))
        )
        first = self.problems[0]
        super().__init__(first.field, first.problem, first.fix)

    def __str__(self) -> str:
        return "\n".join(str(problem) for problem in self.problems)


def raise_problems(problems: Sequence[BatchpilotError]) -> None:
    """Raises the one problem as itself, several as `Problems`; nothing when there are none."""
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise Problems(problems)


def split_problems(error: BatchpilotError) -> list[BatchpilotError]:
    """The single problems an error holds (itself, or the lines of a `Problems`)."""
    return list(error.problems) if isinstance(error, Problems) else [error]


def gradient_accumulation_steps(
    *, global_batch_size: int, micro_batch_size: int, data_parallel_size: int
) -> int:
    """global_batch_size / (micro_batch_size x data_parallel_size), which must be a whole number."""
    per_pass = micro_batch_size * data_parallel_size
    if micro_batch_size <= 0 or data_parallel_size <= 0:
        raise BatchpilotError("batch.micro_batch_size", "micro batch and data-parallel size must be positive")
    if global_batch_size % per_pass:
        raise BatchpilotError(
            "batch.global_batch_size",
            f"{global_batch_size} is not divisible by micro_batch_size {micro_batch_size} x "
            f"data_parallel_size {data_parallel_size} = {per_pass}",
            f"use a multiple of {per_pass}, e.g. {max(per_pass, global_batch_size // per_pass * per_pass)}",
        )
    return global_batch_size // per_pass


def global_batch_to_load(*, global_batch_size: int, expansion_factor: Fraction) -> int:
    """MaxText's global_batch_to_load = global_batch_size x expansion_factor_real_data (must be whole)."""
    value = global_batch_size * expansion_factor
    if value.denominator != 1:
        raise BatchpilotError(
            "data.expansion_factor_real_data",
            f"{global_batch_size} x {expansion_factor} is not a whole number of samples",
            "pick a factor that makes global_batch_size x factor an integer",
        )
    return int(value)


def num_loading_hosts(*, num_hosts: int, expansion_factor: Fraction, samples_per_host_pass: int) -> int:
    """How many hosts read storage when a factor f > 1 is set: num_hosts / f, each a whole share.

    Each loading host reads its own share and that of (f - 1) peers per forward/backward pass, so
    `num_hosts / f` must be whole and `samples_per_host_pass x f` must be whole too. For f <= 1 every host
    reads its own share (f < 1 only shrinks global_batch_to_load, as in MaxText).
    """
    field = "data.expansion_factor_real_data"
    if expansion_factor <= 1:
        return num_hosts
    hosts = Fraction(num_hosts) / expansion_factor
    if hosts.denominator != 1:
        raise BatchpilotError(
            field,
            f"{num_hosts} host(s) / factor {expansion_factor} leaves a fractional number of loading hosts",
            f"use a factor that divides the node count {num_hosts}",
        )
    share = samples_per_host_pass * expansion_factor
    if share.denominator != 1:
        raise BatchpilotError(
            field,
            f"a loading host's share ({samples_per_host_pass} x {expansion_factor}) is fractional",
            "use a whole-number factor",
        )
    return int(hosts)


def check_pipeline_microbatches(
    *, num_pipeline_microbatches: int, pipeline_parallel_size: int, per_pass_batch: int
) -> None:
    """num_pipeline_microbatches must be a multiple of the pipeline stages and divide the per-pass batch."""
    field = "batch.num_pipeline_microbatches"
    if num_pipeline_microbatches % pipeline_parallel_size:
        raise BatchpilotError(
            field,
            f"{num_pipeline_microbatches} is not a multiple of pipeline_parallel_size {pipeline_parallel_size}",
            f"use a multiple of {pipeline_parallel_size}",
        )
    if per_pass_batch % num_pipeline_microbatches:
        raise BatchpilotError(
            field,
            f"{num_pipeline_microbatches} does not divide the per-pass batch "
            f"(micro_batch_size x data_parallel_size = {per_pass_batch})",
            "use a divisor of that batch",
        )

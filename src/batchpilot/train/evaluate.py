"""Validation loss: the mean token loss of a fixed set of validation samples, at stage ends and every N samples.

`Validator` reads its samples once, when the trainer starts: the first `train.eval_samples` samples of the
shard set's `validation` split in file order (no shuffle), so every evaluation sees the same ones and
losses are comparable across steps, stages and world sizes. Data-parallel rank r (a process under eager,
a device under XLA) holds samples `[r x share, (r + 1) x share)` (share = eval_samples / world, in memory
on the CPU, int32) and runs them in micro-batches of the training micro batch, the last one possibly
smaller; every rank runs the same number of forward passes, which FSDP/HSDP need (their forward
all-gathers parameters). The mean is weighted by tokens, so the result does not depend on the world size
or the micro batch. How the passes run and how the ranks' sums meet is the runtime's
(`Runtime.validation_loss`).

`eval_samples` is rounded down to a multiple of the world size (at least one sample per rank) and capped
at the validation split's size (samples past its end would repeat); rank 0 logs the count it uses.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch import nn

from batchpilot.config import Config
from batchpilot.data.loader import TokenLoader
from batchpilot.data.shards import MANIFEST_NAME, read_manifest
from batchpilot.errors import BatchpilotError
from batchpilot.storage import join_uri, open_storage
from batchpilot.train.runtime import Evaluation, Runtime

logger = logging.getLogger(__name__)

SPLIT = "validation"


def evaluation_due(
    *, consumed_before: int, consumed_after: int, stage_end: bool, eval_samples: int, eval_every_samples: int
) -> bool:
    """Whether a step from `consumed_before` to `consumed_after` samples ends with an evaluation: at a
    stage's end, or when it crossed a multiple of `eval_every_samples` (0: stage ends only); never when
    `eval_samples` is 0."""
    if eval_samples == 0:
        return False
    if stage_end:
        return True
    every = eval_every_samples
    return every > 0 and consumed_before // every < consumed_after // every


def samples_per_rank(*, eval_samples: int, split_samples: int, world_size: int) -> int:
    """Validation samples each rank evaluates: `eval_samples` over the ranks, rounded down (at least one),
    capped at an even share of the split's `split_samples`."""
    share = min(max(1, eval_samples // world_size), split_samples // world_size)
    if share == 0:
        raise BatchpilotError(
            "train.eval_samples",
            f"the validation split holds {split_samples} sample(s), fewer than the {world_size} ranks",
            "prepare the data with a larger --validation-fraction, or set train.eval_samples: 0",
        )
    return share


def check_validation_split(uri: str) -> None:
    """Raises BatchpilotError naming `train.eval_samples` when the shard set at `uri` has no validation split."""
    storage = open_storage(uri)
    if not read_manifest(storage).splits.get(SPLIT):
        raise BatchpilotError(
            "train.eval_samples",
            f"asks for validation loss but {join_uri(storage.uri, MANIFEST_NAME)} has no validation split",
            "set train.eval_samples: 0, or prepare the data with --validation-fraction > 0 "
            "(batchpilot data prepare ... --validation-fraction 0.01)",
        )


class Validator:
    """The validation samples of this process and when to evaluate them; one per trainer process.

    Every process constructs it at the same point of the program (its loader may create a process group,
    `data.expansion_factor_real_data` > 1), before training starts, so a missing validation split fails
    the job before the first step.
    """

    def __init__(
        self,
        *,
        uri: str,
        seq_len: int,
        eval_samples: int,
        eval_every_samples: int,
        runtime: Runtime,
        expansion_factor: float = 1.0,
        verify_checksums: bool = True,
    ) -> None:
        """Reads this process's validation samples (nothing when `eval_samples` is 0).

        Args:
            uri: the shard set (`data.uri`).
            seq_len: tokens the model sees per sample (`data.seq_len`).
            eval_samples: `train.eval_samples`, validation samples per evaluation over all ranks; 0 turns
                validation off.
            eval_every_samples: `train.eval_every_samples`; 0 evaluates at stage ends only.
            runtime: this process's place in the job and how its passes run.
            expansion_factor: `data.expansion_factor_real_data` (which hosts read storage).
            verify_checksums: `data.verify_checksums`.

        Raises:
            BatchpilotError: naming `train.eval_samples` when the shard set has no validation split, or
                one smaller than the world size.
        """
        self.eval_samples, self.eval_every_samples, self.runtime = eval_samples, eval_every_samples, runtime
        self.num_samples = 0
        """Samples per evaluation over all ranks (after rounding and capping)."""
        self._rows: torch.Tensor | None = None
        if eval_samples == 0:
            return
        check_validation_split(uri)
        rank, readers, per_node = runtime.place.reader
        world = runtime.place.world_size
        loader = TokenLoader(
            uri=uri,
            seq_len=seq_len,
            seed=0,  # unused: file order
            split=SPLIT,
            rank=rank,
            world_size=readers,
            local_world_size=per_node,
            expansion_factor=expansion_factor,
            prefetch_steps=0,
            shuffle=False,
            verify_checksums=verify_checksums,
        )
        try:
            share = samples_per_rank(
                eval_samples=eval_samples, split_samples=loader.num_samples, world_size=world
            )
            (rows,) = loader.micro_batches(
                consumed_samples=0,
                global_batch_size=share * world,
                micro_batch_size=runtime.place.rows_per_pass(share),
                gradient_accumulation_steps=1,
            )
        finally:
            loader.close()  # the samples stay in memory: the loader's thread and files are not needed any more
        self._rows = rows.to(torch.int32)
        self.num_samples = share * world
        if runtime.place.is_main:
            self._log_count(world)

    @classmethod
    def from_config(cls, config: Config, runtime: Runtime) -> Validator:
        """The validator of a run's `train.eval_samples`, `train.eval_every_samples` and `data` settings."""
        return cls(
            uri=config.data.uri,
            seq_len=config.data.seq_len,
            eval_samples=config.train.eval_samples,
            eval_every_samples=config.train.eval_every_samples,
            runtime=runtime,
            expansion_factor=config.data.expansion_factor_real_data,
            verify_checksums=config.data.verify_checksums,
        )

    @property
    def enabled(self) -> bool:
        return self.num_samples > 0

    def due(self, consumed_before: int, consumed_after: int, *, stage_end: bool) -> bool:
        """Whether the step that took consumed samples from `consumed_before` to `consumed_after` ends with
        an evaluation (see `evaluation_due`). The same on every rank: it depends only on the counters."""
        return evaluation_due(
            consumed_before=consumed_before,
            consumed_after=consumed_after,
            stage_end=stage_end,
            eval_samples=self.num_samples,
            eval_every_samples=self.eval_every_samples,
        )

    def evaluate(
        self,
        model: nn.Module,
        *,
        micro_batch_size: int,
        autocast: Callable[[], contextlib.AbstractContextManager],
    ) -> float:
        """The mean token loss of the validation samples over all ranks (every process calls it together).

        Args:
            model: the module the trainer trains, put in eval mode for the passes, then back in its mode.
            micro_batch_size: samples per forward pass and device (the stage's training micro batch fits).
            autocast: the trainer's autocast factory.
        """
        assert self._rows is not None, "validation is off (train.eval_samples: 0)"
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                evaluation = Evaluation(micro_batch_size, autocast, self.num_samples)
                return self.runtime.validation_loss(model, self._rows, evaluation)
        finally:
            model.train(was_training)

    def _log_count(self, world_size: int) -> None:
        """The main process: how many samples each evaluation uses, why not `eval_samples`, and when."""
        ranks = "devices" if self.runtime.name == "xla" else "ranks"
        when = (
            f"every {self.eval_every_samples:,} samples and at each stage's end"
            if self.eval_every_samples
            else "at each stage's end"
        )
        why = ""
        if self.num_samples != self.eval_samples:
            why = (
                f" (train.eval_samples {self.eval_samples:,} rounded to a multiple of {world_size} {ranks}, at "
                "most the validation split)"
            )
        logger.info(
            "validation loss: %s samples of the validation split over %d %s%s, %s",
            f"{self.num_samples:,}", world_size, ranks, why, when,
        )  # fmt: skip

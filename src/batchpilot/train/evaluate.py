"""Validation loss: the mean token loss of a fixed set of validation samples, at stage ends and every N samples.

`Validator` reads its samples once, when the trainer starts: the first `train.eval_samples` samples of the
shard set's `validation` split in file order (no shuffle), so every evaluation sees the same ones and
losses are comparable across steps, stages and world sizes. Rank r holds samples `[r x share, (r + 1) x
share)` (share = eval_samples / world, in memory on the CPU, int32) and runs them in micro-batches of the
training micro batch, the last one possibly smaller; every rank runs the same number of forward passes,
which FSDP/HSDP need (their forward all-gathers parameters). The mean is weighted by tokens, so the result
does not depend on the world size or the micro batch.

`eval_samples` is rounded down to a multiple of the world size (at least one sample per rank) and capped
at the validation split's size (samples past its end would repeat); rank 0 logs the count it uses.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from batchpilot.config import Config
from batchpilot.data.loader import TokenLoader
from batchpilot.data.shards import MANIFEST_NAME, read_manifest
from batchpilot.errors import BatchpilotError
from batchpilot.storage import join_uri, open_storage
from batchpilot.train.distributed import DistContext
from batchpilot.train.step import micro_batch_loss

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


class ValidatorBase:
    """What the eager and the XLA validators share: when to evaluate, the count they log, and the model in
    eval mode without gradients for the passes."""

    eval_samples: int
    eval_every_samples: int
    num_samples: int = 0
    """Samples per evaluation over all ranks (after rounding and capping)."""

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
            micro_batch_size: samples per forward pass (the stage's training micro batch fits).
            autocast: the trainer's autocast factory.
        """
        raise NotImplementedError

    @staticmethod
    @contextlib.contextmanager
    def evaluating(model: nn.Module) -> Iterator[None]:
        """`model` in eval mode without gradients, then back in its mode."""
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            model.train(was_training)

    def log_count(self, world_size: int, ranks: str) -> None:
        """The main process: how many samples each evaluation uses, why not `eval_samples`, and when."""
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


class Validator(ValidatorBase):
    """This rank's share of the validation samples and when to evaluate them; one per trainer process.

    Every rank constructs it at the same point of the program (its loader may create a process group,
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
        ctx: DistContext,
        expansion_factor: float = 1.0,
        verify_checksums: bool = True,
    ) -> None:
        """Reads this rank's validation samples (nothing when `eval_samples` is 0).

        Args:
            uri: the shard set (`data.uri`).
            seq_len: tokens the model sees per sample (`data.seq_len`).
            eval_samples: `train.eval_samples`, validation samples per evaluation over all ranks; 0 turns
                validation off.
            eval_every_samples: `train.eval_every_samples`; 0 evaluates at stage ends only.
            ctx: this process's rank and device.
            expansion_factor: `data.expansion_factor_real_data` (which hosts read storage).
            verify_checksums: `data.verify_checksums`.

        Raises:
            BatchpilotError: naming `train.eval_samples` when the shard set has no validation split, or
                one smaller than the world size.
        """
        self.eval_samples, self.eval_every_samples, self.ctx = eval_samples, eval_every_samples, ctx
        self._tokens: torch.Tensor | None = None
        self._loader: TokenLoader | None = None
        if eval_samples == 0:
            return
        check_validation_split(uri)
        self._loader = TokenLoader(
            uri=uri,
            seq_len=seq_len,
            seed=0,  # unused: file order
            split=SPLIT,
            rank=ctx.rank,
            world_size=ctx.world_size,
            local_world_size=ctx.local_world_size,
            expansion_factor=expansion_factor,
            prefetch_steps=0,
            shuffle=False,
            verify_checksums=verify_checksums,
        )
        try:
            share = samples_per_rank(
                eval_samples=eval_samples, split_samples=self._loader.num_samples, world_size=ctx.world_size
            )
            (tokens,) = self._loader.micro_batches(
                consumed_samples=0,
                global_batch_size=share * ctx.world_size,
                micro_batch_size=share,
                gradient_accumulation_steps=1,
            )
        finally:
            self.close()  # the samples stay in memory: the loader's thread and files are not needed any more
        self._tokens = tokens.to(torch.int32)
        self.num_samples = share * ctx.world_size
        if ctx.is_main:
            self.log_count(ctx.world_size, "ranks")

    @classmethod
    def from_config(cls, config: Config, ctx: DistContext) -> Validator:
        """The validator of a run's `train.eval_samples`, `train.eval_every_samples` and `data` settings."""
        return cls(
            uri=config.data.uri,
            seq_len=config.data.seq_len,
            eval_samples=config.train.eval_samples,
            eval_every_samples=config.train.eval_every_samples,
            ctx=ctx,
            expansion_factor=config.data.expansion_factor_real_data,
            verify_checksums=config.data.verify_checksums,
        )

    def evaluate(
        self,
        model: nn.Module,
        *,
        micro_batch_size: int,
        autocast: Callable[[], contextlib.AbstractContextManager],
    ) -> float:
        assert self._tokens is not None, "validation is off (train.eval_samples: 0)"
        loss_tokens = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        with self.evaluating(model):
            for batch in torch.split(self._tokens, micro_batch_size):
                loss = micro_batch_loss(
                    model, batch.to(self.ctx.device, dtype=torch.long, non_blocking=True), autocast()
                )
                loss_tokens += loss.double() * batch[:, 1:].numel()
        num_tokens = self._tokens[:, 1:].numel()
        total, tokens = self.ctx.mean([loss_tokens.item(), float(num_tokens)])
        return total / tokens

    def close(self) -> None:
        """Stops the validation loader (idempotent; `evaluate` keeps working from the samples in memory)."""
        loader, self._loader = self._loader, None
        if loader is not None:
            loader.close()

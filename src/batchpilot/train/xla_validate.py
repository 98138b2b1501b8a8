"""Validation loss on XLA: the eager trainer's samples and mean (train/evaluate.py), sharded over devices.

The eager trainer gives rank r its `share` of the first `share x world` validation samples and averages
the token loss over all of them. Here the world is the device count: every host reads those samples
(a few hundred, once), and each pass is `micro x devices` of them, split along the batch over the mesh,
each host sending its own devices' rows. The mean over all samples is the same number on any device
count (up to float rounding).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch import nn

from batchpilot.config import Config
from batchpilot.data.loader import TokenLoader
from batchpilot.train.evaluate import SPLIT, ValidatorBase, check_validation_split, samples_per_rank
from batchpilot.train.step import micro_batch_loss
from batchpilot.train.xla import Layout, XlaHost
from batchpilot.train.xla_state import send_rows

logger = logging.getLogger(__name__)


class XlaValidator(ValidatorBase):
    """The validation samples of all devices and when to evaluate them; one per host process."""

    def __init__(
        self,
        *,
        uri: str,
        seq_len: int,
        eval_samples: int,
        eval_every_samples: int,
        host: XlaHost,
        layout: Layout,
    ) -> None:
        self.eval_samples, self.eval_every_samples = eval_samples, eval_every_samples
        self.host, self.layout = host, layout
        self._share = 0
        self._tokens: torch.Tensor | None = None
        if eval_samples == 0:
            return
        check_validation_split(uri)
        world = host.num_devices
        with TokenLoader(
            uri=uri, seq_len=seq_len, seed=0, split=SPLIT, prefetch_steps=0, shuffle=False
        ) as loader:
            self._share = samples_per_rank(
                eval_samples=eval_samples, split_samples=loader.num_samples, world_size=world
            )
            (tokens,) = loader.micro_batches(
                consumed_samples=0,
                global_batch_size=self._share * world,
                micro_batch_size=self._share * world,
                gradient_accumulation_steps=1,
            )
        self._tokens = tokens.reshape(world, self._share, -1)  # device d's samples, as rank d's
        self.num_samples = self._share * world
        if host.is_main:
            self.log_count(world, "devices")

    @classmethod
    def from_config(cls, config: Config, host: XlaHost, layout: Layout) -> XlaValidator:
        return cls(
            uri=config.data.uri,
            seq_len=config.data.seq_len,
            eval_samples=config.train.eval_samples,
            eval_every_samples=config.train.eval_every_samples,
            host=host,
            layout=layout,
        )

    def evaluate(
        self,
        model: nn.Module,
        *,
        micro_batch_size: int,
        autocast: Callable[[], contextlib.AbstractContextManager],
    ) -> float:
        import torch_xla

        assert self._tokens is not None, "validation is off (train.eval_samples: 0)"
        local = self.host.num_local_devices
        mine = self._tokens[self.host.host * local : (self.host.host + 1) * local]
        total = torch.zeros((), device=torch_xla.device())
        with self.evaluating(model):
            for start in range(0, self._share, micro_batch_size):
                rows = mine[:, start : start + micro_batch_size]
                batch = send_rows(rows.reshape(-1, rows.shape[-1]).long(), self.layout)
                # Each pass's loss is the mean over all devices' rows of this pass: weighted by its tokens.
                loss = micro_batch_loss(model, batch, autocast())
                total = total + loss.float() * (rows.shape[1] * self.host.num_devices * (rows.shape[2] - 1))
                torch_xla.sync()
        # One transfer to the host for the whole evaluation.
        return float(total.cpu()) / (self.num_samples * (self._tokens.shape[-1] - 1))

"""Which run a checkpoint belongs to: the settings that decide the weights a run arrives at.

A checkpoint records its run's identity (`run_identity`) in its meta.json; a launch that finds a checkpoint
of another run refuses to continue it (`continuation`), so editing a config and re-running it never resumes
a different plan's weights. The identity is what decides the trajectory of the weights:

- the model (factory and arguments);
- the data and its order (shard set, split, sequence length, shuffling, the seed);
- the schedule (global batch and its ramp-up, the learning rate and its warm-up and decay, weight decay,
  gradient clipping).

Not in it: how the run is executed (micro batch, accumulation, parallelism, runtime, precision, node
counts, checkpoint and evaluation cadence), which may change between launches of one run.

What legitimately continues says so: a changed length (`train.total_samples` or `train.total_tokens`,
the LR decay then follows the new length from the checkpoint on), and a trials branch, whose checkpoint
folder records the checkpoint it was copied from (`runstate.BRANCH_OBJECT`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchpilot.errors import BatchpilotError

if TYPE_CHECKING:
    from batchpilot.config import Config

LENGTH_KEYS = ("train.total_samples", "train.total_tokens")
"""Keys that may differ from the checkpoint's run: a longer (or shorter) run continues the same one."""


def run_identity(config: Config) -> dict[str, Any]:
    """The run's identity as flat `section.key -> value` pairs (JSON values), the seed's weights and the
    sample order included."""
    model, data, batch, train = config.model, config.data, config.batch, config.train
    rampup = batch.rampup.model_dump(mode="json") if batch.rampup is not None else None
    return {
        "model.factory": model.factory,
        "model.args": json.loads(json.dumps(model.args, sort_keys=True)),
        "data.uri": data.uri,
        "data.split": data.split,
        "data.seq_len": data.seq_len,
        "data.shuffle": data.shuffle,
        "data.shuffle_block_samples": data.shuffle_block_samples,
        "data.shuffle_window_blocks": data.shuffle_window_blocks,
        "train.seed": train.seed,
        "batch.global_batch_size": batch.global_batch_size,
        "batch.max_global_batch_size": batch.max_global_batch_size,
        "batch.rampup": rampup,
        "batch.schedule": batch.schedule,
        "train.lr": train.lr,
        "train.lr_scaling": train.lr_scaling,
        "train.lr_reference_batch": train.lr_reference_batch,
        "train.warmup_samples": train.warmup_samples,
        "train.lr_decay": train.lr_decay,
        "train.lr_decay_samples": train.lr_decay_samples,
        "train.min_lr_ratio": train.min_lr_ratio,
        # wsd's settings only with wsd, so that every other run's identity (and its checkpoints) stays as it was
        **(
            {
                "train.wsd_decay_fraction": train.wsd_decay_fraction,
                "train.wsd_decay_shape": train.wsd_decay_shape,
            }
            if train.lr_decay == "wsd"
            else {}
        ),
        "train.weight_decay": train.weight_decay,
        "train.grad_clip": train.grad_clip,
        "train.init_from": train.init_from,
        "train.total_samples": train.total_samples,
        "train.total_tokens": train.total_tokens,
    }


def run_id(identity: dict[str, Any]) -> str:
    """A short name of a run's identity without its length (12 hex digits): a longer run is the same run."""
    core = {key: value for key, value in identity.items() if key not in LENGTH_KEYS}
    return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:12]


def run_record(config: Config) -> dict[str, Any]:
    """What a checkpoint's meta.json keeps under `run`: the identity and its id."""
    identity = run_identity(config)
    return {"id": run_id(identity), "identity": identity}


@dataclass(frozen=True)
class Continuation:
    """How a launch continues a checkpoint: `same` (its own run), `longer` (its run with another length:
    `changes` says which), `branch` (a trials branch's first launch, from the copied checkpoint `changes`
    names), or `legacy` (a checkpoint written before runs had identities: not checked)."""

    how: str
    run: str
    changes: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.how == "legacy":
            return "a run that recorded no identity (an older batchpilot's checkpoint): not checked"
        if self.how == "branch":
            return f"run {self.run}, {self.changes[0]}"
        if self.how == "longer":
            return f"run {self.run}, with a new length ({'; '.join(self.changes)}): the LR decay follows it from here"
        return f"run {self.run}"


def _show(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    return json.dumps(value) if isinstance(value, (dict, list)) or value is None else repr(value)


def continuation(config: Config, saved: dict[str, Any] | None, *, where: str) -> Continuation:
    """Whether this config may continue the checkpoint whose meta.json `run` record is `saved`.

    Raises:
        BatchpilotError: the checkpoint belongs to another run (one line: the first setting that differs,
            both values, and the fix).
    """
    if not saved or not isinstance(saved.get("identity"), dict):
        return Continuation("legacy", "?")
    mine, theirs = run_identity(config), saved["identity"]
    differs = [key for key in mine if key not in LENGTH_KEYS and mine[key] != theirs.get(key)]
    if differs:
        key = differs[0]
        more = f" (and {len(differs) - 1} more: {', '.join(differs[1:])})" if len(differs) > 1 else ""
        raise BatchpilotError(
            key,
            f"is {_show(mine[key])} but {where} holds run {saved.get('id', '?')}, trained with "
            f"{_show(theirs.get(key))}{more}; a checkpoint only continues the run that wrote it",
            f"give this run its own train.checkpoint_uri, or restore {key} to continue run {saved.get('id', '?')}",
        )
    changes = tuple(
        f"{key} {_show(mine[key])} (was {_show(theirs.get(key))})"
        for key in LENGTH_KEYS
        if mine[key] != theirs.get(key)
    )
    return Continuation("longer" if changes else "same", str(saved.get("id", run_id(mine))), changes)


def checkpoint_continuation(
    config: Config, meta: dict[str, Any], *, branch: dict[str, Any] | None, where: str
) -> Continuation:
    """`continuation` for the meta.json of the checkpoint a launch would resume; a trials branch's copied
    checkpoint (its `branch` record names that checkpoint's run and sample) continues as the branch.

    Raises:
        BatchpilotError: the checkpoint belongs to another run.
    """
    saved = meta.get("run")
    if (
        branch is not None
        and branch.get("consumed_samples") == meta.get("consumed_samples")
        and (saved or {}).get("id") == branch.get("run")
    ):
        mine = run_id(run_identity(config))
        return Continuation(
            "branch",
            mine,
            (f"a trials branch from {branch.get('source')} at sample {meta.get('consumed_samples'):,}",),
        )
    return continuation(config, saved, where=where)

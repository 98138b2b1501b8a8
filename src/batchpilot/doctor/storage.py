"""Storage: the data's manifest against the config and model, and a write under the checkpoint prefix."""

from __future__ import annotations

import os
import uuid
from typing import Any

from batchpilot.doctor.core import CALL_TIMEOUT_S, Check, Context, fail, ok, one_line, skip
from batchpilot.errors import BatchpilotError


def _storage(uri: str) -> Any:
    """The project's storage for `uri`; gs:// with a short retry and per-call timeout."""
    from batchpilot.storage import open_storage

    if not uri.startswith("gs://"):
        return open_storage(uri)
    from batchpilot.storage.gcs import GCSStorage, transient_retry

    bucket, _, prefix = uri.removeprefix("gs://").partition("/")
    if not bucket:
        return open_storage(uri)  # its one-line refusal
    retry = transient_retry(max_delay_s=1.0, deadline_s=2 * CALL_TIMEOUT_S)
    return GCSStorage(bucket=bucket, prefix=prefix.strip("/"), retry=retry, timeout_s=CALL_TIMEOUT_S)


def _unreachable_storage(context: Context, name: str, uri: str) -> Check | None:
    """The skip line when `uri` is gs:// and there are no credentials for it (an emulator needs none)."""
    if not uri.startswith("gs://") or os.environ.get("STORAGE_EMULATOR_HOST"):
        return None
    google = context.found.get("credentials")
    if google is None:
        return skip(name, "no credentials")
    if google.credentials is None:
        return skip(
            name,
            "no credentials (the Container API endpoint is an emulator; set STORAGE_EMULATOR_HOST for a GCS one)",
        )
    return None


def check_data(context: Context) -> Check:
    """The shard set's manifest is readable, has the split, at least one sample, and a vocabulary the
    model embeds."""
    from batchpilot.data.sampling import num_samples
    from batchpilot.data.shards import read_manifest
    from batchpilot.plan.inputs import vocabulary_problem

    data, config = context.config.data, context.config
    if skipped := _unreachable_storage(context, "data", data.uri):
        return skipped
    try:
        manifest = read_manifest(_storage(data.uri))
    except BatchpilotError as error:
        return fail(
            "data",
            f"data.uri: {error.field}: {one_line(error.problem)}",
            error.fix or "fix data.uri or its permissions",
        )
    tokens = manifest.num_tokens(data.split)
    samples = num_samples(num_tokens=tokens, seq_len=data.seq_len)
    if not manifest.splits.get(data.split) or samples == 0:
        return fail(
            "data",
            f"{data.uri} has {tokens} {data.split} token(s): less than one sample of data.seq_len + 1 = {data.seq_len + 1}",
            "prepare more data (batchpilot data prepare), or lower data.seq_len",
        )
    from batchpilot.train.shape import model_shape  # torch: only once the data is there

    vocab = model_shape(factory=config.model.factory, args=config.model.args).vocab_size
    problem = vocabulary_problem(
        model_vocab_size=vocab, data_vocab_size=manifest.vocab_size, data_uri=data.uri
    )
    if problem is not None:  # the rule `plan` applies to local data
        return fail("data", problem.problem, problem.fix or "")
    epochs = config.total_samples / samples
    return ok(
        "data",
        f"{data.uri}: {data.split} split of {tokens:,} tokens = {samples:,} samples of {data.seq_len} "
        f"(training reads it {epochs:.3g} time(s)); vocabulary {manifest.vocab_size} within the model's {vocab}",
    )


def check_checkpoint(context: Context) -> Check:
    """A small object written under train.checkpoint_uri reads back and deletes (the trainer does all
    three: checkpoints, `latest`, and dropping old checkpoints)."""
    uri = context.config.train.checkpoint_uri
    if skipped := _unreachable_storage(context, "checkpoint", uri):
        return skipped
    name = f"batchpilot-doctor-{uuid.uuid4().hex[:12]}"
    payload = f"written by batchpilot doctor ({name})\n".encode()
    fix = "point train.checkpoint_uri at a folder or bucket the run may write, read and delete in"
    try:
        storage = _storage(uri)
        storage.write(name, payload)
        try:
            back = storage.read(name)
        finally:
            storage.delete(name)
    except BatchpilotError as error:
        return fail(
            "checkpoint", f"train.checkpoint_uri: {error.field}: {one_line(error.problem)}", error.fix or fix
        )
    except OSError as error:
        return fail(
            "checkpoint", f"train.checkpoint_uri: cannot write {uri}/{name}: {error.strerror or error}", fix
        )
    if back != payload:
        return fail(
            "checkpoint",
            f"train.checkpoint_uri: {uri}/{name} read back {len(back)} bytes, not the {len(payload)} written",
            fix,
        )
    return ok("checkpoint", f"{uri}: wrote, read back and deleted a {len(payload)}-byte object")

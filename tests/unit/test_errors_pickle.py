"""A BatchpilotError crosses processes whole: DCP gathers a rank's failure to every rank by pickling it (and a
writer process's failure comes back in words), so the line a user reads is the failing rank's own."""

from __future__ import annotations

import pickle

import pytest

from batchpilot.cluster.launch import TrainerRefusal
from batchpilot.config import ConfigError
from batchpilot.errors import BatchpilotError
from batchpilot.storage.protocol import StorageError


@pytest.mark.parametrize(
    "error",
    [
        BatchpilotError("train.checkpoint_uri", "cannot write", "check the bucket"),
        StorageError("gs://bucket/ckpt/000000004/__0_0.distcp", "request failed: 503"),
        ConfigError(["batch.global_batch_size: must be positive"]),
        TrainerRefusal("train.seed: is 2 but the checkpoint was trained with 1"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_an_error_and_its_subclasses_survive_pickling(error):
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert str(again) == str(error) and again.__dict__ == error.__dict__ and again.args == error.args

"""Validation loss in one process: when it is due, which samples it reads, and the loss it reports."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from batchpilot.data.prepare import prepare
from batchpilot.data.shards import ShardSet
from batchpilot.data.tokenizers import ByteTokenizer
from batchpilot.errors import BatchpilotError
from batchpilot.models.gpt import build
from batchpilot.train.distributed import DistContext
from batchpilot.train.eager import EagerRuntime
from batchpilot.train.evaluate import Validator, evaluation_due, samples_per_rank

SEQ_LEN = 16
MODEL_ARGS = {
    "n_layer": 1,
    "n_head": 2,
    "n_embd": 32,
    "block_size": SEQ_LEN,
    "vocab_size": 257,
    "dropout": 0.5,
}
ONE_PROCESS = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


def make_shards(folder: Path, *, validation_fraction: float) -> str:
    """30 random-text documents; a fraction of 0.1 gives 3 validation documents (about 60 samples)."""
    corpus = folder / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    for index in range(30):
        (corpus / f"{index:02d}.txt").write_bytes(
            bytes(rng.integers(32, 127, 300 + index * 10, dtype=np.uint8))
        )
    uri = f"file://{folder}/shards"
    prepare(
        inputs=sorted(corpus.iterdir()),
        out_uri=uri,
        tokenizer=ByteTokenizer(),
        shard_size_tokens=200,  # the validation split spans several shards
        validation_fraction=validation_fraction,
        show_progress=False,
    )
    return uri


@pytest.fixture(scope="module")
def shard_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_shards(tmp_path_factory.mktemp("evaluate"), validation_fraction=0.1)


def validator(uri: str, *, eval_samples: int, eval_every_samples: int = 0) -> Validator:
    return Validator(
        uri=uri,
        seq_len=SEQ_LEN,
        eval_samples=eval_samples,
        eval_every_samples=eval_every_samples,
        runtime=EagerRuntime(ONE_PROCESS),
    )


def first_validation_samples(uri: str, count: int) -> torch.Tensor:
    """The first `count` samples of the validation split, read directly, one range per sample."""
    shards = ShardSet.open(uri=uri, split="validation")
    ranges = [(i * SEQ_LEN, i * SEQ_LEN + SEQ_LEN + 1) for i in range(count)]
    return torch.from_numpy(np.stack(shards.read_tokens(ranges)).astype(np.int64))


def test_due_every_n_samples_and_at_every_stage_end():
    steps = [(c, c + 64) for c in range(0, 640, 64)]  # ten steps of 64 samples
    due = [
        evaluation_due(
            consumed_before=a, consumed_after=b, stage_end=False, eval_samples=256, eval_every_samples=200
        )
        for a, b in steps
    ]
    # boundaries 200, 400, 600 fall inside the steps ending at 256, 448 and 640
    assert due == [False] * 3 + [True] + [False] * 2 + [True] + [False] * 2 + [True]
    exact = [
        evaluation_due(
            consumed_before=a, consumed_after=b, stage_end=False, eval_samples=256, eval_every_samples=128
        )
        for a, b in steps
    ]
    assert exact == [False, True] * 5  # a step ending exactly on a boundary evaluates
    only_ends = [
        evaluation_due(
            consumed_before=a, consumed_after=b, stage_end=b == 320, eval_samples=256, eval_every_samples=0
        )
        for a, b in steps
    ]
    assert only_ends == [False] * 4 + [True] + [False] * 5


def test_disabled_validation_is_never_due():
    assert not evaluation_due(
        consumed_before=0, consumed_after=64, stage_end=True, eval_samples=0, eval_every_samples=1
    )


def test_samples_per_rank_rounds_down_over_the_ranks_and_caps_at_the_split():
    assert samples_per_rank(eval_samples=256, split_samples=1000, world_size=3) == 85
    assert samples_per_rank(eval_samples=4, split_samples=1000, world_size=8) == 1  # at least one each
    assert samples_per_rank(eval_samples=256, split_samples=100, world_size=1) == 100
    assert samples_per_rank(eval_samples=256, split_samples=101, world_size=2) == 50
    with pytest.raises(BatchpilotError, match=r"train\.eval_samples: the validation split holds 5 sample"):
        samples_per_rank(eval_samples=256, split_samples=5, world_size=8)


@pytest.mark.parametrize("micro", [1, 7, 40])  # 7 leaves a smaller last micro-batch
def test_evaluate_is_the_mean_token_loss_of_the_first_validation_samples(shard_uri, micro):
    torch.manual_seed(0)
    model = build(**MODEL_ARGS)
    samples = first_validation_samples(shard_uri, 40)
    model.eval()
    with torch.no_grad():
        logits = model(samples[:, :-1])
        expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), samples[:, 1:].reshape(-1)).item()
    model.train()
    checker = validator(shard_uri, eval_samples=40, eval_every_samples=100)
    assert checker.num_samples == 40 and checker.enabled
    first = checker.evaluate(model, micro_batch_size=micro, autocast=contextlib.nullcontext)
    assert first == pytest.approx(expected, rel=1e-5)
    assert model.training  # back in training mode (dropout 0.5 would have made the two differ)
    again = checker.evaluate(model, micro_batch_size=micro, autocast=contextlib.nullcontext)
    assert again == pytest.approx(first, rel=1e-6)
    assert all(p.grad is None for p in model.parameters())
    assert checker.due(64, 128, stage_end=False) and not checker.due(0, 64, stage_end=False)
    assert checker.evaluate(model, micro_batch_size=micro, autocast=contextlib.nullcontext) == first


def test_more_samples_than_the_split_holds_evaluates_the_whole_split_once(shard_uri, batchpilot_log):
    split_samples = (ShardSet.open(uri=shard_uri, split="validation").num_tokens - 1) // SEQ_LEN
    checker = validator(shard_uri, eval_samples=10_000)
    assert checker.num_samples == split_samples
    assert f"validation loss: {split_samples} samples of the validation split" in batchpilot_log.text
    assert "train.eval_samples 10,000 rounded" in batchpilot_log.text


def test_a_shard_set_without_a_validation_split_is_refused_before_training(tmp_path):
    uri = make_shards(tmp_path, validation_fraction=0.0)
    with pytest.raises(BatchpilotError) as error:
        validator(uri, eval_samples=256)
    assert error.value.field == "train.eval_samples"
    assert "has no validation split" in error.value.problem
    assert error.value.fix is not None and "train.eval_samples: 0" in error.value.fix
    assert "--validation-fraction" in error.value.fix
    off = validator(uri, eval_samples=0, eval_every_samples=64)  # validation off: the split is not needed
    assert not off.enabled and not off.due(0, 128, stage_end=True)

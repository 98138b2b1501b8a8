"""Sharded (DCP) checkpoints through the storage layer on one process, and `full` checkpoints of earlier
versions loading into the current trainer's state. Several ranks: tests/integration/test_train_fsdp.py and
test_train_stages.py."""

from __future__ import annotations

import pytest
import torch

from batchpilot.errors import BatchpilotError
from batchpilot.models.gpt import build
from batchpilot.train.checkpoint import Checkpointer, capture_rng_state
from batchpilot.train.setup import make_optimizer
from batchpilot.train.state import restore_training_state, training_state

ARGS = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8, "vocab_size": 32}


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and its AdamW after two steps (so the optimizer holds moments and a step count)."""
    torch.manual_seed(seed)
    model = build(**ARGS)
    optimizer = make_optimizer(model, weight_decay=0.1)
    for group in optimizer.param_groups:
        group["lr"] = 1e-2
    for _ in range(2):
        batch = torch.randint(0, 32, (4, 9))
        logits = model(batch[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 32), batch[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(123)
    model = build(**ARGS)
    return model, make_optimizer(model, weight_decay=0.1)


def assert_same_state(a: tuple, b: tuple) -> None:
    for (name, pa), pb in zip(a[0].named_parameters(), b[0].parameters(), strict=True):
        assert torch.equal(pa, pb), name
    sa, sb = training_state(*a)["optimizer"], training_state(*b)["optimizer"]
    assert sa["state"].keys() == sb["state"].keys()
    for name, moments in sa["state"].items():
        for key, value in moments.items():
            assert torch.equal(value, sb["state"][name][key]), (name, key)


def test_sharded_round_trip_with_checksums(tmp_path):
    source = trained()
    checkpointer = Checkpointer(uri=f"file://{tmp_path}")
    where = checkpointer.save_sharded(
        step=2,
        consumed_samples=8,
        state=training_state(*source),
        rng=capture_rng_state(),
        extra={"world_size": 1},
    )
    assert where == f"file://{tmp_path}/000000002"
    checkpoint = checkpointer.load()
    assert checkpoint.sharded and checkpoint.consumed_samples == 8
    assert {"__0_0.distcp", ".metadata", "rng.pt"} <= set(checkpoint.meta["files"])
    target = fresh()
    restore_training_state(checkpoint, *target)
    assert_same_state(source, target)
    assert set(checkpoint.full_state()["model"]) == set(source[0].state_dict())


def test_a_corrupted_shard_is_refused(tmp_path):
    checkpointer = Checkpointer(uri=f"file://{tmp_path}")
    checkpointer.save_sharded(
        step=1, consumed_samples=4, state=training_state(*trained()), rng=capture_rng_state()
    )
    shard = tmp_path / "000000001" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(BatchpilotError, match=r"__0_0\.distcp: is corrupted"):
        restore_training_state(checkpointer.load(), *fresh())


def test_full_checkpoints_of_earlier_versions_keep_loading(tmp_path):
    """The format before sharding: model.pt and optimizer.pt (parameters numbered by position)."""
    source = trained()
    checkpointer = Checkpointer(uri=f"file://{tmp_path}")
    checkpointer.save(
        step=2,
        consumed_samples=8,
        model=source[0].state_dict(),
        optimizer=source[1].state_dict(),
        rng=capture_rng_state(),
    )
    checkpoint = checkpointer.load()
    assert not checkpoint.sharded
    target = fresh()
    restore_training_state(checkpoint, *target)
    assert_same_state(source, target)


def test_a_reader_fetches_only_the_blocks_of_the_tensors_it_loads(tmp_path):
    """What a rank that reshards does: it asks DCP for its part of the state, and only the byte ranges of
    those chunks are read (each checked against its block's checksum), not whole files."""
    import torch.distributed.checkpoint as dcp

    from batchpilot.train.checkpoint import dcp_quietly

    weights = {f"w{i}": torch.full((2_000_000,), float(i)) for i in range(4)}  # 8 MB each, one file
    checkpointer = Checkpointer(uri=f"file://{tmp_path}", upload_threads=1)
    checkpointer.save_sharded(
        step=1, consumed_samples=4, state={"model": weights, "optimizer": {}}, rng=capture_rng_state()
    )
    checkpoint = checkpointer.load()
    shard_bytes = (tmp_path / "000000001" / "__0_0.distcp").stat().st_size
    part = {"model": {"w2": torch.empty(2_000_000)}}
    reader = checkpoint.reader()
    with dcp_quietly():
        dcp.load(part, storage_reader=reader, no_dist=True)
    assert torch.equal(part["model"]["w2"], weights["w2"])
    metadata_bytes = (tmp_path / "000000001" / ".metadata").stat().st_size
    # w2's 8 MB and at most one partly used 4 MiB block at each end, of a 32 MB file
    assert reader.storage_fs.bytes_fetched - metadata_bytes <= 8_000_000 + 2 * 4 * 1024 * 1024 < shard_bytes


def test_a_gpu_checkpoints_fused_adamw_resumes_with_this_processs_implementation(tmp_path):
    """A checkpoint written with fused AdamW (make_optimizer on CUDA) loads its moments, but the groups
    keep this process's settings: a fused flag carried to a CPU or XLA process would fail its first step."""
    model, optimizer = trained()
    for group in optimizer.param_groups:
        group["fused"] = True  # as make_optimizer sets it for parameters on CUDA
    Checkpointer(uri=f"file://{tmp_path}").save_sharded(
        step=2, consumed_samples=8, state=training_state(model, optimizer), rng=capture_rng_state()
    )
    target = fresh()
    loaded = Checkpointer(uri=f"file://{tmp_path}").load()
    assert loaded is not None
    restore_training_state(loaded, *target)
    assert [group["fused"] for group in target[1].param_groups] == [None, None]
    assert_same_state(target, (model, optimizer))


def test_make_optimizer_is_fused_only_for_parameters_on_cuda():
    model = build(**ARGS)
    assert [group["fused"] for group in make_optimizer(model, weight_decay=0.1).param_groups] == [None, None]


def other_model(**changes: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fresh model whose model section differs from the checkpoint's by `changes`."""
    torch.manual_seed(123)
    model = build(**{**ARGS, **changes})
    return model, make_optimizer(model, weight_decay=0.1)


def save_both_formats(tmp_path) -> dict[str, Checkpointer]:
    source = trained()
    sharded, full = (
        Checkpointer(uri=f"file://{tmp_path}/sharded"),
        Checkpointer(uri=f"file://{tmp_path}/full"),
    )
    sharded.save_sharded(step=2, consumed_samples=8, state=training_state(*source), rng=capture_rng_state())
    full.save(
        step=2, consumed_samples=8, model=source[0].state_dict(), optimizer=source[1].state_dict(),
        rng=capture_rng_state(),
    )  # fmt: skip
    return {"sharded": sharded, "full": full}


@pytest.mark.parametrize("form", ["sharded", "full"])
def test_a_checkpoint_of_a_wider_model_names_the_first_tensor_and_both_shapes(tmp_path, form):
    checkpoint = save_both_formats(tmp_path)[form].load()
    target = other_model(n_embd=32)
    before = {name: value.clone() for name, value in target[0].state_dict().items()}
    with pytest.raises(BatchpilotError) as refused:
        restore_training_state(checkpoint, *target)
    assert str(refused.value) == (
        f"file://{tmp_path}/{form}/000000002: was written by a different model: wte.weight is [32, 16] there "
        "and [32, 32] in this model (fix: resume with the model section the checkpoint was written with, or "
        "point train.checkpoint_uri at a new folder to start over)"
    )
    after = target[0].state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)  # refused before loading anything


@pytest.mark.parametrize("form", ["sharded", "full"])
def test_a_checkpoint_with_more_or_fewer_blocks_is_refused(tmp_path, form):
    checkpointer = save_both_formats(tmp_path)[form]
    with pytest.raises(
        BatchpilotError, match=r"different model: blocks\.2\.ln_1\.weight is absent there and \[16\]"
    ):
        restore_training_state(checkpointer.load(), *other_model(n_layer=3))
    smaller = other_model(n_layer=1)
    num_extra = sum(name.startswith("blocks.1.") for name in trained()[0].state_dict())
    # DCP alone would load the first block and drop the second without a word.
    with pytest.raises(
        BatchpilotError,
        match=rf"different model: it holds blocks\.1\.ln_1\.weight \[16\], which this model does not have "
        rf"\(and {num_extra - 1} more tensors\)",
    ):
        restore_training_state(checkpointer.load(), *smaller)

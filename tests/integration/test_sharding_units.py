"""How fsdp and hsdp shard and reduce, on real gloo processes (one per rank, spawned here):

- hsdp on 2 nodes x 2 ranks at accumulation 4 all-reduces across nodes once per optimizer step (each
  FSDP unit once), not once per micro-batch, and still gives the global batch's mean gradient;
- its noise scale's small-batch term is each rank's own gradient of every pass (read from FSDP2's
  reduce-scatter input before any reduction), averaged over the passes, computed here again in one process;
  its coherence compares the node's first two passes;
- the token embedding and [final norm, output head] are FSDP units of their own (sharded while the
  blocks run), tied weights stay one parameter, and the gradients are those of one process.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from batchpilot.models.gpt import build as build_gpt
from batchpilot.models.llama import build as build_llama
from batchpilot.train.distributed import DistContext
from batchpilot.train.parallel import shard_units, wrap_model
from batchpilot.train.step import accumulate_gradients

pytestmark = pytest.mark.slow

GPT_ARGS = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 64}
LLAMA_ARGS = {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "max_seq_len": 16, "vocab_size": 64}
GLOBAL_BATCH, MICRO = 32, 2  # hsdp 2 x 2: accumulation 4


def build(name: str, **extra: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_gpt(**GPT_ARGS) if name == "gpt" else build_llama(**LLAMA_ARGS, **extra)


def already_real(model: torch.nn.Module) -> None:
    """wrap_model's `materialize` for a model built on the CPU (the trainer's is built on meta)."""


def global_batch() -> torch.Tensor:
    return torch.randint(0, 64, (GLOBAL_BATCH, 17), generator=torch.Generator().manual_seed(1))


def rank_micro_batches(rank: int, world_size: int) -> list[torch.Tensor]:
    """Rank `rank`'s micro-batches: pass a takes samples [a x micro x world + rank x micro, ... + micro)."""
    per_pass = MICRO * world_size
    batch = global_batch()
    return [
        batch[a * per_pass + rank * MICRO : a * per_pass + (rank + 1) * MICRO]
        for a in range(GLOBAL_BATCH // per_pass)
    ]


def mean_loss_gradient(model: torch.nn.Module, samples: torch.Tensor) -> list[torch.Tensor]:
    """The gradient of the mean token loss over `samples`, in one process."""
    model.zero_grad(set_to_none=True)
    logits = model(samples[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), samples[:, 1:].reshape(-1)).backward()
    return [p.grad.clone() for p in model.parameters()]


def local_sq_norm(model: torch.nn.Module, rank: int, world_size: int) -> float:
    """The mean over rank `rank`'s passes of its own micro-batch gradient's squared norm, in one process: the
    noise scale's small-batch term where the ranks' gradients are read before their reduction
    (planning/noise.py)."""
    passes = rank_micro_batches(rank, world_size)
    return sum(
        sum(float(g.double().pow(2).sum()) for g in mean_loss_gradient(model, batch)) for batch in passes
    ) / len(passes)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.clone()


def count_cross_node_all_reduces(per_node: int) -> Counter:
    """Counts this process's `dist.all_reduce` calls (and bytes) over groups that span nodes, as FSDP2 issues
    its HSDP all-reduce (`dist.all_reduce` on the replicate group); returns the live counter."""
    counts: Counter = Counter()
    original = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        ranks = (
            dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        )
        if len({rank // per_node for rank in ranks}) > 1:
            counts["calls"] += 1
            counts["bytes"] += tensor.numel() * tensor.element_size()
        return original(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting
    return counts


def _join(rank: int, world_size: int, per_node: int, port: int) -> DistContext:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    return DistContext.from_env()


def _hsdp_worker(
    rank: int, world_size: int, per_node: int, port: int, out: str, shard_nodes: int = 1
) -> None:
    ctx = _join(rank, world_size, per_node, port)
    model = build("gpt")
    parallel = wrap_model(
        model, ctx, strategy="hsdp", bf16=False, materialize=already_real, shard_nodes=shard_nodes
    )
    counts = count_cross_node_all_reduces(per_node)
    outcome = accumulate_gradients(
        model=model,
        parallel=parallel,
        micro_batches=rank_micro_batches(rank, world_size),
        ctx=ctx,
        autocast=contextlib.nullcontext,
        measure_noise=True,
        measure_coherence=True,
    )
    gradient_bytes = sum(p.grad.to_local().numel() * 4 for p in model.parameters())
    result = {
        "cross_node_calls": counts["calls"],
        "cross_node_bytes": counts["bytes"],
        "gradient_bytes": gradient_bytes,
        "units": len(shard_units(model)),  # the root holds no parameter of its own
        "shard_degree": parallel.shard_degree,
        "local_rows": model.wte.weight.to_local().shape[0],
        "grads": {name: full(p.grad) for name, p in model.named_parameters()},
        "small_sq_norm": float(outcome.small_sq_norm),
        "small_batch": outcome.small_batch,
        "coherence": float(outcome.coherence),
    }
    torch.save(result, f"{out}.rank{rank}")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(worker, world_size: int, per_node: int, out: Path, *args: object) -> list[dict]:
    mp.spawn(worker, args=(world_size, per_node, free_port(), str(out), *args), nprocs=world_size, join=True)
    return [torch.load(f"{out}.rank{rank}", weights_only=False) for rank in range(world_size)]


@pytest.fixture(scope="module")
def hsdp_ranks(tmp_path_factory) -> list[dict]:
    """One step of 2 nodes x 2 ranks under hsdp, micro batch 2, accumulation 4."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)
    return spawn(_hsdp_worker, 4, 2, tmp_path_factory.mktemp("hsdp") / "result")


def test_hsdp_all_reduces_across_nodes_once_per_step(hsdp_ranks):
    for rank in hsdp_ranks:
        # Each FSDP unit all-reduces its gradient shard once, on the last micro-batch (4 times before).
        assert rank["cross_node_calls"] == rank["units"]
        assert rank["cross_node_bytes"] == rank["gradient_bytes"]


def test_hsdp_accumulated_gradient_is_the_global_batch_mean(hsdp_ranks):
    reference = dict(
        zip(
            [n for n, _ in build("gpt").named_parameters()],
            mean_loss_gradient(build("gpt"), global_batch()),
            strict=True,
        )
    )
    for rank in hsdp_ranks:
        for name, expected in reference.items():
            assert torch.allclose(rank["grads"][name], expected, rtol=1e-4, atol=1e-6), name


@pytest.fixture(scope="module")
def hsdp_group_ranks(tmp_path_factory) -> list[dict]:
    """The same step on 4 nodes of 1 rank with shard groups of 2 nodes (train.hsdp_shard_nodes: 2)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)
    return spawn(_hsdp_worker, 4, 1, tmp_path_factory.mktemp("hsdp-groups") / "result", 2)


def test_hsdp_shard_groups_span_nodes_and_give_the_global_mean(hsdp_group_ranks):
    """Each parameter is split over a group of 2 one-rank nodes (half its rows per rank, as within a node of
    2), the groups replicate each other, and the gradient is the global batch's mean; the noise scale's
    small batch is each rank's own micro batch."""
    reference = dict(
        zip(
            [n for n, _ in build("gpt").named_parameters()],
            mean_loss_gradient(build("gpt"), global_batch()),
            strict=True,
        )
    )
    for rank in hsdp_group_ranks:
        assert rank["shard_degree"] == 2 and rank["local_rows"] == GPT_ARGS["vocab_size"] // 2
        assert rank["small_batch"] == MICRO
        for name, expected in reference.items():
            assert torch.allclose(rank["grads"][name], expected, rtol=1e-4, atol=1e-6), name
    model = build("gpt")
    for rank in range(4):
        expected = local_sq_norm(model, rank, 4)
        assert hsdp_group_ranks[rank]["small_sq_norm"] == pytest.approx(expected, rel=1e-5), rank


def test_hsdp_noise_terms_are_each_ranks_own_passes(hsdp_ranks):
    """The small batch is each rank's own micro batch (2 samples) in every pass, read from the reduce-scatter's
    input; coherence compares the node's first pass (micro 2 x 2 = 4 samples, before the cross-node
    all-reduce) with its second."""
    model = build("gpt")
    for node in (0, 1):
        ranks = (2 * node, 2 * node + 1)
        first = torch.cat([rank_micro_batches(r, 4)[0] for r in ranks])
        second = torch.cat([rank_micro_batches(r, 4)[1] for r in ranks])
        g1, g2 = mean_loss_gradient(model, first), mean_loss_gradient(model, second)
        sq_norm = sum(float(g.double().pow(2).sum()) for g in g1)
        inner = sum(float((a.double() * b.double()).sum()) for a, b in zip(g1, g2, strict=True))
        cosine = inner / (sq_norm * sum(float(g.double().pow(2).sum()) for g in g2)) ** 0.5
        for rank in ranks:
            result = hsdp_ranks[rank]
            assert result["small_batch"] == MICRO
            assert result["small_sq_norm"] == pytest.approx(local_sq_norm(model, rank, 4), rel=1e-5), rank
            assert result["coherence"] == pytest.approx(cosine, rel=1e-5), rank


def _units_worker(
    rank: int, world_size: int, per_node: int, port: int, out: str, name: str, tied: bool
) -> None:
    ctx = _join(rank, world_size, per_node, port)
    model = build(name, **({"tie_embeddings": True} if tied else {}))
    parallel = wrap_model(model, ctx, strategy="fsdp", bf16=False, materialize=already_real)
    first, last = model.outer_modules()
    seen: dict[str, bool] = {}

    def during_blocks(module, inputs):  # what the outer units hold while a block runs
        seen["first_sharded"] = all(isinstance(p, DTensor) for m in first for p in m.parameters())
        seen["last_sharded"] = all(isinstance(p, DTensor) for m in last for p in m.parameters())

    model.blocks[0].register_forward_pre_hook(during_blocks)
    accumulate_gradients(
        model=model,
        parallel=parallel,
        micro_batches=rank_micro_batches(rank, world_size),
        ctx=ctx,
        autocast=contextlib.nullcontext,
        measure_noise=False,
        measure_coherence=False,
    )
    result = {
        "outer_are_units": all(isinstance(m, FSDPModule) for m in [*first, *last]),
        "tied": model.output.weight is model.tok_embeddings.weight
        if name == "llama"
        else model.head.weight is model.wte.weight,
        "grads": {n: full(p.grad) for n, p in model.named_parameters()},
        **seen,
    }
    torch.save(result, f"{out}.rank{rank}")
    dist.destroy_process_group()


@pytest.mark.parametrize(("name", "tied"), [("llama", False), ("llama", True), ("gpt", True)])
def test_embedding_and_head_are_their_own_fsdp_units(tmp_path, monkeypatch, name, tied):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    ranks = spawn(_units_worker, 2, 2, tmp_path / "result", name, tied)
    model = build(name, **({"tie_embeddings": True} if tied else {}))
    names = [n for n, _ in model.named_parameters()]
    reference = dict(zip(names, mean_loss_gradient(model, global_batch()), strict=True))
    for rank in ranks:
        assert rank["outer_are_units"] and rank["tied"] == tied
        # Untied, the embedding is resharded after its forward and the head not yet gathered while the blocks
        # run; tied, they are one unit, gathered from the embedding's forward to the head's.
        assert rank["first_sharded"] == rank["last_sharded"] == (not tied)
        for parameter, expected in reference.items():
            assert torch.allclose(rank["grads"][parameter], expected, rtol=1e-4, atol=1e-6), parameter


# -- built on meta, each rank materialising its shards only ---------------------------------------------------


def _meta_worker(
    rank: int, world_size: int, per_node: int, port: int, out: str, strategy: str, tensor_parallel_size: int
) -> None:
    from batchpilot.models.deferred import build_deferred, to_empty

    ctx = _join(rank, world_size, per_node, port)
    deferred = build_deferred(lambda: build_llama(**LLAMA_ARGS, tie_embeddings=True))
    model = deferred.model

    def materialize(placed: torch.nn.Module) -> None:
        to_empty(placed, device="cpu")
        torch.manual_seed(0)  # the seed `build` uses
        deferred.initialize(placed)

    wrap_model(
        model,
        ctx,
        strategy=strategy,
        bf16=False,
        materialize=materialize,
        tensor_parallel_size=tensor_parallel_size,
    )
    local_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
    result = {
        "weights": {name: full(p) for name, p in model.named_parameters()},
        "buffers": {name: b.clone() for name, b in model.named_buffers()},
        "tied": model.output.weight is model.tok_embeddings.weight,
        "local_bytes": local_bytes,
        "after": torch.rand(4),  # the generator's state after initialisation
    }
    torch.save(result, f"{out}.rank{rank}")
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("strategy", "tensor_parallel_size"), [("fsdp", 1), ("hsdp", 1), ("fsdp", 2), ("hsdp", 2)]
)
def test_a_model_built_on_meta_and_sharded_holds_the_cpu_builds_weights(
    tmp_path, monkeypatch, strategy, tensor_parallel_size
):
    """4 ranks (hsdp: 2 nodes x 2; with tensor parallelism each node's 2 ranks split every block) each fill
    only their parts, and the gathered model is bit for bit the one built on the CPU under the same seed:
    initial weights do not depend on the world or the parallelism."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    ranks = spawn(_meta_worker, 4, 2, tmp_path / "result", strategy, tensor_parallel_size)
    reference = build("llama", tie_embeddings=True)
    after = torch.rand(4)
    whole_bytes = sum(p.numel() * 4 for p in reference.parameters())
    degree = 4 if strategy == "fsdp" else 2  # hsdp with tensor parallelism: the node's 2 ranks split it
    for rank in ranks:
        assert rank["tied"]
        assert rank["weights"].keys() == dict(reference.named_parameters()).keys()
        for name, parameter in reference.named_parameters():
            assert torch.equal(rank["weights"][name], parameter), name
        for name, buffer in reference.named_buffers():
            assert torch.equal(rank["buffers"][name], buffer), name
        assert torch.equal(rank["after"], after)
        # a rank's shards: its share of every tensor, rows rounded up (dim 0 split `degree` ways)
        assert rank["local_bytes"] <= whole_bytes / degree * 1.2, (rank["local_bytes"], whole_bytes)


def _init_from_worker(rank: int, world_size: int, per_node: int, port: int, out: str, folder: str) -> None:
    import safetensors

    from batchpilot.models.deferred import build_deferred, reset_buffers, to_empty
    from batchpilot.train.init_from import load_weights

    ctx = _join(rank, world_size, per_node, port)
    read = Counter()
    opened = safetensors.safe_open

    class CountingSlice:
        def __init__(self, stored):
            self.stored = stored

        def get_shape(self):
            return self.stored.get_shape()

        def __getitem__(self, index):
            part = self.stored[index]
            read["bytes"] += part.numel() * part.element_size()
            return part

    class CountingHandle:
        def __init__(self, *args, **kwargs):
            self.handle = opened(*args, **kwargs)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return CountingSlice(self.inner.get_slice(name))

        def get_tensor(self, name):
            tensor = self.inner.get_tensor(name)
            read["bytes"] += tensor.numel() * tensor.element_size()
            return tensor

    safetensors.safe_open = CountingHandle
    from hf_files import LLAMA_ARGS as HF_ARGS

    deferred = build_deferred(lambda: build_llama(**HF_ARGS))
    model = deferred.model

    def materialize(placed: torch.nn.Module) -> None:
        to_empty(placed, device="cpu")
        reset_buffers(placed)
        load_weights(placed, folder=Path(folder))

    wrap_model(model, ctx, strategy="fsdp", bf16=False, materialize=materialize)
    torch.save(
        {"read_bytes": read["bytes"], "weights": {name: full(p) for name, p in model.named_parameters()}},
        f"{out}.rank{rank}",
    )
    dist.destroy_process_group()


def test_init_from_on_4_ranks_reads_each_ranks_shards_only(tmp_path, monkeypatch):
    """Each of 4 fsdp ranks reads from the (sharded) Hugging Face checkpoint at most a quarter of its weight
    bytes plus one tensor, and the gathered model is the one a single process loads whole."""

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))  # tests/, for hf_files
    from batchpilot.train.init_from import load_weights
    from hf_files import LLAMA_ARGS as HF_ARGS
    from hf_files import write_hf_llama

    folder = write_hf_llama(tmp_path / "hf", max_shard_size="100KB", std=0.3)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    ranks = spawn(_init_from_worker, 4, 4, tmp_path / "result", str(folder))
    reference = build_llama(**HF_ARGS)
    load_weights(reference, folder=folder)
    tensors = [p for p in reference.parameters()]
    whole_bytes = sum(p.numel() * 4 for p in tensors)
    largest = max(p.numel() * 4 for p in tensors)
    assert whole_bytes / 4 + largest < whole_bytes / 2  # a rank reading every weight fails the bound below
    for rank in ranks:
        assert 0 < rank["read_bytes"] <= whole_bytes / 4 + largest, (rank["read_bytes"], whole_bytes, largest)
        for name, parameter in reference.named_parameters():
            assert torch.equal(rank["weights"][name], parameter), name

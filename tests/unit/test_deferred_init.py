"""A model built on the meta device and initialised by replaying its construction (models/deferred.py) has
exactly the weights, buffers and generator state of the same model built on the CPU under the same seed;
what cannot be replayed is refused in one line naming the tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchpilot.errors import BatchpilotError
from batchpilot.models.deferred import build_deferred, to_empty
from batchpilot.models.factory import build_model

GPT = (
    "batchpilot.models.gpt:build",
    {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 50},
)
LLAMA = (
    "batchpilot.models.llama:build",
    {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "max_seq_len": 16, "vocab_size": 50},
)


class Varied(nn.Module):
    """Every kind of initialisation replay supports: layers' own reset_parameters, nn.init's trunc_normal_
    (rejection sampling) and orthogonal_ (a QR decomposition), a parameter made by torch.randn, one by
    torch.ones, a shared parameter, a temporary whose draws are dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.norm = nn.LayerNorm(5)
        nn.init.trunc_normal_(self.a.weight, std=0.3)
        self.b = nn.Linear(5, 5, bias=False)
        nn.init.orthogonal_(self.b.weight)
        self.noise = nn.Parameter(torch.randn(3, 2))
        self.scale = nn.Parameter(torch.ones(4))
        self.c = nn.Linear(5, 7, bias=False)
        self.c.weight = self.a.weight  # replaces c's own weight, whose draws still happened
        torch.empty(6).uniform_()  # a temporary


def replayed(build, seed: int = 7) -> tuple[nn.Module, torch.Tensor]:
    deferred = build_deferred(build)
    assert all(t.is_meta for t in deferred.model.state_dict().values())
    model = deferred.model
    to_empty(model, device="cpu")
    torch.manual_seed(seed)
    deferred.initialize(model)
    return model, torch.rand(4)  # the generator's state after initialisation


def built(build, seed: int = 7) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return build(), torch.rand(4)


@pytest.mark.parametrize(
    "build",
    [
        Varied,
        lambda: build_model(factory=GPT[0], args=GPT[1]),
        lambda: build_model(factory=LLAMA[0], args=LLAMA[1]),
        lambda: build_model(factory=LLAMA[0], args={**LLAMA[1], "tie_embeddings": True}),
    ],
    ids=["varied", "gpt", "llama", "llama-tied"],
)
def test_replay_gives_the_cpu_builds_weights_buffers_and_generator_state(build):
    (ours, after_ours), (theirs, after_theirs) = replayed(build), built(build)
    names = [name for name, _ in theirs.named_parameters(remove_duplicate=False)]
    assert names == [name for name, _ in ours.named_parameters(remove_duplicate=False)]
    for (name, mine), (_, reference) in zip(
        [*ours.named_parameters(), *ours.named_buffers()],
        [*theirs.named_parameters(), *theirs.named_buffers()],
        strict=True,
    ):
        assert torch.equal(mine, reference), name
    assert torch.equal(after_ours, after_theirs)
    shared = {id(p) for p in theirs.parameters()}  # tied parameters stay one tensor
    assert len({id(p) for p in ours.parameters()}) == len(shared)


@pytest.mark.parametrize(
    "build",
    [
        Varied,
        lambda: build_model(factory=LLAMA[0], args={**LLAMA[1], "tie_embeddings": True}),
    ],
    ids=["varied", "llama-tied"],
)
def test_streaming_hands_over_each_parameter_whole_once_and_keeps_none(build):
    """What the XLA runtime places (`Deferred.stream`): every parameter's whole CPU tensor once (a tied one
    under one name), the CPU build's values, and nothing of an earlier tensor kept while the next is made."""
    import weakref

    deferred = build_deferred(build)
    torch.manual_seed(7)  # as `built` seeds the CPU build
    delivered: dict[str, torch.Tensor] = {}
    earlier: list[weakref.ref] = []
    alive_at_delivery = []

    def deliver(name: str, values: torch.Tensor) -> None:
        alive_at_delivery.append(sum(ref() is not None for ref in earlier))
        earlier.append(weakref.ref(values))
        delivered[name] = values.clone()  # the caller's copy; the streamed tensor is dropped

    deferred.stream(deliver)
    after = torch.rand(4)
    theirs, after_theirs = built(build)
    parameters = dict(theirs.named_parameters())  # a tied parameter under its first name
    assert delivered.keys() >= parameters.keys()
    for name, reference in parameters.items():
        assert torch.equal(delivered[name], reference), name
    assert torch.equal(after, after_theirs)
    assert alive_at_delivery == [0] * len(alive_at_delivery)


def test_the_seed_decides_the_weights():
    first, _ = replayed(Varied, seed=1)
    second, _ = replayed(Varied, seed=2)
    assert not torch.equal(first.a.weight, second.a.weight)


class PartInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(4, 4)
        with torch.no_grad():
            self.w.weight[:2].normal_()


class CopyInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(4, 4)
        with torch.no_grad():
            self.w.weight.copy_(torch.eye(4) * 2)


class OffMeta(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3, device="cpu").normal_())


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(2, 2)
        self.register_buffer("mask", torch.tril(torch.ones(3, 3)))


class Empty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (PartInit, "initialises part of w.weight"),
        (CopyInit, "initialises with aten.copy_.default on w.weight"),
        (OffMeta, "builds tensors off the meta device (aten.normal_.default on a cpu tensor)"),
        (Empty, "never initialises w by an operation the meta-device build can replay"),
    ],
)
def test_what_cannot_be_replayed_is_refused_naming_the_tensor(build, expected):
    with pytest.raises(BatchpilotError) as raised:
        build_deferred(build)
    assert raised.value.field == "model.factory"
    assert expected in str(raised.value)


def test_a_buffer_without_reset_buffers_is_refused_when_placed():
    deferred = build_deferred(NoReset)
    to_empty(deferred.model, device="cpu")
    with pytest.raises(BatchpilotError, match=r"has buffer mask and no reset_buffers\(\)"):
        deferred.initialize(deferred.model)

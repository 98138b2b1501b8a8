"""A model built on the `meta` device, its initialisation recorded to be replayed on each rank's shard.

A 70B model does not fit one device or one host, so the trainer builds it on `meta` (shapes only), spreads
it over the ranks, gives each rank's shard real memory, and only then initialises it. The initial weights
must stay a function of the seed alone (the same for any world size, parallelism and runtime: resumes and
the eager-vs-XLA tests compare runs bit for bit), and they stay exactly those of the model built on the CPU
under `torch.manual_seed(seed)`:

- `build_deferred` runs the factory under `torch.device("meta")` with a dispatch mode that records every
  in-place operation on a tensor (the factory's own `nn.init` calls and each layer's `reset_parameters`);
  on meta they draw no random numbers.
- `Deferred.initialize` replays them in order. A random operation (`normal_`, `uniform_`, ...) runs on a
  whole CPU tensor of its target's shape, drawing from the default CPU generator exactly what the CPU build
  draws; the rank keeps its own part (its DTensor shard, or all of it) and drops the rest. An elementwise
  operation with number arguments (`fill_`, `mul_`, `clamp_`, ...) runs on that part alone (the part of an
  elementwise result is the result on the part). Host memory: the rank's parts plus one whole tensor.

`nn.init`'s `trunc_normal_`, `orthogonal_`, `dirac_` and `sparse_` do nothing on meta tensors, so they are
recorded as whole calls instead (`_INIT_FUNCTIONS`) and replayed on a whole CPU tensor.

What cannot be replayed is refused in one line (`model.factory`): an operation on part of a parameter, an
in-place operation that is not elementwise on numbers (`copy_` from a computed tensor), a tensor built off
the meta device, a parameter no replayable operation initialises. Buffers hold no values on meta: a model that has any must recompute them
in `reset_buffers()` (the Llama's rotary tables), which `initialize` and `reset_buffers` call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from batchpilot.errors import BatchpilotError

aten = torch.ops.aten

RANDOM_IN_PLACE = frozenset(
    {
        aten.normal_.default, aten.uniform_.default, aten.bernoulli_.float, aten.bernoulli_.Tensor,
        aten.exponential_.default, aten.geometric_.default, aten.log_normal_.default, aten.cauchy_.default,
        aten.random_.default, getattr(aten.random_, "from"), aten.random_.to,
    }
)  # fmt: skip
"""In-place operations that draw from the generator: replayed on a whole tensor."""

ELEMENTWISE_IN_PLACE = frozenset(
    {
        aten.fill_.Scalar, aten.zero_.default, aten.mul_.Scalar, aten.div_.Scalar, aten.add_.Scalar,
        aten.sub_.Scalar, aten.clamp_.default, aten.clamp_min_.default, aten.clamp_max_.default,
        aten.erfinv_.default, aten.sqrt_.default, aten.abs_.default, aten.neg_.default, aten.exp_.default,
    }
)  # fmt: skip
"""In-place elementwise operations whose arguments are numbers: replayed on the rank's part only
(`nn.init.ones_`/`zeros_`/`constant_` are `fill_`/`zero_`)."""

RANDOM_FACTORIES = frozenset(
    {
        aten.randn.default, aten.randn.generator, aten.rand.default, aten.rand.generator,
        aten.randint.default, aten.randint.low, aten.randperm.default, aten.normal.float_float,
    }
)  # fmt: skip
"""Out-of-place operations that draw from the generator (`nn.Parameter(torch.randn(n))`): replayed on the CPU."""

CONSTANT_FACTORIES = frozenset(
    {
        aten.ones.default, aten.zeros.default, aten.full.default, aten.ones_like.default,
        aten.zeros_like.default, aten.full_like.default, aten.eye.default, aten.scalar_tensor.default,
    }
)  # fmt: skip
"""Out-of-place operations that make a tensor of known values (`nn.Parameter(torch.ones(n))`): replayed on the
CPU, the rank keeping its part."""

FIELD = "model.factory"

_INIT_FUNCTIONS = ("_no_grad_trunc_normal_", "orthogonal_", "dirac_", "sparse_")
"""`torch.nn.init` functions that return at once on a meta tensor (their values depend on the draws: rejection
sampling, a QR decomposition): recorded whole while the model is built, when called as `nn.init.<name>`
(`trunc_normal_` always: it calls its helper by the module's name)."""


@dataclass(frozen=True)
class InitOp:
    """One recorded operation: `func(target, *args, **kwargs)` (a factory: `func(*args, **kwargs)`).

    Attributes:
        target: the model's name of the tensor it wrote (None: a tensor the model does not keep, whose random
            draws are replayed and dropped all the same, as the CPU build made them).
        shape, dtype: the tensor's.
        whole: it runs on a whole CPU tensor (it draws from the generator, or makes its tensor); otherwise it
            is elementwise and runs on the rank's part.
        factory: it makes its tensor (`torch.randn`, `torch.ones`) rather than writing one.
    """

    func: Any
    target: str | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    whole: bool
    factory: bool = False

    @property
    def overwrites(self) -> bool:
        """It sets every element without reading any (a random fill, a constant, a factory)."""
        return self.whole or self.func in (aten.fill_.Scalar, aten.zero_.default)

    def whole_tensor(self) -> torch.Tensor:
        """The operation's result on a whole CPU tensor, drawing from the default generator as the CPU
        build does."""
        if self.factory:
            return self.func(*self.args, **{**self.kwargs, "device": torch.device("cpu")})
        tensor = torch.empty(self.shape, dtype=self.dtype)
        self.func(tensor, *self.args, **self.kwargs)
        return tensor

    def apply_to(self, part: torch.Tensor) -> None:
        """The elementwise operation on the rank's part of its target."""
        self.func(part, *self.args, **self.kwargs)


class _Recorder(TorchDispatchMode):
    """Records in-place operations on meta tensors and random factories while a model is built."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, torch.Tensor, tuple[Any, ...], dict[str, Any]]] = []
        self.off_meta: str | None = None

    @contextlib.contextmanager
    def init_functions(self) -> Iterator[None]:
        """`_INIT_FUNCTIONS` recorded on meta tensors while the model is built (the originals restored)."""
        originals = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}

        def recording(original: Callable[..., Any]) -> Callable[..., Any]:
            def record(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if not tensor.is_meta:
                    return original(tensor, *args, **kwargs)
                self.ops.append((original, tensor, args, kwargs))
                return tensor

            return record

        try:
            for name, original in originals.items():
                setattr(nn.init, name, recording(original))
            yield
        finally:
            for name, original in originals.items():
                setattr(nn.init, name, original)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (func in RANDOM_FACTORIES or func in CONSTANT_FACTORIES) and isinstance(out, torch.Tensor):
            self.ops.append((func, out, args, {k: v for k, v in kwargs.items() if k != "device"}))
        elif func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
            target = args[0]
            if target.device.type != "meta":
                self.off_meta = self.off_meta or f"{func} on a {target.device.type} tensor"
            self.ops.append((func, target, args[1:], kwargs))  # holds the tensor: no storage is reused
        return out


@dataclass
class Deferred:
    """A model built on meta and the operations that initialise it."""

    model: nn.Module
    ops: list[InitOp]

    def initialize(self, model: nn.Module) -> None:
        """Fills `model` (this model, placed: `to_empty` on a device, maybe sharded) with the seed's weights:
        the recorded operations replayed in order from the current default CPU generator state, then the
        buffers. Call it with the generator seeded as the CPU build was.

        Only a target's last overwrite and the elementwise operations after it decide its values (a layer's
        `reset_parameters` that the model's own initialisation overwrites only draws); a target's part is
        staged on the CPU from that overwrite to its last operation, then copied into the placed tensor.
        """
        placed = _tensors(model)
        self._replay(
            part=lambda name: part_slices(placed[name]),
            empty=lambda name: torch.empty_like(local_tensor(placed[name]), device="cpu"),
            deliver=lambda name, values: local_tensor(placed[name]).copy_(values),
        )
        reset_buffers(model)

    def stream(self, deliver: Callable[[str, torch.Tensor], None]) -> None:
        """The seed's weights one whole CPU tensor at a time: the recorded operations replayed as `initialize`
        replays them (the same draws, seeded alike), each target handed to `deliver(name, tensor)` at its last
        operation and dropped after (a runtime whose devices take whole tensors, SPMD under XLA, uploads and
        shards it). A tied weight is delivered once, under the name its operations were recorded with.
        Buffers are not made here (`reset_buffers` on the placed model)."""
        layouts = {op.target: (op.shape, op.dtype) for op in self.ops if op.target is not None}
        self._replay(
            part=lambda name: (),
            empty=lambda name: torch.empty(layouts[name][0], dtype=layouts[name][1]),
            deliver=deliver,
        )

    def _replay(
        self,
        *,
        part: Callable[[str], tuple[slice, ...]],
        empty: Callable[[str], torch.Tensor],
        deliver: Callable[[str, torch.Tensor], Any],
    ) -> None:
        """The recorded operations in order: `part(name)` is where the kept part of a target lies in its whole
        tensor, `empty(name)` a CPU tensor of that part's shape, `deliver(name, values)` takes the part at the
        target's last operation."""
        live_from = {op.target: index for index, op in enumerate(self.ops) if op.overwrites}
        last = {op.target: index for index, op in enumerate(self.ops)}
        parts: dict[str, torch.Tensor] = {}  # targets being replayed: this rank's part, on the CPU
        with torch.no_grad():
            for index, op in enumerate(self.ops):
                live = op.target is not None and index >= live_from.get(op.target, index + 1)
                name = op.target if live else None  # None: only its draws matter
                if op.whole:
                    whole = op.whole_tensor()  # draws what the CPU build draws, kept or not
                    if name is not None:
                        parts[name] = whole[part(name)]
                    del whole
                elif name is not None:  # elementwise: on the part
                    if name not in parts:  # a fill_ or zero_: the placed part's shape is enough
                        parts[name] = empty(name)
                    op.apply_to(parts[name])
                if name is not None and index == last[name]:
                    deliver(name, parts.pop(name))
        assert not parts, f"staged and never placed: {sorted(parts)}"

    def initialized_names(self) -> set[str]:
        """The tensors an operation overwrites whole (the others' values would be the memory's)."""
        return {op.target for op in self.ops if op.target is not None and op.overwrites}


def build_deferred(build: Callable[[], nn.Module]) -> Deferred:
    """`build()` under `torch.device("meta")` with its initialisation recorded (see the module docstring).

    Raises:
        BatchpilotError: what cannot be replayed, naming the tensor and the operation.
    """
    recorder = _Recorder()
    with torch.device("meta"), recorder, recorder.init_functions():
        model = build()
    if recorder.off_meta is not None:
        raise BatchpilotError(
            FIELD,
            f"builds tensors off the meta device ({recorder.off_meta}), so the trainer cannot build it sharded",
            "create every tensor on the default device (no device= argument)",
        )
    names = {_key(tensor): name for name, tensor in reversed(list(_tensors(model).items()))}
    ops = [_recorded(func, tensor, args, kwargs, names) for func, tensor, args, kwargs in recorder.ops]
    deferred = Deferred(model=model, ops=ops)
    parameters = dict(model.named_parameters())
    never = sorted(set(parameters) - deferred.initialized_names())
    if never:
        raise BatchpilotError(
            FIELD,
            f"never initialises {never[0]} by an operation the meta-device build can replay (its values would be "
            "whatever the memory held)",
            "initialise it in the constructor with nn.init, or make it with torch.randn/ones/zeros/full",
        )
    return deferred


def to_empty(model: nn.Module, *, device: torch.device | str) -> None:
    """`model.to_empty(device=device)` keeping shared parameters shared (a tied head and embedding):
    `Module.to_empty` gives each name a tensor of its own, FSDP2's sharded parameters stay shared."""
    groups: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(parameter), []).append(name)
    model.to_empty(device=device)
    for first, *aliases in groups.values():
        shared = model.get_parameter(first)
        for alias in aliases:
            owner, _, attribute = alias.rpartition(".")
            module = model.get_submodule(owner)
            if getattr(module, attribute) is not shared:
                setattr(module, attribute, shared)


def _recorded(
    func: Any, tensor: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any], names: dict[Any, str]
) -> InitOp:
    name = names.get(_key(tensor))
    random = func in RANDOM_IN_PLACE or not isinstance(func, torch._ops.OpOverload)  # an nn.init function
    shape, dtype = tuple(tensor.shape), tensor.dtype
    if func in RANDOM_FACTORIES or func in CONSTANT_FACTORIES:  # a kept tensor, or a temporary's draws
        whole = name is not None or func in RANDOM_FACTORIES
        return InitOp(func, name, shape, dtype, tuple(args), kwargs, whole=whole, factory=True)
    if name is None:  # a temporary: only its random draws matter
        return InitOp(func, None, shape, dtype, tuple(args), kwargs, whole=random)
    what = f"{func} on {name}"
    if not random and func not in ELEMENTWISE_IN_PLACE:
        raise BatchpilotError(
            FIELD,
            f"initialises with {what}, which the meta-device build cannot replay on a shard",
            "initialise with nn.init's normal_, uniform_, trunc_normal_, zeros_, ones_ or constant_",
        )
    if any(isinstance(arg, torch.Tensor) for arg in (*args, *kwargs.values())):
        raise BatchpilotError(
            FIELD, f"initialises with {what} of a tensor argument, which cannot be replayed"
        )
    if (
        tensor.storage_offset() != 0
        or not tensor.is_contiguous()
        or tensor.numel() * tensor.element_size() != (tensor.untyped_storage().nbytes())
    ):
        raise BatchpilotError(
            FIELD, f"initialises part of {name} ({what} on a view), which cannot be replayed on a shard",
            "initialise whole parameters",
        )  # fmt: skip
    return InitOp(func, name, shape, dtype, tuple(args), kwargs, whole=random)


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, a shared one under each of its names."""
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return tensors


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `tensor`: its DTensor shard, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def part_slices(placed: torch.Tensor) -> tuple[slice, ...]:
    """Where this rank's part of `placed` lies in the whole tensor: its DTensor shard's ranges, or all of it."""
    if not isinstance(placed, DTensor):
        return tuple(slice(None) for _ in placed.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(placed.shape, placed.device_mesh, placed.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))


def reset_buffers(model: nn.Module) -> None:
    """Recomputes the buffers a meta build left empty (`model.reset_buffers()`); refuses a model with
    buffers and no such method."""
    buffers = [name for name, _ in model.named_buffers()]
    reset = getattr(model, "reset_buffers", None)
    if callable(reset):
        reset()
    elif buffers:
        raise BatchpilotError(
            FIELD,
            f"has buffer {buffers[0]} and no reset_buffers(): built on the meta device, it would hold no values",
            "add a reset_buffers() method that recomputes the model's buffers",
        )

"""The set-up both runtimes share: the checks before training (resume point, sample order, vocabulary), the
initial model, the optimizer, the training loader, and the FLOPs and device peak MFU is measured against.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from batchpilot import runstate
from batchpilot.config import Config, resolved_runtime
from batchpilot.config.identity import checkpoint_continuation
from batchpilot.data.loader import TokenLoader
from batchpilot.errors import BatchpilotError
from batchpilot.models.deferred import build_deferred, reset_buffers
from batchpilot.models.factory import build_model, set_activation_checkpointing
from batchpilot.planning import Stage
from batchpilot.planning.devices import device_peak_flops
from batchpilot.planning.flops import flops_per_token, peak_bf16_flops
from batchpilot.train.checkpoint import Checkpoint
from batchpilot.train.init_from import start_from
from batchpilot.train.runtime import Initialization, Place
from batchpilot.train.shape import model_shape

logger = logging.getLogger(__name__)


def data_order(config: Config) -> dict[str, Any]:
    """The settings that decide which sample each position reads; a resumed run must use the same."""
    data = config.data
    return {
        "uri": data.uri,
        "split": data.split,
        "seq_len": data.seq_len,
        "seed": config.train.seed,
        "shuffle": data.shuffle,
        "shuffle_block_samples": data.shuffle_block_samples,
        "shuffle_window_blocks": data.shuffle_window_blocks,
    }


def check_world(stages: Sequence[Stage], *, place: Place, devices_per_node: int, fix: str) -> None:
    """A stage or a launch runs on its planned world (`num_nodes x devices_per_node` data-parallel ranks)."""
    wrong = next((s for s in stages if s.world_size != place.num_devices), None)
    if wrong is not None:
        raise BatchpilotError(
            "--stage",
            f"{wrong.name} is planned for {wrong.num_nodes} node(s) x {devices_per_node} = {wrong.world_size} "
            f"{place.unit}, {place.job} has {place.num_devices}",
            fix,
        )


def check_resume_point(*, stages: list[Stage], checkpoint: Checkpoint | None, uri: str) -> int:
    """The consumed_samples to start from; raises when the checkpoint does not belong to these stages."""
    first, last = stages[0], stages[-1]
    consumed = checkpoint.consumed_samples if checkpoint else 0
    if checkpoint is None and first.start_sample > 0:
        raise BatchpilotError(
            "train.checkpoint_uri",
            f"{first.name} starts at sample {first.start_sample:,} but {uri} holds no checkpoint",
            "run the earlier stages first (or point checkpoint_uri at their checkpoints)",
        )
    if consumed < first.start_sample:
        raise BatchpilotError(
            "--stage",
            f"the latest checkpoint is at sample {consumed:,}, before {first.name} starts ({first.start_sample:,})",
            "run the stage that contains that sample first",
        )
    if consumed > last.end_sample:
        raise BatchpilotError(
            "--stage",
            f"the latest checkpoint ({consumed:,} samples) is past the end of {last.name} ({last.end_sample:,})",
            "run a later stage",
        )
    return consumed


def check_same_data_order(config: Config, checkpoint: Checkpoint | None) -> None:
    """Refuses to resume with a different sample order (samples would be repeated or skipped)."""
    saved = checkpoint.meta.get("data_order") if checkpoint else None
    if saved is None:
        return
    for key, value in data_order(config).items():
        if saved.get(key) != value:
            raise BatchpilotError(
                f"data.{key}" if key != "seed" else "train.seed",
                f"is {value!r} but the checkpoint was trained with {saved.get(key)!r}; resuming would repeat or "
                "skip samples",
                "restore the setting, or start a new run with a new checkpoint_uri",
            )


def check_same_run(config: Config, checkpoint: Checkpoint | None, *, uri: str) -> str | None:
    """Refuses a checkpoint another run wrote (`config.identity`); the words the resume line says about the
    run it continues, None on a first start."""
    if checkpoint is None:
        return None
    branch = runstate.read_branch(checkpoint.storage)
    how = checkpoint_continuation(config, checkpoint.meta, branch=branch, where=uri).describe()
    if getattr(config.batch.rampup, "adaptive", None) is not None:
        how += " (an adaptive ramp-up: its stages are decided as it trains)"
    return how


def check_vocabulary(model: nn.Module, *, vocab_size: int) -> None:
    """The model's first embedding must cover every token id of the dataset."""
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is not None and embedding.num_embeddings < vocab_size:
        raise BatchpilotError(
            "model.args.vocab_size",
            f"the model embeds {embedding.num_embeddings} token ids but the dataset's vocabulary has {vocab_size}",
            f"set vocab_size to at least {vocab_size}",
        )


def train_loader(config: Config, *, reader: tuple[int, int, int]) -> TokenLoader:
    """The training samples of this process: rank `reader[0]` of `reader[1]` data readers, `reader[2]` of
    them per node (see `Runtime.reader`)."""
    rank, world_size, local_world_size = reader
    data = config.data
    return TokenLoader(
        uri=data.uri,
        seq_len=data.seq_len,
        seed=config.train.seed,
        rank=rank,
        world_size=world_size,
        local_world_size=local_world_size,
        expansion_factor=data.expansion_factor_real_data,
        split=data.split,
        shuffle=data.shuffle,
        prefetch_steps=data.prefetch_steps,
        verify_checksums=data.verify_checksums,
        shuffle_block_samples=data.shuffle_block_samples,
        shuffle_window_blocks=data.shuffle_window_blocks,
    )


def initial_model(
    config: Config,
    *,
    vocab_size: int,
    checkpoint: Checkpoint | None,
    local_rank: int,
    say: Callable[[str], None],
    say_every_rank: Callable[[str], None],
) -> tuple[nn.Module, Initialization]:
    """The model on the `meta` device (shapes only: nothing of a 70B model is held yet), with activation
    checkpointing as configured, and the function that fills it once the runtime has placed it (each rank's
    shard given memory): the seed's weights (`models.deferred`: those of the model built on the CPU under
    `train.seed`, the same for any world size, parallelism and runtime), `train.init_from`'s on a first start
    (read by shard, `local_rank`'s node copy), or on a resume the buffers alone (the checkpoint's weights are
    restored next)."""
    deferred = build_deferred(lambda: build_model(factory=config.model.factory, args=config.model.args))
    model = deferred.model
    check_vocabulary(model, vocab_size=vocab_size)
    set_activation_checkpointing(model, config.train.activation_checkpointing)

    seeded = checkpoint is None and config.train.init_from is None

    def initialize(placed: nn.Module) -> None:
        if seeded:
            torch.manual_seed(config.train.seed)
            deferred.initialize(placed)
            return
        reset_buffers(placed)
        start_from(
            placed,
            config=config,
            resuming_step=None if checkpoint is None else checkpoint.step,
            local_rank=local_rank,
            say=say,
            say_every_rank=say_every_rank,
            ranged=resolved_runtime(config) != "xla",  # eager ranks read their shards' byte ranges of gs://
        )

    return model, Initialization(
        fill=initialize,
        seeded=deferred if seeded else None,
        seed=config.train.seed,
        resuming=checkpoint is not None,
    )


def make_optimizer(model: nn.Module, *, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases, norms and embeddings' 1-D parameters. Fused (one kernel for every
    parameter's update) when the parameters are on CUDA; elsewhere PyTorch's default implementation."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(groups, lr=0.0, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)


def model_flops_per_token(config: Config) -> float:
    """Training FLOPs per token of the config's model (6N plus attention, N without the embedding lookups:
    planning/flops.py)."""
    shape = model_shape(factory=config.model.factory, args=config.model.args)
    return flops_per_token(
        num_params=shape.matmul_params,
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        seq_len=config.data.seq_len,
    )


def device_peak(config: Config, device: torch.device, *, bf16: bool) -> float | None:
    """The bf16 peak FLOP/s of one device (`cluster.device_peak_flops`, else the device table by the pool's
    accelerator type or the CUDA device's name); None for fp32 training or an unknown device."""
    if config.cluster.device_peak_flops is not None:
        return config.cluster.device_peak_flops
    if not bf16:
        return None
    if device.type == "cuda":
        return peak_bf16_flops(torch.cuda.get_device_name(device))
    return device_peak_flops(config.cluster.accelerator_type)

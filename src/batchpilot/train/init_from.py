"""`train.init_from`: the run's first start takes its model weights from a Hugging Face Llama checkpoint.

Only a start without a checkpoint of the run's own loads it (the trainer decides, `train()`): every later
start resumes from `train.checkpoint_uri`, whose weights have trained on. The weights go into the model as
the factory built it, on the CPU of every rank, before it is moved, wrapped by DDP or sharded by FSDP2:
DDP then starts from them as from any weights, and `fully_shard` shards them.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from batchpilot.checks import init_from_shape_problems
from batchpilot.config import Config
from batchpilot.errors import BatchpilotError
from batchpilot.planning.batch import raise_problems


def load_init_from(model: nn.Module, *, config: Config, folder: Path) -> int:
    """Reads the checkpoint in `folder`, checks it against the config's model (as `batchpilot plan` did) and
    copies its weights into `model`; returns the number of tensors loaded.

    Raises:
        BatchpilotError: a missing folder or file, another architecture or shape, weights missing or left
            over, or safetensors not installed (one line each).
    """
    from batchpilot.models.hf import LLAMA_FACTORY, from_hf_state_dict, read_hf_checkpoint

    if config.model.factory != LLAMA_FACTORY:  # plan refuses it; a hand-edited plan is refused by its hash
        raise BatchpilotError(
            "train.init_from", f"loads a Llama, but model.factory is {config.model.factory}"
        )
    if not folder.is_dir():
        raise BatchpilotError("train.init_from", f"{folder} does not exist here", "give a checkpoint folder")
    hf_config, hf_state = read_hf_checkpoint(folder)  # without safetensors: one line naming the hf extra
    raise_problems(init_from_shape_problems(config, hf_config, path=folder / "config.json"))
    _, _, state = from_hf_state_dict(hf_config, hf_state)
    model.load_state_dict(state, strict=True)
    return len(state)

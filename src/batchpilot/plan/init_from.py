"""`train.init_from`, a Hugging Face Llama checkpoint, against the config: the factory, where the trainers can
read the folder, the `hf` extra, and the checkpoint's config.json against model.args (no weight is read).
"""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from batchpilot.config import Config
from batchpilot.errors import BatchpilotError
from batchpilot.models.hf import INIT_FROM_FIELD


def init_from_problems(config: Config) -> list[BatchpilotError]:
    """`train.init_from` against the config, one error per problem: the Llama factory, the eager runtime, a
    folder the trainers can read (gs:// off the local backend), the `hf` extra, and the checkpoint's
    config.json and weights (`init_from_folder_problems`, `init_from_gcs_problems`). Reads config.json (and
    for gs:// the objects' metadata) only, never the weights."""
    source = config.train.init_from
    if source is None:
        return []
    from batchpilot.models.hf import INSTALL_FIX, LLAMA_FACTORY

    if config.model.factory != LLAMA_FACTORY:
        return [
            BatchpilotError(
                INIT_FROM_FIELD,
                f"loads a Hugging Face Llama, but model.factory is {config.model.factory}",
                f"set model.factory: {LLAMA_FACTORY} with the checkpoint's shape in model.args",
            )
        ]
    problems = []
    folder = config.train.init_from_folder
    if folder is not None and config.cluster.backend != "local":
        problems.append(
            BatchpilotError(
                INIT_FROM_FIELD,
                f"is the local folder {folder}, which the trainer pods on {config.cluster.backend} do not see",
                f"use a gs:// folder (gcloud storage cp -r {folder} gs://BUCKET/PATH)",
            )
        )
        return problems
    if config.cluster.backend == "local" and find_spec("safetensors") is None:
        problems.append(
            BatchpilotError(
                INIT_FROM_FIELD, "needs safetensors to read the checkpoint's weights", INSTALL_FIX
            )
        )
    if folder is None:
        return problems + init_from_gcs_problems(config, source)
    return problems + init_from_folder_problems(config, folder)


def init_from_gcs_problems(config: Config, uri: str) -> list[BatchpilotError]:
    """A gs:// checkpoint folder, as `init_from_folder_problems` a local one: its config.json (read through
    the storage layer and its credentials) against model.args, and safetensors weights beside it."""
    from batchpilot.models.hf import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE
    from batchpilot.storage import ObjectNotFound, StorageError, join_uri, open_storage

    path = join_uri(uri, CONFIG_FILE)
    try:
        storage = open_storage(uri)
        text = storage.read(CONFIG_FILE)
        has_weights = storage.exists(WEIGHTS_FILE) or storage.exists(INDEX_FILE)
    except ObjectNotFound as error:  # the object, or the bucket
        problem = f"{uri} has no {CONFIG_FILE}" if error.field == path else f"{error.field} does not exist"
        return [
            BatchpilotError(
                INIT_FROM_FIELD,
                problem,
                "give the gs:// folder `save_pretrained` wrote (config.json and weights)",
            )
        ]
    except StorageError as error:
        return [error]
    try:
        hf_config = json.loads(text)
    except ValueError as error:
        return [BatchpilotError(INIT_FROM_FIELD, f"{path} is not readable JSON ({error})")]
    problems = shape_problems(config, hf_config, path=path)
    if not has_weights:
        problems.append(
            BatchpilotError(
                INIT_FROM_FIELD,
                f"{uri} has neither {WEIGHTS_FILE} nor {INDEX_FILE}",
                "save the weights as safetensors: model.save_pretrained(folder, safe_serialization=True)",
            )
        )
    return problems


def init_from_folder_problems(config: Config, folder: Path) -> list[BatchpilotError]:
    """The checkpoint folder: a config.json of a LlamaForCausalLM whose shape is the config's model.args
    (one error per differing arg, naming both values and the fix), safetensors weights, and a max_seq_len
    that covers data.seq_len. The trainer asks the same before it loads the weights."""
    from batchpilot.models.hf import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE

    if not folder.is_dir():
        return [
            BatchpilotError(
                INIT_FROM_FIELD,
                f"{folder} does not exist",
                "give the folder of a Hugging Face Llama checkpoint",
            )
        ]
    path = folder / CONFIG_FILE
    try:
        hf_config = json.loads(path.read_text())
    except FileNotFoundError:
        return [
            BatchpilotError(
                INIT_FROM_FIELD,
                f"{folder} has no {CONFIG_FILE}",
                "give the folder `save_pretrained` wrote (config.json and model.safetensors)",
            )
        ]
    except (OSError, ValueError) as error:
        return [BatchpilotError(INIT_FROM_FIELD, f"{path} is not readable JSON ({error})")]
    problems = shape_problems(config, hf_config, path=path)
    if not (folder / WEIGHTS_FILE).is_file() and not (folder / INDEX_FILE).is_file():
        problems.append(
            BatchpilotError(
                INIT_FROM_FIELD,
                f"{folder} has neither {WEIGHTS_FILE} nor {INDEX_FILE}",
                "save the weights as safetensors: model.save_pretrained(folder, safe_serialization=True)",
            )
        )
    return problems


def shape_problems(config: Config, hf_config: Any, *, path: Path | str) -> list[BatchpilotError]:
    """A config.json (`path`, for the messages) against the config's model (`models.hf.llama_shape_problems`)."""
    from batchpilot.models.hf import llama_shape_problems

    return llama_shape_problems(
        model_factory=config.model.factory, model_args=config.model.args, seq_len=config.data.seq_len,
        hf_config=hf_config, path=path,
    )  # fmt: skip

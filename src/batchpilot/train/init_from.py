"""`train.init_from`: the run's first start takes its model weights from a Hugging Face Llama checkpoint.

Only a start without a checkpoint of the run's own loads it (the trainer decides, `train()`): every later
start resumes from `train.checkpoint_uri`, whose weights have trained on. The weights go into the model once
the runtime has placed it (`setup.initial_model`): into each rank's FSDP2 shards after `fully_shard`, into a
whole replica before DDP wraps it, into the host's CPU copy under XLA.

Memory and reads: the safetensors files are memory-mapped and each rank reads, tensor by tensor, only the
rows of its own shard (`safe_open(...).get_slice`), copying them into its parameter; the mapped pages are the
node's page cache, shared by its ranks.

A `gs://` folder is read by each eager rank in byte ranges, only its shards' rows, with every file's CRC32C
checked from all ranks' reads (`load_init_from_bucket`, `ranged_safetensors.py`). For XLA's hosts and
explore's probes it is downloaded once per node (`node_cache_folder`): local rank 0 streams config.json, the
index and the weight files into a node-local cache, checks every file's size and CRC32C against the object's
metadata and publishes the folder by an atomic rename; the other local ranks wait for it, bounded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchpilot.config import Config
from batchpilot.errors import BatchpilotError
from batchpilot.models.deferred import local_tensor, part_slices
from batchpilot.planning.batch import raise_problems
from batchpilot.storage import Storage, open_storage

FIELD = "train.init_from"
Deliver = Callable[[str, torch.Tensor], Any]
"""Takes one of the model's tensors by name, whole, on the CPU (an XLA host places it on its devices)."""
CACHE_ENV = "BATCHPILOT_INIT_FROM_CACHE"
"""The node-local folder `gs://` checkpoints are downloaded into (default: the temp dir's
`batchpilot-init-from`; on GKE /tmp is the pod's emptyDir on the node's disk)."""
WAIT_ENV = "BATCHPILOT_INIT_FROM_WAIT_S"
"""How long the other local ranks wait for local rank 0's download (default `DEFAULT_WAIT_S`)."""
DEFAULT_WAIT_S = 7200.0
CHUNK_BYTES = 64 * 1024 * 1024
"""One ranged read of a download: a 5 GB shard never sits in memory whole."""
SOURCE_FILE = ".batchpilot-source.json"
"""In a published cache folder: the URI and every object's size, generation and CRC32C it was made from."""
_PARTIAL = ".partial-"
_POLL_S = 0.5


# --- the folder a rank loads from ------------------------------------------------------------------------


def start_from(
    model: nn.Module,
    *,
    config: Config,
    resuming_step: int | None,
    local_rank: int,
    say: Callable[[str], None],
    say_every_rank: Callable[[str], None],
    ranged: bool = False,
    deliver: Deliver | None = None,
) -> None:
    """`train.init_from`: a start without a checkpoint of the run's own takes the Hugging Face weights (step 0,
    a fresh optimizer); a resume (`resuming_step` set) never does, its checkpoint's weights have trained on.
    With `ranged` (the eager trainer) every rank reads its own shards' byte ranges of a gs:// folder
    (`ranged_safetensors.py`); with `deliver` (an XLA host, whose model is still on meta) every weight is read
    whole, by byte ranges from gs://, and handed to `deliver` one tensor at a time (`copy_weights`);
    otherwise (explore's probes) a gs:// folder is first downloaded once per node (local rank 0; the other
    local ranks wait for it). The eager trainer calls this on every rank once its shards (or replica) have
    memory.

    Args:
        say: a message once (the main rank's log); say_every_rank: a message from this rank.
    """
    source = config.train.init_from
    if source is None:
        return
    if resuming_step is not None:
        say(f"train.init_from {source} not loaded: resuming from step {resuming_step}'s checkpoint")
        return
    if (ranged or deliver is not None) and source.startswith("gs://"):
        loaded, read_bytes = load_init_from_bucket(model, config=config, uri=source, deliver=deliver)
        what = "by ranges, one tensor at a time" if deliver is not None else "this rank's shards"
        say_every_rank(f"train.init_from {source}: read {read_bytes / 2**20:.1f} MiB, {what}")
        say(f"initialized the model from {source} ({loaded} tensors of a Hugging Face Llama checkpoint)")
        return
    folder = init_from_folder(source, local_rank=local_rank, say=say_every_rank)
    loaded = load_init_from(model, config=config, folder=folder, deliver=deliver)
    say(f"initialized the model from {source} ({loaded} tensors of a Hugging Face Llama checkpoint)")


def init_from_folder(
    source: str, *, local_rank: int, say: Callable[[str], None], cache_root: Path | None = None
) -> Path:
    """The local folder to load `source` (train.init_from) from: the folder itself, or for `gs://` the node's
    verified copy (local rank 0 downloads it, the other local ranks wait for it)."""
    if not source.startswith("gs://"):
        return Path(source.removeprefix("file://"))
    root = cache_root or Path(
        os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir(), "batchpilot-init-from")
    )
    wait_s = float(os.environ.get(WAIT_ENV) or DEFAULT_WAIT_S)
    return node_cache_folder(source, cache_root=root, local_rank=local_rank, wait_s=wait_s, say=say)


def node_cache_folder(
    uri: str, *, cache_root: Path, local_rank: int, wait_s: float, say: Callable[[str], None]
) -> Path:
    """The folder under `cache_root` holding a verified copy of the checkpoint at `uri` (config.json, the
    safetensors index and weights; nothing else of the folder). Local rank 0 reuses a complete copy of the
    same object generations or downloads one; the others wait up to `wait_s` for it.

    Raises:
        BatchpilotError: a missing object, a download that does not match its object's size or CRC32C, or a
            wait that ran out (naming what it waited for).
    """
    storage = open_storage(uri)
    objects = _objects(storage)
    folder = cache_root / hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    if local_rank != 0:
        return _wait_for(folder, uri=uri, objects=objects, wait_s=wait_s, say=say)
    if _complete(folder, uri=uri, objects=objects):
        say(f"train.init_from {uri}: using this node's copy in {folder}")
        return folder
    started = time.monotonic()
    _download(storage, uri=uri, objects=objects, folder=folder)
    num_bytes = sum(info["size_bytes"] for info in objects.values())
    say(
        f"train.init_from {uri}: downloaded {len(objects)} files ({num_bytes / 2**30:.2f} GiB) into {folder} "
        f"in {time.monotonic() - started:.1f} s"
    )
    return folder


def _objects(storage: Storage) -> dict[str, dict[str, Any]]:
    """name -> size_bytes, generation, crc32c of the objects a load reads: config.json and model.safetensors,
    or config.json, the index and the shards it names."""
    from batchpilot.models.hf import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE

    names = [CONFIG_FILE]
    if storage.exists(WEIGHTS_FILE):
        names.append(WEIGHTS_FILE)
    elif storage.exists(INDEX_FILE):
        names += [INDEX_FILE, *_index_names(json.loads(storage.read(INDEX_FILE)), where=storage.uri)]
    else:
        raise BatchpilotError(FIELD, f"{storage.uri} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    objects = {}
    for name in names:
        info = storage.stat(name)  # ObjectNotFound names the object's URI
        objects[name] = {"size_bytes": info.size_bytes, "generation": info.generation, "crc32c": info.crc32c}
    return objects


def _index_names(index: Any, *, where: str) -> list[str]:
    try:
        return sorted(set(index["weight_map"].values()))
    except (KeyError, TypeError, AttributeError):
        raise BatchpilotError(FIELD, f"{where}'s safetensors index has no weight_map") from None


def _complete(folder: Path, *, uri: str, objects: dict[str, dict[str, Any]]) -> bool:
    """Whether `folder` is a published copy of these very objects, every file at its object's size."""
    try:
        source = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    if source != {"uri": uri, "objects": objects}:
        return False
    return all(_size_or_none(folder / name) == info["size_bytes"] for name, info in objects.items())


def _size_or_none(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _wait_for(
    folder: Path, *, uri: str, objects: dict[str, dict[str, Any]], wait_s: float, say: Callable[[str], None]
) -> Path:
    started = time.monotonic()
    while not _complete(folder, uri=uri, objects=objects):
        if time.monotonic() - started > wait_s:
            raise BatchpilotError(
                FIELD,
                f"waited {wait_s:.0f} s for local rank 0 to download {uri} into {folder}, and it is not complete",
                f"see local rank 0's error, or raise {WAIT_ENV} for a larger checkpoint",
            )
        time.sleep(_POLL_S)
    say(f"train.init_from {uri}: loading local rank 0's copy in {folder}")
    return folder


def _download(storage: Storage, *, uri: str, objects: dict[str, dict[str, Any]], folder: Path) -> None:
    """Downloads into a partial folder, checks each file, and renames it to `folder` (a crashed download
    leaves only a partial folder, which is never taken and is removed by the next download)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    for leftover in folder.parent.glob(f"{_PARTIAL}{folder.name}-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    partial = folder.with_name(f"{_PARTIAL}{folder.name}-{os.getpid()}")
    partial.mkdir()
    try:
        with ThreadPoolExecutor(max_workers=min(8, len(objects))) as pool:
            for future in [
                pool.submit(_download_object, storage, name, info, partial / name)
                for name, info in objects.items()
            ]:
                future.result()
        (partial / SOURCE_FILE).write_text(json.dumps({"uri": uri, "objects": objects}))
        if folder.exists():  # an older generation or a damaged copy
            shutil.rmtree(folder)
        os.rename(partial, folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _download_object(storage: Storage, name: str, info: dict[str, Any], path: Path) -> None:
    """Streams one object of the pinned generation to `path` in CHUNK_BYTES reads, checking size and CRC32C."""
    import google_crc32c

    size, crc = info["size_bytes"], 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as file:
        for start in range(0, size, CHUNK_BYTES):
            chunk = storage.read(
                name, start=start, end=min(size, start + CHUNK_BYTES), generation=info["generation"]
            )
            crc = google_crc32c.extend(crc, chunk)
            file.write(chunk)
        file.flush()
        os.fsync(file.fileno())
    where = f"{storage.uri.rstrip('/')}/{name}"
    if path.stat().st_size != size:
        raise BatchpilotError(FIELD, f"downloaded {path.stat().st_size} bytes of {where}, which has {size}")
    if info["crc32c"] is None or crc != info["crc32c"]:
        raise BatchpilotError(
            FIELD,
            f"the download of {where} has CRC32C {crc:08x}, the object {_hex(info['crc32c'])}",
            "start again (the copy was not kept); if it repeats, check the object",
        )


def _hex(value: int | None) -> str:
    return "none" if value is None else f"{value:08x}"


# --- loading ------------------------------------------------------------------------------------------------


def load_init_from(model: nn.Module, *, config: Config, folder: Path, deliver: Deliver | None = None) -> int:
    """Reads the checkpoint in `folder`, checks it against the config's model (as `batchpilot plan` did) and
    copies its weights into `model` one tensor at a time (with `deliver`, hands each whole tensor to it
    instead: see `copy_weights`); returns the number of tensors loaded.

    Raises:
        BatchpilotError: a missing folder or file, another architecture or shape, weights missing or left
            over, or safetensors not installed (one line each).
    """
    from batchpilot.models.hf import LLAMA_FACTORY, llama_shape_problems

    if config.model.factory != LLAMA_FACTORY:  # plan refuses it; a hand-edited plan is refused by its hash
        raise BatchpilotError(FIELD, f"loads a Llama, but model.factory is {config.model.factory}")
    path, hf_config = _checkpoint_config(folder)
    raise_problems(
        llama_shape_problems(
            model_factory=config.model.factory,
            model_args=config.model.args,
            seq_len=config.data.seq_len,
            hf_config=hf_config,
            path=path,
        )
    )
    return _copy_checkpoint(model, hf_config=hf_config, folder=folder, deliver=deliver)


def load_init_from_bucket(
    model: nn.Module, *, config: Config, uri: str, deliver: Deliver | None = None
) -> tuple[int, int]:
    """`train.init_from`'s gs:// folder into this rank's part of `model`, each weight file read by byte ranges
    (this rank's rows), every file's CRC32C then checked from all ranks' reads (a collective when a process
    group is up: every rank must call it). With `deliver` (an XLA host: every tensor whole, handed over one at
    a time) this process reads every byte itself and checks the CRC32Cs from its own reads. Returns (tensors
    loaded, bytes this rank read).

    Raises:
        BatchpilotError: as `load_init_from`, and for a file that is not safetensors or whose bytes do not
            match the object's CRC32C.
    """
    from batchpilot.models.hf import (
        CONFIG_FILE,
        LLAMA_FACTORY,
        llama_args_from_hf_config,
        llama_shape_problems,
    )
    from batchpilot.train.ranged_safetensors import RangedSafetensors, check_objects

    if config.model.factory != LLAMA_FACTORY:  # plan refuses it; a hand-edited plan is refused by its hash
        raise BatchpilotError(FIELD, f"loads a Llama, but model.factory is {config.model.factory}")
    storage = open_storage(uri)
    objects = _objects(storage)
    where = f"{uri.rstrip('/')}/{CONFIG_FILE}"
    try:
        hf_config = json.loads(storage.read(CONFIG_FILE, generation=objects[CONFIG_FILE]["generation"]))
    except ValueError as error:
        raise BatchpilotError(where, f"is not readable JSON ({error})") from None
    raise_problems(
        llama_shape_problems(
            model_factory=config.model.factory, model_args=config.model.args, seq_len=config.data.seq_len,
            hf_config=hf_config, path=where,
        )
    )  # fmt: skip
    readers = [
        RangedSafetensors(storage, name, info)
        for name, info in objects.items()
        if name.endswith(".safetensors")
    ]
    files = {key: reader for reader in readers for key in reader.tensor_names()}
    loaded = copy_weights(
        model,
        args=llama_args_from_hf_config(hf_config),
        files=files,
        open_file=contextlib.nullcontext,
        deliver=deliver,
    )
    mine = {reader.name: list(reader.reads) for reader in readers}
    read_bytes = sum(end - start for reads in mine.values() for start, end, _ in reads)
    check_objects(readers, [mine] if deliver is not None else _all_ranks(mine))
    return loaded, read_bytes


def _all_ranks(mine: dict[str, list[tuple[int, int, int]]]) -> list[dict[str, list[tuple[int, int, int]]]]:
    """Every rank's `mine` (this one's alone without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def load_weights(model: nn.Module, *, folder: Path) -> int:
    """Copies the checkpoint in `folder` into `model` (as `load_init_from`, without a Config: explore's study
    process has only model.factory and model.args). The config's shape was checked against the checkpoint
    before (`plan.init_from.init_from_problems`); `copy_weights` still refuses a missing, left-over or misshapen tensor.
    Returns the number of tensors loaded.
    """
    _, hf_config = _checkpoint_config(folder)
    return _copy_checkpoint(model, hf_config=hf_config, folder=folder)


def _checkpoint_config(folder: Path) -> tuple[Path, Any]:
    """(the path of `folder`'s config.json, its JSON); a missing folder or unreadable file is one line."""
    from batchpilot.models.hf import CONFIG_FILE, read_hf_config

    if not folder.is_dir():
        raise BatchpilotError(FIELD, f"{folder} does not exist here", "give a checkpoint folder")
    path = folder / CONFIG_FILE
    return path, read_hf_config(path)


def _copy_checkpoint(
    model: nn.Module, *, hf_config: Any, folder: Path, deliver: Deliver | None = None
) -> int:
    from batchpilot.models.hf import llama_args_from_hf_config

    return copy_weights(
        model, args=llama_args_from_hf_config(hf_config), files=weight_files(folder), deliver=deliver
    )


def weight_files(folder: Path) -> dict[str, Path]:
    """Hugging Face weight name -> the safetensors file in `folder` that holds it (read from the headers)."""
    from batchpilot.models.hf import INDEX_FILE, WEIGHTS_FILE, require

    safetensors = require("safetensors")
    if (folder / WEIGHTS_FILE).is_file():
        paths = [folder / WEIGHTS_FILE]
    elif (folder / INDEX_FILE).is_file():
        index = json.loads((folder / INDEX_FILE).read_text())
        paths = [folder / name for name in _index_names(index, where=str(folder))]
    else:
        raise BatchpilotError(FIELD, f"{folder} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    files = {}
    for path in paths:
        try:
            with safetensors.safe_open(str(path), framework="pt", device="cpu") as handle:
                files.update(dict.fromkeys(handle.keys(), path))
        except Exception as error:  # safetensors raises its own error types for missing or damaged files
            raise BatchpilotError(str(path), f"is not a readable safetensors file ({error})") from None
    return files


def copy_weights(
    model: nn.Module,
    *,
    args: dict[str, Any],
    files: dict[str, Any],
    open_file: Callable[[Any], contextlib.AbstractContextManager[Any]] | None = None,
    deliver: Deliver | None = None,
) -> int:
    """Copies every weight of `files` (Hugging Face name -> file) into the model's own tensor, reading one
    tensor at a time, this rank's rows only; a tied head must equal the embedding. `open_file(file)` gives a
    handle with `get_slice` (default: the local path memory-mapped by safetensors). With `deliver`, each
    weight is read whole, cast to the model's dtype and handed to `deliver(name, tensor)` instead (the model
    may be on meta: an XLA host places each tensor on its devices before the next is read). Returns the
    number of the model's state-dict entries set."""
    from batchpilot.models.hf import llama_weight_names, require

    if open_file is None:
        safetensors = require("safetensors")

        def open_file(path: Any) -> contextlib.AbstractContextManager[Any]:
            return safetensors.safe_open(str(path), framework="pt", device="cpu")

    names = llama_weight_names(args)
    targets = model.state_dict(keep_vars=True)
    tied_head = files.pop("lm_head.weight", None) if args["tie_embeddings"] else None
    unknown = [
        theirs for theirs in files if theirs not in names and not theirs.endswith("rotary_emb.inv_freq")
    ]
    if unknown:
        raise BatchpilotError(FIELD, f"holds {unknown[0]}, which a LlamaForCausalLM of its config.json lacks")
    missing = [theirs for theirs in names if theirs not in files]
    if missing:
        raise BatchpilotError(FIELD, f"lacks {missing[0]}, a weight of its config.json's LlamaForCausalLM")
    by_file: dict[Any, list[str]] = {}
    for theirs in names:
        by_file.setdefault(files[theirs], []).append(theirs)
    with torch.no_grad():
        for path, group in by_file.items():
            with open_file(path) as handle:
                for theirs in group:
                    ours = names[theirs]
                    one = None if deliver is None else partial(deliver, ours)
                    _copy_one(handle, path, theirs, targets[ours], deliver=one)
        if tied_head is not None:
            embedding = targets["tok_embeddings.weight"]
            with open_file(tied_head) as handle:
                head = handle.get_slice("lm_head.weight")[part_slices(embedding)]  # this rank's rows
            if deliver is not None:  # what was delivered: the embedding as stored, read again
                with open_file(files["model.embed_tokens.weight"]) as handle:
                    mine = handle.get_slice("model.embed_tokens.weight")[:].to(embedding.dtype)
            else:
                mine = local_tensor(embedding).cpu()
            if not torch.equal(head.to(embedding.dtype), mine):
                raise BatchpilotError(
                    FIELD, "lm_head.weight differs from the embedding, but config.json ties them"
                )
    loaded = set(names.values()) | ({"output.weight"} if args["tie_embeddings"] else set())
    left = sorted(set(targets) - loaded)
    if left:
        raise BatchpilotError(FIELD, f"set no weight for the model's {left[0]}")
    return len(loaded)


def _copy_one(
    handle: Any, path: Path, name: str, target: torch.Tensor, *, deliver: Callable[[torch.Tensor], Any] | None
) -> None:
    """One tensor into the model's own: the rank's part of it only (its shard's rows of the mapped file); with
    `deliver`, the whole tensor to it."""
    stored = handle.get_slice(name)
    if tuple(stored.get_shape()) != tuple(target.shape):
        raise BatchpilotError(
            FIELD,
            f"{path} holds {name} of shape {list(stored.get_shape())}, the model's is {list(target.shape)}",
        )
    values = stored[part_slices(target)]  # all of it where the target is not a DTensor (a meta model's)
    if deliver is not None:
        deliver(values.to(target.dtype))  # cast as load_state_dict casts a bf16 checkpoint
        return
    local_tensor(target).copy_(values)  # casts a bf16 checkpoint to the model's dtype as load_state_dict does

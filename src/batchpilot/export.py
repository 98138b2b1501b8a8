"""A run's checkpoint as a Hugging Face model folder: what `batchpilot export --format hf` does.

The model's weights are read from the sharded checkpoint on this one process, whatever the world size and
strategy (ddp, fsdp, hsdp) that wrote it: DCP reads each tensor whole from every rank's chunks, and only the
`model.` entries (no optimizer state). The model is built on the meta device for its shapes, and the files are
written one shard at a time: DCP reads only that shard's tensors, so memory holds one shard (5 GiB by
default), never the whole model. The folder is written beside
`--out` under a temporary name and renamed into place, so a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from batchpilot import runstate
from batchpilot.data.shards import read_manifest
from batchpilot.data.tokenizers import TOKENIZER_OBJECT
from batchpilot.errors import BatchpilotError
from batchpilot.files import check_output_dir
from batchpilot.models import hf
from batchpilot.storage import join_uri, open_storage

if TYPE_CHECKING:
    from torch import Tensor
    from torch import dtype as TorchDtype

    from batchpilot.train.checkpoint import Checkpoint

FORMATS = ("hf",)
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class ExportResult:
    """What `export_hf` wrote.

    Attributes:
        out: the Hugging Face folder.
        files: (file name, size in bytes) of every file in it, in the order written.
        num_params: parameters of the model (a tied head counted once).
        step, consumed_samples: the checkpoint exported.
        architecture: the Hugging Face class, e.g. `LlamaForCausalLM`.
        tokenizer_note: what the folder holds of the tokenizer, or why it holds none.
    """

    out: Path
    files: list[tuple[str, int]]
    num_params: int
    step: int
    consumed_samples: int
    architecture: str
    tokenizer_note: str


def export_hf(*, plan: str | Path, out: str | Path, step: int | None = None, dtype: str = "fp32",
              force: bool = False) -> ExportResult:  # fmt: skip
    """Writes the checkpoint of run document `plan` (`latest`, or `step`) as a Hugging Face model into `out`.

    Args:
        plan: the run's plan.json (the config: model, data and checkpoint URI).
        out: the folder to write; it must be absent or empty unless `force` (then it is replaced).
        step: the optimizer step of the checkpoint (None: the one `latest` names).
        dtype: `fp32` or `bf16`, the weights' type in the files.

    Raises:
        BatchpilotError: one line for every refusal, before anything is written.
    """
    from batchpilot.plan.rundoc import read_run_document

    target = _check_out(out, force=force)
    if dtype not in DTYPES:
        raise BatchpilotError("--dtype", f"is {dtype!r}", f"use one of {', '.join(DTYPES)}")
    hf.require("safetensors.torch")
    config = read_run_document(plan).config
    factory, args = config.model.factory, dict(config.model.args)
    hf_config = hf.hf_config_for(factory, args)  # refuses a model with no counterpart before any reading
    checkpoint = find_checkpoint(checkpoint_uri=config.train.checkpoint_uri, step=step)
    tokenizer_files, note, eos_token_id = shard_set_tokenizer(config.data.uri)
    hf_config["eos_token_id"] = eos_token_id
    hf_config["torch_dtype"] = DTYPES[dtype]
    weights = CheckpointWeights.of(factory=factory, args=args, checkpoint=checkpoint, dtype=dtype)
    written = _write_into_place(target, hf_config, weights, tokenizer_files)
    return ExportResult(
        out=target,
        files=[(path.name, path.stat().st_size) for path in written],
        num_params=weights.num_params,
        step=checkpoint.step,
        consumed_samples=checkpoint.consumed_samples,
        architecture=hf_config["architectures"][0],
        tokenizer_note=note,
    )


def _check_out(out: str | Path, *, force: bool) -> Path:
    target = check_output_dir(out, field="--out")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise BatchpilotError(
            "--out", f"{out} is not empty", "choose an empty or new folder, or pass --force to replace it"
        )
    return target


def find_checkpoint(*, checkpoint_uri: str, step: int | None) -> Checkpoint:
    """The checkpoint `latest` names, or that of `step`; refuses a missing one, listing the steps there are."""
    from batchpilot.train.checkpoint import Checkpointer

    checkpointer = Checkpointer(uri=checkpoint_uri)
    if step is None:
        found = checkpointer.load()
        if found is None:
            raise BatchpilotError(
                "train.checkpoint_uri",
                f"{checkpoint_uri} holds no checkpoint yet",
                "train the plan first (batchpilot launch --plan ...), or export the run that wrote one",
            )
        return found
    steps = runstate.committed_steps(checkpointer.storage)
    if step not in steps:
        there = ", ".join(str(s) for s in steps) if steps else "none"
        raise BatchpilotError(
            "--step", f"{checkpoint_uri} has no checkpoint of step {step} (steps there: {there})"
        )
    loaded = checkpointer.load(step)
    assert loaded is not None  # a step is given
    return loaded


@dataclass
class CheckpointWeights:
    """A checkpoint's model under Hugging Face names, read one file shard at a time (`hf.HfWeights`): DCP
    reads only the tensors of the shard being written, so memory holds one shard (5 GiB by default), never
    the whole model. A checkpoint written before sharding is in memory whole anyway (its model.pt).

    Attributes:
        sources: every Hugging Face weight and the tensor of ours it comes from (`hf.hf_sources`).
        tied: the tied (head, embedding), checked equal when the embedding is read; None: untied.
        shapes: our tensors' shapes (from the meta-device model, checked against the checkpoint's).
        checkpoint: the checkpoint read.
        dtype: the torch dtype written.
    """

    sources: list[hf.Source]
    tied: tuple[str, str] | None
    shapes: dict[str, tuple[int, ...]]
    checkpoint: Checkpoint
    dtype: TorchDtype

    @classmethod
    def of(
        cls, *, factory: str, args: dict[str, object], checkpoint: Checkpoint, dtype: str
    ) -> CheckpointWeights:
        """Refuses a checkpoint of another model (the first tensor that differs) before anything is read."""
        import torch

        from batchpilot.models.factory import build_model
        from batchpilot.train.checkpoint import tensor_shapes

        with torch.device("meta"):
            model = build_model(factory=factory, args=args)
        shapes = tensor_shapes(model.state_dict())
        try:
            checkpoint.check_same_model(shapes)
        except BatchpilotError as error:  # its fix speaks of resuming; here the plan is what to change
            raise BatchpilotError(
                error.field, error.problem, "export it with the plan.json of the run that wrote it"
            ) from None
        sources, tied = hf.hf_sources(factory, args)
        return cls(sources, tied, shapes, checkpoint, getattr(torch, DTYPES[dtype]))

    @property
    def num_params(self) -> int:
        return sum(math.prod(self._shape(source)) for source in self.sources)

    def _shape(self, source: hf.Source) -> tuple[int, ...]:
        shape = self.shapes[source.ours]
        return (
            (shape[0],) if source.how == "zero_bias" else shape[::-1] if source.how == "transposed" else shape
        )

    def sizes(self) -> dict[str, int]:
        import torch

        item = torch.empty((), dtype=self.dtype).element_size()
        return {source.theirs: math.prod(self._shape(source)) * item for source in self.sources}

    def load(self, names: list[str]) -> dict[str, Tensor]:
        wanted = set(names)
        chosen = [source for source in self.sources if source.theirs in wanted]
        ours = {source.ours for source in chosen}
        if self.tied is not None and self.tied[1] in ours and self.tied[0] in self.shapes:
            ours.add(self.tied[0])  # read beside the embedding, to check they are one weight
        state = self._read(sorted(ours))
        if self.tied is not None and self.tied[1] in state:
            head, embedding = self.tied
            hf.check_tied(state, head=head, embedding=embedding)
        return {source.theirs: source.convert(state[source.ours]).to(self.dtype) for source in chosen}

    def _read(self, names: list[str]) -> dict[str, Tensor]:
        """Our tensors `names`, read from the checkpoint onto the CPU (DCP: only their chunks)."""
        import torch
        import torch.distributed.checkpoint as dcp

        from batchpilot.train.checkpoint import dcp_quietly, user_errors_of_dcp

        if not self.checkpoint.sharded:  # a checkpoint written before sharding: in memory whole
            assert self.checkpoint.model is not None
            return {name: self.checkpoint.model[name] for name in names}
        state = {name: torch.empty(self.shapes[name]) for name in names}
        with user_errors_of_dcp(), dcp_quietly():
            dcp.load({"model": state}, storage_reader=self.checkpoint.reader(), no_dist=True)
        return state


def shard_set_tokenizer(data_uri: str) -> tuple[dict[str, bytes], str, int]:
    """(tokenizer files to write, a note saying what they are or why there are none, the EOS token id) of the
    shard set the run trained on."""
    storage = open_storage(data_uri)
    manifest = read_manifest(storage)
    kind = manifest.tokenizer.get("kind")
    eos = manifest.eos_token_id
    if kind == "bytes":
        note = (
            f"no tokenizer written: the model's vocabulary is raw bytes (token id = byte value 0-255) and "
            f"end of document {eos}; encode text as UTF-8 bytes"
        )
        return {}, note, eos
    if storage.exists(TOKENIZER_OBJECT):
        files = {
            TOKENIZER_OBJECT: storage.read(TOKENIZER_OBJECT),
            "tokenizer_config.json": _tokenizer_config(manifest.tokenizer.get("eos_token")),
        }
        return (
            files,
            f"tokenizer.json copied from {join_uri(storage.uri, TOKENIZER_OBJECT)}, with a tokenizer_config.json "
            f"for AutoTokenizer (EOS id {eos})",
            eos,
        )
    name = manifest.tokenizer.get("file", "the tokenizer file")
    note = (
        f"no tokenizer written: the shard set {storage.uri} (tokenizer kind {kind}) holds no {TOKENIZER_OBJECT}; "
        f"copy {name}, which the data was prepared with, into the folder (EOS id {eos})"
    )
    return {}, note, eos


def _tokenizer_config(eos_token: object) -> bytes:
    """What `AutoTokenizer.from_pretrained` needs beside a bare tokenizer.json: the class that wraps it (the
    fast tokenizer over the file as it is, no model-specific pre-processing) and the end-of-document token."""
    config: dict[str, object] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if isinstance(eos_token, str):
        config["eos_token"] = eos_token
    return (json.dumps(config, indent=2) + "\n").encode()


def _write_into_place(
    target: Path, hf_config: dict[str, object], weights: hf.HfWeights, tokenizer_files: dict[str, bytes]
) -> list[Path]:
    """Writes the folder under a temporary name beside `target`, then moves it into `target`'s place (an
    existing `target`, empty or replaced with --force, is removed only once the new folder is complete)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
    try:
        written = hf.write_hf_checkpoint(partial, hf_config, weights, tokenizer_files=tokenizer_files)
        if target.exists():
            old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
            target.rename(old / target.name)
            partial.rename(target)
            shutil.rmtree(old)
        else:
            partial.rename(target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    # mkdtemp's folder is 0700 and safetensors' files 0600: give them what a plain mkdir and open() would.
    umask = os.umask(0)
    os.umask(umask)
    target.chmod(0o777 & ~umask)
    for path in written:
        (target / path.name).chmod(0o666 & ~umask)
    return [target / path.name for path in written]

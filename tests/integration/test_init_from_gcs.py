"""`train.init_from: gs://...` against a real GCS server (fake-gcs-server): the plan-time check reads the
checkpoint's config.json from the bucket; each node downloads the folder once into its cache (sizes and
CRC32C checked, published by a rename), a second start reuses it, a partial or damaged copy is not taken, the
other local ranks wait for local rank 0 (bounded), and the weights loaded from the copy compute the logits of
transformers' LlamaForCausalLM."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from batchpilot.config import Config, parse_config
from batchpilot.errors import BatchpilotError
from batchpilot.models.factory import build_model
from batchpilot.plan.init_from import init_from_problems
from batchpilot.storage.gcs import GCSStorage
from batchpilot.train.init_from import SOURCE_FILE, load_init_from, node_cache_folder
from helpers import tiny_config
from hf_files import LLAMA_ARGS, max_logits_difference, write_hf_llama

ARGS = LLAMA_ARGS
PREFIX = "models/llama"


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A LlamaForCausalLM saved by transformers in shards (with model.safetensors.index.json)."""
    folder = write_hf_llama(tmp_path_factory.mktemp("hf") / "llama", max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def upload(client, bucket: str, folder: Path) -> str:
    """Every file of `folder` under gs://bucket/PREFIX; returns that URI."""
    for path in folder.iterdir():
        client.bucket(bucket).blob(f"{PREFIX}/{path.name}").upload_from_filename(str(path))
    return f"gs://{bucket}/{PREFIX}"


def llama_config(tmp_path: Path, uri: str, **args: object) -> Config:
    config = tiny_config(data_uri=f"file://{tmp_path}/data", checkpoint_uri=f"file://{tmp_path}/ckpt")
    config["model"] = {"factory": "batchpilot.models.llama:build", "args": {**ARGS, **args}}
    config["train"]["init_from"] = uri
    config["cluster"]["backend"] = "gke"
    return parse_config(config)


def fetch(uri: str, cache: Path, *, local_rank: int = 0, wait_s: float = 30.0) -> tuple[Path, list[str]]:
    said: list[str] = []
    folder = node_cache_folder(uri, cache_root=cache, local_rank=local_rank, wait_s=wait_s, say=said.append)
    return folder, said


def test_the_plan_check_reads_config_json_from_gcs(tmp_path, gcs_client, gcs_bucket, hf_folder):
    uri = upload(gcs_client, gcs_bucket, hf_folder)
    assert init_from_problems(llama_config(tmp_path, uri)) == []
    (line,) = [str(problem) for problem in init_from_problems(llama_config(tmp_path, uri, n_layer=4))]
    assert line == (
        f"model.args.n_layer: is 4 but {uri}/config.json has num_hidden_layers 2 (fix: set model.args.n_layer: 2)"
    )
    (problem,) = init_from_problems(llama_config(tmp_path, f"gs://{gcs_bucket}/nothing-here"))
    assert problem.field == "train.init_from"
    assert problem.problem == f"gs://{gcs_bucket}/nothing-here has no config.json"


def test_a_node_downloads_once_and_loads_transformers_logits(tmp_path, gcs_client, gcs_bucket, hf_folder):

    uri = upload(gcs_client, gcs_bucket, hf_folder)
    folder, said = fetch(uri, tmp_path / "cache")
    assert said[0].startswith(f"train.init_from {uri}: downloaded ")
    shards = sorted(path.name for path in hf_folder.glob("model-*.safetensors"))
    assert len(shards) > 2
    for name in ["config.json", "model.safetensors.index.json", *shards]:
        assert (folder / name).read_bytes() == (hf_folder / name).read_bytes(), name
    assert not (folder / "generation_config.json").exists()  # only what a load reads

    config = llama_config(tmp_path, uri)
    model = build_model(factory=config.model.factory, args=config.model.args)
    assert load_init_from(model, config=config, folder=folder) == 21
    assert max_logits_difference(model, hf_folder) <= 1e-4

    again, said = fetch(uri, tmp_path / "cache")
    assert again == folder and said == [f"train.init_from {uri}: using this node's copy in {folder}"]


def test_a_partial_or_damaged_copy_is_not_taken(tmp_path, gcs_client, gcs_bucket, hf_folder):
    uri = upload(gcs_client, gcs_bucket, hf_folder)
    folder, _ = fetch(uri, tmp_path / "cache")
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])  # cut short after it was published
    crashed = folder.with_name(f".partial-{folder.name}-999999")  # a download that died mid-way
    crashed.mkdir()
    (crashed / "config.json").write_text("{}")
    with pytest.raises(BatchpilotError, match="waited 1 s for local rank 0 to download"):
        fetch(uri, tmp_path / "cache", local_rank=1, wait_s=1.0)  # another rank does not take it either
    again, said = fetch(uri, tmp_path / "cache")
    assert again == folder and said[0].startswith(f"train.init_from {uri}: downloaded ")
    assert shard.read_bytes() == (hf_folder / shard.name).read_bytes()
    assert not crashed.exists()


def test_a_download_that_does_not_match_the_crc32c_is_not_published(
    tmp_path, gcs_client, gcs_bucket, hf_folder, monkeypatch
):
    uri = upload(gcs_client, gcs_bucket, hf_folder)
    real_read = GCSStorage.read

    def flip_a_byte(self, name, **kwargs):  # as a transfer that damaged one byte
        data = real_read(self, name, **kwargs)
        return bytes([data[0] ^ 1]) + data[1:] if name.startswith("model-00001") else data

    monkeypatch.setattr(GCSStorage, "read", flip_a_byte)
    with pytest.raises(
        BatchpilotError, match=r"the download of .*model-00001-of-\d+\.safetensors has CRC32C"
    ):
        fetch(uri, tmp_path / "cache")
    assert [path.name for path in (tmp_path / "cache").iterdir()] == []  # nothing published, nothing left


def test_the_other_local_ranks_wait_for_local_rank_0(tmp_path, gcs_client, gcs_bucket, hf_folder):
    uri = upload(gcs_client, gcs_bucket, hf_folder)
    results: dict[int, Path] = {}
    waiter = threading.Thread(
        target=lambda: results.update({1: fetch(uri, tmp_path / "cache", local_rank=1)[0]})
    )
    waiter.start()
    results[0] = fetch(uri, tmp_path / "cache")[0]
    waiter.join(timeout=30)
    assert results[1] == results[0] and (results[0] / SOURCE_FILE).is_file()


def test_a_new_generation_of_the_checkpoint_is_downloaded_again(tmp_path, gcs_client, gcs_bucket, hf_folder):
    uri = upload(gcs_client, gcs_bucket, hf_folder)
    folder, _ = fetch(uri, tmp_path / "cache")
    upload(gcs_client, gcs_bucket, hf_folder)  # the same bytes, new generations
    again, said = fetch(uri, tmp_path / "cache")
    assert again == folder and said[0].startswith(f"train.init_from {uri}: downloaded ")


# -- each rank reading its own shards' byte ranges (the eager trainer) -----------------------------------------


def _ranged_worker(
    rank: int, world_size: int, per_node: int, port: int, out: str, config_json: str, flip: bool
):
    import json as json_module

    import torch
    import torch.distributed as dist
    from test_sharding_units import _join, full

    from batchpilot.models.deferred import build_deferred, reset_buffers, to_empty
    from batchpilot.train.init_from import load_init_from_bucket
    from batchpilot.train.parallel import wrap_model

    ctx = _join(rank, world_size, per_node, port)
    if flip and rank == 1:  # one rank's transfer damages one byte of what it reads of a weight file
        real_read = GCSStorage.read

        def flip_a_byte(self, name, **kwargs):  # in the tensors' bytes, past the header
            data = real_read(self, name, **kwargs)
            damaged = name.startswith("model-00002") and kwargs.get("start", 0) >= 4096
            return data[:-1] + bytes([data[-1] ^ 1]) if damaged and data else data

        GCSStorage.read = flip_a_byte
    config = parse_config(json_module.loads(config_json))
    deferred = build_deferred(lambda: build_model(factory=config.model.factory, args=config.model.args))
    model, result = deferred.model, {}

    def materialize(placed):
        to_empty(placed, device="cpu")
        reset_buffers(placed)
        try:
            result["loaded"], result["read_bytes"] = load_init_from_bucket(
                placed, config=config, uri=config.train.init_from
            )
        except BatchpilotError as error:
            result["error"] = str(error)

    wrap_model(model, ctx, strategy="fsdp", bf16=False, materialize=materialize)
    if "error" not in result:
        result["weights"] = {name: full(p) for name, p in model.named_parameters()}
    torch.save(result, f"{out}.rank{rank}")
    dist.destroy_process_group()


def ranged_load(tmp_path: Path, uri: str, *, flip: bool = False) -> list[dict]:
    import json as json_module

    import torch
    import torch.multiprocessing as mp
    from test_sharding_units import free_port

    config = tiny_config(data_uri=f"file://{tmp_path}/data", checkpoint_uri=f"file://{tmp_path}/ckpt")
    config["model"] = {"factory": "batchpilot.models.llama:build", "args": ARGS}
    config["train"]["init_from"] = uri
    out = tmp_path / "result"
    mp.spawn(
        _ranged_worker,
        args=(4, 4, free_port(), str(out), json_module.dumps(config), flip),
        nprocs=4,
        join=True,
    )
    return [torch.load(f"{out}.rank{rank}", weights_only=False) for rank in range(4)]


def test_each_rank_reads_its_shards_byte_ranges_and_the_files_crc32c_is_checked(
    tmp_path, gcs_client, gcs_bucket, hf_folder, monkeypatch
):
    """4 fsdp ranks load a gs:// checkpoint with no node copy: each reads at most a quarter of the weight bytes
    plus one tensor and the files' headers, the gathered model is the one loaded whole from the folder, and
    the files' CRC32C, combined from every rank's ranges, matches the objects'."""
    import torch

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    uri = upload(gcs_client, gcs_bucket, hf_folder)
    ranks = ranged_load(tmp_path, uri)
    reference = build_model(factory="batchpilot.models.llama:build", args=ARGS)
    load_init_from(reference, config=llama_config(tmp_path, uri), folder=hf_folder)
    weights = sum(p.numel() * 4 for p in reference.parameters())
    largest = max(p.numel() * 4 for p in reference.parameters())
    headers = sum(
        8 + int.from_bytes(path.read_bytes()[:8], "little") for path in hf_folder.glob("*.safetensors")
    )
    assert weights / 4 + largest + headers < weights / 2  # reading everything fails the bound
    assert not (tmp_path / "batchpilot-init-from").exists()
    for rank in ranks:
        assert "error" not in rank, rank.get("error")
        assert rank["loaded"] == 21
        assert 0 < rank["read_bytes"] <= weights / 4 + largest + headers, (rank["read_bytes"], weights)
        for name, parameter in reference.named_parameters():
            assert torch.equal(rank["weights"][name], parameter), name


def test_a_byte_damaged_on_one_rank_fails_every_rank_on_the_files_crc32c(
    tmp_path, gcs_client, gcs_bucket, hf_folder, monkeypatch
):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    uri = upload(gcs_client, gcs_bucket, hf_folder)
    ranks = ranged_load(tmp_path, uri, flip=True)
    for rank in ranks:
        assert rank["error"].startswith(f"train.init_from: the bytes read of {uri}/model-00002-of-"), rank[
            "error"
        ]
        assert "have CRC32C" in rank["error"] and "(fix: start again" in rank["error"]

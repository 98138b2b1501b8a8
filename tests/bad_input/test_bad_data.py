"""`data prepare`, `data inspect` and `pool status`: inputs that cannot make a shard set, credentials that do
not work, and interrupted runs. Each is one line and leaves nothing behind."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import Outcome, closed_port, no_debris, run_cli, run_process, sigint_as_in_a_terminal
from tests.integration.gcs_server import gcs_server_running

import batchpilot
import batchpilot.data.prepare as prepare_module
from batchpilot.credentials import google_credentials
from batchpilot.errors import BatchpilotError

GKE_CONFIG = Path(batchpilot.__file__).parent / "configs" / "llama_5b.yaml"


def test_a_single_document_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    (tmp_path / "one.txt").write_text("the only document\n")
    with no_debris(tmp_path):
        outcome = run_cli("data", "prepare", str(tmp_path / "one.txt"), "--out", f"file://{tmp_path}/out")
    outcome.assert_refused("validation split", "--validation-fraction 0")


@pytest.fixture
def failing_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A corpus whose second file fails part-way, after shards were written; returns the prepare arguments."""
    tokenizers = pytest.importorskip("tokenizers")
    words = [f"w{i}" for i in range(50)]
    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    model.save(str(tmp_path / "tokenizer.json"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    # The first file fills a whole tokenizing batch (made 4 KiB here, from 4 MiB), so its shards are written
    # before the second file, which is not UTF-8, fails.
    monkeypatch.setattr(prepare_module, "_BATCH_BYTES", 4096)
    (corpus / "a.txt").write_text(" ".join(words) * 40)
    (corpus / "b.txt").write_bytes(b"caf\xe9 w1 w2\n")
    return ["--tokenizer", str(tmp_path / "tokenizer.json"), "--shard-size-tokens", "256", "--no-progress"]


def test_a_failure_part_way_keeps_the_journaled_shards_and_the_rerun_resumes(
    tmp_path: Path, failing_corpus: list[str]
) -> None:
    corpus, argv = tmp_path / "corpus", failing_corpus
    out = tmp_path / "out" / "set"
    outcome = run_cli("data", "prepare", str(corpus), "--out", f"file://{out}", *argv)
    outcome.assert_refused(
        "b.txt", "UTF-8", f"(7 shards) are kept at file://{out}: run the same command again to resume"
    )
    # Kept: the journal and the full shards of a.txt (document 0, validation), nothing of b.txt.
    assert listing(out) == ["prepare-progress.json", *(f"validation-{i:05d}.bin" for i in range(7))]
    (corpus / "b.txt").write_text("cafe w1 w2\n")  # fixed: it is after the position, so the run resumes
    resumed = run_cli("data", "prepare", str(corpus), "--out", f"file://{out}", *argv)
    assert resumed.code == 0, resumed.stderr
    assert "resuming: 0 documents and 7 shards already prepared" in resumed.stdout
    assert run_cli("data", "prepare", str(corpus), "--out", f"file://{tmp_path}/fresh", *argv).code == 0
    assert contents(out) == contents(tmp_path / "fresh")


def test_a_failure_part_way_of_a_forced_run_removes_the_old_sets_leftovers(
    tmp_path: Path, failing_corpus: list[str]
) -> None:
    corpus, argv = tmp_path / "corpus", failing_corpus
    good, old = tmp_path / "good", tmp_path / "old"
    good.mkdir()
    for index in range(3):
        (good / f"{index}.txt").write_text("w1 w2 w3 " * 400)
    assert run_cli("data", "prepare", str(good), "--out", f"file://{old}", *argv).code == 0
    assert "train-00009.bin" in listing(old)
    run_cli("data", "prepare", str(corpus), "--out", f"file://{old}", "--force", *argv).assert_refused(
        "b.txt", "run the same command without --force to resume, or with it to start over"
    )
    # The old set's manifest went first and its other shards with the failure: only the new journal's are left.
    assert listing(old) == ["prepare-progress.json", *(f"validation-{i:05d}.bin" for i in range(7))]


def test_a_failure_part_way_on_gcs_keeps_the_journaled_objects(
    tmp_path: Path, failing_corpus: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from google.cloud import storage

    with gcs_server_running(log_path=tmp_path / "gcs.log") as server:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.endpoint)
        client = storage.Client(project="batchpilot-test")
        client.create_bucket("bad-data")
        outcome = run_cli(
            "data", "prepare", str(tmp_path / "corpus"), "--out", "gs://bad-data/set", *failing_corpus
        )
        outcome.assert_refused("b.txt", "UTF-8", "(7 shards) are kept at gs://bad-data/set")
        assert [blob.name for blob in client.list_blobs("bad-data")] == [
            "set/prepare-progress.json", *(f"set/validation-{i:05d}.bin" for i in range(7))
        ]  # fmt: skip


def test_a_successful_prepare_leaves_no_lock_file(tmp_path: Path) -> None:
    for index in range(4):
        (tmp_path / f"doc{index}.txt").write_text(f"document {index}\n" * 50)
    argv = ["data", "prepare", str(tmp_path), "--out", f"file://{tmp_path}/out", "--shard-size-tokens", "256"]
    assert run_cli(*argv, "--no-progress").code == 0
    assert listing(tmp_path / "out") == shard_set_objects(tmp_path / "out")  # no lock file beside them
    assert run_cli(*argv, "--no-progress", "--force").code == 0  # nor when a set is replaced
    assert listing(tmp_path / "out") == shard_set_objects(tmp_path / "out")


def listing(folder: Path) -> list[str]:
    return sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*"))


def contents(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in listing(folder)}


def shard_set_objects(folder: Path) -> list[str]:
    """manifest.json and the shards it names."""
    manifest = json.loads((folder / "manifest.json").read_text())
    shards = [shard["name"] for split in manifest["splits"].values() for shard in split["shards"]]
    assert len(shards) > 1
    return sorted(["manifest.json", *shards])


@pytest.mark.parametrize(("signum", "code", "what"), [(signal.SIGINT, 130, "interrupted"),
                                                      (signal.SIGTERM, 143, "terminated (SIGTERM)")])  # fmt: skip
def test_ctrl_c_or_sigterm_in_the_middle_keeps_the_journaled_shards_and_the_rerun_resumes(
    tmp_path: Path, signum: int, code: int, what: str
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index in range(8):  # 80 MB: about a second of work, most of it after the first shard
        (corpus / f"{index}.txt").write_bytes(bytes([97 + index]) * 10_000_000)
    out = tmp_path / "out"
    argv = [
        "data",
        "prepare",
        str(corpus),
        "--out",
        f"file://{out}",
        "--shard-size-tokens",
        "1M",
        "--no-progress",
    ]
    process = subprocess.Popen(
        [sys.executable, "-m", "batchpilot", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=sigint_as_in_a_terminal,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    # Past the first document (10 shards of 1M tokens; files appear as each shard is written): a stop then
    # keeps the shards of the documents before the one in progress. (A stop inside the first document keeps
    # nothing and leaves nothing; under load the signal could land there when this waited for the journal.)
    while len(list(out.glob("*.bin"))) < 12 or not (out / "prepare-progress.json").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.001)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=60)
    outcome = Outcome(process.returncode, stdout, stderr)
    assert "Traceback" not in stderr, stderr
    journal = json.loads((out / "prepare-progress.json").read_text())
    shards = [shard["name"] for split in journal["splits"].values() for shard in split]
    assert outcome.code == code, stderr
    (line,) = outcome.error_lines()
    assert line.startswith(f"batchpilot: {what}: "), line
    assert line.endswith(
        f"documents ({len(shards)} shards) are kept at file://{out}: run the same command again to resume, "
        "or add --force to start over"
    ), line
    assert listing(out) == sorted(["prepare-progress.json", *shards])  # no partial shard
    resumed = run_cli(*argv)
    assert resumed.code == 0 and f"and {len(shards)} shards already prepared" in resumed.stdout, resumed
    assert run_cli(*argv[:4], f"file://{tmp_path}/fresh", *argv[5:]).code == 0
    assert contents(out) == contents(tmp_path / "fresh")


def dummy_service_account(path: Path, *, token_uri: str) -> Path:
    """A well-formed service-account key file whose key no server knows."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    info = {
        "type": "service_account",
        "project_id": "nobody",
        "private_key_id": "0",
        "private_key": pem.decode(),
        "client_email": "nobody@nobody.iam.gserviceaccount.com",
        "client_id": "0",
        "token_uri": token_uri,
    }
    path.write_text(json.dumps(info))
    return path


def gs_commands(folder: Path) -> dict[str, list[str]]:
    return {
        "data prepare": [
            "data",
            "prepare",
            str(folder / "doc.txt"),
            "--out",
            "gs://bp-bucket/set",
            "--validation-fraction",
            "0",
        ],
        "data inspect": ["data", "inspect", "gs://bp-bucket/set"],
        "pool status": ["pool", "status", "--config", str(GKE_CONFIG)],
    }


@pytest.mark.parametrize("command", ["data prepare", "data inspect", "pool status"])
def test_no_google_credentials_is_one_line_naming_where_it_looked(no_google_credentials: Path, command: str):
    folder = no_google_credentials
    started = time.monotonic()
    with no_debris(folder):
        outcome = run_process(*gs_commands(folder)[command], timeout=60)
    elapsed_s = time.monotonic() - started
    line = outcome.assert_refused(
        "found no Google credentials", "GOOGLE_APPLICATION_CREDENTIALS is not set", str(folder / "gcloud"),
        "gcloud auth application-default login", "Workload Identity",
    )  # fmt: skip
    assert ("cluster.project" if command == "pool status" else "gs://bp-bucket/set") in line
    assert elapsed_s < 10, elapsed_s


@pytest.mark.parametrize("command", ["data inspect", "pool status"])
def test_a_key_file_without_a_reachable_token_endpoint_answers_in_seconds(
    no_google_credentials: Path, monkeypatch: pytest.MonkeyPatch, command: str
):
    folder = no_google_credentials
    key = dummy_service_account(folder / "key.json", token_uri=f"http://127.0.0.1:{closed_port()}/token")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    started = time.monotonic()
    with no_debris(folder):
        outcome = run_process(*gs_commands(folder)[command], timeout=60)
    elapsed_s = time.monotonic() - started
    outcome.assert_refused(
        f"GOOGLE_APPLICATION_CREDENTIALS ({key})", "got no access token", "Connection refused"
    )
    assert elapsed_s < 10, elapsed_s  # before: the storage client's retries went on for 120 s


def test_a_token_endpoint_that_never_answers_is_given_up_at_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as silent:  # accepts connections (the kernel does) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        key = dummy_service_account(tmp_path / "key.json", token_uri=f"http://127.0.0.1:{port}/token")
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
        started = time.monotonic()
        with pytest.raises(BatchpilotError, match=r"^gs://b: .*got no access token .*timed out"):
            google_credentials(field="gs://b", scopes=("silent-endpoint-test",), deadline_s=1.0)
        assert time.monotonic() - started < 3


def test_a_missing_key_file_is_named(no_google_credentials: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(no_google_credentials / "absent.json"))
    outcome = run_cli("data", "inspect", "gs://bp-bucket/set")
    outcome.assert_refused("GOOGLE_APPLICATION_CREDENTIALS", "absent.json", "was not found")


# --- data import-megatron: Megatron-LM .bin/.idx pairs that cannot be imported ---------------------------


def megatron_pair(folder: Path, **fields: object) -> Path:
    """A valid 3-document pair at folder/src/d (ids < 50), with `fields` breaking one field of it."""
    from tests.megatron_files import write_megatron

    documents = [[[1, 2, 3], [4, 49]], [[5, 6]], [[7, 8, 9, 10]]]
    return write_megatron(folder / "src" / "d", documents, **fields)


def import_megatron(folder: Path, prefix: Path, *extra: str) -> Outcome:
    vocabulary = extra or ("--vocab-size", "50", "--eos-token-id", "0")
    return run_cli(
        "data", "import-megatron", str(prefix), "--out", f"file://{folder}/out/set", *vocabulary,
        "--validation-fraction", "0", "--no-progress",
    )  # fmt: skip


def test_a_truncated_megatron_bin_is_named_with_both_sizes(tmp_path: Path) -> None:
    prefix = megatron_pair(tmp_path)
    data = (tmp_path / "src" / "d.bin").read_bytes()
    (tmp_path / "src" / "d.bin").write_bytes(data[:-4])
    with no_debris(tmp_path):
        outcome = import_megatron(tmp_path, prefix)
    outcome.assert_refused("d.bin", "d.idx", "idx says 22 bytes of tokens, bin holds 18")


@pytest.mark.parametrize(
    ("fields", "fragments"),
    [
        ({"pointer_shift": 2}, ["d.idx", "points sequence 1 at byte 8", "put it at 6"]),
        ({"magic": b"NOTANIDX\x00"}, ["d.idx", "is not a Megatron-LM index", "preprocess_data.py"]),
        ({"version": 2}, ["d.idx", "index version 2", "reads version 1"]),
        ({"code": 7}, ["d.idx", "float dtype float32", "must be integers"]),
        ({"code": 9}, ["d.idx", "unknown dtype code (9)"]),
    ],
    ids=["wrong-pointers", "bad-magic", "version", "float-dtype", "unknown-dtype"],
)
def test_a_broken_megatron_index_is_refused(tmp_path: Path, fields: dict, fragments: list[str]) -> None:
    prefix = megatron_pair(tmp_path, **fields)
    with no_debris(tmp_path):
        outcome = import_megatron(tmp_path, prefix)
    outcome.assert_refused(*fragments)


def test_a_multimodal_megatron_index_is_refused(tmp_path: Path) -> None:
    prefix = megatron_pair(tmp_path)
    with (tmp_path / "src" / "d.idx").open("ab") as idx:
        idx.write(bytes(4))  # one int8 mode per sequence
    with no_debris(tmp_path):
        outcome = import_megatron(tmp_path, prefix)
    outcome.assert_refused("d.idx", "sequence modes", "multimodal")


def test_a_missing_megatron_bin_is_named(tmp_path: Path) -> None:
    prefix = megatron_pair(tmp_path)
    (tmp_path / "src" / "d.bin").unlink()
    with no_debris(tmp_path):
        outcome = import_megatron(tmp_path, prefix)
    outcome.assert_refused("d.bin", "does not exist", "d.bin + d.idx")


def test_a_token_id_outside_the_vocabulary_names_its_document_and_leaves_nothing(tmp_path: Path) -> None:
    prefix = megatron_pair(tmp_path)
    with no_debris(tmp_path):
        outcome = import_megatron(tmp_path, prefix, "--vocab-size", "9", "--eos-token-id", "0")
    outcome.assert_refused("d.bin", "document 0 holds token id 49", "--vocab-size 9")


def test_a_token_id_found_after_shards_were_written_removes_them(tmp_path: Path) -> None:
    from tests.megatron_files import write_megatron

    documents = [[list(range(1, 40))] for _ in range(5)] + [[[1, 2, 60]]]
    prefix = write_megatron(tmp_path / "src" / "d", documents)
    with no_debris(tmp_path):
        outcome = run_cli(
            "data", "import-megatron", str(prefix), "--out", f"file://{tmp_path}/out/set",
            "--vocab-size", "50", "--eos-token-id", "0", "--shard-size-tokens", "16", "--no-progress",
        )  # fmt: skip
    outcome.assert_refused("document 5 holds token id 60")


@pytest.mark.parametrize(
    ("vocabulary", "fragments"),
    [
        ((), ["--vocab-size", "is needed", "--tokenizer tokenizer.json"]),
        (("--vocab-size", "50"), ["--eos-token-id", "is needed"]),
        (("--tokenizer", "t.json", "--vocab-size", "50"), ["--vocab-size", "conflicts with --tokenizer"]),
    ],
    ids=["none", "no-eos", "both"],
)
def test_a_megatron_import_needs_one_vocabulary(
    tmp_path: Path, vocabulary: tuple, fragments: list[str]
) -> None:
    prefix = megatron_pair(tmp_path)
    with no_debris(tmp_path):
        outcome = run_cli(
            "data", "import-megatron", str(prefix), "--out", f"file://{tmp_path}/out", *vocabulary,
            "--no-progress",
        )  # fmt: skip
    outcome.assert_refused(*fragments)


def test_a_megatron_eos_id_outside_the_vocabulary_is_refused(tmp_path: Path) -> None:
    prefix = megatron_pair(tmp_path)
    with no_debris(tmp_path):
        outcome = import_megatron(tmp_path, prefix, "--vocab-size", "50", "--eos-token-id", "50")
    outcome.assert_refused("--eos-token-id", "50 is not below --vocab-size 50")


def _corrupt_corpus(folder: Path, kind: str) -> Path:
    """One input file of `kind`'s mistake (JSON Lines, Parquet or zstd) in `folder`; returns its path."""
    good = [json.dumps({"text": f"document {i}", "id": i}) for i in range(4)]
    if kind == "missing-field":
        path, lines = folder / "c.jsonl", [*good[:1], json.dumps({"body": "x", "id": 1}), *good[2:]]
    elif kind == "not-a-string":
        path, lines = folder / "c.jsonl", [*good[:2], json.dumps({"text": 7}), *good[3:]]
    elif kind == "invalid-json":
        path, lines = folder / "c.jsonl", [*good[:2], '{"text": "unterminated', *good[3:]]
    elif kind == "empty":
        path, lines = folder / "c.jsonl", [json.dumps({"text": ""}), "", json.dumps({"text": ""})]
    elif kind == "truncated-zst":
        import zstandard

        path = folder / "c.jsonl.zst"
        data = zstandard.ZstdCompressor().compress(("\n".join(good * 500) + "\n").encode())
        path.write_bytes(data[: len(data) // 2])
        return path
    else:
        assert kind == "corrupt-parquet"
        path = folder / "c.parquet"
        path.write_bytes(b"PAR1" + bytes(range(256)) * 8 + b"PAR1")
        return path
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("kind", "fragments"),
    [
        ("missing-field", ["c.jsonl:2", "no field 'text'", "fields: 'body', 'id'", "--text-field"]),
        ("not-a-string", ["c.jsonl:3", "field 'text' is a JSON int, not a string", "--text-field"]),
        ("invalid-json", ["c.jsonl:3", "is not valid JSON"]),
        ("empty", ["INPUT", "holds no documents", "--text-field"]),
        ("truncated-zst", ["c.jsonl.zst", "truncated"]),
        ("corrupt-parquet", ["c.parquet", "is not a readable Parquet file"]),
    ],
)
def test_a_corpus_that_cannot_be_read_is_one_line_and_leaves_nothing(
    tmp_path: Path, kind: str, fragments: list[str]
) -> None:
    pytest.importorskip("pyarrow")
    pytest.importorskip("zstandard")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    path = _corrupt_corpus(corpus, kind)
    with no_debris(tmp_path):
        outcome = run_cli(
            "data", "prepare", str(path), "--out", f"file://{tmp_path}/out/set", "--workers", "2",
            "--no-progress",
        )  # fmt: skip
    outcome.assert_refused(*fragments)


def test_a_parquet_column_that_is_missing_or_not_text_is_named(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    parquet.write_table(pa.table({"body": ["a b", "c d"], "id": [1, 2]}), tmp_path / "c.parquet")
    with no_debris(tmp_path):
        missing = run_cli("data", "prepare", str(tmp_path / "c.parquet"), "--out", f"file://{tmp_path}/out")
        not_text = run_cli(
            "data", "prepare", str(tmp_path / "c.parquet"), "--out", f"file://{tmp_path}/out", "--text-field", "id"
        )  # fmt: skip
    missing.assert_refused("c.parquet", "no column 'text'", "columns: 'body', 'id'", "--text-field")
    not_text.assert_refused("c.parquet", "column 'id' holds int64, not strings")


def test_all_documents_held_out_is_refused_after_tokenizing_and_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": "the only document"}) + "\n")
    with no_debris(tmp_path):
        outcome = run_cli(
            "data", "prepare", str(tmp_path / "one.jsonl"), "--out", f"file://{tmp_path}/out/set"
        )
    outcome.assert_refused(
        "1 non-empty document(s) all go to the validation split", "--validation-fraction 0"
    )


@pytest.mark.parametrize(("name", "module"), [("c.parquet", "pyarrow"), ("c.jsonl.zst", "zstandard")])
def test_a_corpus_format_without_its_package_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, module: str
) -> None:
    (tmp_path / name).write_bytes(b"not read: the package is missing first")
    for missing in (module, f"{module}.parquet", f"{module}.ipc"):
        monkeypatch.setitem(sys.modules, missing, None)  # `import` raises ImportError, as when not installed
    with no_debris(tmp_path):
        outcome = run_cli("data", "prepare", str(tmp_path / name), "--out", f"file://{tmp_path}/out")
    outcome.assert_refused(name, f"needs the `{module}` package", "pip install 'batchpilot[corpora]'")

"""Integrity of what goes to and comes from GCS (`storage.gcs`) and of checkpoint files read back
(`train.dcp_storage`), the rules a one-line slip would break unseen:

- a whole-object read is checked against the CRC32C GCS reports: a body damaged on its way is read again,
  never returned;
- an upload carries the CRC32C of its bytes, so GCS refuses a body damaged on its way instead of storing it;
- a ranged read of a checkpoint file that returns fewer bytes than asked (a truncated object) is one
  BatchpilotError naming the object and both sizes;
- a checkpoint file recorded with only a whole-file SHA-256 (meta.json entries of earlier versions, without
  block checksums) is still checked: a damaged file is refused.

GCS is `FakeGcs`, an in-process stand-in for the JSON API behind google-cloud-storage's own requests
transport (the real client builds the requests, computes and checks the checksums); it serves media
downloads with the `x-goog-hash` GCS sends, and multipart uploads that GCS would refuse when their
`crc32c` does not match the body. It can damage one byte of the next transfers, as a bad link does.
Its rules are Cloud Storage's, as documented: an object's CRC32C is the base64 of its four big-endian bytes
and a download reports it in the `x-goog-hash: crc32c=...` response header ("Hashes and ETags"); a CRC32C
given with an upload is validated by the server, which rejects a mismatched upload before the object is
created (the JSON API's objects.insert; the .NET client's `UploadValidationMode.RejectAndThrow` reference
says it in those words); a ranged download answers 206 with a `Content-Range` (the JSON API's media download).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import urllib.parse
from pathlib import Path
from typing import Any

import google_crc32c
import pytest
import requests
import urllib3
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage as gcs_client

from batchpilot.errors import BatchpilotError
from batchpilot.storage import LocalStorage
from batchpilot.storage.gcs import GCSStorage, transient_retry
from batchpilot.storage.protocol import StorageError
from batchpilot.train.dcp_storage import StorageFileSystem, block_checksums

BUCKET = "audit-bucket"


def crc32c_b64(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


def flip_middle_byte(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :]


class FakeGcs(requests.adapters.BaseAdapter):
    """GCS's JSON API for media downloads and multipart uploads, in memory.

    Attributes:
        objects: stored bytes by object name.
        damage_downloads, damage_uploads: how many of the next transfers arrive with one byte flipped.
        media_requests: (method, object name) of every download and upload, in order.
    """

    def __init__(self) -> None:
        super().__init__()
        self.objects: dict[str, bytes] = {}
        self.damage_downloads = self.damage_uploads = 0
        self.media_requests: list[tuple[str, str]] = []

    def close(self) -> None:
        pass

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        url = urllib.parse.urlsplit(request.url)
        query = urllib.parse.parse_qs(url.query)
        download = f"/download/storage/v1/b/{BUCKET}/o/"
        if request.method == "GET" and url.path.startswith(download) and query.get("alt") == ["media"]:
            return self._download(request, urllib.parse.unquote(url.path.removeprefix(download)))
        if request.method == "POST" and url.path == f"/upload/storage/v1/b/{BUCKET}/o":
            assert query.get("uploadType") == ["multipart"], query
            return self._upload(request)
        return self._respond(request, 501, json.dumps({"error": {"code": 501}}).encode())

    def _download(self, request: requests.PreparedRequest, name: str) -> requests.Response:
        self.media_requests.append(("GET", name))
        if name not in self.objects:
            return self._respond(request, 404, b'{"error": {"code": 404, "message": "No such object"}}')
        stored = self.objects[name]
        headers = {"x-goog-hash": f"crc32c={crc32c_b64(stored)}", "x-goog-generation": "1"}
        body, status = stored, 200
        if "range" in {k.lower() for k in request.headers}:
            first, last = request.headers["Range"].removeprefix("bytes=").split("-")
            end = len(stored) if not last else int(last) + 1
            body, status = stored[int(first) : end], 206
            headers["content-range"] = f"bytes {first}-{end - 1}/{len(stored)}"
        if self.damage_downloads:
            self.damage_downloads -= 1
            body = flip_middle_byte(body)
        return self._respond(request, status, body, headers)

    def _upload(self, request: requests.PreparedRequest) -> requests.Response:
        body = request.body if isinstance(request.body, bytes) else request.body.encode()
        content_type = request.headers["Content-Type"]  # the client sends it as bytes
        content_type = content_type.decode() if isinstance(content_type, bytes) else content_type
        boundary = content_type.split("boundary=")[1].strip("'\"").encode()
        parts = body.split(b"--" + boundary)
        metadata = json.loads(parts[1].split(b"\r\n\r\n", 1)[1].strip())
        data = parts[2].split(b"\r\n\r\n", 1)[1][: -len(b"\r\n")]
        name = metadata["name"]
        self.media_requests.append(("POST", name))
        if self.damage_uploads:
            self.damage_uploads -= 1
            data = flip_middle_byte(data)
        if "crc32c" in metadata and metadata["crc32c"] != crc32c_b64(data):
            message = (
                f"Provided CRC32C {metadata['crc32c']} doesn't match calculated CRC32C {crc32c_b64(data)}."
            )
            return self._respond(
                request, 400, json.dumps({"error": {"code": 400, "message": message}}).encode()
            )
        self.objects[name] = data
        resource = {
            "kind": "storage#object", "name": name, "bucket": BUCKET, "generation": "1",
            "metageneration": "1", "size": str(len(data)), "crc32c": crc32c_b64(data),
        }  # fmt: skip
        return self._respond(request, 200, json.dumps(resource).encode())

    @staticmethod
    def _respond(
        request: requests.PreparedRequest, status: int, body: bytes, headers: dict[str, str] | None = None
    ) -> requests.Response:
        raw = urllib3.HTTPResponse(
            body=io.BytesIO(body),
            headers={"content-length": str(len(body)), **(headers or {})},
            status=status,
            preload_content=False,
            decode_content=False,
        )
        return requests.adapters.HTTPAdapter().build_response(request, raw)


@pytest.fixture
def gcs(monkeypatch: pytest.MonkeyPatch) -> tuple[GCSStorage, FakeGcs]:
    """A GCSStorage whose client (the real google-cloud-storage one) sends its requests to FakeGcs."""
    fake = FakeGcs()
    session = requests.Session()
    session.mount("http://", fake)
    session.mount("https://", fake)
    real_client = gcs_client.Client
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://gcs.invalid")  # anonymous: no credentials looked up
    monkeypatch.setattr(
        gcs_client,
        "Client",
        lambda project, credentials: real_client(
            project="audit", credentials=AnonymousCredentials(), _http=session
        ),
    )
    retry = transient_retry(initial_delay_s=0.001, max_delay_s=0.002, deadline_s=5.0)
    return GCSStorage(bucket=BUCKET, prefix="run", retry=retry), fake


DATA = bytes(range(256)) * 16


def test_a_whole_read_damaged_on_its_way_is_read_again_not_returned(gcs):
    store, fake = gcs
    fake.objects["run/meta.json"] = DATA
    fake.damage_downloads = 1
    assert store.read("meta.json") == DATA
    assert fake.media_requests == [("GET", "run/meta.json")] * 2


def test_an_upload_carries_its_crc32c_so_a_damaged_body_is_refused_not_stored(gcs):
    store, fake = gcs
    fake.damage_uploads = 1
    with pytest.raises(StorageError) as refused:
        store.write("000000001/rng.pt", DATA)
    assert str(refused.value).startswith("gs://audit-bucket/run/000000001/rng.pt")
    assert "run/000000001/rng.pt" not in fake.objects
    store.write("000000001/rng.pt", DATA)  # undamaged: stored as sent
    assert fake.objects["run/000000001/rng.pt"] == DATA


def test_a_ranged_read_is_what_the_range_holds(gcs):
    store, fake = gcs
    fake.objects["run/shard.bin"] = DATA
    assert store.read("shard.bin", start=10, end=300) == DATA[10:300]


class ShortReads(LocalStorage):
    """A local storage whose ranged reads return one byte less than they hold (a truncated object)."""

    def read(
        self, name: str, *, start: int = 0, end: int | None = None, generation: int | None = None
    ) -> bytes:
        data = super().read(name, start=start, end=end, generation=generation)
        return data[:-1] if end is not None else data


def test_a_ranged_checkpoint_read_one_byte_short_names_the_object_and_both_sizes(tmp_path: Path):
    data = bytes(range(200)) * 50  # 10,000 bytes in blocks of 4,096
    store = ShortReads(tmp_path)
    store.write("000000001/__0_0.distcp", data)
    expected = {
        "000000001/__0_0.distcp": {
            "size_bytes": len(data), "block_bytes": 4096, "block_crc32": block_checksums(data, 4096),
        }
    }  # fmt: skip
    files = StorageFileSystem(store, expected=expected)
    with (
        pytest.raises(BatchpilotError) as short,
        files.create_stream("000000001/__0_0.distcp", "rb") as stream,
    ):
        stream.seek(5000)
        stream.read(100)
    assert str(short.value) == (
        f"file://{tmp_path}/000000001/__0_0.distcp: returned 4095 bytes for bytes [4096, 8192), not 4096: "
        "the object is not the 10000 bytes its checkpoint recorded (truncated or replaced)"
    )


def test_a_file_recorded_without_block_checksums_is_checked_against_its_sha256(tmp_path: Path):
    data = bytes(range(200)) * 50
    store = LocalStorage(tmp_path)
    store.write("000000001/__0_0.distcp", flip_middle_byte(data))  # damaged after the checkpoint recorded it
    expected = {
        "000000001/__0_0.distcp": {"size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    }
    files = StorageFileSystem(store, expected=expected)
    with (
        pytest.raises(BatchpilotError, match=r"__0_0\.distcp: is corrupted \(checksum mismatch\)"),
        files.create_stream("000000001/__0_0.distcp", "rb") as stream,
    ):
        stream.read()
    store.write("000000001/__0_0.distcp", data)
    with files.create_stream("000000001/__0_0.distcp", "rb") as stream:
        assert stream.read() == data

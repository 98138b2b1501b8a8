"""Fixtures for integration tests: a real GCS server (fake-gcs-server) on loopback, a simulated GKE cluster.

- `gcs_server`: one server per test session, on a free port, log in the session's temp folder.
- `gcs_client`: points google-cloud-storage at that server for one test (STORAGE_EMULATOR_HOST,
  anonymous credentials, a project id) and returns a client.
- `gcs_bucket`: a fresh, empty bucket name for one test.
- `fault_rng`: the random kill and stop points of a fault test, seeded and printed (shown with a failure):
  `BATCHPILOT_FAULT_SEED=<seed>` repeats a run's points.
- `simulated_cluster`: a simulated GKE cluster (`gke_sim.simulated_gke`) behind the Container and
  Kubernetes API stand-ins, with no node pool yet (`simulated_cluster.add_pool(...)`); pods do not
  run as processes (use `simulated_gke(run_pods_in=folder)` for that).
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from gcs_server import GCSServer, gcs_server_running
from gke_sim import SimulatedGke, simulated_gke

PROJECT_ID = "batchpilot-test"


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GCSServer]:
    log_path = tmp_path_factory.mktemp("fake-gcs-server") / "server.log"
    with gcs_server_running(log_path=log_path) as server:
        yield server


@pytest.fixture
def gcs_client(gcs_server: GCSServer, monkeypatch: pytest.MonkeyPatch) -> Any:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint)
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", PROJECT_ID)
    return storage.Client(project=PROJECT_ID, credentials=AnonymousCredentials())


@pytest.fixture
def gcs_bucket(gcs_client: Any) -> str:
    name = f"test-{uuid.uuid4().hex[:12]}"
    gcs_client.create_bucket(name)
    return name


@pytest.fixture
def fault_rng(request: pytest.FixtureRequest) -> random.Random:
    seed = int(os.environ.get("BATCHPILOT_FAULT_SEED") or random.SystemRandom().randrange(2**32))
    print(f"{request.node.nodeid}: fault points from seed {seed} (repeat: BATCHPILOT_FAULT_SEED={seed})")
    return random.Random(seed)


@pytest.fixture
def simulated_cluster() -> Iterator[SimulatedGke]:
    with simulated_gke() as cluster:
        yield cluster

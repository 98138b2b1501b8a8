"""The Dockerfile agrees with what the launchers and the chart assume about the image."""

from __future__ import annotations

import re

from batchpilot.cluster.placement import TRAINER_UID
from helpers import REPO

DOCKERFILE = (REPO / "Dockerfile").read_text()


def test_the_image_runs_as_the_uid_the_pods_declare():
    (user,) = re.findall(r"^USER (\S+)", DOCKERFILE, flags=re.MULTILINE)
    assert user == f"{TRAINER_UID}:{TRAINER_UID}"


def test_the_build_refuses_a_tag_that_is_not_the_package_version():
    assert "ARG VERSION" in DOCKERFILE and "is not the package version" in DOCKERFILE
    assert 'org.opencontainers.image.version="${VERSION}"' in DOCKERFILE


def test_the_image_installs_the_extras_the_trainers_and_launchers_import():
    (extras,) = re.findall(r"\[([a-z,]+)\]\"", DOCKERFILE)
    assert set(extras.split(",")) >= {"train", "data", "gcs", "cluster", "pipeline"}


def test_the_build_context_is_only_what_the_image_needs():
    lines = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in lines and "!src/" in lines and "!pyproject.toml" in lines

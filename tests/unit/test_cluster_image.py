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
    (extras,) = re.findall(r"^ARG EXTRAS=([a-z,]+)$", DOCKERFILE, flags=re.MULTILINE)
    assert set(extras.split(",")) >= {"train", "data", "gcs", "cluster", "pipeline"}
    assert '"${wheel}[${EXTRAS}]"' in DOCKERFILE  # the build argument is what the install line installs


def test_the_build_context_is_only_what_the_image_needs():
    lines = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in lines and "!src/" in lines and "!pyproject.toml" in lines


def test_a_tpu_image_must_carry_torch_xla_and_libtpu():
    """Issue #14: TORCH_FLAVOR=tpu fails the build unless torch_xla and libtpu are installed, and the
    documented requirement pins the torch/torch_xla pair of the `tpu` extra."""
    import tomllib

    assert re.search(
        r"^\s+tpu\) python -c \"[^\n]*import [^\n]*torch_xla[^\n]*libtpu", DOCKERFILE, re.MULTILINE
    )
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["tpu"]
    pins = {
        requirement.split("==")[0]: requirement.split("==")[1] for requirement in extra if "==" in requirement
    }
    documented = re.search(r'TORCH_REQUIREMENT="torch==([\d.]+) torch-xla\[tpu\]==([\d.]+)"', DOCKERFILE)
    assert documented and (documented[1], documented[2]) == (pins["torch"], pins["torch-xla"])


def final_stage_env() -> dict[str, str]:
    """KEY=value pairs of the ENV instructions of the image's last stage (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    final = text[text.rindex("\nFROM ") :]
    env: dict[str, str] = {}
    for instruction in re.findall(r"^ENV (.+)$", final, flags=re.MULTILINE):
        env.update(re.findall(r"(\w+)=(\S+)", instruction))
    return env


def test_the_image_finds_the_nvidia_driver_gke_mounts():
    """Issue #20: GKE's device plugin mounts the node's driver at /usr/local/nvidia; without its lib64 on
    LD_LIBRARY_PATH a CUDA torch sees no GPU in the container."""
    env = final_stage_env()
    libraries = env.get("LD_LIBRARY_PATH", "").split(":")
    assert "/usr/local/nvidia/lib64" in libraries and "/usr/local/nvidia/lib" in libraries
    path = env.get("PATH", "").split(":")
    assert "/usr/local/nvidia/bin" in path and "${PATH}" in path  # nvidia-smi, and the base image's PATH

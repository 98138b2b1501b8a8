# syntax=docker/dockerfile:1
# The one image every batchpilot component and trainer runs, tagged with the package version:
#
#   VERSION=$(python -c "import tomllib; print(tomllib.load(open('pyproject.toml','rb'))['project']['version'])")
#   docker build --build-arg VERSION=$VERSION -t REGISTRY/batchpilot:$VERSION .
#
# The build fails when VERSION is not the package's version, so a tag always names what is inside.
# TORCH_REQUIREMENT picks the torch build: the default is the CPU build; for GPU nodes pass a CUDA
# build (and, if it lives on another index, PIP_EXTRA_INDEX_URL as a build argument).

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ARG VERSION
ARG TORCH_REQUIREMENT=torch==2.13.0
ARG PIP_EXTRA_INDEX_URL=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp
LABEL org.opencontainers.image.title="batchpilot" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY constraints.txt /tmp/constraints.txt
COPY --from=wheel /wheels /tmp/wheels
# torch first: a bare `torch` requirement could pull a different build than the one asked for.
RUN pip install "${TORCH_REQUIREMENT}" \
    && wheel="$(ls /tmp/wheels/batchpilot-*.whl)" \
    && pip install -c /tmp/constraints.txt "${wheel}[train,data,gcs,pipeline,cluster]" \
    && rm -rf /tmp/wheels /tmp/constraints.txt
RUN test -n "${VERSION}" || { echo "build with --build-arg VERSION=<package version>" >&2; exit 1; } \
    && python -c "import sys, batchpilot; v = batchpilot.__version__; sys.exit(0 if v == '${VERSION}' else f'VERSION ${VERSION} is not the package version {v}')"
# The pipeline and its components are part of the package: `batchpilot compile` and `batchpilot submit`
# work from the installed wheel (the chart's upload Job runs `batchpilot compile`).
# A fixed non-root uid: the chart's pods and the trainer pods run as 1000 with a read-only root
# filesystem and an emptyDir on /tmp (HOME), so nothing here needs to be writable.
RUN groupadd --gid 1000 batchpilot && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp batchpilot
USER 1000:1000
WORKDIR /tmp
CMD ["batchpilot", "--help"]

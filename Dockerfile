# syntax=docker/dockerfile:1
# The one image every batchpilot component and trainer runs, tagged with the package version:
#
#   VERSION=$(python -c "import tomllib; print(tomllib.load(open('pyproject.toml','rb'))['project']['version'])")
#   docker build --build-arg VERSION=$VERSION -t REGISTRY/batchpilot:$VERSION .
#
# The build fails when VERSION is not the package's version, so a tag always names what is inside.
#
# torch is installed first and on its own, because which build you get depends on the requirement and
# the index, not on batchpilot (its `train` extra accepts any torch>=2.4):
#   TORCH_REQUIREMENT   the torch to install (default torch==2.13.0, what the package index serves for
#                       that pin; the CPU build on the index these tests use)
#   PIP_EXTRA_INDEX_URL an index to search as well, e.g. the PyTorch CUDA wheel index for your CUDA version
#   TORCH_FLAVOR        cpu (default), cuda or tpu; with cuda the build fails unless the installed torch is
#                       a CUDA build, with tpu unless torch_xla and libtpu import with the torch they need,
#                       so an accelerator image can never ship the wrong build by accident
# GPU nodes (A2, A3, G2) need the CUDA build, e.g.
#   docker build --build-arg VERSION=$VERSION --build-arg TORCH_FLAVOR=cuda \
#     --build-arg TORCH_REQUIREMENT=torch==2.13.0+cu128 \
#     --build-arg PIP_EXTRA_INDEX_URL=<the PyTorch CUDA wheel index for cu128> \
#     -t REGISTRY/batchpilot:$VERSION-cuda .
# TPU nodes (GKE TPU slices: tpu-v5-lite-podslice, tpu-v6e-slice, tpu-v5p-slice) need torch_xla with
# libtpu and the torch it was built for (torch_xla's metadata does not pin torch: the pair is pinned here
# and in batchpilot's `tpu` extra), e.g.
#   docker build --build-arg VERSION=$VERSION --build-arg TORCH_FLAVOR=tpu \
#     --build-arg TORCH_REQUIREMENT="torch==2.9.0 torch-xla[tpu]==2.9.0" \
#     -t REGISTRY/batchpilot:$VERSION-tpu .
# (torch 2.9.0's default wheel is the CUDA build, several GB of unused libraries on a TPU VM: add
# PIP_EXTRA_INDEX_URL=<the PyTorch CPU wheel index> and TORCH_REQUIREMENT="torch==2.9.0+cpu ..." to
# avoid them.) The trainers then run train.runtime xla, one process per TPU host (docs/cluster.md).
#   EXTRAS              the package's extras to install (default train,data,gcs,report,pipeline,cluster:
#                       everything a pipeline step or trainer imports: train (torch, numpy), data, gcs,
#                       report (matplotlib: explore and the report draw charts), pipeline (kfp) and cluster
#                       (torchx, GKE, Kubernetes)). Add hf (transformers, safetensors) for trainers that
#                       start from a Hugging Face checkpoint (train.init_from), e.g.
#                       --build-arg EXTRAS=train,data,gcs,report,pipeline,cluster,hf
# tests/integration/test_image_extras.py installs exactly the default extras into a fresh venv and imports
# every batchpilot module (models/hf.py's transformers and safetensors aside: the hf extra's).

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
ARG TORCH_FLAVOR=cpu
ARG EXTRAS=train,data,gcs,report,pipeline,cluster
# GKE's NVIDIA device plugin mounts the node's driver libraries into every GPU container at
# /usr/local/nvidia (libraries in lib64 and lib, nvidia-smi in bin); CUDA finds them only through
# LD_LIBRARY_PATH, as in NVIDIA's CUDA base images. Without it a CUDA torch sees no GPU, and a trainer
# planned for GPUs refuses to start (batchpilot.train.accelerators) instead of training on the CPU.
# The paths do not exist on CPU and TPU nodes, where they are harmless.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/nvidia/lib \
    PATH=/usr/local/nvidia/bin:${PATH}
LABEL org.opencontainers.image.title="batchpilot" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.batchpilot.torch-flavor="${TORCH_FLAVOR}"
COPY constraints.txt /tmp/constraints.txt
COPY --from=wheel /wheels /tmp/wheels
# torch first: a bare `torch` requirement could pull a different build than the one asked for.
RUN pip install ${TORCH_REQUIREMENT} \
    && wheel="$(ls /tmp/wheels/batchpilot-*.whl)" \
    && pip install -c /tmp/constraints.txt "${wheel}[${EXTRAS}]" \
    && rm -rf /tmp/wheels /tmp/constraints.txt
RUN case "${TORCH_FLAVOR}" in \
      cpu) ;; \
      cuda) python -c "import sys, torch; sys.exit(0 if torch.version.cuda else f'TORCH_FLAVOR=cuda but {torch.__version__} is not a CUDA build: pass a CUDA TORCH_REQUIREMENT and its index')" ;; \
      tpu) python -c "import importlib.util as u, sys, torch, torch_xla; sys.exit(0 if u.find_spec('libtpu') else 'TORCH_FLAVOR=tpu but libtpu is missing: install torch-xla[tpu] in TORCH_REQUIREMENT')" ;; \
      *) echo "TORCH_FLAVOR must be cpu, cuda or tpu, not ${TORCH_FLAVOR}" >&2; exit 1 ;; \
    esac
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

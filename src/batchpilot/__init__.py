"""batchpilot: the right batch size, ramped up in stages, as one Kubeflow Pipeline."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("batchpilot")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

__all__ = ["__version__"]

"""Loaded (through PYTHONPATH) only by tests/e2e/test_gke_flex_start.py's processes: the simulated pods have
no GPU (tests/integration/pod_runner.py), so the GPU plan of that test runs on the CPU with gloo instead of
refusing to start. The test copies it to a folder outside /tmp, because the pods' emptyDir at /tmp takes
every /tmp path."""

import batchpilot.train.accelerators as accelerators

accelerators.planned_gpu = lambda **_: False

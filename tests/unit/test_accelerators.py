"""Issue #20: a process planned for GPUs or TPUs refuses to start without them, in one line with the cause."""

from __future__ import annotations

import pytest

from batchpilot.errors import BatchpilotError
from batchpilot.train.accelerators import (
    cuda_refusal,
    planned_gpu,
    planned_tpu,
    require_planned_accelerator,
    tpu_refusal,
)

DRIVER = "/usr/local/nvidia/lib64:/usr/local/nvidia/lib"


def refusal(**found: object) -> str | None:
    """cuda_refusal for 8 H100s of a trainer node, with what a healthy GKE GPU container finds unless
    `found` says otherwise; its one line, or None."""
    facts: dict = dict(
        is_available=True,
        device_count=8,
        torch_version="2.13.0+cu128",
        cuda_version="12.8",
        ld_library_path=DRIVER,
    )
    facts.update(found)
    error = cuda_refusal(
        accelerator_type="nvidia-h100-80gb", num_devices_needed=8, needed_by="LOCAL_WORLD_SIZE=8", **facts
    )
    return None if error is None else str(error)


def test_which_configs_are_planned_for_an_accelerator():
    # Whatever the backend (#34: a local config naming nvidia-l4 trained on the CPU without a word).
    assert planned_gpu(accelerator_type="nvidia-h100-80gb")
    assert planned_gpu(accelerator_type="nvidia-l4")
    assert not planned_gpu(accelerator_type=None)  # a CPU pool, the demo
    assert not planned_gpu(accelerator_type="tpu-v6e-slice")
    assert planned_tpu(accelerator_type="tpu-v6e-slice")
    assert not planned_tpu(accelerator_type="nvidia-l4")
    assert not planned_tpu(accelerator_type=None)


def test_a_container_with_its_gpus_starts():
    assert refusal() is None
    assert refusal(device_count=9) is None  # more GPUs than processes: each process takes its own


def test_a_cpu_build_of_torch_is_named_with_the_image_flavor_to_build():
    assert refusal(is_available=False, device_count=0, torch_version="2.13.0+cpu", cuda_version=None) == (
        "cluster.accelerator_type: nvidia-h100-80gb needs 8 CUDA device(s) here (LOCAL_WORLD_SIZE=8), found 0 "
        "(torch.cuda.is_available() is False, torch.cuda.device_count() is 0): torch 2.13.0+cpu is a CPU build "
        "(torch.version.cuda is None) (fix: build the image with TORCH_FLAVOR=cuda and a CUDA "
        "TORCH_REQUIREMENT (see the Dockerfile))"
    )


def test_a_driver_missing_from_ld_library_path_is_named_with_the_path_seen():
    line = refusal(is_available=False, device_count=0, ld_library_path=None)
    assert line is not None
    assert "found 0 (torch.cuda.is_available() is False" in line
    assert (
        "the NVIDIA driver libraries are not on LD_LIBRARY_PATH (GKE mounts them at /usr/local/nvidia/lib64; "
        "LD_LIBRARY_PATH=unset)" in line
    )
    other = refusal(is_available=False, device_count=0, ld_library_path="/opt/lib:/usr/local/nvidia/lib")
    assert other is not None and "LD_LIBRARY_PATH=/opt/lib:/usr/local/nvidia/lib)" in other


def test_a_trailing_slash_on_the_driver_path_still_counts():
    assert refusal(ld_library_path="/usr/local/nvidia/lib64/") is None
    line = refusal(is_available=False, device_count=0, ld_library_path="/usr/local/nvidia/lib64/")
    assert line is not None and "the pod has no GPU" in line


def test_cuda_that_does_not_start_with_the_driver_on_the_path_points_at_the_pods_gpus():
    line = refusal(is_available=False, device_count=0)
    assert line is not None
    assert "CUDA 12.8 does not start although /usr/local/nvidia/lib64 is on LD_LIBRARY_PATH" in line
    assert line.endswith(
        "(fix: run /usr/local/nvidia/bin/nvidia-smi in the pod to see its GPUs and driver version)"
    )


def test_fewer_gpus_than_processes_per_node_is_refused():
    line = refusal(device_count=4)
    assert line is not None
    assert line.startswith("cluster.accelerator_type: nvidia-h100-80gb needs 8 CUDA device(s) here")
    assert "found 4 (torch.cuda.is_available() is True, torch.cuda.device_count() is 4)" in line
    assert "fewer GPUs than processes" in line


def test_every_refusal_is_one_line():
    for found in ({"cuda_version": None}, {"ld_library_path": ""}, {}):
        line = refusal(is_available=False, device_count=0, **found)
        assert line is not None and "\n" not in line
    line = refusal(device_count=1)
    assert line is not None and "\n" not in line


def test_the_trainer_start_refuses_a_gpu_plan_on_this_cpu_machine(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(BatchpilotError, match=r"needs 8 CUDA device\(s\) here \(LOCAL_WORLD_SIZE=8 "):
        require_planned_accelerator(accelerator_type="nvidia-h100-80gb", runtime="eager")


def test_the_trainer_start_lets_configs_without_an_accelerator_run_on_the_cpu(monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    require_planned_accelerator(accelerator_type=None, runtime="eager")
    require_planned_accelerator(accelerator_type=None, runtime="xla")


def test_a_local_config_naming_a_gpu_or_a_tpu_refuses_on_this_cpu_machine(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    with pytest.raises(BatchpilotError, match=r"cluster\.accelerator_type: nvidia-l4 needs 1 CUDA device"):
        require_planned_accelerator(accelerator_type="nvidia-l4", runtime="eager")
    with pytest.raises(BatchpilotError, match=r"tpu-v6e-slice is a TPU but PJRT_DEVICE is unset"):
        require_planned_accelerator(accelerator_type="tpu-v6e-slice", runtime="xla")


def test_a_tpu_plan_whose_environment_does_not_ask_pjrt_for_the_tpu_is_refused(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    with pytest.raises(BatchpilotError) as caught:
        require_planned_accelerator(accelerator_type="tpu-v6e-slice", runtime="xla")
    assert str(caught.value) == (
        "cluster.accelerator_type: tpu-v6e-slice is a TPU but PJRT_DEVICE is CPU, so torch_xla would train on "
        "another device (fix: set PJRT_DEVICE=TPU (the TPU JobSet of `batchpilot launch` does))"
    )
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    require_planned_accelerator(accelerator_type="tpu-v6e-slice", runtime="xla")


def test_a_host_with_its_tpus_starts_and_a_process_not_asked_for_tpus_is_not_checked():
    assert tpu_refusal(pjrt_device="TPU", device_type="TPU", num_devices=4, init_error=None) is None
    assert tpu_refusal(pjrt_device="CPU", device_type="CPU", num_devices=8, init_error=None) is None
    assert tpu_refusal(pjrt_device=None, device_type=None, num_devices=0, init_error=None) is None


def test_a_tpu_runtime_that_does_not_start_is_one_line_naming_its_error():
    error = tpu_refusal(
        pjrt_device="TPU",
        device_type=None,
        num_devices=0,
        init_error="TPU initialization failed: No TPU found",
    )
    assert str(error) == (
        "PJRT_DEVICE: is TPU but this host has no TPU device: the TPU runtime did not start (TPU initialization "
        "failed: No TPU found); the pod is not on a TPU node of the slice (no google.com/tpu limit) or libtpu is "
        "missing (fix: run the trainer pods that `batchpilot launch` renders, from an image built with "
        "TORCH_FLAVOR=tpu)"
    )


def test_a_tpu_runtime_without_tpu_devices_is_refused():
    error = tpu_refusal(pjrt_device="TPU", device_type="CPU", num_devices=1, init_error=None)
    assert error is not None and "torch_xla found 1 device(s) of type CPU" in str(error)
    empty = tpu_refusal(pjrt_device="TPU", device_type="TPU", num_devices=0, init_error=None)
    assert empty is not None and "torch_xla found 0 device(s) of type TPU" in str(empty)

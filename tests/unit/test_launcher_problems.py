"""`cluster.launcher: trainjob` and `cluster.training_runtime` mistakes: one line each at config check, exit 2."""

from __future__ import annotations

import pytest
import yaml

from batchpilot.cli import main
from batchpilot.planning.names import launcher_problems
from helpers import gke_a3_config


def test_the_launcher_settings_that_contradict_each_other_are_named():
    assert launcher_problems(backend="gke", launcher="trainjob", training_runtime="team.runtime",
                             accelerator_type="nvidia-h100-80gb") == []  # fmt: skip
    assert (
        launcher_problems(backend="local", launcher="jobset", training_runtime="x", accelerator_type=None)
        == []
    )
    (alone,) = launcher_problems(
        backend="gke", launcher="jobset", training_runtime="x", accelerator_type=None
    )
    assert str(alone) == (
        "cluster.training_runtime: names a Kubeflow Trainer runtime, but cluster.launcher is jobset "
        "(fix: set cluster.launcher: trainjob, or remove cluster.training_runtime)"
    )
    (bad,) = launcher_problems(backend="gke", launcher="trainjob", training_runtime="Team_Runtime",
                               accelerator_type=None)  # fmt: skip
    assert str(bad).startswith(
        "cluster.training_runtime: 'Team_Runtime' cannot name a ClusterTrainingRuntime:"
    )
    (tpu,) = launcher_problems(backend="gke", launcher="trainjob", training_runtime=None,
                               accelerator_type="tpu-v6e-slice")  # fmt: skip
    assert str(tpu).startswith("cluster.launcher: trainjob is not implemented for TPU slices (tpu-v6e-slice)")


@pytest.mark.parametrize("runtime", ["Team_Runtime", "batchpilot"])
def test_config_check_refuses_a_runtime_it_cannot_use_in_one_line(tmp_path, capsys, runtime):
    config = gke_a3_config(training_runtime=runtime)  # the jobset launcher: a runtime has no use
    if runtime == "Team_Runtime":
        config["cluster"]["launcher"] = "trainjob"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["config", "check", "--config", str(path)]) == 2
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if "cluster.training_runtime" in line]
    assert len(lines) == 1 and "Traceback" not in out.err, out

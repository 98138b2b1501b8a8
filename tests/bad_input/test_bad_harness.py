"""The suite's own contract, checked on a mistake every command shares: a config file that is not there."""

import pytest
from harness import no_debris, run_cli


@pytest.mark.parametrize("command", [["plan"], ["explore"], ["compile", "--output", "x.yaml"], ["doctor"]])
def test_a_missing_config_file_is_one_line(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with no_debris(tmp_path):
        outcome = run_cli(*command, "--config", str(tmp_path / "nope.yaml"))
    outcome.assert_refused("nope.yaml")


def test_the_contract_goes_red_on_a_traceback_and_on_two_lines():
    from harness import Outcome

    with pytest.raises(AssertionError):
        Outcome(2, "", "Traceback (most recent call last):\nbatchpilot: error: x").assert_refused()
    with pytest.raises(AssertionError):
        Outcome(2, "", "batchpilot: error: x\nbatchpilot: error: y").assert_refused()
    assert Outcome(2, "", "usage: batchpilot plan\n       [-h]\nbatchpilot plan: error: x").assert_refused(
        "x"
    )

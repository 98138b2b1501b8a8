"""What every doctor check shares: its result (`Check`), what earlier checks found (`Context`), and the
bound each check runs under."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from batchpilot.config import Config
from batchpilot.errors import BatchpilotError
from batchpilot.planning.batch import split_problems

CALL_TIMEOUT_S = 5.0
"""The most one network call may take (connect and read)."""

CHECK_TIMEOUT_S = 20.0
"""The most one check may take, whatever its calls do (a backstop for retries inside client libraries)."""

Status = Literal["passed", "FAILED", "skipped"]


@dataclass(frozen=True)
class Check:
    """The outcome of one check: what `line()` prints, and what later checks may use (`found`)."""

    name: str
    status: Status
    message: str
    fix: str | None = None
    found: Any = field(default=None, repr=False, compare=False)

    def line(self) -> str:
        text = f"{self.name}: {self.status}: {self.message}"
        return f"{text} (fix: {self.fix})" if self.fix else text


def ok(name: str, message: str, *, found: Any = True) -> Check:
    return Check(name, "passed", message, found=found)


def fail(name: str, message: str, fix: str) -> Check:
    return Check(name, "FAILED", message, fix)


def skip(name: str, why: str) -> Check:
    return Check(name, "skipped", why)


@dataclass
class Context:
    """The config, the command's options, and what each passed check found, by check name."""

    config: Config
    kfp_host: str | None = None
    kfp_token: str | None = None
    kfp_namespace: str = "kubeflow"
    found: dict[str, Any] = field(default_factory=dict)


Step = tuple[str, Callable[[Context], Check]]


def bounded(name: str, step: Callable[[Context], Check], context: Context) -> Check:
    """Runs one check in a thread for at most CHECK_TIMEOUT_S; an error becomes its FAILED line."""
    result: list[Check] = []

    def work() -> None:
        try:
            result.append(step(context))
        except BatchpilotError as error:
            more = len(split_problems(error)) - 1  # the planner reports every problem of a config at once
            also = f" (and {more} more: `batchpilot config check` lists them)" if more else ""
            problem = one_line(f"{error.field}: {error.problem}{also}")
            result.append(fail(name, problem, error.fix or f"correct {error.field}"))
        except Exception as error:  # a doctor prints lines, never a traceback
            problem = f"unexpected {type(error).__name__}: {one_line(str(error))}"
            result.append(fail(name, problem, "report it as a batchpilot bug, with this line"))

    thread = threading.Thread(target=work, name=f"doctor-{name}", daemon=True)
    thread.start()
    thread.join(CHECK_TIMEOUT_S)
    if not result:
        return fail(
            name, f"did not finish within {CHECK_TIMEOUT_S:g}s", "check that its endpoint is reachable"
        )
    return result[0]


def one_line(text: str) -> str:
    return " ".join(str(text).split())


@dataclass(frozen=True)
class Largest:
    """The plan's largest launch: `num_nodes` nodes of `devices_per_node` devices."""

    num_nodes: int
    devices_per_node: int

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node


def nodes_text(largest: Largest) -> str:
    return f"{largest.num_nodes} node(s) x {largest.devices_per_node} device(s) = {largest.num_devices}"

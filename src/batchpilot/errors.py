"""The one error type users see: a single line naming the field and the fix."""

from __future__ import annotations


class BatchpilotError(ValueError):
    """A problem with the user's input, reported as `field: problem (fix: ...)`.

    Attributes:
        field: dotted path of the offending setting, e.g. `batch.rampup.increment`.
        problem: what is wrong, in one sentence.
        fix: what the user can change, in one sentence (optional).
    """

    def __init__(self, field: str, problem: str, fix: str | None = None) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(str(self))

    def __str__(self) -> str:
        text = f"{self.field}: {self.problem}"
        return f"{text} (fix: {self.fix})" if self.fix else text

    def __reduce__(
        self,
    ) -> tuple[object, tuple[type[BatchpilotError], dict[str, object], tuple[object, ...]]]:
        # Pickled whole, subclasses too (DCP gathers a rank's failure to every rank): the default rebuilds an
        # exception by calling its class with `args`, which these __init__s do not take.
        return (_rebuilt, (type(self), dict(self.__dict__), self.args))


def _rebuilt(
    cls: type[BatchpilotError], state: dict[str, object], args: tuple[object, ...]
) -> BatchpilotError:
    """A pickled BatchpilotError (or subclass) as it was, without calling its __init__."""
    error = cls.__new__(cls)
    error.__dict__.update(state)
    error.args = args
    return error

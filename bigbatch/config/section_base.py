"""The base of every Strategy section: a frozen dataclass whose fields carry their
validation rules (`bigbatch.config.fields.check_fields` applies them)."""

from dataclasses import dataclass, field
from typing import Any, ClassVar

from bigbatch.config.fields import check_fields

__all__ = ["_Section", "_f"]


def _f(default: Any, **rules: Any) -> Any:
    """A dataclass field whose metadata holds its validation rules.

    Rules: ``choices`` (tuple of allowed strings), ``ge``/``gt``/``le``/``lt``
    (numeric bounds); see ``bigbatch.config.fields.check_fields``.
    """
    return field(default=default, metadata=rules)


@dataclass(frozen=True)
class _Section:
    section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_fields(self, self.section)
        self._check()

    def _check(self) -> None:
        """Checks across fields of one section (after types and ranges)."""

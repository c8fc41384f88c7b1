"""The record a Fleet strategy's translation builds (`bigbatch.config.fleet`,
`bigbatch.config.fleet_layout`): the bigbatch strategy, the rows ``Fleet key -> bigbatch
key = value`` the run prints, and the one-line refusals."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bigbatch.config.fields import closest
from bigbatch.errors import ConfigError

__all__ = ["FleetTranslation", "refuse", "take"]

WIDTH = 80

@dataclass
class FleetTranslation:
    """A translated Fleet strategy: the bigbatch strategy as a dict, the rows that say
    where each value came from, and what the file asks of the launch."""

    strategy: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``{section: {key: value}}`` for `Strategy.from_dict`."""
    rows: list[tuple[str, str]] = field(default_factory=list)
    """(Fleet key or a Fleet rule in parentheses, ``section.key = value`` or a note)."""
    world_size: int | None = None
    """The number of processes the file's degrees need (hybrid_configs), or None."""
    task: str | None = None
    """The file's ``task`` (bigbatch's built-in task), when given."""
    source: str = "<text>"

    def set(self, fleet_key: str, key: str, value: Any) -> None:
        """Write ``section.key = value`` and record that `fleet_key` gave it."""
        section, _, name = key.partition(".")
        self.strategy.setdefault(section, {})[name] = value
        self.rows.append((fleet_key, f"{key} = {_show(value)}"))

    def note(self, fleet_key: str, text: str) -> None:
        self.rows.append((fleet_key, text))

    def build(self):
        """The bigbatch `Strategy`; a value bigbatch refuses is named by its Fleet key."""
        from bigbatch.config.strategy import Strategy

        try:
            return Strategy.from_dict(self.strategy)
        except ConfigError as e:
            text = str(e)
            for fleet_key, target in self.rows:
                key = target.partition(" = ")[0]
                if " = " in target and key in text and not fleet_key.startswith("("):
                    raise ConfigError(f"{self.source}: {fleet_key} (bigbatch {key}): "
                                      f"{text}") from None
            raise ConfigError(f"{self.source}: {text}") from None

    def table(self) -> str:
        """The translation as a boxed table, one row per line: Fleet key -> bigbatch key."""
        heavy = "+" + "=" * (WIDTH - 2) + "+"
        inner = WIDTH - 4
        out = [heavy, f"|{'Fleet DistributedStrategy -> bigbatch Strategy':^{WIDTH - 2}}|",
               f"|{self.source[-(WIDTH - 2):]:^{WIDTH - 2}}|", heavy]
        width = min(34, max((len(k) for k, _ in self.rows), default=0))
        for fleet_key, target in self.rows:
            text = f"{fleet_key:>{width}} -> {target}"
            if len(text) <= inner:
                out.append(f"| {text:<{inner}} |")
                continue
            out.append(f"| {fleet_key[:inner - 3] + ' ->':<{inner}} |")
            for part in textwrap.wrap(target, inner - 4, break_on_hyphens=False):
                out.append(f"|     {part:<{inner - 4}} |")
        out.append(heavy)
        return "\n".join(out)


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)


def refuse(source: str, key: str, why: str) -> ConfigError:
    """The one line for a Fleet key bigbatch cannot honour."""
    return ConfigError(f"{source}: Fleet key {key} is not supported: {why}")


def take(table: Mapping[str, Any], name: str, known: dict[str, Any], source: str
         ) -> dict[str, Any]:
    """`table`'s keys over Fleet's defaults `known`; an unknown key is refused by name."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"{source}: {name} must be a table of Fleet keys, got {table!r}")
    for key in table:
        if key not in known:
            guess = closest(key, list(known))
            hint = f"; did you mean `{guess}`?" if guess else f"; Fleet's keys: {', '.join(known)}"
            raise ConfigError(f"{source}: unknown key {name}.{key}{hint}")
    return {**known, **table}

"""The compatibility table (`bigbatch.config.compat`): every row refuses its own example,
through the real check, with exactly the row's one-line message; the rows are what
the tests cover; `docs/compatibility.md` is the page the table renders.

(`tests/test_compat.py` is about files written by older versions.)
"""

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from bigbatch.config.compat import CONFLICTS, NO_CONTEXT, check, conflicts
from bigbatch.config.compat_docs import render, sections_of
from bigbatch.config.sections import SECTIONS, section_from_dict
from bigbatch.config.strategy import Strategy
from bigbatch.engine.prepare import prepare
from bigbatch.errors import ConfigError
from bigbatch.parallel.world import World

DOCS = Path(__file__).resolve().parent.parent / "docs" / "compatibility.md"


def unchecked(example):
    """The strategy `example` describes: each section validated, their combination not
    (a `Strategy` would refuse it), with Strategy's defaults for the sections it omits."""
    sections = {f.name: f.default_factory() for f in dataclasses.fields(Strategy)}
    sections.update({name: section_from_dict(SECTIONS[name], body)
                     for name, body in example.items()})
    return SimpleNamespace(**sections)


@pytest.mark.parametrize("row", CONFLICTS, ids=[row.key for row in CONFLICTS])
def test_each_row_refuses_its_example_with_its_message(row):
    expected = row.message(unchecked(row.example), row.given)
    assert "\n" not in expected and expected.strip() == expected
    if row.needs:  # the strategy alone is fine; where the facts are known, it is not
        strategy = Strategy.from_dict(row.example)
        check(strategy, NO_CONTEXT)
        with pytest.raises(ConfigError) as info:
            check(strategy, row.given)
    else:
        with pytest.raises(ConfigError) as info:
            Strategy.from_dict(row.example)
    assert str(info.value) == expected


PREPARE_ROWS = [row for row in CONFLICTS if "prepare()" in row.checked_by]


@pytest.mark.parametrize("row", PREPARE_ROWS, ids=[row.key for row in PREPARE_ROWS])
def test_prepare_refuses_what_its_rows_refuse(row, monkeypatch):
    """prepare() tells the table what it knows: its arguments, this worker (before
    any process group exists, so a world of 2 needs no peer here) and this torch (one
    without FSDP2's unused-parameter pass is mocked by removing the method)."""
    given, strategy = row.given, Strategy.from_dict(row.example)
    if given.fsdp_unused is False:
        from torch.distributed.fsdp import FSDPModule

        monkeypatch.delattr(FSDPModule, "set_reduce_scatter_unused_params", raising=False)
    model = nn.Linear(4, 2)
    world = World(world_size=2 if given.distributed or "tensor_parallel" in row.example else 1,
                  device=torch.device(given.device or "cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if given.own_optimizer else None
    with pytest.raises(ConfigError) as info:
        prepare(model, strategy, total_steps=1, world=world, optimizer=optimizer)
    assert str(info.value) == row.message(strategy, given)


def test_the_rows_are_the_rows_tested():
    """Each example is refused by its own row first (no earlier row hides it), so the
    rows the parametrized test covers are all the rows; keys are unique."""
    keys = [row.key for row in CONFLICTS]
    assert len(set(keys)) == len(keys)
    tested = {next(conflicts(unchecked(row.example), row.given)).key for row in CONFLICTS}
    assert tested == set(keys)


def test_rows_name_their_features_and_where_they_are_checked():
    for row in CONFLICTS:
        assert row.reason and row.fix and row.a and row.b, row.key
        assert row.checked_by  # every fact a row needs has a place that knows it
        if not row.needs:  # two strategy settings: both sides are in the matrix
            assert sections_of(row.a) and sections_of(row.b), row.key


def test_docs_page_is_the_rendered_table():
    """Regenerate with `python -m bigbatch.config.compat_docs > docs/compatibility.md`."""
    assert DOCS.read_text() == render()
    for number, row in enumerate(CONFLICTS, 1):
        assert f"| {number} | " in DOCS.read_text(), row.key

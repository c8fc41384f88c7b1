"""The compatibility table (`bigbatch.config.compat`): every row refuses its own example,
through the real check, with exactly the row's one-line message; the rows are what
the tests cover; `docs/compatibility.md` is the page the table renders.

(`tests/test_compat.py` is about files written by older versions.)
"""

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from bigbatch.config.compat import CONFLICTS, NO_CONTEXT, check, conflicts
from bigbatch.config.compat_docs import render, sections_of
from bigbatch.config.sections import SECTIONS, section_from_dict
from bigbatch.config.strategy import Strategy
from bigbatch.errors import ConfigError

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

"""The docs as a whole: the README's shape (short, the feature table early, links that
resolve), the generated pages equal their generators, the API page covers
`bigbatch.__all__`, and the MkDocs site builds in strict mode (a broken link or anchor, a
docstring the API reference cannot render, any warning fails it)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

import bigbatch
from bigbatch.config import reference_docs

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """Python-Markdown's toc anchor for a heading (MkDocs uses the same)."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+\s+(.+?)\s*$", text, re.M)}


def test_readme_is_short_with_the_feature_table_early():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, len(lines)
    table = next(i for i, line in enumerate(lines, 1)
                 if line.startswith("| feature | strategy section"))
    assert table <= 150, table
    for heading in ("## Two commands", "## Install into your own environment",
                    "## Features", "## Your own loop", "## Before you scale: caveats"):
        assert heading in lines, heading


def test_readme_links_resolve():
    for target in LINK.findall(README.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        page = (ROOT / path) if path else README
        assert page.exists(), f"README links to {target}, which does not exist"
        if anchor:
            assert anchor in anchors(page), f"README links to {target}: no such heading"


def test_docs_pages_link_only_into_docs():
    """The site holds docs/ alone: files elsewhere are named as paths, not linked
    (MkDocs's strict build below checks the links within docs/)."""
    for page in (ROOT / "docs").rglob("*.md"):
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "#")):
                continue
            resolved = (page.parent / target.partition("#")[0]).resolve()
            assert (ROOT / "docs") in resolved.parents, f"{page.name} links to {target}"


def test_strategy_key_reference_is_the_generated_page():
    """Regenerate with `python -m bigbatch.config.reference_docs > docs/strategy-keys.md`."""
    assert (ROOT / "docs" / "strategy-keys.md").read_text() == reference_docs.render()


def test_every_key_has_its_docstring():
    import dataclasses

    from bigbatch.config.sections import SECTIONS

    for name, cls in SECTIONS.items():
        docs = reference_docs.field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in docs]
        assert not missing, f"[{name}] keys without a docstring: {missing}"


def test_api_page_covers_the_public_api():
    text = (ROOT / "docs" / "api.md").read_text()
    for name in bigbatch.__all__:
        if name != "__version__":
            assert f"### `bigbatch.{name}`" in text, name


def test_site_builds_strict(tmp_path):
    missing = [m for m in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python")
               if importlib.util.find_spec(m.split(".")[0]) is None
               or (m.endswith("python") and importlib.util.find_spec(m) is None)]
    if missing:
        pytest.skip(f"the docs tools are not installed ({', '.join(missing)}): "
                    "pip install -e '.[dev]'")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                        "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "WARNING" not in p.stderr, p.stderr[-3000:]
    for page in ("index.html", "api/index.html", "strategy-keys/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "Apply" in api and "trust ratio" in api  # prepare's and LARS's docstrings

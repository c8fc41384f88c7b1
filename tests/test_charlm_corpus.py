"""charlm's corpora: the default `topics` text unchanged, and the `stdlib` corpus built
deterministically from whole files, split without leaks, cached and keyed on its files.
Most tests read a tiny fake standard library; one reads the real one, capped."""

import pytest
import torch

from bigbatch.errors import ConfigError
from bigbatch.tasks import corpus as corpus_mod
from bigbatch.tasks import get_task
from bigbatch.tasks.corpus import STDLIB_VOCAB, UNKNOWN, held_out, load_corpus, stdlib_files

SMALL = dict(seq_len=16, d_model=16, n_layer=1, n_head=2)


def _source(i: int) -> str:
    # Each file has its own marker, so a test can tell which file a text came from.
    return "".join(f"def f{i}_{j}(x):\n    return x + {i * j}  # file {i:02d}\n"
                   for j in range(40))


@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch):
    """20 modules (one not UTF-8, one with non-ASCII text) plus what the corpus must
    skip: test suites, site-packages, caches; `stdlib_root()` points at it."""
    root = tmp_path / "lib"
    for i in range(20):
        sub = root / ("pkg" if i % 3 == 0 else "")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"mod{i:02d}.py").write_text(_source(i))
    (root / "mod05.py").write_text(_source(5) + "# naïve café ✓\r\n")
    (root / "mod07.py").write_bytes(b"x = '\xff\xfe'\n")  # not UTF-8: left out
    for skipped in ("test", "pkg/tests", "idlelib/idle_test", "site-packages/foo",
                    "__pycache__"):
        (root / skipped).mkdir(parents=True)
        (root / skipped / "leak.py").write_text("LEAK = 1\n")
    (root / "README.txt").write_text("not python\n")
    monkeypatch.setattr(corpus_mod, "stdlib_root", lambda: root)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return root


def _text(ids: torch.Tensor) -> str:
    return "".join(STDLIB_VOCAB[i] for i in ids.tolist())


def test_stdlib_files_skip_tests_and_site_packages_in_sorted_order(fake_stdlib):
    names = [rel for rel, _ in stdlib_files(fake_stdlib)]
    assert names == sorted(names) and len(names) == 20
    assert not any("leak" in n for n in names)


def test_build_is_deterministic_and_holds_out_whole_files(fake_stdlib, tmp_path):
    a = load_corpus("stdlib", cache=tmp_path / "a")
    b = load_corpus("stdlib", cache=tmp_path / "b")
    assert a.generated and b.generated  # two independent builds ...
    assert torch.equal(a.train, b.train) and torch.equal(a.test, b.test)  # ... agree
    assert a.identity["text_sha256"] == b.identity["text_sha256"]
    files = stdlib_files(fake_stdlib)
    test_files = [rel for i, (rel, _) in enumerate(files) if held_out(i, 0.1)]
    assert len(test_files) == 2 == a.identity["held_out_files"]  # files 9 and 19 of 20
    train, test = _text(a.train), _text(a.test)
    for rel, _ in files:
        marker = f"# file {int(rel[-5:-3]):02d}\n"
        if rel == "mod07.py":  # not UTF-8
            assert a.identity["skipped"] == 1 and marker not in train + test
        else:
            assert (marker in test) == (rel in test_files) != (marker in train)
    assert "LEAK" not in train + test


def test_vocab_is_bounded_and_unknown_characters_share_one_id(fake_stdlib, tmp_path):
    c = load_corpus("stdlib", cache=tmp_path)
    assert c.chars == list(STDLIB_VOCAB) and len(c.chars) == 98
    assert int(c.train.max()) < 98 and int(c.test.max()) < 98
    text = _text(torch.cat([c.train, c.test]))
    assert f"# na{UNKNOWN}ve caf{UNKNOWN} {UNKNOWN}{UNKNOWN}\n" in text  # ï é ✓ \r
    assert c.identity["unknown"] == 4


def test_cache_is_used_and_its_key_follows_the_file_list(fake_stdlib, monkeypatch):
    first = get_task("charlm", corpus="stdlib", **SMALL)
    assert first.generated and first.cache_path.exists()
    assert first.cache_path.name.startswith("charlm-stdlib-")
    assert not list(first.cache_path.parent.glob(".*tmp"))  # atomic: no temporary left

    def boom(*a, **k):
        raise AssertionError("rebuilt despite a cache hit")

    build = corpus_mod.build_stdlib
    monkeypatch.setattr(corpus_mod, "build_stdlib", boom)
    second = get_task("charlm", corpus="stdlib", **SMALL)
    assert not second.generated and second.cache_path == first.cache_path
    assert torch.equal(first.train_set.tensors[0], second.train_set.tensors[0])
    assert second.data_note() == first.data_note().replace("(built in", "(cached, built in")
    monkeypatch.setattr(corpus_mod, "build_stdlib", build)
    (fake_stdlib / "mod20.py").write_text(_source(20))  # another file: another key
    third = get_task("charlm", corpus="stdlib", **SMALL)
    assert third.generated and third.cache_path != first.cache_path
    note = third.data_note()
    assert "CPython" in note or "PyPy" in note
    assert "20 of 21 files (2 held out, 1 not UTF-8)" in note and third.corpus.identity["files_sha256"][:12] in note


def test_corrupt_cache_is_rebuilt(fake_stdlib):
    first = get_task("charlm", corpus="stdlib", **SMALL)
    first.cache_path.write_bytes(b"not a torch file")
    again = get_task("charlm", corpus="stdlib", **SMALL)
    assert again.generated
    assert torch.equal(first.test_set.tensors[1], again.test_set.tensors[1])


def test_corpus_chars_is_a_budget_split_like_the_whole(fake_stdlib, tmp_path):
    whole = load_corpus("stdlib", cache=tmp_path)
    capped = load_corpus("stdlib", cache=tmp_path, max_chars=5000)
    assert capped.train.numel() == 4500 and capped.test.numel() == 500
    assert torch.equal(capped.train, whole.train[:4500])
    assert torch.equal(capped.test, whole.test[:500])


@pytest.mark.parametrize(("options", "message"), [
    (dict(corpus="wikipedia"), "corpus must be one of topics, stdlib; got 'wikipedia'"),
    (dict(corpus="stdib"), "did you mean `stdlib`?"),
    (dict(corpus_chars=10), "corpus_chars must be >= 1000, got 10"),
    (dict(corpus="stdlib", corpus_chars=1000, seq_len=128),
     "corpus='stdlib' with corpus_chars=1000 leaves the held-out text 100 characters; "
     "allowed: more than seq_len=128 in each split"),
])
def test_bad_corpus_options_are_one_line(fake_stdlib, options, message):
    with pytest.raises(ConfigError) as e:
        get_task("charlm", **{**SMALL, **options})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_default_corpus_is_unchanged():
    # The task as it was before corpora: every character of the topics text in the
    # vocabulary, the last 10% held out, windows of seq_len.
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([stoi[c] for c in text])
    split = int(len(ids) * 0.9)
    task = get_task("charlm", **SMALL)
    assert task.chars == chars and task.cache_path is None and not task.generated
    assert len(task.train_set) == (split - 1) // 16
    assert len(task.test_set) == (len(ids) - split - 1) // 16
    assert torch.equal(task.train_set.tensors[0].flatten(), ids[: len(task.train_set) * 16])
    assert torch.equal(task.test_set.tensors[1].flatten(),
                       ids[split + 1 : split + 1 + len(task.test_set) * 16])
    assert task.data_note().startswith("data: charlm corpus topics, ")


def test_real_stdlib_capped(tmp_path):
    task = get_task("charlm", corpus="stdlib", corpus_chars=200_000, cache_dir=tmp_path, **SMALL)
    assert task.generated and task.vocab_size == 98
    assert (len(task.train_set), len(task.test_set)) == ((180_000 - 1) // 16, (20_000 - 1) // 16)
    info = task.corpus.identity
    assert info["files"] > 300 and 0 < info["held_out_files"] < info["files_used"]
    assert info["characters"] == 200_000
    x = task.train_set.tensors[0]
    assert "import" in task.decode(x[: 2000].flatten().tolist())


def test_run_header_names_the_data_first():
    from pathlib import Path
    from types import SimpleNamespace

    from bigbatch.train.header import header_lines

    lines = header_lines(SimpleNamespace(step=3), None, Path("out"),
                         SimpleNamespace(epoch=0, position=5), None, None, 10, None, None,
                         resumed=True, data_note="data: charlm corpus stdlib, ...")
    assert lines == ["data: charlm corpus stdlib, ...",
                     "resuming out from step 3 (epoch 0, sample 5)"]

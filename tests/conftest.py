"""Fixtures shared by the test files."""

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_intra_op_thread():
    """One intra-op thread for the whole session, as `OMP_NUM_THREADS=1` gives: the tests'
    tensors are tiny, and on a shared 2-core box torch's default (a thread per core) only
    adds contention (the default suite took ~10 min through `scripts/test` without it,
    ~8.5 min with OMP_NUM_THREADS=1). Workers and CLI subprocesses set their own."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def train_env(tmp_path_factory, monkeypatch):
    """In-process `train()` as a fresh single worker would see it.

    One data cache for the whole session (MNIST-1D is generated once), no
    torchrun variables leaking in from the environment, and one intra-op thread.
    """
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-tensor tests: more threads only add
    contention on a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

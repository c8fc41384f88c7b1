"""Every Python snippet in README.md runs as written (each with the names it assumes
set up here); a new snippet needs its set-up added below, or this test fails."""

import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

README = Path(__file__).resolve().parent.parent / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
STRATEGY = """
[batch]
global_batch_size = 16
base_batch_size = 16
base_lr = 0.1
"""


def _classifier(ns, tmp_path):
    torch.manual_seed(0)
    (tmp_path / "strategy.toml").write_text(STRATEGY)
    ns["model"] = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    ns["data"] = TensorDataset(torch.randn(64, 8), torch.randint(0, 4, (64,)))


def _tokens(ns, tmp_path):
    import bigbatch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10))
    ns.update(F=torch.nn.functional, model=model, x=torch.randint(0, 10, (4, 6)),
              y=torch.randint(0, 10, (4, 6)).masked_fill(torch.rand(4, 6) < 0.3, -100),
              run=bigbatch.prepare(model, bigbatch.Strategy.from_toml(STRATEGY), total_steps=2))


def _resume(ns, tmp_path):
    import bigbatch

    _classifier(ns, tmp_path)
    strategy = bigbatch.Strategy.from_toml(tmp_path / "strategy.toml")
    run = bigbatch.prepare(ns["model"], strategy, total_steps=10_000)
    ns.update(bigbatch=bigbatch, strategy=strategy, world_size=1,
              ckpt={"run": run.state_dict()})


def _nothing(ns, tmp_path):
    """The snippet defines what it uses (a Policy subclass)."""


SETUP = {"DataLoader, DistributedSampler": _classifier, "ms.backward(loss, count=": _tokens,
         "resume_plan(": _resume, "from bigbatch import LARS": _classifier,
         "(bigbatch.Policy)": _nothing}


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.splitlines()[0][:40] for s in SNIPPETS])
def test_readme_snippet_runs(snippet, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    setups = [f for key, f in SETUP.items() if key in snippet]
    assert setups, "a README snippet without a set-up in tests/test_readme.py"
    ns: dict = {}
    setups[0](ns, tmp_path)
    exec(compile(snippet, "README.md", "exec"), ns)

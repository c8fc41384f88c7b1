"""The README's own-loop block (and docs/own-loop.md's, the same loop) run as printed
under `torchrun --nproc-per-node 2` end with the weights one process ends with (issue 38).

Each block is written to a file exactly as printed, followed by a few appended lines
(`SAVE`) that write this rank's final parameters to `$OWN_LOOP_BLOCK_OUT.rank<R>`. The
block ends with `run.close()`, which tears the process group down, so the appended lines
cannot gather a sharded parameter any more: each rank saves its local piece (a DTensor's
`to_local()`, with its placements) and the test joins ZeRO-3's `Shard(0)` pieces in rank
order (FSDP2 splits dim 0 as `torch.chunk` does).

- one process: `python block.py`, the reference;
- DDP: `torchrun --nproc-per-node 2 block.py`, as printed;
- ZeRO-3: bigbatch has no environment override of the strategy, so this case runs a
  test-only variant: the one text substitution `ZERO3` below, which appends
  `[sharding]\\nstage = 3` to the block's TOML string (the rest of the block unchanged);
- tensor parallel 2: the block's `nn.Sequential` has no tensor-parallel plan, so
  `prepare()` refuses it in one line naming the missing plan (asserted here), as the
  README says next to the block.

Weights are compared to the one-process run at 1e-6 relative (float32): the largest
absolute difference of a tensor over that tensor's largest magnitude.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests._cli import cli_env
from tests._dist import free_port
from tests.test_docs_blocks import blocks

ROOT = Path(__file__).resolve().parent.parent
PAGES = {"readme": ROOT / "README.md", "own-loop": ROOT / "docs" / "own-loop.md"}
OUT_ENV = "OWN_LOOP_BLOCK_OUT"
TOML_END = '[gradient_merge]          # k_steps = 512 / (64 x workers)\n"""'
ZERO3 = (TOML_END, TOML_END[:-3] + '[sharding]\nstage = 3\n"""')
TP2 = (TOML_END, TOML_END[:-3] + '[tensor_parallel]\ntensor_parallel_degree = 2\n"""')

SAVE = f"""
# -- appended by tests/test_own_loop_blocks.py: this rank's final parameters --
import os as _os
_state = {{}}
for _name, _p in run.module.named_parameters():
    _t = _p.detach()
    if hasattr(_t, "to_local"):  # a DTensor (ZeRO-3): this rank's piece
        _state[_name] = (_t.to_local().clone(), [repr(_pl) for _pl in _t.placements])
    else:
        _state[_name] = (_t.clone(), None)
torch.save(_state, _os.environ["{OUT_ENV}"] + ".rank" + _os.environ.get("RANK", "0"))
"""


def own_loop_block(page: Path) -> str:
    """The page's own-loop block, as printed."""
    found = [b.code for b in blocks(page)
             if b.language == "python" and "bigbatch.prepare(model, strategy" in b.code
             and "run.loader(data)" in b.code and "nn.Sequential" in b.code]
    assert len(found) == 1, f"{page.name}: expected one own-loop block, found {len(found)}"
    return found[0]


def _run(code: str, tmp: Path, nproc: int, timeout: float = 120) -> subprocess.CompletedProcess:
    script = tmp / f"block_{nproc}.py"
    script.write_text(code)
    out = tmp / f"weights_{nproc}"
    env = cli_env(tmp / "cache", GLOO_SOCKET_IFNAME="lo", **{OUT_ENV: str(out)})
    if nproc == 1:
        cmd = [sys.executable, str(script)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(script)]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _weights(tmp: Path, nproc: int) -> dict[str, torch.Tensor]:
    out = tmp / f"weights_{nproc}"
    ranks = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(nproc)]
    full = {}
    for name, (t, placements) in ranks[0].items():
        if placements is None:
            full[name] = t
        else:
            assert placements == ["Shard(dim=0)"], (name, placements)
            full[name] = torch.cat([ranks[r][name][0] for r in range(nproc)], 0)
    return full


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    worst = 0.0
    for name in a:
        assert a[name].shape == b[name].shape, name
        rel = ((a[name] - b[name]).abs().max() / b[name].abs().max()).item()
        worst = max(worst, rel)
    return worst


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode == 0, f"{what}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "epoch 3: step 24" in proc.stdout, proc.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The README block on one process (docs/own-loop.md's block is the same text)."""
    tmp = tmp_path_factory.mktemp("one")
    proc = _run(own_loop_block(PAGES["readme"]) + SAVE, tmp, 1)
    _check(proc, "one process")
    return _weights(tmp, 1)


def test_pages_print_the_same_loop():
    """docs/own-loop.md's block is the README's, so the runs below cover both."""
    assert own_loop_block(PAGES["readme"]) == own_loop_block(PAGES["own-loop"])


def test_ddp_as_printed_equals_one_process(tmp_path, reference):
    start = time.monotonic()
    proc = _run(own_loop_block(PAGES["readme"]) + SAVE, tmp_path, 2)
    _check(proc, "torchrun DDP")
    worst = _worst(_weights(tmp_path, 2), reference)
    print(f"DDP x2 vs one process: worst relative difference {worst:.2e} "
          f"({time.monotonic() - start:.1f} s)")
    assert worst <= 1e-6


def test_zero3_equals_one_process(tmp_path, reference):
    code = own_loop_block(PAGES["readme"])
    assert code.count(ZERO3[0]) == 1
    start = time.monotonic()
    proc = _run(code.replace(*ZERO3) + SAVE, tmp_path, 2)
    _check(proc, "torchrun ZeRO-3")
    assert "Shard(dim=0)" in str(torch.load(f"{tmp_path}/weights_2.rank0",
                                            weights_only=False))
    worst = _worst(_weights(tmp_path, 2), reference)
    print(f"ZeRO-3 x2 vs one process: worst relative difference {worst:.2e} "
          f"({time.monotonic() - start:.1f} s)")
    assert worst <= 1e-6


def test_tensor_parallel_refused_naming_the_plan(tmp_path):
    """The block's model has no plan: each rank stops in prepare() with the one line."""
    code = own_loop_block(PAGES["readme"])
    assert code.count(TP2[0]) == 1
    proc = _run(code.replace(*TP2) + SAVE, tmp_path, 2)
    assert proc.returncode != 0
    line = ("tensor_parallel.tensor_parallel_degree=2: no tensor-parallel plan for this "
            "model; pass prepare(..., tp_plan=...)")
    assert line in proc.stderr, proc.stderr[-4000:]
    assert "epoch 1" not in proc.stdout

"""A parameter one rank does not use under ZeRO stage 2-3 (FSDP2), on 2 gloo ranks.

FSDP2 reduces only the gradients a rank got, so a branch one rank skips made the
reductions differ in size and gloo abort that rank (SIGABRT), or the gathers of a
skipped block pair with the wrong ones (a hang). In the first optimizer steps
(`bigbatch.parallel.unused_params`) the ranks compare what they ran and used before
the collectives: the run ends with the same one line on every rank, naming the
parameters and the rank, and what to do (data_parallel.find_unused_parameters, which
tests/test_unused_fsdp_reduced trains with). A parameter no rank uses trains as before,
and the check stops after its steps. A real 2-process job ends with a non-zero exit code
and the line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _dist import run_workers
from torch import nn

from bigbatch.config.strategy import Strategy
from bigbatch.engine.prepare import prepare
from bigbatch.parallel.data_parallel import UnusedParametersError
from bigbatch.parallel.sharding import fsdp_reduces_unused
from bigbatch.parallel.unused_params import CHECKED_STEPS, unused_line

TESTS = Path(__file__).resolve().parent


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, h, skip_b=False):
        h = torch.relu(self.a(h))
        return h if skip_b else self.b(h)


class Branchy(nn.Module):
    """Blocks (FSDP2's units) around a root with its own layers; `skip` names the parts
    this rank leaves out of forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.extra = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)
        self.skip: tuple[str, ...] = ()

    def forward(self, x):
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if f"blocks.{i}" not in self.skip:
                h = block(h, skip_b=f"blocks.{i}.b" in self.skip)
        if "extra" not in self.skip:
            h = self.extra(h)
        return self.out(h)


def _strategy(stage: int) -> Strategy:
    return Strategy.from_dict({
        "batch": {"global_batch_size": 16, "micro_batch_size": 4, "base_batch_size": 16,
                  "base_lr": 0.01},
        "optimizer": {"type": "adamw"}, "lamb": {}, "gradient_merge": {"k_steps": 2},
        "sharding": {"stage": stage}})


def _loop(run, steps: int) -> None:
    """`steps` optimizer steps of 2 micro-steps, each rank on its own rows."""
    g = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
    for _ in range(steps):
        for _ in range(2):
            with run.micro_step() as ms:
                x = torch.randn(4, 6, generator=g)
                ms.backward(F.cross_entropy(run.model(x), x[:, :3].argmax(1)))


def _run(stage: int, skips: dict[int, tuple[str, ...]], steps: int):
    torch.manual_seed(0)
    model = Branchy()
    model.skip = skips.get(int(os.environ.get("RANK", "0")), ())
    return prepare(model, _strategy(stage), total_steps=steps)


def _train(stage: int, skips: dict[int, tuple[str, ...]], steps: int):
    """(the error's line or None, steps taken, whether the check is still on)."""
    run = _run(stage, skips, steps)
    try:
        _loop(run, steps)
    except UnusedParametersError as e:
        return str(e), run.step, run.unused_check.active
    return None, run.step, run.unused_check.active


SKIP_ONE = {
    "root-layer": ({1: ("extra",)}, "parameter(s) extra.weight, extra.bias on rank 1 got no "
                   "gradient in optimizer step 1 while other ranks' did"),
    "block-layer": ({1: ("blocks.1.b",)}, "parameter(s) blocks.1.b.weight, blocks.1.b.bias on "
                    "rank 1 got no gradient in optimizer step 1 while other ranks' did"),
    "block": ({1: ("blocks.0",)}, "module blocks.0 (parameter(s) blocks.0.a.weight, "
              "blocks.0.a.bias, blocks.0.b.weight, blocks.0.b.bias) did not run on rank 1 in "
              "optimizer step 1 while rank 0 ran it"),
}


_STAGE1 = ("(without tensor parallelism) sharding.stage = 1 with "
           "data_parallel.find_unused_parameters = true")
FIX = {  # a parameter: FSDP2's pass where this torch has it (2.13); a whole block: not that
    False: ("set data_parallel.find_unused_parameters = true (FSDP2 then reduces zeros for "
            "them), or use every parameter in forward on every rank"
            if fsdp_reduces_unused() else
            f"use every parameter in forward on every rank, or {_STAGE1}"),
    True: ("run every block on every rank (where a rank does not want one, add 0 * its "
           f"output, so that its backward runs too), or {_STAGE1}")}


def _all_cases():
    return {(stage, case): _train(stage, SKIP_ONE[case][0], steps=2)
            for stage in (2, 3) for case in SKIP_ONE}


@pytest.fixture(scope="module")
def skipped():
    return run_workers(_all_cases, 2, timeout=180)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("case", list(SKIP_ONE))
def test_a_part_one_rank_skips_is_named_before_the_collectives(skipped, stage, case):
    lines = {r[(stage, case)][0] for r in skipped}
    assert len(lines) == 1, lines  # every rank says the same
    line = lines.pop()
    assert line is not None and "\n" not in line
    assert line.startswith(SKIP_ONE[case][1]), line
    assert line.endswith(FIX[case == "block"]), line
    assert all(r[(stage, case)][1] == 0 for r in skipped)  # before the first step's update


def test_a_parameter_no_rank_uses_trains_and_the_check_ends():
    got = run_workers(_train, 2, args=(3, {0: ("extra",), 1: ("extra",)}, CHECKED_STEPS + 2),
                      timeout=120)
    assert got == [(None, CHECKED_STEPS + 2, False)] * 2


def _group_after_the_error() -> tuple[bool, bool]:
    """(whether the error came, whether a process group is left after it)."""
    import torch.distributed as dist

    run = _run(3, {1: ("extra",)}, steps=2)
    try:
        _loop(run, steps=2)
    except UnusedParametersError:
        return True, dist.is_initialized()
    return False, dist.is_initialized()


def test_the_agreed_error_closes_the_group_prepare_made():
    assert run_workers(_group_after_the_error, 2, timeout=120) == [(True, False)] * 2


def test_the_line_groups_ranks_and_shortens_long_lists():
    names = [f"p{i}" for i in range(10)]
    line = unused_line(names, {1: [0, 1], 3: [0, 1], 2: list(range(10))}, 7)
    assert line.startswith("parameter(s) p0, p1 on ranks 1, 3; p0, p1, p2, p3, p4, p5, p6, p7 "
                           "and 2 more on rank 2 got no gradient in optimizer step 7"), line


JOB = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from test_unused_fsdp import _loop, _run
_loop(_run(3, {{1: ("extra",)}}, steps=2), steps=2)
"""


def test_a_two_process_job_ends_with_the_line(tmp_path):
    """Through torchrun, as a user's own script runs (it never closes the run): the job
    exits non-zero and its output names the parameter and the rank, with no SIGABRT (a
    gloo group left alive to the interpreter's exit aborted one rank in 2 of 6 runs on
    a loaded machine: the run now closes its group as the agreed error leaves it)."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    for name in [n for n in env if n.startswith(("TORCHELASTIC_", "BIGBATCH_LAUNCHER"))]:
        del env[name]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", str(script)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=180)
    assert p.returncode != 0, p.stderr[-3000:]
    said = re.findall(r"^\[rank(\d)\]: bigbatch\.parallel\.data_parallel\."
                      r"UnusedParametersError: (.*)$", p.stderr, re.MULTILINE)
    assert sorted(rank for rank, _ in said) == ["0", "1"], p.stderr[-3000:]
    lines = {line for _, line in said}  # every rank the same
    assert len(lines) == 1, lines
    assert lines.pop().startswith("parameter(s) extra.weight, extra.bias on rank 1 got no "
                                  "gradient in optimizer step 1")
    assert "SIGABRT" not in p.stderr and "Signal 6" not in p.stderr, p.stderr[-3000:]

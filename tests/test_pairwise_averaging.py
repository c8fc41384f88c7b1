"""`[localsgd] averaging = "pairwise"`: after its local steps each worker averages its
weights with one peer, rank XOR 2^(j mod log2 N) at the j-th average, over
point-to-point sends (KungFu's pairwise averaging in a fixed order).

On 2 and 4 gloo ranks, a model written as users write them (a stem, nested blocks, a
final norm, an untied head) trains to the weights of one process that keeps N copies,
steps each on its own shard with the optimizer and schedule `build_optimizer` /
`build_scheduler` give, averages the gradients in the synchronous steps and the pairs
after the local ones; the local steps and their averages call no all-reduce (with the
non-finite-loss guard off, whose flag is one all-reduced float a step). A checkpoint mid-run
(which averages every worker's weights and moments, as `[localsgd]` does) resumes to the
uninterrupted run's weights, the hypercube schedule continuing where it was. A world
size that is not a power of two and the layouts local SGD refuses are one line each.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from _dist import CountCalls, run_workers
from torch import nn

from bigbatch.config.parallelism import degrees
from bigbatch.config.strategy import Strategy
from bigbatch.engine.optimizer import build_optimizer, build_scheduler
from bigbatch.engine.prepare import prepare
from bigbatch.errors import ConfigError
from bigbatch.parallel.pairwise_averaging import hypercube_peer

MICRO, D, CLASSES, STEPS = 8, 12, 5, 6
RTOL = 1e-6


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h):
        return self.fc2(F.gelu(self.fc1(h)))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1, self.mix = nn.LayerNorm(d), nn.Linear(d, d)
        self.norm2, self.mlp = nn.LayerNorm(d), MLP(d)

    def forward(self, h):
        h = h + torch.tanh(self.mix(self.norm1(h)))
        return h + self.mlp(self.norm2(h))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block(D) for _ in range(2))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, CLASSES)  # untied

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _strategy(w: int, merge: int, k_steps: int, begin_step: int) -> Strategy:
    return Strategy.from_dict({
        "batch": {"global_batch_size": w * merge * MICRO, "micro_batch_size": MICRO,
                  "base_batch_size": 16, "base_lr": 0.1, "warmup_steps": 2, "decay": "cosine"},
        "optimizer": {"type": "momentum", "momentum": 0.9, "weight_decay": 1e-4},
        "gradient_merge": {"k_steps": merge},
        "localsgd": {"k_steps": k_steps, "begin_step": begin_step, "averaging": "pairwise"}})


def _data(w: int, merge: int, steps: int = STEPS):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps, w * merge * MICRO, D, generator=g)
    y = torch.randint(0, CLASSES, (steps, w * merge * MICRO), generator=g)
    return x, y


def _rows(w: int, merge: int, rank: int, m: int) -> slice:
    """Rank `rank`'s rows of micro-step `m` in a step's batch (micro-steps outermost)."""
    start = (m * w + rank) * MICRO
    return slice(start, start + MICRO)


def _feed(run, x, y, w, merge, rank, trace=None):
    for step in range(x.shape[0]):
        for m in range(merge):
            rows = _rows(w, merge, rank, m)
            with run.micro_step() as ms:
                ms.backward(F.cross_entropy(run.model(x[step, rows]), y[step, rows]))
        assert ms.stepped
        if trace is not None:
            trace.append((run.last_lr, run.local_sgd.pairs.peer, run.local_sgd.averages))


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _worker(w: int, merge: int, k_steps: int, begin_step: int, resume: bool) -> dict:
    rank = int(os.environ["RANK"])
    s = _strategy(w, merge, k_steps, begin_step)
    x, y = _data(w, merge)
    # nan_policy None: the default guard all-reduces one flag per step (not the model)
    run = prepare(_net(), s, total_steps=STEPS, nan_policy=None)
    trace: list = []
    _feed(run, x[:begin_step], y[:begin_step], w, merge, rank, trace)
    with CountCalls(("all_reduce",)) as counted:  # the local steps and their averages
        _feed(run, x[begin_step:], y[begin_step:], w, merge, rank, trace)
    out = {"params": _params(run.module), "trace": trace, "all_reduces": counted.calls}
    if not resume:
        return out
    # a checkpoint after step 3 (state_dict() averages first, in the uninterrupted run too)
    cut = 3
    run = prepare(_net(), s, total_steps=STEPS)
    _feed(run, x[:cut], y[:cut], w, merge, rank)
    engine = run.state_dict()
    saved = copy.deepcopy((run.module.state_dict(), engine))
    _feed(run, x[cut:], y[cut:], w, merge, rank)
    out["full"] = _params(run.module)
    model = _net()
    model.load_state_dict(saved[0])
    run = prepare(model, s, total_steps=STEPS)
    run.load_state_dict(saved[1])
    resumed: list = []
    _feed(run, x[cut:], y[cut:], w, merge, rank, resumed)
    out["resumed"], out["resumed_trace"] = _params(run.module), resumed
    return out


def _simulate(w: int, merge: int, k_steps: int, begin_step: int):
    """N copies in one process, each stepped on its own shard; the gradients averaged in
    steps 1..begin_step, the pairs averaged after every k_steps-th local step."""
    s = _strategy(w, merge, k_steps, begin_step)
    x, y = _data(w, merge)
    models = [_net() for _ in range(w)]
    opts = [build_optimizer(m, s, data_degree=w) for m in models]
    scheds = [build_scheduler(o, s, STEPS, data_degree=w) for o in opts]
    lrs, peers, averages = [], [], 0
    for step in range(1, STEPS + 1):
        lrs.append(opts[0].param_groups[0]["lr"])
        for r, model in enumerate(models):
            model.zero_grad()
            for m in range(merge):
                rows = _rows(w, merge, r, m)
                (F.cross_entropy(model(x[step - 1, rows]), y[step - 1, rows]) / merge).backward()
        if step <= begin_step:
            for ps in zip(*(m.parameters() for m in models), strict=True):
                mean = sum(p.grad for p in ps) / w
                for p in ps:
                    p.grad = mean.clone()
        for o, sched in zip(opts, scheds, strict=True):
            o.step()
            sched.step()
        if step > begin_step and (step - begin_step) % k_steps == 0:
            pair = [hypercube_peer(r, averages, w) for r in range(w)]
            with torch.no_grad():
                before = [_params(m) for m in models]
                for r, model in enumerate(models):
                    for p, a, b in zip(model.parameters(), before[r], before[pair[r]],
                                       strict=True):
                        p.copy_((a + b) / 2)
            averages += 1
            peers.append(pair)
        else:
            peers.append(None)
    return [_params(m) for m in models], lrs, peers


def _worst(a, b) -> float:
    """The largest max|a - b| / max|b| over the tensors."""
    return max(float((p - q).abs().max() / q.abs().max()) for p, q in zip(a, b, strict=True))


CASES = {  # w, gradient merge, k_steps, begin_step
    "2_ranks_merge2_k2": (2, 2, 2, 2),  # averages after steps 4, 6
    "4_ranks_k1": (4, 1, 1, 2),  # averages after steps 3-6: peers r^1, r^2, r^1, r^2
}


@pytest.mark.parametrize("case", list(CASES))
def test_pairwise_equals_n_copies_in_one_process(case):
    w, merge, k_steps, begin_step = CASES[case]
    got = run_workers(_worker, w, (w, merge, k_steps, begin_step, w == 4), timeout=120)
    want, lrs, peers = _simulate(w, merge, k_steps, begin_step)
    worst = max(_worst(got[r]["params"], want[r]) for r in range(w))
    print(f"{case}: worst relative difference {worst:.2e}")
    assert worst < RTOL
    for r in range(w):
        trace = got[r]["trace"]
        torch.testing.assert_close([t[0] for t in trace], lrs, rtol=1e-12, atol=0)
        averaged = [p is not None for p in peers]
        assert [t[2] for t in trace] == [sum(averaged[:i + 1]) for i in range(STEPS)]
        assert {t[1] for t, p in zip(trace, peers, strict=True) if p is not None} <= \
               {p[r] for p in peers if p is not None}
        assert got[r]["all_reduces"] == 0  # one peer, point to point, no all-reduce
    # pairs agree bit for bit; the workers of different pairs differ
    last = next(p for p in reversed(peers) if p is not None)
    for r in range(w):
        assert all(torch.equal(a, b) for a, b in zip(got[r]["params"],
                                                     got[last[r]]["params"], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(got[0]["params"], got[w - 1]["params"],
                                                     strict=True)) or w == 2
    if w == 4:  # the checkpoint's resume
        for r in range(w):
            assert all(torch.equal(a, b) for a, b in zip(got[r]["resumed"], got[r]["full"],
                                                         strict=True))
            assert [t[1:] for t in got[r]["resumed_trace"]] == [t[1:] for t in got[r]["trace"][3:]]


def test_hypercube_schedule_pairs_everyone_in_log2_n_averages():
    for n in (1, 2, 4, 8, 16):
        for j in range(8):
            pair = [hypercube_peer(r, j, n) for r in range(n)]
            assert all(pair[pair[r]] == r for r in range(n))  # symmetric, disjoint
        dims = max(1, n.bit_length() - 1)
        # log2 N averages in a row are the butterfly: each rank's mix covers all N ranks
        reach = [{r} for r in range(n)]
        for j in range(dims):
            reach = [reach[r] | reach[hypercube_peer(r, j, n)] for r in range(n)]
        assert all(len(s) == n for s in reach)
    with pytest.raises(ValueError, match="power-of-two"):
        hypercube_peer(0, 0, 6)


def test_world_size_not_a_power_of_two_is_one_line():
    s = _strategy(2, 1, 1, 1)
    assert degrees(s, 4).data == 4
    with pytest.raises(ConfigError) as e:
        degrees(s, 3)
    assert str(e.value).count("\n") == 0
    assert 'localsgd.averaging = "pairwise"' in str(e.value) and "got 3" in str(e.value)


@pytest.mark.parametrize("layout, what", [
    ({"sharding": {"stage": 2}}, "[sharding]"),
    ({"tensor_parallel": {"tensor_parallel_degree": 2}}, "tensor parallelism"),
    ({"pipeline": {"pp_degree": 2}}, "[pipeline]")])
def test_layouts_local_sgd_refuses_are_refused(layout, what):
    with pytest.raises(ConfigError) as e:
        Strategy.from_dict({"localsgd": {"averaging": "pairwise"}, **layout})
    assert str(e.value).startswith(f"[localsgd] with {what}") and "\n" not in str(e.value)


def test_cli_refuses_three_workers_in_one_line(tmp_path, capsys, monkeypatch):
    from bigbatch.cli.main import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    code = main(["train", "--nproc", "3", "--no-progress", "--no-tensorboard", "--task-opt",
                 "num_samples=1000", "--set", "batch.global_batch_size=96", "--set",
                 "batch.base_batch_size=32", "--steps", "2", "--set",
                 "localsgd.averaging=pairwise", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and 'localsgd.averaging = "pairwise"' in err, err
    assert "got 3" in err and not (tmp_path / "out").exists()

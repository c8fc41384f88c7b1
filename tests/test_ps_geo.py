"""The parameter server's geo mode (Fleet's GEO-SGD, `parameter_server.mode = "geo"`): the
round's arithmetic against a literal transcription of Paddle's GeoCommunicator (float64,
two workers), and the main job on real ranks: with one worker geo is that worker's own
training (the sync server's result), and a killed geo run resumes to the same bits."""

from __future__ import annotations

import os

import pytest
import torch
from _dist import run_workers

from bigbatch.config.strategy import Strategy
from bigbatch.parallel.parameter_server import Push, Server, geo_delta, geo_take

# ---------------------------------------------------------------- the round, in-process


def _paddle_reference(targets, lr, k, rounds):
    """GEO-SGD as Paddle's GeoCommunicator writes it, per worker: `latest` (the trained
    copy), `old` (timestamp), the server's `pserver`; SGD on 0.5 |x - t_w|^2."""
    w_count = len(targets)
    pserver = torch.zeros(3, dtype=torch.float64)
    latest = [pserver.clone() for _ in targets]
    old = [pserver.clone() for _ in targets]
    for _ in range(rounds):
        for w, t in enumerate(targets):
            for _ in range(k):
                latest[w] = latest[w] - lr * (latest[w] - t)
        deltas = []
        for w in range(w_count):  # SendDense: delta = (latest - old) / trainers; old += delta
            delta = (latest[w] - old[w]) * (1.0 / w_count)
            old[w] = old[w] + delta
            deltas.append(delta)
        for d in deltas:  # the server sums what it receives
            pserver = pserver + d
        for w in range(w_count):  # RecvDense: latest += pserver - old; old = pserver
            latest[w] = latest[w] + (pserver - old[w])
            old[w] = pserver.clone()
    return pserver, latest


def test_geo_round_is_paddles_geo_sgd():
    targets = [torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64),
               torch.tensor([3.0, 0.25, -1.0], dtype=torch.float64)]
    lr, k, rounds = 0.3, 3, 5
    param = torch.zeros(3, dtype=torch.float64)
    server = Server(0, [param], 2, "geo", 0, lambda g, p: None)
    xs = [torch.zeros(3, dtype=torch.float64) for _ in targets]
    olds = [[x.clone()] for x in xs]
    for r in range(rounds):
        futures, kept = [], []
        for w, t in enumerate(targets):
            for _ in range(k):
                xs[w].sub_(lr * (xs[w] - t))
            deltas, keep = geo_delta([xs[w]], olds[w], 2)
            kept.append(keep)
            futures.append(server.push(Push(w, r, deltas, 1.0, 0.0)))
            assert not futures[0].done() or w == 1  # the round waits for every worker
        for w, f in enumerate(futures):
            reply = f.wait()
            assert reply.version == r + 1
            geo_take([xs[w]], olds[w], reply.params, kept[w])
    ref_server, ref_latest = _paddle_reference(targets, lr, k, rounds)
    torch.testing.assert_close(param, ref_server, rtol=1e-12, atol=1e-12)
    for x, ref in zip(xs, ref_latest, strict=True):
        torch.testing.assert_close(x, ref, rtol=1e-12, atol=1e-12)
    # each worker keeps 1 - 1/W of its own progress on top of the servers' values
    assert not torch.allclose(xs[0], param) and not torch.allclose(xs[0], xs[1])


def test_one_worker_takes_back_exactly_what_it_trained():
    x = torch.tensor([0.5, -1.5, 2.0])
    old = [torch.tensor([0.25, -1.0, 1.0])]
    server_value = old[0].clone()
    deltas, kept = geo_delta([x], old, 1)
    server_value += deltas[0]
    geo_take([x], old, [server_value], kept)
    assert torch.equal(x, torch.tensor([0.5, -1.5, 2.0])) and torch.equal(old[0], x)


def test_geo_keys_are_checked():
    s = Strategy().with_overrides(["parameter_server.mode=geo", "parameter_server.geo_k_steps=3"])
    assert s.parameter_server.mode == "geo" and s.parameter_server.geo_k_steps == 3
    with pytest.raises(Exception, match="geo_k_steps"):
        Strategy().with_overrides(["parameter_server.geo_k_steps=0"])


# ---------------------------------------------------------------- the main job, real ranks

from test_train import SMALL, STRATEGY  # noqa: E402

GEO = ["parameter_server.servers=1", "parameter_server.mode=geo",
       "parameter_server.geo_k_steps=3"]


def _job(out, overrides, cache, resume=False):
    from bigbatch.train.trainer import TrainConfig, train

    os.environ["XDG_CACHE_HOME"] = cache
    torch.set_num_threads(1)
    strategy = Strategy.from_toml(STRATEGY).with_overrides(overrides)
    config = TrainConfig(task="mnist1d", model="mlp", task_options=SMALL, steps=8, out=out,
                         checkpoint_every=4, log_every=2, progress=False, tensorboard=False,
                         keep_checkpoints=9, resume=resume)
    return train(config, strategy)


def _final(out):
    return torch.load(os.path.join(out, "final.pt"), weights_only=True)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.getbasetemp() / "xdg-cache")


@pytest.mark.slow  # ~16 s: two 2-rank jobs (RPC start-up dominates)
def test_one_geo_worker_trains_as_the_sync_server_does(tmp_path, cache):
    """With one worker, old + (x - old) is x: geo is the worker's own training, which the
    sync server runs on the same batches in the same order (the LR schedule too)."""
    one = ["batch.global_batch_size=32"]
    geo, sync = str(tmp_path / "geo"), str(tmp_path / "sync")
    (summary, _) = run_workers(_job, 2, args=(geo, [*GEO, *one], cache), timeout=300)
    assert summary["steps"] == 8 and summary["parameter_server"]["mode"] == "geo"
    run_workers(_job, 2, args=(sync, ["parameter_server.servers=1", *one], cache), timeout=300)
    a, b = _final(geo), _final(sync)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # ~20 s: a 3-rank geo job, then its resume from a mid-run checkpoint
def test_geo_resumes_exactly(tmp_path, cache):
    """Rounds of 3 steps end at 3, 6 and 8: the checkpoint falls at step 6 (the first round
    boundary after 4), and the resume takes the short last round as the full run did."""
    import json
    import shutil

    out, cut = str(tmp_path / "geo"), str(tmp_path / "cut")
    (summary, *_) = run_workers(_job, 3, args=(out, GEO, cache), timeout=300)
    assert summary["steps"] == 8 and summary["parameter_server"]["workers"] == 2
    names = sorted(os.listdir(os.path.join(out, "checkpoints")))
    steps = sorted({int(n.split("-")[1].split(".")[0]) for n in names})
    assert steps[0] == 6, names
    text = (tmp_path / "geo" / "metrics.jsonl").read_text()
    lines = [json.loads(x) for x in text.splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "train"] == [3, 6, 8]
    shutil.copytree(out, cut)
    for name in os.listdir(os.path.join(cut, "checkpoints")):
        if int(name.split("-")[1].split(".")[0]) > 6:
            os.remove(os.path.join(cut, "checkpoints", name))
    for name in ("final.pt", "summary.json"):
        os.remove(os.path.join(cut, name))
    run_workers(_job, 3, args=(cut, GEO, cache, True), timeout=300)
    a, b = _final(out), _final(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

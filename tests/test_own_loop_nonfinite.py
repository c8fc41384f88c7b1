"""Your own loop meets a non-finite loss: `prepare(..., nan_policy=)` as `bigbatch train
--nan-policy`. The default stops with `NonFiniteLossError` naming the optimizer step
before that step touches a weight; `skip` drops the step and counts it; on 1 process and
on 2 gloo ranks where only one rank sees the nan. The device check (CUDA's way, forced
here on CPU) skips in the optimizer and raises once the flag is looked at."""

import math

import pytest
import torch
import torch.nn.functional as F
from _dist import run_workers
from test_engine import make_data, make_model, strategy

from bigbatch.engine.nonfinite import MAX_NONFINITE_SKIPS
from bigbatch.engine.prepare import prepare
from bigbatch.errors import ConfigError, NonFiniteLossError
from bigbatch.parallel.world import World

STEPS, BAD = 4, 3  # optimizer steps; the one (1-based) whose first micro-batch has a nan loss


def _loop(policy="stop", opt="lars", world=None, bad_rank=0, on_device=False, bad=(BAD,),
          skip_data=()):
    """STEPS optimizer steps of 2 micro-steps; returns (error, weights, run, skipped flags)."""
    world = world if world is not None else World()
    kw = {} if policy == "default" else {"nan_policy": policy}
    run = prepare(make_model(), strategy(opt, global_batch=128 * world.world_size, micro=64,
                                         k=2), total_steps=STEPS, world=world, **kw)
    if on_device:
        run.nan_check_on_device = True
    x, y = make_data(steps=STEPS, n=128 * world.world_size)
    rows = slice(128 * world.rank, 128 * (world.rank + 1))
    error, skipped = None, []
    try:
        for step in range(STEPS):
            if step + 1 in skip_data:
                continue
            xs, ys = x[step, rows], y[step, rows]
            for i in (0, 64):
                with run.micro_step() as ms:
                    loss = F.cross_entropy(run.model(xs[i:i + 64]), ys[i:i + 64])
                    if step + 1 in bad and i == 0 and world.rank == bad_rank:
                        loss = loss * math.nan
                    ms.backward(loss)
            skipped.append(ms.skipped)
        _ = run.stats  # where a device check is looked at, at the latest
    except NonFiniteLossError as e:
        error = str(e)
    return error, [p.detach().clone() for p in run.module.parameters()], run, skipped


def _finite(weights):
    return all(torch.isfinite(w).all() for w in weights)


def test_the_default_stops_naming_the_step_before_it_touches_a_weight():
    error, weights, run, _ = _loop("default")
    assert error == f"non-finite loss at optimizer step {BAD} (nan_policy=stop); " \
                    "its update was not applied"
    assert _finite(weights) and run.step == BAD - 1 and run.micro == 0
    # Exactly the weights of a clean run stopped before that step.
    _, clean, _, _ = _loop(None, skip_data=range(BAD, STEPS + 1))
    torch.testing.assert_close(weights, clean, rtol=0, atol=0)


def test_skip_drops_the_step_and_counts_it():
    error, weights, run, skipped = _loop("skip")
    assert error is None and _finite(weights)
    assert skipped == [False, False, True, False]
    assert run.nonfinite_skipped_steps == 1 and run.stats["nonfinite_skipped_steps"] == 1
    assert run.step == STEPS - 1  # the schedule stays on a skipped step
    # The same as a run that never saw that step's data.
    _, clean, _, _ = _loop(None, skip_data=(BAD,))
    torch.testing.assert_close(weights, clean, rtol=0, atol=0)
    state = run.state_dict()["extra"]["nonfinite"]
    assert state == {"skipped": 1, "consecutive": 0}


def test_skip_gives_up_after_the_limit_of_consecutive_steps():
    bad = range(1, MAX_NONFINITE_SKIPS + 1)
    run = prepare(make_model(), strategy("sgd", global_batch=64), total_steps=20, world=World(),
                  nan_policy="skip")
    x, y = make_data(steps=1, n=64)
    with pytest.raises(NonFiniteLossError, match=f"at {MAX_NONFINITE_SKIPS} consecutive "
                       f"optimizer steps, the last at step 1 \\(nan_policy=skip\\)"):
        for _ in bad:
            with run.micro_step() as ms:
                ms.backward(F.cross_entropy(run.model(x[0]), y[0]) * math.nan)
    assert _finite(run.module.parameters())


def test_off_and_a_bad_value():
    error, weights, _, _ = _loop(None)
    assert error is None and not _finite(weights)  # the old behaviour, asked for
    with pytest.raises(ConfigError, match="nan_policy='ignore' is not valid; allowed: stop, skip"):
        prepare(make_model(), strategy("sgd"), total_steps=2, world=World(), nan_policy="ignore")


def test_the_device_check_skips_in_the_optimizer_and_raises_when_looked_at():
    error, weights, run, skipped = _loop("default", on_device=True)
    assert error == f"non-finite loss at optimizer step {BAD} (nan_policy=stop); " \
                    "its update was not applied"
    assert _finite(weights) and run.step == BAD  # raised at the next step's finish
    error, weights, run, skipped = _loop("skip", on_device=True)
    assert error is None and _finite(weights) and skipped == [False] * STEPS
    assert run.nonfinite_skipped_steps == 1
    assert run.step == STEPS and run.skipped_steps == 1  # as an fp16 overflow on the device


def _ranks(policy):
    world = World.from_env()
    error, weights, run, skipped = _loop(policy, world=world, bad_rank=1)
    count = run.nonfinite_skipped_steps if error is None else None
    run.close()
    return error, weights, skipped, count


@pytest.mark.parametrize("policy", ["default", "skip"])
def test_two_ranks_decide_alike_when_one_sees_the_nan(policy):
    results = run_workers(_ranks, world_size=2, args=(policy,), timeout=60)
    (e0, w0, s0, c0), (e1, w1, s1, c1) = results
    assert e0 == e1 and s0 == s1 and c0 == c1
    torch.testing.assert_close(w0, w1, rtol=0, atol=0)
    assert _finite(w0)
    if policy == "default":
        assert e0 == f"non-finite loss at optimizer step {BAD} (nan_policy=stop); " \
                     "its update was not applied"
    else:
        assert e0 is None and c0 == 1 and s0 == [False, False, True, False]

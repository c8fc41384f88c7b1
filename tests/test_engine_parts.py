"""The engine's parts, each the one owner of its state.

- `ScheduleClock` is the only writer of the LR: whatever moves it (a step, AdaScale's
  gain, a policy's scale, a batch change, a resume) the optimizer's groups hold
  ``schedule.lr(progress) * lr_scale`` after `apply`.
- `MergeWindow` decides when gradients sync and how losses are scaled, and its state
  round-trips mid-window.
- The code keeps the rule: no part stores the run, nothing outside ``engine/run.py``
  reads `Run`'s private attributes, and one function clips.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from bigbatch.config.schedules import Schedule
from bigbatch.engine.clock import ScheduleClock
from bigbatch.engine.merge import MergeWindow
from bigbatch.errors import ConfigError
from bigbatch.optim.clip import clip_factor, clip_grads_

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "bigbatch"


def _opt(scales=(1.0, 0.5)):
    groups = [{"params": [torch.nn.Parameter(torch.ones(2))], "lr_scale": s} for s in scales]
    return torch.optim.SGD(groups, lr=0.0)


def _schedule(**kw):
    base = {"peak_lr": 1.0, "warmup_steps": 4, "total_steps": 20, "decay": "cosine",
            "warmup_start_lr": 0.1}
    return Schedule(**{**base, **kw})


def _lrs(opt):
    return [g["lr"] for g in opt.param_groups]


def test_clock_writes_schedule_times_scale_into_every_group():
    opt = _opt()
    clock = ScheduleClock(_schedule(), opt, total_steps=20, unit_batch_size=64)
    assert _lrs(opt) == [pytest.approx(0.1), pytest.approx(0.05)]  # written at once
    for _ in range(3):
        clock.advance()
    clock.set_gain(2.0, 1.5)  # AdaScale: LR x gain, progress counts the gain
    clock.advance()
    assert clock.step == 4 and clock.progress == pytest.approx(4.5)
    lr = clock.apply()
    assert lr == pytest.approx(_schedule().lr(4.5) * 2.0) == clock.last_lr
    assert _lrs(opt) == [pytest.approx(lr), pytest.approx(lr * 0.5)]
    clock.set_lr_scale(0.25)  # a policy: effective from the next apply
    assert _lrs(opt)[0] == pytest.approx(lr)
    assert clock.apply() == pytest.approx(_schedule().lr(4.5) * 0.25)


def test_clock_skip_leaves_the_schedule_and_done_follows_progress():
    clock = ScheduleClock(_schedule(), _opt(), total_steps=2, unit_batch_size=8)
    clock.skip()
    assert (clock.step, clock.skipped_steps, clock.progress, clock.done) == (0, 1, 0.0, False)
    clock.advance()
    clock.advance()
    assert clock.done


def test_clock_rescale_repeaks_and_counts_samples():
    class Plan:
        peak_lr, global_batch_size = 4.0, 256

    class Batch:
        base_lr, warmup_start = 1.0, "base"

    class Strategy:
        batch = Batch()

    clock = ScheduleClock(_schedule(), _opt(), total_steps=20, unit_batch_size=64)
    clock.rescale(Plan(), Strategy())
    assert clock.schedule.peak_lr == 4.0 and clock.progress_rate == 4.0
    assert clock.schedule.warmup_steps == 4  # the configured warmup is kept


def test_clock_state_round_trip_writes_the_lr_again():
    opt = _opt()
    a = ScheduleClock(_schedule(), opt, total_steps=20, unit_batch_size=64)
    for _ in range(7):
        a.advance()
    a.set_gain(1.5, 1.25)
    a.advance()
    a.skip()
    opt2 = _opt()
    b = ScheduleClock(_schedule(), opt2, total_steps=20, unit_batch_size=64)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert b.apply() == a.apply() and _lrs(opt2) == _lrs(opt)


class _DDP:
    def __init__(self):
        self.entered = 0

    def no_sync(self):
        ddp = self

        class Ctx:
            def __enter__(self):
                ddp.entered += 1

            def __exit__(self, *a):
                return False

        return Ctx()


class _FSDP:
    def __init__(self):
        self.calls = []

    def set_requires_gradient_sync(self, flag):
        self.calls.append(flag)


def _window(k=3, **kw):
    p = torch.nn.Parameter(torch.zeros(3))
    base = {"k_steps": k, "micro_batch_size": 4, "avg": True, "data_rank": 0, "params": [p],
            "device": torch.device("cpu"), "distributed": False}
    return MergeWindow(**{**base, **kw}), p


def test_window_holds_back_sync_until_its_last_micro_step():
    ddp, fsdp = _DDP(), _FSDP()
    window, _ = _window(k=3, ddp=ddp, fsdp=fsdp)
    sync = []
    for _ in range(3):
        contexts = window.sync_contexts()
        sync.append(not contexts)
        window.loss_multiplier(None)
        if not window.is_last:
            window.end_micro()
    assert sync == [False, False, True] and fsdp.calls == [False, False, True]
    assert ddp.no_sync() is not None and window.mean_mult == pytest.approx(1 / 3)


def test_window_refuses_mixed_losses_and_sums_counts():
    window, _ = _window(k=2)
    assert window.loss_multiplier(torch.tensor(5)) == pytest.approx(1 / 4)
    with pytest.raises(ConfigError, match="mixing count= and mean losses"):
        window.loss_multiplier(None)
    window.end_micro()
    window.loss_multiplier(3.0)
    assert float(window.total_count()) == 8.0
    # data degree 2, avg: 2 / (1/4 * 8)
    assert float(window.grad_factor(2)) == pytest.approx(1.0)


def test_window_state_round_trips_mid_window():
    window, p = _window(k=3)
    window.loss_multiplier(6.0)
    p.grad = torch.arange(3.0)
    window.end_micro()
    state = window.state_dict()
    assert state["micro"] == 1 and state["window"]["count"] == 6.0
    other, q = _window(k=3)
    other.load_window(state)
    assert (other.micro, other.mode, other.count) == (1, "count", 6.0)
    assert torch.equal(q.grad, p.grad) and q.grad is not p.grad


def test_window_even_micro_batches_after_a_change_of_workers():
    window, _ = _window(k=1)
    window.load_micro_batch_sizes([3, 5], data_degree=2)
    assert window.micro_batch_sizes == [3, 5] and window.mean_mult == pytest.approx(3 / 4)
    window.load_micro_batch_sizes([2, 2, 4], data_degree=2)  # moved: stays as it was
    assert window.micro_batch_sizes == [3, 5]
    window.resize(8, 2)
    assert window.micro_batch_sizes is None


def test_clip_scales_onto_the_bound_and_never_up():
    grads = [torch.full((4,), 3.0), torch.full((2,), 4.0)]
    norm = torch.linalg.vector_norm(torch.cat(grads))
    clip_grads_(grads, norm, 2.0)
    assert float(torch.linalg.vector_norm(torch.cat(grads))) == pytest.approx(2.0)
    assert float(clip_factor(torch.tensor(1.0), 2.0)) == 1.0


# ----------------------------------------------------------------- the rule, kept


def _sources():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_nothing_outside_run_py_reads_runs_private_attributes():
    offenders = []
    for path in _sources():
        if path.relative_to(PACKAGE).as_posix() == "engine/run.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in ("run", "r")):
                offenders.append(f"{path.name}:{node.lineno} run.{node.attr}")
    assert offenders == []


def test_no_engine_part_stores_the_run():
    """Parts get the components they change; `BoundPolicies` is `run.policies`' short-lived
    view, made on each access."""
    offenders = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    names = target.elts if isinstance(target, ast.Tuple) else [target]
                    for t in names:
                        if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                and t.value.id == "self" and t.attr in ("run", "_run")):
                            offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    allowed = {"engine/policies.py",  # BoundPolicies, the view
               "train/trainer.py", "train/ps_driver.py"}  # the loops that own their run
    assert [o for o in offenders if o.split(":")[0] not in allowed] == []


def test_the_clock_is_the_only_writer_of_the_lr():
    writers = []
    for path in _sources():
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    # group["lr"] = ... (a config dict's d["adaptive"]["lr"] is no LR)
                    if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
                            and isinstance(t.slice, ast.Constant) and t.slice.value == "lr"):
                        writers.append(rel)
    # Schedule.apply is the plain-loop helper for users without a Run; optimizers
    # only read their groups; integrations/ sets and restores the LR of another
    # trainer's optimizer around a range test (no bigbatch clock drives it).
    assert sorted(set(writers)) == ["config/schedules.py", "engine/clock.py",
                                    "integrations/probe.py"]


def test_an_optimizer_error_names_the_parameter():
    from bigbatch.engine.step import optimizer_step

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    # Transposed, as a layout mistake leaves it (torch's setter would refuse a plain one).
    model[1].weight.grad.data = torch.ones(2, 1)
    with pytest.raises(RuntimeError, match=r"1\.weight \(weight \(1, 2\), gradient \(2, 1\)\)"):
        optimizer_step(opt, model.named_parameters)

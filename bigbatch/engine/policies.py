"""Policies on the engine: loading them, running their hooks, their state, what they ask for.

`attach(run, policies)` gives the run `run.policies` (a `Policies`): the engine
calls every policy's ``after_step`` after each optimizer step taken; the training
loop calls the others (``before_train``, ``before_epoch(epoch)``, ``after_epoch(epoch)``,
``after_train``), as `bigbatch train` does::

    run.policies.before_train()
    for epoch in range(1, epochs + 1):
        run.policies.before_epoch(epoch)         # the batch may change here: follow run.plan
        for ...: with run.micro_step() as ms: ...
        run.policies.after_epoch(epoch)
        if run.policies.stop is not None: ...    # checkpoint, then end
    run.policies.after_train()

Each of these runs once per epoch (or training) even across a resume: the calls
already made are part of the saved state. A hook that raises ends the run with a
`PolicyError` naming the policy and the hook (the CLI prints one line, exit 2).

Built-in policies: ``goodput`` (the `[adaptive]` goodput batch size), ``noise_scale_doubling``
(KungFu's, `bigbatch.adaptive.doubling`), ``straggler`` (`bigbatch.engine.straggler`) and
``sync_switch`` (`bigbatch.engine.sync_switch`).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch.distributed as dist

from bigbatch.adaptive.doubling import NoiseScaleDoubler
from bigbatch.adaptive.policy import Policy
from bigbatch.config.fields import format_literal
from bigbatch.config.schedules import growth_of
from bigbatch.engine.adaptive import MAX_BATCH_FACTOR
from bigbatch.errors import ConfigError, PolicyError, PolicyStop
from bigbatch.parallel.world import is_peer_failure

__all__ = ["GoodputPolicy", "NoiseScaleDoublingPolicy", "Policies", "attach", "load_policy"]

log = logging.getLogger("bigbatch.adaptive")

class GoodputPolicy(Policy):
    """``goodput``: every `adaptive.interval_steps`, Pollux's tuner may move the batch
    (`bigbatch.engine.adaptive.Adaptive.on_step`, whose state is the controller's)."""

    name = "goodput"

    def setup(self, run: Any) -> None:
        if run.adaptive is None or run.adaptive.tuner is None:
            raise ConfigError('the goodput policy needs adaptive.batch_size = "goodput" '
                              '(or "goodput" in adaptive.policies) in the strategy')

    def after_step(self, run: Any, stats: dict[str, float]) -> None:
        run.adaptive.on_step(run)


class NoiseScaleDoublingPolicy(Policy):
    """``noise_scale_doubling``: every `adaptive.interval_steps`, double the global batch once
    the noise scale has doubled since the batch was last set (`NoiseScaleDoubler`), up to
    `adaptive.max_batch_size` (default 32x the configured batch, and the data set).
    The micro batch grows up to the configured one (memory), merge steps beyond."""

    name = "noise_scale_doubling"

    def __init__(self, interval_steps: int = 100, max_batch_size: int | None = None) -> None:
        self.interval_steps = int(interval_steps)
        self.max_batch_size = max_batch_size
        self.doubler: NoiseScaleDoubler | None = None
        self._max_micro = 0

    @classmethod
    def from_strategy(cls, strategy: Any) -> NoiseScaleDoublingPolicy:
        a = strategy.adaptive
        return cls(a.interval_steps, a.max_batch_size)

    def setup(self, run: Any) -> None:
        if run.adaptive is None:
            raise ConfigError("noise_scale_doubling needs the noise scale: put it in "
                              "adaptive.policies (which tracks it) rather than only in prepare()")
        try:  # bounds from the configured batch, not from one a resume restored
            configured = run.strategy.resolve(run.mesh.data_degree)
        except ConfigError:
            configured = run.plan
        hi = self.max_batch_size or configured.global_batch_size * MAX_BATCH_FACTOR
        self.doubler = NoiseScaleDoubler(hi)
        self._max_micro = max(configured.micro_batch_size, run.plan.micro_batch_size)

    def after_step(self, run: Any, stats: dict[str, float]) -> None:
        if run.step % self.interval_steps:
            return
        ctl = run.adaptive
        ctl.flush()
        noise = [float(ctl.tracker.b_simple)]
        if run.world.is_distributed and dist.is_initialized():
            dist.broadcast_object_list(noise, src=0)  # one decision for every worker
        self.doubler.max_batch_size = min(self.doubler.max_batch_size, ctl.batch_limit)
        new = self.doubler.decide(noise[0], run.plan.global_batch_size)
        if new is None:
            return
        old = run.plan.global_batch_size
        m, k = run.batch.double(self._max_micro)
        reason = (f"noise scale {noise[0]:.4g} doubled since the batch was set: global batch "
                  f"{old} -> {run.plan.global_batch_size} (micro {m} x {k} steps)")
        run.batch_size_changes.append({"step": run.step, "old": old,
                                       "new": run.plan.global_batch_size, "micro_batch_size": m,
                                       "k_steps": k, "reason": reason})
        if run.world.is_main:
            log.info("step %d: %s", run.step, reason)

    def state_dict(self) -> dict[str, Any]:
        return self.doubler.state_dict() if self.doubler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.doubler is not None and state:
            self.doubler.load_state_dict(state)


def _builtin(name: str) -> type[Policy]:
    if name == "straggler":
        from bigbatch.engine.straggler import Straggler

        return Straggler
    if name == "sync_switch":
        from bigbatch.engine.sync_switch import SyncSwitch

        return SyncSwitch
    return {"goodput": GoodputPolicy, "noise_scale_doubling": NoiseScaleDoublingPolicy}[name]


def load_policy(spec: str, strategy: Any) -> Policy:
    """The policy a config names: a built-in name or ``"package.module:Class"``, built with
    ``Class.from_strategy(strategy)``; a `PolicyError` (one line) when it cannot be."""
    from bigbatch.config.sections import BUILTIN_POLICIES

    if spec in BUILTIN_POLICIES:
        cls: Any = _builtin(spec)
    else:
        module_name, colon, cls_name = spec.partition(":")
        if not colon or not module_name or not cls_name:
            raise PolicyError(f"policy {spec!r}: expected a built-in name "
                              f"({', '.join(BUILTIN_POLICIES)}) or \"package.module:Class\"")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # noqa: BLE001 - any import failure is the user's path
            raise PolicyError(f"policy {spec!r}: cannot import {module_name}: "
                              f"{_one_line(e)}") from None
        cls = getattr(module, cls_name, None)
        if cls is None:
            raise PolicyError(f"policy {spec!r}: module {module_name} has no {cls_name}")
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise PolicyError(f"policy {spec!r}: {getattr(cls, '__name__', cls)!s} is not a "
                          "subclass of bigbatch.Policy")
    try:
        policy = cls.from_strategy(strategy)
    except Exception as e:  # noqa: BLE001
        raise PolicyError(f"policy {spec!r}: building it raised {_one_line(e)}") from None
    if not isinstance(policy, Policy):
        raise PolicyError(f"policy {spec!r}: from_strategy returned {type(policy).__name__}, "
                          "not a bigbatch.Policy")
    if not policy.name:
        policy.name = spec
    return policy


def _literal(value: Any) -> bool:
    if isinstance(value, list | tuple):
        return all(_literal(v) and not isinstance(v, list | tuple) for v in value)
    return isinstance(value, str | bool | int | float)


def _one_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class Policies:
    """The run's policies in order, their hooks, and their requests.

    `run.policies` is this object bound to its run (`bound`): the loop calls
    ``run.policies.before_epoch(epoch)`` and the like. `stop` (None, or
    ``(message, status)``) and `checkpoint_requested` are what the policies asked
    for; `take_records()` hands over the lines they want in the metrics.
    """

    def __init__(self, policies: list[Policy]) -> None:
        self.policies = list(policies)
        names = [p.name or type(p).__name__ for p in self.policies]
        for p, name in zip(self.policies, names, strict=True):
            p.name = name
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise PolicyError(f"two policies are named {sorted(dup)[0]!r}; give one another "
                              "`name`")
        self.stop: tuple[str, int] | None = None
        """``(message, exit status)`` once a policy asked to end the run."""
        self.checkpoint_requested = False
        """A policy asked for a checkpoint now (the loop clears it when written)."""
        self.relaunch: dict[str, Any] | None = None
        """Strategy keys (``"section.key"`` -> value) a policy asked the run to resume with
        (`request_relaunch`)."""
        self._records: list[dict[str, Any]] = []
        self._began = self._ended = False
        self._epoch_begun = self._epoch_ended = 0

    def bound(self, run: Any) -> BoundPolicies:
        """This object with `run` passed to every hook (what `run.policies` returns)."""
        return BoundPolicies(self, run)

    def __len__(self) -> int:
        return len(self.policies)

    def __iter__(self):
        return iter(self.policies)

    def get(self, name: str) -> Policy | None:
        return next((p for p in self.policies if p.name == name), None)

    # ------------------------------------------------------------- what policies ask for

    def request_checkpoint(self) -> None:
        self.checkpoint_requested = True

    def request_stop(self, message: str, status: int = 0) -> None:
        """End the run after a checkpoint; the CLI prints `message` and exits with `status`."""
        if self.stop is None:
            self.stop = (str(message), int(status))

    def request_relaunch(self, changes: dict[str, Any], message: str) -> None:
        """End the run after a checkpoint and have it resumed from that checkpoint with the
        strategy keys `changes` set (``{"data_parallel.reduce": "powersgd"}``): a change a
        resume accepts (`bigbatch.train.resume`) but the running job cannot make in place.
        `bigbatch train --nproc N` (N >= 2) and ``MIN:MAX`` relaunch at once, as
        ``--resume --set KEY=VALUE``; anything else (one process, a torchrun of your own)
        just stops, and the stop's line gives those flags. Values are TOML-literal types
        (str, bool, int, float, lists of them)."""
        if not changes or not all(isinstance(k, str) and k.count(".") == 1 for k in changes):
            raise PolicyError(f"request_relaunch({changes!r}): expected "
                              '{"section.key": value, ...} with at least one key')
        for key, value in changes.items():
            if not _literal(value):
                raise PolicyError(f"request_relaunch: {key} = {value!r} is not a TOML literal "
                                  "(str, bool, int, float or a list of them)")
        if self.stop is None:
            self.relaunch = dict(changes)
            sets = " ".join(f"--set {k}={format_literal(v)}" for k, v in changes.items())
            self.request_stop(f"{message}; resume with --resume {sets}", 0)

    def record(self, entry: dict[str, Any]) -> None:
        """A line for `metrics.jsonl` (``kind`` and ``step`` first; rank 0 writes it)."""
        self._records.append(dict(entry))

    def take_records(self) -> list[dict[str, Any]]:
        out, self._records = self._records, []
        return out

    # ------------------------------------------------------------- hooks (given the run)

    def setup(self, run: Any) -> None:
        for p in self.policies:
            self._call(run, p, "setup")

    def before_train(self, run: Any) -> None:
        if not self._began:
            self._began = True
            for p in self.policies:
                self._call(run, p, "before_train")

    def before_epoch(self, run: Any, epoch: int) -> None:
        if epoch > self._epoch_begun:
            self._epoch_begun = epoch
            for p in self.policies:
                self._call(run, p, "before_epoch", epoch)

    def after_step(self, run: Any) -> None:
        """The engine's step hook (every optimizer step taken)."""
        stats = {"step": run.step, "lr": run.last_lr,
                 "global_batch_size": run.plan.global_batch_size,
                 "micro_batch_size": run.plan.micro_batch_size, "k_steps": run.k_steps,
                 "progress": run.progress, "step_seconds": run.last_step_seconds}
        for p in self.policies:
            self._call(run, p, "after_step", stats)

    def after_epoch(self, run: Any, epoch: int) -> None:
        if epoch > self._epoch_ended:
            self._epoch_ended = epoch
            for p in self.policies:
                self._call(run, p, "after_epoch", epoch)

    def after_train(self, run: Any) -> None:
        if not self._ended:
            self._ended = True
            for p in self.policies:
                self._call(run, p, "after_train")

    def _call(self, run: Any, policy: Policy, hook: str, *args: Any) -> None:
        before = run.plan
        changes = len(run.batch_size_changes)
        try:
            getattr(policy, hook)(run, *args)
        except (PolicyStop, PolicyError):
            raise
        except Exception as e:
            if is_peer_failure(e):  # a dead or hung peer, not the policy's fault
                raise
            shown = ", ".join(repr(a) for a in args if not isinstance(a, dict))
            raise PolicyError(f"policy {policy.name!r}: {hook}({shown}) raised "
                              f"{_one_line(e)}") from e
        if run.plan != before:
            self._batch_changed(run, policy, hook, before, changes)

    def _batch_changed(self, run: Any, policy: Policy, hook: str, before: Any,
                       changes: int) -> None:
        if run.pipeline is not None:  # its schedules are built for one micro-batch count
            raise PolicyError(
                f"policy {policy.name!r}: {hook} changed the batch, which [pipeline] keeps "
                "fixed; train without [pipeline]")
        if len(run.batch_size_changes) == changes:  # the policy set it directly: say so
            run.batch_size_changes.append({
                "step": run.step, "old": before.global_batch_size,
                "new": run.plan.global_batch_size, "micro_batch_size": run.plan.micro_batch_size,
                "k_steps": run.k_steps, "reason": f"policy {policy.name} ({hook})"})
        for change in run.batch_size_changes[changes:]:
            self.record({"kind": "batch_size", **change})

    # ------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        return {"policies": {p.name: p.state_dict() for p in self.policies},
                "began": self._began, "ended": self._ended,
                "epoch_begun": self._epoch_begun, "epoch_ended": self._epoch_ended}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("policies", {})
        for p in self.policies:
            if p.name in saved:
                try:
                    p.load_state_dict(saved[p.name])
                except Exception as e:
                    raise PolicyError(f"policy {p.name!r}: load_state_dict raised "
                                      f"{_one_line(e)}") from e
        self._began = bool(state.get("began", False))
        self._ended = bool(state.get("ended", False))
        self._epoch_begun = int(state.get("epoch_begun", 0))
        self._epoch_ended = int(state.get("epoch_ended", 0))


class BoundPolicies:
    """`run.policies`: a short-lived view of `Policies` that passes the run to each hook.

    Everything else (``stop``, ``get``, ``record``, ``request_stop``, ``len``, ...)
    is the `Policies` object's own.
    """

    __slots__ = ("_policies", "_run")

    def __init__(self, policies: Policies, run: Any) -> None:
        self._policies, self._run = policies, run

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policies, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__slots__:
            object.__setattr__(self, name, value)
        else:
            setattr(self._policies, name, value)

    def __len__(self) -> int:
        return len(self._policies)

    def __iter__(self):
        return iter(self._policies)

    def setup(self) -> None:
        self._policies.setup(self._run)

    def before_train(self) -> None:
        self._policies.before_train(self._run)

    def before_epoch(self, epoch: int) -> None:
        self._policies.before_epoch(self._run, epoch)

    def after_step(self, run: Any = None) -> None:
        self._policies.after_step(self._run if run is None else run)

    def after_epoch(self, epoch: int) -> None:
        self._policies.after_epoch(self._run, epoch)

    def after_train(self) -> None:
        self._policies.after_train(self._run)


def attach(run: Any, given: list[Any] | None = None) -> Policies:
    """Build `run.policies` from ``[adaptive] policies`` (goodput also from ``batch_size``)
    and `given` (Policy objects); register the step hook and the state; run `setup`."""
    a = run.strategy.adaptive
    specs = list(a.policies)
    if a.goodput and "goodput" not in specs:
        specs.insert(0, "goodput")
    policies = [load_policy(s, run.strategy) for s in specs]
    if growth_of(run.strategy) != "fixed":  # batch.schedule's own policy, first
        from bigbatch.engine.batch_schedule import BatchSchedulePolicy

        policies.insert(0, BatchSchedulePolicy.from_strategy(run.strategy))
    from bigbatch.adaptive.autoscale import segment_policy

    if (segment := segment_policy()) is not None:  # a measured segment of `--nproc MIN:MAX`
        policies.append(segment)
    for p in given or []:
        if not isinstance(p, Policy):
            raise PolicyError(f"prepare(policies=...): {p!r} is not a bigbatch.Policy (a "
                              "name belongs in adaptive.policies)")
        policies.append(p)
    ctl = Policies(policies)
    run.policies = ctl
    if policies:
        run.step_hooks.append(ctl.after_step)
        run.state_objects["policies"] = ctl
        ctl.setup(run)
    return ctl

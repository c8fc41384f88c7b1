"""`Policy`: adaptation written as hooks around the training loop (KungFu's policies,
Mai et al. 2020, "KungFu: Making Training in Distributed Machine Learning Adaptive").

A policy watches the run and acts on it between steps::

    class DoubleAtEpoch2(bigbatch.Policy):
        def before_epoch(self, run, epoch):
            if epoch == 2:
                run.set_batch(run.plan.micro_batch_size, 2 * run.k_steps)

Hooks, all optional (`run` is the engine's `Run`):

- ``setup(run)``: when the policy joins a run, in every process start, resumes
  included (install measurement hooks here; no collectives);
- ``before_train(run)`` and ``after_train(run)``: once per training, not again on resume;
- ``before_epoch(run, epoch)`` and ``after_epoch(run, epoch)``: epochs are numbered from 1;
  ``after_epoch(run, 1)`` runs when the first epoch ends;
- ``after_step(run, stats)``: after every optimizer step taken; `stats` holds ``step``,
  ``lr``, ``global_batch_size``, ``micro_batch_size``, ``k_steps``, ``progress`` and
  ``step_seconds`` (read `run.stats` for the gradient statistics).

What a hook may do: change the batch (`run.set_batch`), scale the LR (`run.lr_scale`),
ask for a checkpoint (`run.policies.request_checkpoint()`) or end the run after one
(`run.policies.request_stop(message, status)`). Every worker runs every hook, so a
decision must be the same on all of them (decide on gathered or broadcast numbers).

State: what `state_dict()` returns is saved in `run.state_dict()` and given back to
`load_state_dict()` on resume. A policy is loaded by name from
``[adaptive] policies = ["package.module:Class"]`` (built with `from_strategy`), or
passed to ``prepare(..., policies=[...])``.

Pure: this module imports nothing but the standard library.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Policy"]


class Policy:
    """Base class of a policy: every hook does nothing; override the ones you need."""

    name: str = ""
    """Shown in errors and used as the key of its state; empty: the class name."""

    @classmethod
    def from_strategy(cls, strategy: Any) -> Policy:
        """The policy for a run of `strategy` (loaded from a config); default: ``cls()``."""
        return cls()

    def setup(self, run: Any) -> None:
        """The policy joins `run` (every start, resume included)."""

    def before_train(self, run: Any) -> None:
        """Training starts (once; a resumed run does not call it again)."""

    def before_epoch(self, run: Any, epoch: int) -> None:
        """Epoch `epoch` (from 1) starts."""

    def after_step(self, run: Any, stats: dict[str, float]) -> None:
        """An optimizer step was taken (skipped steps do not count)."""

    def after_epoch(self, run: Any, epoch: int) -> None:
        """Epoch `epoch` (from 1) ended."""

    def after_train(self, run: Any) -> None:
        """Training ended (before the final checkpoint)."""

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs (plain data and tensors)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict()` returned."""

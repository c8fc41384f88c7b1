"""Policies as a user writes them, loaded by name ("tests.user_policies:Class") in the
tests of `bigbatch.Policy` (also inside torchrun's workers: this module imports only bigbatch)."""

import os

import bigbatch


class DoubleAtEpoch2(bigbatch.Policy):
    """Doubles the global batch when epoch 2 begins; remembers every hook call."""

    def __init__(self) -> None:
        self.calls: list[list] = []

    def before_train(self, run):
        self.calls.append(["before_train", run.step])

    def before_epoch(self, run, epoch):
        self.calls.append(["before_epoch", epoch, run.step])
        if epoch == 2:
            run.set_batch(run.plan.micro_batch_size, 2 * run.k_steps)

    def after_epoch(self, run, epoch):
        self.calls.append(["after_epoch", epoch, run.step])

    def after_train(self, run):
        self.calls.append(["after_train", run.step])

    def state_dict(self):
        return {"calls": [list(c) for c in self.calls]}

    def load_state_dict(self, state):
        self.calls = [list(c) for c in state["calls"]]


class Raises(bigbatch.Policy):
    def after_epoch(self, run, epoch):
        raise ValueError("no epochs for me")


class NotAPolicy:
    pass


class StopAt3(bigbatch.Policy):
    def after_step(self, run, stats):
        if run.step == 3:
            run.policies.request_stop("stop: asked by the test at step 3", 75)


class CompressAt6(bigbatch.Policy):
    """Switches the run to PowerSGD at step 6 through a checkpoint and a relaunch
    (`request_relaunch`); with BIGBATCH_TEST_STOP_ONLY set it only stops there, for the
    same switch made by hand."""

    def after_step(self, run, stats):
        if run.step != 6 or run.strategy.data_parallel.reduce == "powersgd":
            return
        if os.environ.get("BIGBATCH_TEST_STOP_ONLY"):
            run.policies.request_stop("stopped at step 6 by the test", 0)
        else:
            run.policies.request_relaunch({"data_parallel.reduce": "powersgd"},
                                          "compress: asked by the test at step 6")

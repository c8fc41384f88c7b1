"""The engine: a Strategy applied to your own training loop (Fleet's `distributed_optimizer`).

`prepare()` turns a model and a Strategy into a `Run` that owns the micro-step
(gradient merge, AMP and loss scaling, clipping, the optimizer step and the
learning rate), the gradient statistics and the `[adaptive]` controller.

A plain PyTorch loop::

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in loader:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

becomes (launch with `torchrun --nproc-per-node N train.py`, or plain `python` for one process)::

    import bigbatch

    model = Net()
    run = bigbatch.prepare(model, bigbatch.Strategy.from_toml("strategy.toml"), total_steps=10_000)
    sampler = DistributedSampler(data, run.world.world_size, run.world.rank)
    loader = DataLoader(data, batch_size=run.plan.micro_batch_size, sampler=sampler)
    for x, y in loader:
        x, y = x.to(run.world.device), y.to(run.world.device)
        with run.micro_step() as ms:                  # autocast; no_sync but on the k-th
            loss = F.cross_entropy(run.model(x), y)
            ms.backward(loss)                         # merge, loss scaling, step, LR
    run.close()

For a summed loss over a variable number of items (tokens), pass the count and
the merged step is exactly one step on the big batch::

            loss = F.cross_entropy(logits, targets, reduction="sum", ignore_index=-100)
            ms.backward(loss, count=(targets != -100).sum())

Gradient semantics per optimizer step (k micro-steps, W workers):
- `ms.backward(loss)` with a per-micro-batch *mean* loss: the optimizer sees the
  mean over workers of the mean of the k micro-step gradients (`gradient_merge.avg
  = true`) or of their sum (`avg = false`, Fleet's semantics).
- `ms.backward(loss, count=n)` with a *summed* loss: the optimizer sees the sum
  over all micro-steps and workers divided by the total count (one scalar
  all-reduce per step); `avg = false` multiplies that by k, as for mean losses.

BatchNorm under gradient merge normalises each micro-batch on its own and its
running statistics advance once per micro-step; SyncBatchNorm
(`data_parallel.sync_batch_norm`) synchronises over workers but never over
micro-steps. Use a model without BatchNorm where exact big-batch equivalence matters.

Models that do not fit one worker: `[sharding]` and `[tensor_parallel]` need no change
to the loop (pass `prepare(..., tp_plan=...)` for tensor parallelism; `run.module`
then holds DTensors, and `run.mesh` says where this rank sits). With `[pipeline]`,
`run.module` is this rank's stage and one call per optimizer step replaces the
micro-steps (every rank calls it; inputs matter on the first stage, targets on the
last)::

    total, count = run.pipeline_step(x, y, lambda out, y: (F.cross_entropy(
        out.flatten(0, 1), y.flatten(), reduction="sum"), y.numel()))

Training length and the `[adaptive]` section (glue in `bigbatch.engine.adaptive`):

- The schedule is read at `run.progress`, which advances by `run.progress_rate`
  per optimizer step; loop `while not run.done` (``progress >= total_steps``).
  Without adaptive methods progress == step. With ``lr = "adascale"`` the rate is
  AdaScale's gain and `total_steps` / `steps_per_epoch` count *scale-1 steps*
  (steps at `batch.base_batch_size`); `schedule_steps()` computes both.
- ``noise_scale = true`` (implied by adascale and goodput): `run.stats` gains
  ``gns`` (B_simple = tr(Sigma)/|G|^2, in items), ``gns_stderr``, ``gns_sq_norm``,
  ``gns_trace`` and ``gns_biased``; the tracker is `run.adaptive.tracker`.
  Under `[pipeline]` the small batch is the step's first micro-batch and the big one
  the step, both summed over the stages (`bigbatch.engine.pipeline_gns`); AdaScale
  works there, batch changes do not (a ConfigError).
- ``batch_size = "goodput"``: every `interval_steps` the engine may change the
  batch; it then replaces `run.plan` (and `run.k_steps`) *between* optimizer
  steps, right after the step that decided, and appends
  ``{step, old, new, micro_batch_size, k_steps, reason}`` to
  `run.batch_size_changes` (logged on logger ``bigbatch.adaptive``). Step times
  are the seconds inside the step's micro-step blocks (`run.last_step_seconds`:
  forward, backward, sync, optimizer; data loading excluded).
- The noise scale needs the plain mean of the workers' gradients:
  ``data_parallel.reduce = "adasum"`` with any of these is a ConfigError.

Policies (`bigbatch.Policy`, KungFu's hooks; `bigbatch.engine.policies`): ``[adaptive]
policies`` and ``prepare(..., policies=[...])`` give `run.policies`. The engine calls each
policy's ``after_step`` after every step taken; the loop calls ``run.policies.before_epoch(e)``
and the other loop hooks, and honours ``run.policies.stop`` (checkpoint, then end). The
``straggler`` policy (`bigbatch.engine.straggler`) may set `run.micro_batch_sizes`: per-rank
micro batches that the loader must follow (mean losses are then weighted by samples).

The data contract of an adaptive batch size: the loop reads `run.plan` after
every optimizer step (`ms.stepped`) and, when `plan.global_batch_size` or
`plan.micro_batch_size` differ from what its loader yields, rebuilds the loader
for the new global batch of `k_steps` micro-batches of `micro_batch_size` per
worker, keeping its position in the epoch (counted in samples). The micro batch
never exceeds the configured one (the memory limit). After
`run.load_state_dict()` the plan is the checkpoint's: build the loader from
`run.plan`, not from `strategy.resolve()`. Cap the batch at the data set with
`run.adaptive.limit_batch_size(len(train_set))`. The training length stays that
of `total_steps` configured-batch steps (progress advances by
``new_global / configured_global`` per step), so loop on `run.done`.

Less gradient traffic (`bigbatch.parallel.compression`, `bigbatch.parallel.local_sgd`):
`data_parallel.reduce` = fp16, bf16, powersgd or dgc installs that DDP comm hook
inside the engine's; DGC reads `run.grad_factor()` during the last backward and owns
momentum and weight decay (the optimizer is then plain SGD). `[localsgd]` /
`[adaptive_localsgd]` make `run.local_sgd` average weights after the steps it picks;
workers hold different weights in between, so call `run.synchronize()` before
evaluating (`run.state_dict()` calls it, and must come before `model.state_dict()`).
`run.apply_gradients(grads)` steps on gradients computed elsewhere (the parameter
server's servers run their optimizer through it).

How the engine is built (for maintainers). Each piece of a run's state has one owner,
and the helpers get the part they change, never the run:

- `clock.ScheduleClock` (`run.clock`): schedule, progress, step counters; the only writer
  of the LR (`apply`). AdaScale calls `set_gain`, a policy sets `run.lr_scale`.
- `merge.MergeWindow` (`run.window`): micro-step position, loss multipliers and counts,
  DDP's `no_sync` / FSDP2's gradient sync, the first micro-step's norm.
- `batch.BatchControl` (`run.batch`): `plan` and its `changes`; `set` resizes the window,
  re-peaks the clock and tells its listeners (the adaptive controller).
- `step`: the step's stages, normalize -> unscale -> statistics -> clip -> optimizer step
  -> schedule, run in that order by `Run._finish_step`; clipping is `bigbatch.optim.clip`.
- `grad_info`, `adaptive`, `kfac`, `pipeline_gns`, `local_norms`, `policies`: the hooks,
  each built from the clock, window, batch and optimizer it uses.
- `state`: `Run.state_dict()` as each part's state, in the checkpoint's flat layout;
  `saving`: `run.save_state` / `load_state` / `whole_state_dict` (DCP when sharded).
- `parallelize`: a model's (or pipeline stage's) layout on the mesh, tensor parallel ->
  recompute -> FSDP2, from its `bigbatch.ModelPlan`; `prepare` calls it.
"""

from .prepare import prepare
from .run import Run

__all__ = ["Run", "prepare"]

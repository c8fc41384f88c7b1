"""A nanoGPT-style loop on bigbatch: a character-level GPT on the Python stdlib's sources.

    python examples/gpt/train.py --config examples/gpt/adamw_small.toml --tokens 2000000
    python examples/gpt/train.py --config examples/gpt/lamb_16x.toml --tokens 2000000
    python examples/gpt/train.py --config examples/gpt/lamb_16x.toml --lr-find --out runs/lrf
    torchrun --nproc-per-node 2 examples/gpt/train.py --config examples/gpt/lamb_16x.toml

The strategy (TOML) holds what nanoGPT keeps in globals: batch sizes in sequences, the LR,
warmup and decay, the optimizer. bigbatch owns gradient merge (`gradient_accumulation_steps`),
DDP and `no_sync`, autocast, clipping and the LR schedule; the loop keeps the data and the loss.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make `examples.gpt` and `bigbatch` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import bigbatch
from examples.gpt.data import IGNORE_INDEX, CharCorpus
from examples.gpt.model import GPT, GPTConfig

HERE = Path(__file__).resolve().parent
Batch = list[tuple[torch.Tensor, torch.Tensor]]
"""One optimizer step's micro-batches on this rank: k_steps (inputs, targets) pairs."""


def batches(corpus: CharCorpus, run: bigbatch.Run, seed: int) -> Iterator[Batch]:
    """This rank's share of each global batch, for ever.

    Every rank draws the same global batch from one seeded generator and keeps its own
    rows, so the data depend on the seed and the global batch only, not on how many
    workers split it: the run on 2 workers is the run on 1.
    """
    g = torch.Generator().manual_seed(seed)
    block = run.module.cfg.block_size
    while True:
        plan = run.plan  # read per step: a policy may change the batch between steps
        x, y = corpus.sample(g, plan.global_batch_size, block)
        per_rank = plan.micro_batch_size * run.k_steps
        lo = run.mesh.data_rank * per_rank
        x, y = x[lo:lo + per_rank], y[lo:lo + per_rank]
        yield list(zip(x.split(plan.micro_batch_size), y.split(plan.micro_batch_size),
                       strict=True))


def train_step(run: bigbatch.Run, batch: Batch) -> torch.Tensor:
    """One optimizer step: the micro-steps of `batch`. Returns [loss sum, token count] over
    all workers (float64), so every rank logs, and decides, on the same numbers."""
    device = run.world.device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batch:
        x, y = x.to(device), y.to(device)
        with run.micro_step() as ms:
            logits = run.model(x)
            # A sum and a count, not a mean: micro-batches hold different numbers of
            # tokens, and the mean of their means would weight each token by 1/its
            # micro-batch's count. With count= the merged step is the big-batch step.
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum",
                                   ignore_index=IGNORE_INDEX)
            n = (y != IGNORE_INDEX).sum()
            ms.backward(loss, count=n)
        total += torch.stack([loss.detach().double(), n.double()])
    if run.world.is_distributed:
        dist.all_reduce(total, group=run.mesh.dp_group)
    return total


@torch.no_grad()
def evaluate(run: bigbatch.Run, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> float:
    """Mean cross-entropy (nats per character) over the given blocks. Every rank evaluates
    all of them on its own copy of the weights (identical under DDP): no collective."""
    model = run.module  # the model itself, not the DDP wrapper: no gradient sync wanted
    was_training = model.training
    model.eval()
    loss, count = 0.0, 0
    for xb, yb in zip(x.split(batch_size), y.split(batch_size), strict=True):
        xb, yb = xb.to(run.world.device), yb.to(run.world.device)
        with run.autocast():  # the precision training used (a no-op without [amp])
            logits = model(xb)
        loss += float(F.cross_entropy(logits.float().flatten(0, 1), yb.flatten(),
                                      reduction="sum", ignore_index=IGNORE_INDEX))
        count += int((yb != IGNORE_INDEX).sum())
    model.train(was_training)
    return loss / count


def load_strategy(config: str | Path, overrides: list[str] = ()) -> bigbatch.Strategy:
    strategy = bigbatch.Strategy.from_toml(Path(config))
    return strategy.with_overrides(overrides) if overrides else strategy


def steps_for(strategy: bigbatch.Strategy, tokens: int, block_size: int) -> int:
    """Optimizer steps that put `tokens` positions through the model at the strategy's
    global batch (in sequences of `block_size`), so two configs see equal tokens."""
    plan = strategy.resolve(1)  # the global batch does not depend on the world size
    return max(1, math.ceil(tokens / (plan.global_batch_size * block_size)))


def build(strategy: bigbatch.Strategy, corpus: CharCorpus, steps: int, seed: int,
          model_cfg: dict | None = None, dtype: torch.dtype = torch.float32) -> bigbatch.Run:
    torch.manual_seed(seed)  # the same initial weights on every rank (DDP broadcasts anyway)
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, **(model_cfg or {}))).to(dtype)
    return bigbatch.prepare(model, strategy, total_steps=steps)


def train(strategy: bigbatch.Strategy, corpus: CharCorpus, *, steps: int, seed: int = 0,
          model_cfg: dict | None = None, eval_blocks: int = 256, eval_every: int = 0,
          log_every: int = 50, out: Path | None = None, log=print) -> dict:
    """Train for `steps` optimizer steps; returns the numbers the final line prints."""
    run = build(strategy, corpus, steps, seed, model_cfg)
    is_main = run.world.is_main
    block = run.module.cfg.block_size
    xv, yv = corpus.val_blocks(eval_blocks, block)
    eval_batch = run.plan.micro_batch_size
    metrics = None
    if out is not None and is_main:
        out.mkdir(parents=True, exist_ok=True)
        metrics = (out / "metrics.jsonl").open("w")
    if is_main:
        p = run.plan
        log(f"{sum(q.numel() for q in run.module.parameters()):,} parameters; global batch "
            f"{p.global_batch_size} x {block} = {p.global_batch_size * block} positions = "
            f"{p.micro_batch_size} x {run.k_steps} micro-steps x {run.mesh.data_degree} "
            f"worker(s); peak LR {p.peak_lr:.3g} ({run.strategy.optimizer_name()}); {steps} steps")
    tokens, positions, losses, t0 = 0, 0, [], time.perf_counter()
    data = batches(corpus, run, seed)
    while not run.done:
        total = train_step(run, next(data))
        loss_sum, count = total.tolist()
        tokens += int(count)
        positions += run.plan.global_batch_size * block
        losses.append(loss_sum / count)
        row = {"step": run.step, "lr": run.last_lr, "loss": losses[-1], "tokens": tokens}
        if eval_every and run.step % eval_every == 0 and not run.done:
            row["val_loss"] = evaluate(run, xv, yv, eval_batch)
        if is_main and (run.step % log_every == 0 or "val_loss" in row):
            val = f" val {row['val_loss']:.4f}" if "val_loss" in row else ""
            log(f"step {run.step:5d}  lr {run.last_lr:.3g}  loss {losses[-1]:.4f}{val}  "
                f"{tokens / (time.perf_counter() - t0):,.0f} tok/s")
        if metrics is not None:
            metrics.write(json.dumps(row) + "\n")
    val = evaluate(run, xv, yv, eval_batch)
    result = {"config": run.strategy.optimizer_name(), "steps": run.step,
              "global_batch": run.plan.global_batch_size, "peak_lr": run.plan.peak_lr,
              "val_loss": val, "val_bits_per_char": val / math.log(2),
              "first_loss": losses[0], "last_loss": losses[-1], "tokens": tokens,
              "positions": positions, "seconds": time.perf_counter() - t0,
              "workers": run.mesh.data_degree}
    if metrics is not None:
        metrics.close()
        (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
        torch.save(run.module.state_dict(), out / "model.pt")
    run.close()
    return result


def find_lr(strategy: bigbatch.Strategy, corpus: CharCorpus, *, steps: int, lr_min: float,
            lr_max: float, seed: int = 0, model_cfg: dict | None = None,
            out: Path | None = None) -> bigbatch.study.lr_find.LRFind:
    """The LR range test at the strategy's global batch, on a fresh model (it trains it)."""
    from bigbatch.study.lr_find import plot_lr_find

    # lr_find sets every step's LR itself; the strategy's warmup would only have to fit
    # into the test's length.
    strategy = strategy.with_overrides(["batch.warmup_steps=0"])
    run = build(strategy, corpus, steps, seed, model_cfg)
    # train_step's loss is all-reduced, so every rank sees the same curve and stops
    # at the same step; a per-rank loss could stop one rank early and hang the others.
    def step(run: bigbatch.Run, batch: Batch) -> float:
        loss_sum, count = train_step(run, batch).tolist()
        return loss_sum / count

    result = bigbatch.lr_find(run, batches(corpus, run, seed), step, lr_min=lr_min,
                              lr_max=lr_max, steps=steps)
    if out is not None and run.world.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "lr_find.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        plot_lr_find(result, out / "lr_find.png")
    run.close()
    return result


def check_merge(strategy: bigbatch.Strategy, corpus: CharCorpus, *, k: int = 4, steps: int = 3,
                seed: int = 0, model_cfg: dict | None = None) -> dict[str, float]:
    """The largest weight difference, after `steps` steps in float64 on blocks of uneven
    token counts, between one micro-step of the whole global batch and `k` merged
    micro-steps: with summed losses and counts (`train_step`), and with each
    micro-batch's mean loss, the habit a nanoGPT loop brings along. One process."""
    g = strategy.resolve(1).global_batch_size
    if g % k:
        raise ValueError(f"--check-merge: global batch {g} is not a multiple of k={k}")
    block = GPTConfig(vocab_size=1, **(model_cfg or {})).block_size
    x, y = corpus.ragged_blocks(g * steps, block)
    models = {}
    for name, micro in (("whole", g), ("count", g // k), ("mean", g // k)):
        s = strategy.with_overrides([f"batch.micro_batch_size={micro}", "batch.warmup_steps=0"])
        run = build(s, corpus, steps, seed, model_cfg, dtype=torch.float64)
        models.setdefault("start", copy.deepcopy(run.module))
        for i in range(steps):
            batch = list(zip(x[i * g:(i + 1) * g].split(micro), y[i * g:(i + 1) * g].split(micro),
                             strict=True))
            if name != "mean":
                train_step(run, batch)
                continue
            for xb, yb in batch:
                with run.micro_step() as ms:
                    ms.backward(F.cross_entropy(run.model(xb).flatten(0, 1), yb.flatten(),
                                                ignore_index=IGNORE_INDEX))
        models[name] = run.module

    def gap(a: torch.nn.Module, b: torch.nn.Module) -> float:
        return max(float((p - q).detach().abs().max())
                   for p, q in zip(a.parameters(), b.parameters(), strict=True))

    counts = (y[:g] != IGNORE_INDEX).view(k, -1).sum(1)
    return {"count": gap(models["count"], models["whole"]),
            "mean": gap(models["mean"], models["whole"]),
            "moved": gap(models["whole"], models["start"]),
            "min_tokens": int(counts.min()), "max_tokens": int(counts.max())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(HERE / "adamw_small.toml"), help="strategy TOML")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a strategy key, e.g. --set amp.dtype=bfloat16")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--tokens", type=int, default=1_000_000,
                        help="training budget in positions (sequences x block size); "
                             "equal budgets make configs comparable (default 1,000,000)")
    length.add_argument("--steps", type=int, help="optimizer steps instead of --tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write metrics.jsonl, summary.json, model.pt here")
    p.add_argument("--eval-every", type=int, default=0, help="steps between val losses")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--max-chars", type=int, default=2_000_000, help="corpus size cap")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--check-merge", type=int, metavar="K",
                   help="compare K merged micro-steps with one big-batch step and exit")
    p.add_argument("--lr-find", action="store_true",
                   help="run the LR range test at the config's global batch and exit")
    p.add_argument("--lr-find-steps", type=int, default=100)
    p.add_argument("--lr-min", type=float, default=1e-5)
    p.add_argument("--lr-max", type=float, default=1.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    strategy = load_strategy(args.config, args.set)
    corpus = CharCorpus(max_chars=args.max_chars)
    model_cfg = {"block_size": args.block_size, "n_layer": args.n_layer,
                 "n_head": args.n_head, "n_embd": args.n_embd}
    is_main = int(os.environ.get("RANK", "0")) == 0  # torchrun's; one process: rank 0
    if args.check_merge:
        r = check_merge(strategy, corpus, k=args.check_merge, model_cfg=model_cfg)
        print(f"{args.check_merge} merged micro-steps of {r['min_tokens']} to {r['max_tokens']} "
              f"tokens vs one step on the whole batch, float64, 3 steps: largest weight "
              f"difference {r['count']:.2g} with ms.backward(sum, count=n), {r['mean']:.2g} "
              f"with each micro-batch's mean loss (the steps moved weights by up to "
              f"{r['moved']:.2g})")
        return 0
    if args.lr_find:
        r = find_lr(strategy, corpus, steps=args.lr_find_steps, lr_min=args.lr_min,
                    lr_max=args.lr_max, seed=args.seed, model_cfg=model_cfg, out=args.out)
        if is_main:
            print(r.summary())
        return 0
    steps = args.steps or steps_for(strategy, args.tokens, args.block_size)
    r = train(strategy, corpus, steps=steps, seed=args.seed, model_cfg=model_cfg,
              eval_every=args.eval_every, log_every=args.log_every, out=args.out,
              log=print if is_main else (lambda *a: None))
    if is_main:
        print(f"val loss {r['val_loss']:.4f} ({r['val_bits_per_char']:.3f} bits/char) after "
              f"{r['steps']} steps at global batch {r['global_batch']} ({r['config']}); "
              f"{r['tokens']:,} tokens seen ({r['positions']:,} positions), "
              f"{r['workers']} worker(s), {r['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

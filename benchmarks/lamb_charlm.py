"""Two helpers behind benchmarks/NOTES-lamb-charlm.md (LAMB against AdamW on charlm).

    python benchmarks/lamb_charlm.py ratios [--lr 0.016] [--steps 400]
        LAMB's per-tensor trust ratio ||w|| / ||u|| on the charlm Transformer at batch 16
        (the demo's param groups, a 100-step linear warmup to a constant LR): the factor
        by which a LAMB step is smaller than an Adam step at the same LR, tensor by tensor.

    python benchmarks/lamb_charlm.py no-bias-correction train --task charlm --nproc 1 ...
        `bigbatch ...` in this process with LAMB(bias_correction=False) (the strategy has no
        key for it); one worker only (`--nproc 1`), since launched workers would not see it.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
from torch.utils.data import DataLoader


def ratios(lr: float, steps: int, report: tuple[int, ...] = (1, 10, 100, 400)) -> None:
    from bigbatch import Strategy, get_task
    from bigbatch.engine.optimizer import build_optimizer
    from bigbatch.tasks.charlm import DEMO_STRATEGY

    torch.manual_seed(0)
    task = get_task("charlm")
    model = task.build_model()
    strategy = Strategy.from_toml(DEMO_STRATEGY)
    opt = build_optimizer(model, strategy, lr)
    opt.track_trust_ratios = True
    named = [(n, p) for g in opt.param_groups
             for n, p in zip(g["param_names"], g["params"], strict=True)]
    loader = DataLoader(task.train_set, batch_size=16, shuffle=True, drop_last=True)
    step = 0
    while step < steps:
        for batch in loader:
            step += 1
            for g in opt.param_groups:
                g["lr"] = lr * min(1.0, step / 100)
            loss, count = task.loss(model(batch[0]), batch)
            opt.zero_grad()
            (loss / count).backward()
            opt.step()
            if step in report:
                print(f"step {step}: train loss {loss.item() / count:.3f} nats/char")
                for (name, p), r in zip(named, opt.trust_ratios().tolist(), strict=True):
                    if r != 1.0:
                        rms = p.norm().item() / p.numel() ** 0.5
                        print(f"  {name:26s} rms(w) {rms:.4f}  trust ratio {r:.4f}")
            if step == steps:
                break


def no_bias_correction(argv: list[str]) -> int:
    import bigbatch.optim.lamb as lamb
    from bigbatch.cli import main

    init = lamb.LAMB.__init__

    @functools.wraps(init)
    def without(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "bias_correction": False})

    lamb.LAMB.__init__ = without
    return main(argv)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1:2] == ["no-bias-correction"]:
        sys.exit(no_bias_correction(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["ratios"])
    parser.add_argument("--lr", type=float, default=0.016)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    ratios(args.lr, args.steps)

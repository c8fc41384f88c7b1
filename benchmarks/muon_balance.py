"""How `bigbatch.Muon` splits its Newton-Schulz work between DDP replicas, and what the
sharing costs, on GPT-2-shaped matrices (`muon_step.gpt2_shapes`).

As rank 0 of N on torch's fake process group (nothing moves; the planner's own way),
with the parameters on the meta device: `Muon.ns_work` gives each replica's Newton-Schulz
flops a step, and one optimizer step counted by the planner's counter gives the bytes of
the all-gather that shares the results, against the matrices' own bytes (the padding of
the per-replica buckets).

    python benchmarks/muon_balance.py [--model mini|small] [--ranks 2,4,8,16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from muon_step import MODELS, gpt2_shapes  # noqa: E402

from bigbatch.optim import Muon  # noqa: E402
from bigbatch.planner.counting import CommCount, counting, dims_of  # noqa: E402
from bigbatch.planner.fake import fake_world  # noqa: E402


def measure(shapes: list[tuple[int, ...]], ranks: int) -> tuple[list[int], int]:
    """(each replica's Newton-Schulz flops a step, bytes all-gathered a step)."""
    params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in shapes]
    for p in params:
        p.grad = torch.empty_like(p)
    count = CommCount()
    with fake_world(0, ranks):
        opt = Muon([{"params": params, "use_muon": True}], replicas=dist.group.WORLD)
        with counting(count, dims_of(None)):
            opt.step()
        work = opt.ns_work()
    return work, sum(count.bytes.get("all_gather", {}).values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--ranks", default="2,4,8,16")
    args = parser.parse_args()
    shapes, _ = gpt2_shapes(*MODELS[args.model])
    own = sum(torch.Size(s).numel() for s in shapes) * 4
    print(f"GPT-2 {args.model}: {len(shapes)} Muon matrices, {own / 2**20:.1f} MiB in float32")
    for ranks in (int(r) for r in args.ranks.split(",")):
        work, gathered = measure(shapes, ranks)
        mean = sum(work) / len(work)
        print(f"  {ranks:3d} DDP ranks: Newton-Schulz {sum(work) / 1e9:8.1f} GFLOP a step, "
              f"busiest rank {max(work) / 1e9:7.1f} (max/mean {max(work) / mean:.3f}); "
              f"all-gather {gathered / own:.3f}x the matrices' bytes")


if __name__ == "__main__":
    main()

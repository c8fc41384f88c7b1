"""The worked examples of docs/plan.md: `bigbatch plan` through the real CLI for a
BERT-large-sized and a Llama-7B-sized model, and issue 31's 38.7 B-parameter checks, with
each command's wall time and peak memory (the child's max RSS).

    .venv/bin/python benchmarks/plan_examples.py [--only NAME ...]

Writes docs/plan/examples.json (each example: its command, its plan's JSON, seconds,
max RSS) and rewrites the tables between the `<!-- plan-examples -->` markers of
docs/plan.md from it; tests/test_plan_docs.py checks that the two agree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "plan" / "examples.json"
DOC = ROOT / "docs" / "plan.md"


def charlm(d_model: int, layers: int, heads: int, seq: int) -> list[str]:
    return ["--task", "charlm", "--task-opt", f"d_model={d_model}", "--task-opt",
            f"n_layer={layers}", "--task-opt", f"n_head={heads}", "--task-opt", f"seq_len={seq}"]


BERT = charlm(1024, 24, 16, 512)
LLAMA = charlm(4096, 32, 32, 2048)
BIG = charlm(8192, 48, 64, 64)
BF16 = ["--set", "amp.dtype=bfloat16"]

EXAMPLES = {
    "bert-ddp": [*BERT, "--world", "64", "--set", "batch.global_batch_size=4096",
                 "--set", "gradient_merge.k_steps=4", *BF16, "--gpu-memory", "80"],
    "bert-zero2": [*BERT, "--world", "64", "--set", "batch.global_batch_size=4096",
                   "--set", "gradient_merge.k_steps=4", "--set", "sharding.stage=2", *BF16,
                   "--gpu-memory", "80"],
    "llama-zero3": [*LLAMA, "--world", "256", "--set", "batch.global_batch_size=256",
                    "--set", "sharding.stage=3", *BF16, "--gpu-memory", "80"],
    "llama-tp8-zero3": [*LLAMA, "--world", "256", "--set", "batch.global_batch_size=256",
                        "--set", "sharding.stage=3", "--set",
                        "tensor_parallel.tensor_parallel_degree=8", *BF16, "--gpu-memory", "80"],
    "llama-pp4-zero3": [*LLAMA, "--world", "256", "--set", "batch.global_batch_size=512",
                        "--set", "pipeline.pp_degree=4", "--set", "pipeline.accumulate_steps=8",
                        "--set", "sharding.stage=3", *BF16, "--gpu-memory", "80"],
    "38b-zero3": [*BIG, "--world", "1024", "--set", "sharding.stage=3"],
    "38b-tp8-zero3": [*BIG, "--world", "1024", "--set", "sharding.stage=3",
                      "--set", "tensor_parallel.tensor_parallel_degree=8"],
    "38b-pp8": [*BIG, "--world", "1024", "--set", "pipeline.pp_degree=8",
                "--set", "pipeline.accumulate_steps=32"],
}
REFUSED = {
    "38b-1000-tp8-pp8": [*BIG, "--world", "1000", "--set",
                         "tensor_parallel.tensor_parallel_degree=8",
                         "--set", "pipeline.pp_degree=8"],
    "38b-1000-tp8-batch1024": [*BIG, "--world", "1000", "--set",
                               "tensor_parallel.tensor_parallel_degree=8",
                               "--set", "batch.global_batch_size=1024"],
}


def _run(args: list[str]) -> tuple[int, str, str, float, int]:
    """(exit status, stdout, stderr, seconds, the child's own max RSS in bytes)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "bigbatch", "plan", *args], cwd=ROOT,
                                env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read(), seconds, usage.ru_maxrss * 1024


def command(args: list[str]) -> str:
    return "bigbatch plan " + " ".join(args)


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def render(results: dict) -> str:
    """The markdown tables of docs/plan.md from `results`."""
    lines = ["Bytes per rank in GiB (the fullest rank); sent/step: GiB the busiest rank sends "
             "per optimizer step under ring algorithms.", "",
             "| example | layout | global = micro x accum x data | params | grads | "
             "optimizer | activations / micro | peak | fits 80 GiB | sent/step "
             "| bubble | planned in (wall, max RSS) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "plan" not in r:
            continue
        p, b = r["plan"], r["plan"]["per_rank_bytes"]
        batch = p["batch"]
        lines.append(
            f"| {name} | {p['layout']} | {batch['global']} = {batch['micro']} x "
            f"{batch['accumulation']} x {batch['data']} | {gib(b['params'])} | "
            f"{gib(b['grads'])} | {gib(b['optimizer'])} | {gib(b['activations'])} | "
            f"{gib(b['peak'])} | {'-' if p['fits'] is None else 'yes' if p['fits'] else 'no'} | "
            f"{gib(p['comm_sent_bytes_per_step'])} | {p['bubble']:.3f} | "
            f"{r['seconds']:.0f} s, {r['max_rss'] / 2**30:.2f} GiB |")
    lines += ["", "The commands (each with `--json` for the file):", ""]
    lines += [f"- {name}: `{command(r['args'])}`" for name, r in results.items() if "plan" in r]
    lines += ["", "Refused (exit 2, one line on stderr, nothing on stdout):", ""]
    for r in results.values():
        if "refused" in r:
            lines.append(f"- `{command(r['args'])}`  \n  `{r['refused']}`")
    return "\n".join(lines)


def update_doc(results: dict) -> None:
    text = DOC.read_text()
    start, end = "<!-- plan-examples -->", "<!-- /plan-examples -->"
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    DOC.write_text(f"{head}{start}\n{render(results)}\n{end}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="examples to rerun (default: all)")
    args = parser.parse_args()
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    for name, cli in {**EXAMPLES, **REFUSED}.items():
        if args.only and name not in args.only:
            continue
        status, stdout, stderr, seconds, rss = _run([*cli, "--json"] if name in EXAMPLES
                                                    else cli)
        entry = {"args": cli, "seconds": round(seconds, 1), "max_rss": rss}
        if name in EXAMPLES:
            if status != 0:
                sys.exit(f"{name}: exit {status}: {stderr}")
            entry["plan"] = json.loads(stdout)
        else:
            lines = [line for line in stderr.splitlines() if "Warning" not in line]
            if status != 2 or stdout or len(lines) != 1:
                sys.exit(f"{name}: expected a one-line refusal, got {status}: {stderr}")
            entry["refused"] = lines[0]
        results[name] = entry
        print(f"{name}: {seconds:.1f} s, max RSS {rss / 2**30:.2f} GiB", flush=True)
        OUT.parent.mkdir(parents=True, exist_ok=True)
        ordered = {n: results[n] for n in [*EXAMPLES, *REFUSED] if n in results}
        OUT.write_text(json.dumps(ordered, indent=1) + "\n")
        update_doc(ordered)


if __name__ == "__main__":
    main()

"""Run the benchmarks (``make bench`` runs them all): each prints its table of ratios against the
same run's baseline and appends its raw rows to its results file (see benchmarks/README.md).

    python benchmarks/run_all.py                  # every benchmark, in the order below
    python benchmarks/run_all.py decode memory    # only these
    python benchmarks/run_all.py --list           # names and scripts

Each benchmark runs in its own process under this interpreter, with this environment (the
``BENCH_*`` and ``HF_ZERO3_*`` variables each script documents); one that fails does not stop the
others, and the exit status is non-zero if any failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = {  # name -> (script, what it measures)
    "generation": ("generation/bench_generation.py", "lockstep generation vs synced_gpus and fixed steps"),
    "decode": ("generation/bench_decode.py", "compiled static decode loop vs HF eager and static cache"),
    "first_call": ("generation/bench_first_call.py", "a process's first compiled rollout from empty and warm caches"),
    "eval": ("eval/bench_eval.py", "eval under DeepCompile vs plain ZeRO-3 hooks"),
    "memory": ("memory/bench_memory.py", "memory plan vs plain ZeRO-3 and DeepSpeed's default schedule"),
    "agreements": ("agreements/bench_agreements.py", "cost of tagged agreements"),
    "trl": ("trl/bench_trl.py", "TRL GRPO rollouts and DeepSpeed's OPSD rollout"),
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "names", nargs="*", metavar="NAME", help=f"benchmarks to run (default: all): {', '.join(BENCHMARKS)}"
    )
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for name, (script, what) in BENCHMARKS.items():
            print(f"{name:<11} benchmarks/{script:<32} {what}")
        return 0
    failed = []
    for name in args.names or list(BENCHMARKS):
        script = os.path.join(HERE, BENCHMARKS[name][0])
        print(f"\n===== {name}: benchmarks/{BENCHMARKS[name][0]} =====", flush=True)
        t = time.time()
        rc = subprocess.call([sys.executable, script], cwd=os.path.dirname(HERE))
        print(f"===== {name}: exit {rc} after {time.time() - t:.0f} s =====", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

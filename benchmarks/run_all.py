"""Run every benchmark (`make bench`); each prints its table and writes its JSON beside itself."""

import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for script in ("generation/bench_generation.py", "generation/bench_decode.py", "eval/bench_eval.py", "memory/bench_memory.py",
               "agreements/bench_agreements.py", "trl/bench_trl.py"):
    print(f"\n===== {script} =====", flush=True)
    sys.argv = [script]
    runpy.run_path(os.path.join(HERE, script), run_name="__main__")

"""The runnable examples run as their docstrings say (torchrun, two gloo ranks, CPU), to their last
line: a name an example reads only at its end (the last rollout's report) fails here, not for a
user whose training just finished."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 240  # the whole run, both ranks; past it the process group is killed and its output shown


def _torchrun(script: str, *args: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(ROOT / script),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks
        out, _ = proc.communicate()
        raise AssertionError(f"{script} {' '.join(args)} ran past {LIMIT_S} s; its output:\n{out[-6000:]}") from None
    assert proc.returncode == 0, f"{script} {' '.join(args)} exited {proc.returncode}:\n{out[-6000:]}"
    return out


def test_the_grpo_example_with_a_tool_on_one_rank_runs_to_its_report():
    out = _torchrun("examples/trl_grpo.py", "--steps", "2", "--tools")
    ranks = [line for line in out.splitlines() if line.startswith("[rank ")]
    assert len(ranks) == 2, out[-4000:]
    # both ranks read the last rollout's report (lockstep gathered the rollouts: "held")
    assert all("last gather: held" in line for line in ranks), ranks
    assert "every rank ran the same generate() calls and decode forwards: yes" in out

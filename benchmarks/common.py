"""Shared benchmark plumbing: the rank launch (every GPU up to 2, else CPU), the ratio table each
benchmark prints, and the raw-row writer (the models are :mod:`hf_zero3.testing`'s).

Raw rows: every benchmark appends one JSON line per measured row to its results file
(``benchmarks/<dir>/<name>.jsonl``, or ``$BENCH_RESULTS/<name>.jsonl`` when ``BENCH_RESULTS``
names a directory). Each line is one object::

    {"benchmark": "decode", "run": "<id shared by the rows of one invocation>",
     "date": "<UTC ISO-8601>", "command": "<env switches> python benchmarks/... <args>",
     "commit": "<git HEAD or $BENCH_COMMIT>", "dirty": <hf_zero3/ had uncommitted changes>,
     "environment": {"gpus": [...], "torch": ..., "cuda": ..., "triton": ..., "deepspeed": ...,
                     "transformers": ..., "accelerate": ..., "trl": ..., "python": ...},
     "setup": {<the benchmark's fixed parameters>}, "result": {<the row>}}

``benchmarks/plot.py`` and RESULTS.md read these files; nothing else is written into the tree
(partial rows and profiles go to :func:`scratch_dir`, ignored by git).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))

# the environment as the benchmark was started (before any rank sets a switch): its command line
_START_ENV = dict(os.environ)
_ARGV = list(sys.argv)
# variables that change what a benchmark measures; they are written into each row's command
_COMMAND_PREFIXES = (
    "BENCH_",
    "HF_ZERO3_",
    "PROBE_",
    "PROFILE_",
    "ATTENTION_PROBE_",
    "CUDA_VISIBLE_DEVICES",
    "NCCL_",
    "TORCH_CUDA_ARCH_LIST",
    "PYTORCH_CUDA_ALLOC_CONF",
)
_NOT_COMMAND = ("BENCH_RESULTS", "BENCH_COMMIT")  # where rows go and what ran, not what they measure
_RUN = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]


#: the model shapes the decode benchmarks build (``hf_zero3.testing.models``' config functions)
SHAPES = {
    "qwen2-0.5b": "qwen2_0_5b_shape_config",
    "llama-1b": "llama_1b_shape_config",
    "llama-8b": "llama_8b_shape_config",
}


def hbm_tbps(gpu_name: str) -> float:
    """The bandwidth a decode floor counts at, TB/s: ``BENCH_HBM_TBPS``, else by the GPU's name
    (an H100's 3.35, else an H200's 4.3)."""
    if os.environ.get("BENCH_HBM_TBPS"):
        return float(os.environ["BENCH_HBM_TBPS"])
    return 3.35 if "H100" in gpu_name else 4.3


def shape_config(name: str):
    """The config of model shape ``name`` (:data:`SHAPES`); an unknown name stops the benchmark."""
    if name not in SHAPES:
        raise SystemExit(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    from hf_zero3.testing import models

    return getattr(models, SHAPES[name])()


def world_and_backend(max_gpus: int = 2):
    import torch

    n = torch.cuda.device_count()
    return (min(n, max_gpus), "nccl") if n else (2, "gloo")


def environment() -> dict:
    """Hardware and library versions of this process (call it after the ranks ran: it
    initializes CUDA here)."""
    import importlib.metadata as md

    import torch

    n = torch.cuda.device_count()
    env = {
        "gpus": [torch.cuda.get_device_name(i) for i in range(n)],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "platform": platform.platform(terse=True),
    }
    for pkg in ("triton", "deepspeed", "transformers", "accelerate", "trl"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            env[pkg] = None
    return env


def command() -> str:
    """The command line that started this benchmark, with the environment switches it ran under."""
    env = [
        f"{k}={shlex.quote(v)}"
        for k, v in sorted(_START_ENV.items())
        if k.startswith(_COMMAND_PREFIXES) and k not in _NOT_COMMAND
    ]
    script = os.path.relpath(os.path.abspath(_ARGV[0]), ROOT) if _ARGV and _ARGV[0] else "?"
    return " ".join(env + ["python", script] + [shlex.quote(a) for a in _ARGV[1:]])


def _commit() -> dict:
    """``commit`` and ``dirty`` of the tree that runs. ``BENCH_COMMIT`` names the commit where the
    tree's git is not its own (a working tree copied onto a GPU host): ``dirty`` is then unknown."""
    named = os.environ.get("BENCH_COMMIT")
    if named:
        return {"commit": named, "dirty": None}
    return {
        "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no", "--", "hf_zero3")),
    }


def _git(*args) -> str | None:
    try:
        return subprocess.run(
            ["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=20, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def results_path(name: str, here: str) -> str:
    """Where ``name``'s rows go: ``$BENCH_RESULTS/<name>.jsonl`` when set, else beside the script."""
    out = os.environ.get("BENCH_RESULTS")
    if out:
        os.makedirs(out, exist_ok=True)
        return os.path.join(out, f"{name}.jsonl")
    return os.path.join(here, f"{name}.jsonl")


def scratch_dir() -> str:
    """Partial rows and diagnostic dumps: ``$BENCH_RESULTS`` when set, else ``benchmarks/out``
    (ignored by git)."""
    path = os.environ.get("BENCH_RESULTS") or os.path.join(BENCH_DIR, "out")
    os.makedirs(path, exist_ok=True)
    return path


def record(name: str, rows: list[dict], here: str, setup: dict | None = None) -> str:
    """Append ``rows`` to ``name``'s results file, each with this run's command, environment and
    date; returns the file's path."""
    meta = {
        "benchmark": name,
        "run": _RUN,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command(),
        **_commit(),
        "environment": environment(),
        "setup": setup or {},
    }
    path = results_path(name, here)
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps({**meta, "result": row}, default=str) + "\n")
    return path


def load(path: str) -> list[dict]:
    """A results file's rows (the JSON objects :func:`record` wrote), in file order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def set_switches(switches: dict, known) -> None:
    """This row's ``HF_ZERO3_*`` switches set, every other one of ``known`` unset (so it runs at the
    library's default): the decode benchmark's rows and the profile's variants."""
    for name in known:
        os.environ.pop(name, None)
    os.environ.update(switches)


def graph_us(calls: list, replays: int) -> tuple[float, list]:
    """Microseconds per call of ``calls`` (zero-argument callables) captured as one CUDA graph (after
    a warm-up of the first two on a side stream) and replayed ``replays`` times; and their outputs."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls[:2]:
            call()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [call() for call in calls]
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(calls)), outs


def table(rows: list[dict], cols: list[str]) -> str:
    """A Markdown table of ``cols`` over ``rows`` (floats to 3 decimals, or 1 from 100)."""
    widths = [max([len(c)] + [len(_fmt(r.get(c))) for r in rows]) for c in cols]

    def line(vals):
        return "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"

    out = [line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line([_fmt(r.get(c)) for c in cols]) for r in rows]
    return "\n".join(out)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return "" if v is None else str(v)

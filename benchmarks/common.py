"""Shared benchmark plumbing: launch on every GPU (up to 2) or CPU, print a ratio table, save raw
numbers as JSON next to the caller (and under $OUT when set)."""

from __future__ import annotations

import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))


def llama_1b_config(num_hidden_layers: int = 16):
    """The issues' model, built in code with random weights: Llama-3.2-1B's shape (hidden 2048,
    intermediate 8192, 32 heads / 8 KV, vocab 128256, tied embeddings), SDPA attention."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                       num_hidden_layers=num_hidden_layers, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=2048, tie_word_embeddings=True, attn_implementation="sdpa",
                       pad_token_id=0, bos_token_id=1, eos_token_id=2)


def world_and_backend(max_gpus: int = 2):
    import torch

    n = torch.cuda.device_count()
    return (min(n, max_gpus), "nccl") if n else (2, "gloo")


def environment() -> dict:
    import importlib.metadata as md

    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "gpus": [torch.cuda.get_device_name(i)
                                                for i in range(torch.cuda.device_count())]}
    for pkg in ("deepspeed", "transformers", "accelerate"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            env[pkg] = None
    return env


def set_switches(switches: dict, known) -> None:
    """This row's ``HF_ZERO3_*`` switches set, every other one of ``known`` unset (so it runs at the
    library's default): the decode benchmark's rows and the profile's variants."""
    for name in known:
        os.environ.pop(name, None)
    os.environ.update(switches)


def save(name: str, payload: dict, here: str) -> str:
    payload = {"environment": environment(), **payload}
    path = os.path.join(here, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(payload, f, indent=1, default=str)
    return path


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
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    out = [line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line([_fmt(r.get(c)) for c in cols]) for r in rows]
    return "\n".join(out)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return "" if v is None else str(v)

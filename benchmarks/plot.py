"""Plots of the headline benchmarks from their raw rows (matplotlib, an optional dependency:
``pip install matplotlib``).

    python benchmarks/plot.py [--results DIR] [--out DIR]

decode.png  tokens/s against batch: hf_zero3's compiled decode loop, transformers' static cache,
            HF eager with the model gathered (TRL's path), and the HBM bandwidth floor; from the
            newest run in generation/decode.jsonl with both HF baselines at the most batches
            (Llama-1B shape, fixed-length prompts).
memory.png  peak allocated memory and step time of plain ZeRO-3, DeepCompile (zero3 pass only,
            DeepSpeed's default schedule) and hf_zero3's memory plan, uncapped and under a cap;
            the newest row of each cell of memory/memory.jsonl in the benchmark's default
            configuration (torch Adam, zero.Init, non-reentrant checkpointing) on the most GPUs.
``--results DIR`` reads ``DIR/<name>.jsonl`` instead of the files beside the scripts (e.g. a
``BENCH_RESULTS`` directory); ``--out`` (default benchmarks/plots) is where the PNGs go.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import hbm_tbps, load  # noqa: E402

FILES = {"decode": "generation/decode.jsonl", "memory": "memory/memory.jsonl"}
COLORS = {
    "hf_zero3": "#d62728",
    "static": "#1f77b4",
    "eager": "#7f7f7f",
    "floor": "black",
    "plain": "#7f7f7f",
    "dc_zero3": "#9ecae1",
    "dc_default": "#1f77b4",
    "ours": "#d62728",
    "ours_match": "#ff9896",
}


def _path(name: str, results: str | None) -> str:
    return os.path.join(results, os.path.basename(FILES[name])) if results else os.path.join(HERE, FILES[name])


def _caption(rows: list[dict]) -> str:
    env = rows[-1]["environment"]
    gpus = env.get("gpus") or ["CPU"]
    hw = f"{len(gpus)}x {gpus[0]}" if gpus else "CPU"
    dates = sorted({r["date"][:10] for r in rows})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    return (
        f"{hw}, torch {env.get('torch')}, DeepSpeed {env.get('deepspeed')}, "
        f"transformers {env.get('transformers')}; {when}"
    )


def plot_decode(plt, rows: list[dict], out: str) -> str:
    runs = {}
    for r in rows:  # the Llama-1B shape's fixed-length prompts (a run may hold padded ones, or be another shape)
        if r["setup"].get("shape", "llama-1b") == "llama-1b" and r["result"].get("prompts", "fixed") == "fixed":
            runs.setdefault(r["run"], []).append(r)
    complete = [
        rs
        for rs in runs.values()
        if {"hf_eager_gathered", "hf_static_gathered", "hf_zero3_graphs"} <= {r["result"]["config"] for r in rs}
    ]
    if not complete:
        raise SystemExit("decode.jsonl has no run with hf_eager_gathered, hf_static_gathered and hf_zero3_graphs")
    # a line against batch: the run with the most batches, the newest of those
    run = max(complete, key=lambda rs: (len({r["result"]["batch"] for r in rs}), rs[0]["date"]))
    # the floor at the run's GPU's bandwidth (rows before the benchmark chose it by the GPU counted
    # an H200's on any GPU)
    bw = hbm_tbps((run[0]["environment"].get("gpus") or [""])[0]) * 1e12
    res = [dict(r["result"]) for r in run]
    for r in res:
        r["floor_tok_s"] = r["batch"] / (r["weight_bytes"] / bw)
        r["fraction_of_floor"] = r["step_tokens_per_s"] / r["floor_tok_s"]
    batches = sorted({r["batch"] for r in res})

    def series(config, key="step_tokens_per_s"):
        return [next(r[key] for r in res if r["batch"] == b and r["config"] == config) for b in batches]

    fig, ax = plt.subplots(figsize=(8, 5))

    def note(b, y, text, color):  # left of the smallest batch, right of the others
        left = b == batches[0]
        ax.annotate(
            text,
            (b, y),
            textcoords="offset points",
            xytext=(-10 if left else 10, 0),
            fontsize=7.5,
            color=color,
            va="center",
            ha="right" if left else "left",
        )

    floor = series("hf_zero3_graphs", "floor_tok_s")
    ax.plot(batches, floor, "--", color=COLORS["floor"], lw=1.2, label="bandwidth floor (weights read once a step)")
    for b, y in zip(batches, floor):
        note(b, y, f"floor {y / 1e3:.1f}k", COLORS["floor"])
    for config, label, color, marker in (
        ("hf_zero3_graphs", "hf_zero3 compiled decode loop (defaults)", COLORS["hf_zero3"], "o"),
        ("hf_static_gathered", "transformers' static cache, model gathered", COLORS["static"], "s"),
        ("hf_eager_gathered", "HF eager, model gathered (TRL's path)", COLORS["eager"], "^"),
    ):
        ys = series(config)
        ax.plot(
            batches, ys, marker=marker, color=color, lw=2 if config == "hf_zero3_graphs" else 1.5, ms=7, label=label
        )
        for b, y in zip(batches, ys):
            row = next(r for r in res if r["batch"] == b and r["config"] == config)
            text = f"{y / 1e3:.1f}k tok/s"
            if config == "hf_zero3_graphs":
                text += (
                    f"\n{100 * row['fraction_of_floor']:.1f} % of floor\n"
                    f"{row['vs_hf_static']:.2f}x static, {row['vs_hf_eager_gathered']:.1f}x eager"
                )
            note(b, y, text, color)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlim(batches[0] / 4, batches[-1] * 4)
    ax.set_xlabel("batch (sequences per rank)")
    ax.set_ylabel("decode tokens/s per rank (every row, every step)")
    setup = run[0]["setup"]
    ax.set_title(
        f"Rollout decode under ZeRO-3: Llama-3.2-1B shape, bf16, {setup.get('prompt')}-token prompts, "
        f"{setup.get('max_new_tokens')} new tokens",
        fontsize=9.5,
    )
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="lower right")
    fig.text(0.01, 0.01, _caption(run) + "; benchmarks/generation/bench_decode.py", fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path = os.path.join(out, "decode.png")
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


MEMORY_SETTINGS = [  # label in the rows -> short label, color key
    ("plain ZeRO-3 (eager)", "plain ZeRO-3", "plain"),
    ("DeepCompile zero3 pass only", "DeepCompile\nzero3 pass only", "dc_zero3"),
    ("DeepCompile default schedule", "DeepCompile\ndefault schedule", "dc_default"),
    ("hf_zero3 plan (budget)", "hf_zero3 plan\n(default mode)", "ours"),
    ("hf_zero3 plan (match_zero3)", "hf_zero3 plan\n(match_zero3)", "ours_match"),
]


def plot_memory(plt, rows: list[dict], out: str) -> str:
    default_cfg = [
        r
        for r in rows
        if (
            r["result"].get("optim", "torch"),
            r["result"].get("build", "zero_init"),
            r["result"].get("ckpt", "nonreentrant"),
        )
        == ("torch", "zero_init", "nonreentrant")
    ]
    if not default_cfg:
        raise SystemExit("memory.jsonl has no row of the default configuration")
    world = max(r["setup"].get("world", 1) for r in default_cfg)
    newest = {}
    for r in sorted((r for r in default_cfg if r["setup"].get("world", 1) == world), key=lambda r: r["date"]):
        newest[(r["result"]["setting"], str(r["result"]["cap_gib"]))] = r
    caps = sorted({cap for _, cap in newest}, key=lambda c: (c != "none", float(c) if c != "none" else 0))
    settings = [s for s in MEMORY_SETTINGS if any(s[0] == k for k, _ in newest)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    width = 0.8 / len(settings)
    for ax, key, ylabel in (
        (axes[0], "peak_alloc_gib", "peak allocated memory per GPU (GiB)"),
        (axes[1], "median_step_s", "step time (s), median of the later steps"),
    ):
        top = max((r["result"].get(key) or 0) for r in newest.values())
        for i, (label, short, color) in enumerate(settings):
            for j, cap in enumerate(caps):
                r = newest.get((label, cap))
                x = j + (i - (len(settings) - 1) / 2) * width
                if r is None:
                    continue
                res = r["result"]
                val = res.get(key)
                shared = (res.get("concurrent_jobs") or 1) > 1
                if val is None or not str(res.get("status", "")).startswith("trained"):
                    ax.text(
                        x,
                        top * 0.02,
                        "OOM" if "OOM" in str(res.get("status")) else "failed",
                        rotation=90,
                        ha="center",
                        va="bottom",
                        fontsize=8,
                        color=COLORS[color],
                        fontweight="bold",
                    )
                    continue
                ax.bar(
                    x,
                    val,
                    width * 0.92,
                    color=COLORS[color],
                    hatch="//" if shared else None,
                    edgecolor="white" if shared else None,
                )
                ax.text(
                    x,
                    val,
                    f"{val:.2f}" if key == "peak_alloc_gib" else f"{val:.3f}",
                    ha="center",
                    va="bottom",
                    fontsize=6.5,
                )
        ax.set_xticks(range(len(caps)), ["uncapped" if c == "none" else f"capped at {float(c):g} GiB" for c in caps])
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, top * 1.15)
        ax.grid(True, axis="y", alpha=0.25)
        if key == "peak_alloc_gib":
            for j, cap in enumerate(caps):
                if cap != "none":
                    ax.hlines(float(cap), j - 0.45, j + 0.45, colors="black", linestyles="--", lw=1)
                    ax.text(j + 0.45, float(cap), "cap", ha="right", va="bottom", fontsize=7)
    if any((r["result"].get("concurrent_jobs") or 1) > 1 for r in newest.values()):
        axes[1].text(
            0.99,
            0.98,
            "hatched: measured with another job on the GPUs",
            transform=axes[1].transAxes,
            ha="right",
            va="top",
            fontsize=7,
            color="#555555",
        )
    from matplotlib.patches import Patch

    fig.legend(
        [Patch(color=COLORS[color]) for _, _, color in settings],
        [short.replace("\n", " ") for _, short, _ in settings],
        loc="upper center",
        bbox_to_anchor=(0.5, 0.93),
        ncol=len(settings),
        fontsize=7.5,
        frameon=False,
    )
    fig.suptitle(
        f"ZeRO-3 training step: Llama-3.2-1B shape, bs 1 x 512, bf16, torch Adam, activation checkpointing, "
        f"{world} rank{'s' if world > 1 else ''}",
        fontsize=10,
        y=0.985,
    )
    runs = len({r["run"] for r in newest.values()})
    fig.text(
        0.01,
        0.01,
        _caption(list(newest.values())) + f"; newest row of each cell ({runs} runs); benchmarks/memory/bench_memory.py",
        fontsize=7,
        color="#555555",
    )
    fig.tight_layout(rect=(0, 0.03, 1, 0.9))
    path = os.path.join(out, "memory.png")
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", help="directory holding <name>.jsonl (default: beside each benchmark)")
    ap.add_argument("--out", default=os.path.join(HERE, "plots"), help="where the PNGs go")
    args = ap.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("benchmarks/plot.py needs matplotlib: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(args.out, exist_ok=True)
    for name, fn in (("decode", plot_decode), ("memory", plot_memory)):
        path = _path(name, args.results)
        if not os.path.exists(path):
            print(f"{name}: no {path}; skipped")
            continue
        print(f"{name}: {fn(plt, load(path), args.out)}")


if __name__ == "__main__":
    main()

"""``hf_zero3 env``: what this install runs, in the manner of ``accelerate env`` and ``ds_report``.

Three parts, each a list of rows (``name``, ``value``, ``status``, ``note``): the installed releases
against CI's floor, pinned and newest sets; which parts of the fast path this install can run and
why not (CUDA, Triton, the native gate, DeepCompile, transformers' generation contract, every
transformers function the decode path computes itself); and with a model config, which decode
parts that model would get. The model is built on the meta device: no weights are read.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass

import torch
from packaging.version import Version
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin
from transformers.cache_utils import StaticCache

from . import native_gate
from ._upstream import deepspeed as ds_up
from ._upstream import transformers as hf_up
from ._upstream import versions
from .decode import families, fused_qkv, gqa_attention, mlp_kernels, norm_kernel, ring_cache, static_loop
from .decode import plan as decode_plan
from .gathering import GATHER_MODES
from .kernels import gqa_decode, triton_launch

PACKAGES = ("torch", "deepspeed", "transformers", "accelerate", "trl", "peft")
OK, NO, WARN = "ok", "no", "warn"


@dataclass
class Row:
    name: str
    value: str
    status: str  # ok / warn / no
    note: str = ""


def version_rows() -> list[Row]:
    """One row per library: its installed release against the floor and the tested releases."""

    rows = [Row("python", platform.python_version(), OK)]
    floors = {k: v for d in versions.MINIMUM.values() for k, v in d.items()}
    for pkg in PACKAGES:
        have = versions.installed(pkg)
        tested = versions.TESTED[pkg]
        floor = floors.get(pkg)
        if have is None:
            rows.append(Row(pkg, "not installed", NO, f"floor {floor}; tested {tested}"))
            continue
        release = Version(have.split("+")[0])
        tested_set = {s[pkg] for s in versions.RELEASE_SETS.values()} | (
            {versions.GPU_TORCH} if pkg == "torch" else set()
        )
        if floor is not None and release < Version(floor):
            rows.append(Row(pkg, have, NO, f"below the floor {floor}: pip install -U '{pkg}>={floor}'"))
        elif versions.newer_than_checked(pkg, have):
            rows.append(
                Row(
                    pkg, have, WARN, f"newer than the newest checked ({versions.NEWEST[pkg]}): the fast path falls back"
                )
            )
        elif str(release) in tested_set:
            rows.append(Row(pkg, have, OK, f"tested ({tested})"))
        else:
            rows.append(Row(pkg, have, OK, f"between tested releases ({tested})"))
    return rows


def fast_path_rows() -> list[Row]:
    """Which parts of the fast path this install can run, and why not."""
    rows = []
    cuda = torch.cuda.is_available()
    rows.append(
        Row(
            "CUDA",
            torch.cuda.get_device_name(0) if cuda else "not available",
            OK if cuda else NO,
            "" if cuda else "decode='auto' decodes eagerly on the CPU; DeepCompile and the Triton kernels need CUDA",
        )
    )
    missing = triton_launch.missing()
    rows.append(Row("Triton", versions.installed("triton") or "not installed", NO if missing else OK, missing or ""))
    rows.append(
        Row(
            "decode attention kernel",
            "Triton" if gqa_decode.is_available() else "PyTorch form",
            OK if gqa_decode.is_available() and cuda else WARN,
            gqa_decode.unavailable_reason() or ("" if cuda else "runs on CUDA"),
        )
    )
    supported, why = ds_up.deepcompile_supported()
    rows.append(Row("DeepCompile", "supported" if supported else "not supported", OK if supported else NO, why))
    native = native_gate.is_available()
    rows.append(
        Row(
            "native prefetch gate",
            "built" if native else "PyTorch fallback",
            OK if native else WARN,
            native_gate.unavailable_reason() or "",
        )
    )
    problems = hf_up.contract_problems()
    rows.append(
        Row(
            "generation contract",
            f"cache keyword {hf_up.cache_keyword()!r}" if not problems else "broken",
            NO if problems else OK,
            "; ".join(problems) if problems else "every read of transformers' generation is present",
        )
    )
    for path in hf_up.CHECKED_SOURCES:
        why = hf_up.unchecked_reason(path)
        parts = path.split(".")
        # a method: Class.method; a model module's function: its model type's (llama.rotate_half)
        short = parts[-3] + "." + parts[-1] if parts[-2].startswith("modeling_") else ".".join(parts[-2:])
        rows.append(
            Row(short, "checked" if why is None else "model's own code", OK if why is None else WARN, why or "")
        )
    return rows


def _config(source: str):
    """A transformers config from a directory, a ``config.json`` file or a Hub-style name already
    in the local cache (no download: ``HF_HUB_OFFLINE`` is honoured by transformers)."""

    if os.path.isfile(source):
        with open(source) as f:
            data = json.load(f)
        model_type = data.pop("model_type", None)
        if not model_type:
            raise ValueError(f"{source} has no model_type: pass a model directory or its config.json")
        return AutoConfig.for_model(model_type, **data)
    return AutoConfig.from_pretrained(source)


def _token_ids_problem(config) -> str | None:
    """A special token id of ``config`` outside its vocabulary (None: none)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int):
        return None
    for field in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(text, field, None)
        ids = value if isinstance(value, (list, tuple)) else [value]
        bad = [i for i in ids if isinstance(i, int) and not 0 <= i < vocab]
        if bad:
            return (
                f"its {field} {value} lies outside the vocabulary (vocab_size {vocab}): "
                f"set {field} to an id below {vocab}, or vocab_size above {max(bad)}"
            )
    return None


#: The call ``hf_zero3 env --model`` plans for unless told otherwise (``--call key=value``): a
#: rollout's shape, the whole model gathered, on CUDA.
DEFAULT_CALL = {"decode": "auto", "gather": "all", "max_new_tokens": 128, "prompt_length": 64}


def model_rows(source: str, call: dict | None = None) -> list[Row]:
    """Which decode parts a model of ``source``'s config would get, built on the meta device, and
    the decode path a call would take (``call``: generation keywords over :data:`DEFAULT_CALL`).
    Raises ``ValueError`` (one line) for a config no model can be built from."""

    config = _config(source)
    problem = _token_ids_problem(config)
    if problem is not None:
        raise ValueError(f"{source}: {problem}")
    # the decode path's kernels take half-precision weights: the config's, else bf16 (a float32
    # model decodes through the model's own MLP)
    dtype = getattr(config, "dtype", None)
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    dtype = dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, TypeError, KeyError, AssertionError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(f"{source}: transformers builds no causal LM from it ({type(exc).__name__}: {first})") from exc
    family = families.FAMILIES.get(config.model_type)
    rows = [
        Row("model", f"{type(model).__name__} ({config.model_type}, {str(dtype).replace('torch.', '')})", OK),
        Row(
            "family",
            family.model_type if family else "none",
            OK if family else WARN,
            "" if family else "the MLP and attention run the model's own code (the static loop still applies)",
        ),
        Row(
            "compileable",
            str(hf_up.can_compile_fullgraph(model)),
            OK if hf_up.can_compile_fullgraph(model) else NO,
            "" if hf_up.can_compile_fullgraph(model) else "transformers does not mark it _can_compile_fullgraph",
        ),
        Row("attention", str(hf_up.attention_implementation(model.config)), OK),
    ]
    if not gqa_attention.applies(model):
        attention = Row(
            "decode attention",
            "model's own",
            WARN,
            "not an attention of transformers' interface the decode attention computes",
        )
    elif gqa_attention.multi_head(model):
        attention = Row(
            "decode attention",
            "hf_zero3 decode attention kernel",
            OK,
            "Triton kernel on CUDA where it pays, else the model's own (one head per group)",
        )
    else:
        attention = Row("decode attention", "hf_zero3 GQA attention", OK, "Triton kernel on CUDA where it pays")
    rows.append(attention)
    rope = gqa_attention.rope_plan(model, gqa_attention.KERNEL)
    rows.append(Row("rope kernel", f"{len(rope)} attention modules", OK if rope else WARN))
    mlps = [n for n, m in model.named_modules() if mlp_kernels.applies(m)]
    rows.append(Row("MLP kernels", f"{len(mlps)} MLP modules", OK if mlps else WARN))
    rows.append(Row("fused q/k/v", f"{len(fused_qkv.plan(model))} attention modules", OK))
    norms = [n for n, m in model.named_modules() if norm_kernel.applies(m)]
    eager = "where the decode step runs eagerly"
    rows.append(Row("norm kernel", f"{len(norms)} RMSNorms", OK if norms else WARN, eager))
    rotary = families.rotary_function(model)
    rows.append(
        Row(
            "rotary kernel",
            rotary.rpartition(".models.")[2] if rotary else "model's own",
            OK if rotary else WARN,
            eager,
        )
    )
    rows += _family_rows(model)
    for why in families.fallbacks(model):
        rows.append(Row("fallback", "model's own code", WARN, why))
    return rows + plan_rows(model, call)


def plan_rows(model, call: dict | None = None) -> list[Row]:
    """The decode step and loop :func:`hf_zero3.decode.plan.plan` gives a call of ``model`` (on
    CUDA, lockstep's gathering ``gather``), with the reasons the call's warning and report give.
    The logits processors and stopping criteria are the call's own (``generate()`` builds them):
    here none beyond the step budget."""

    call = {**DEFAULT_CALL, **(call or {})}
    mode, gather, prompt = call.pop("decode"), call.pop("gather"), int(call.pop("prompt_length"))
    if mode not in decode_plan.DECODE_MODES or gather not in (*GATHER_MODES, "held"):
        raise ValueError(f"--call decode= takes {decode_plan.DECODE_MODES}, gather= {(*GATHER_MODES, 'held')}")
    gather = "all" if gather == "auto" else gather  # where every rank has the memory for it
    request = dataclasses.replace(decode_plan.DecodeRequest.of(model, mode, call), on_cuda=True)
    generation_config = copy.deepcopy(model.generation_config)
    generation_config.update(**{k: v for k, v in call.items() if hasattr(generation_config, k)})
    length = prompt + int(request.max_new_tokens or 0)
    decided = decode_plan.plan(model, request, gather=gather)
    if decided.compiled:
        cache = StaticCache(config=model.config, max_cache_len=length)
        static_loop.ready_cache(model, cache, length, length)
        kwargs = {**hf_up.cache_arguments(cache), "use_cache": True}
        inputs = decode_plan.LoopInputs(generation_config, kwargs, length=length)
        decided = decode_plan.plan(model, request, gather=gather, model_kwargs=kwargs, loop=inputs)
    shown = ", ".join(f"{k}={v!r}" for k, v in {"decode": mode, "gather": gather, **call}.items())
    rows = [Row("decode call", shown, OK, f"a {prompt}-token prompt, on CUDA")]
    rows.append(Row("decode step", decided.step, OK if decided.compiled else WARN, decided.step_reason or ""))
    if decided.loop is not None:
        ok = decided.loop == "hf_zero3"
        rows.append(Row("decode loop", decided.loop, OK if ok else WARN, decided.loop_reason or ""))
    return rows


def _family_rows(model) -> list[Row]:
    """The rows of what a family beyond dense attention needs from the static loop: its own
    generation inputs, sliding windows (rings), experts, linear-attention states."""

    rows = []
    config = model.config
    length = getattr(config, "max_position_embeddings", None) or 4096
    if type(model).prepare_inputs_for_generation is not GenerationMixin.prepare_inputs_for_generation:
        why = families.generation_inputs_reason(model, 1)
        family = families.FAMILIES.get(config.model_type)
        limit = getattr(config, family.inputs_limit, None) if why is None and family.inputs_limit else None
        value = f"{type(model).__name__}'s, checked" if why is None else f"{type(model).__name__}'s"
        note = f"the static loop for calls up to {family.inputs_limit} ({limit}) tokens" if limit else why or ""
        rows.append(Row("generation inputs", value, OK if why is None else WARN, note))
    cache = StaticCache(config=config, max_cache_len=length)
    windows = hf_up.sliding_layer_lengths(cache)
    if windows:
        why = ring_cache.why_not(model, cache)
        rows.append(
            Row(
                "sliding windows",
                f"{len(windows)} layers of {windows[0]} tokens",
                OK if why is None else WARN,
                "rings where a call passes the window" if why is None else f"transformers' loop past the window: {why}",
            )
        )
    experts = hf_up.experts_implementation(model)
    if experts is not None:
        rows.append(Row("experts", experts, OK, "transformers' experts implementation, in the compiled step"))
    count = hf_up.linear_attention_layers(cache)
    if count:
        note = "their states updated in place by the steps; the prompt's forward eager"
        rows.append(Row("linear attention", f"{count} layers", OK, note))
    return rows


def report(model: str | None = None, call: dict | None = None) -> dict:
    """Every part as ``{"versions": [...], "fast_path": [...], "model": [...]}`` of row dicts."""
    out = {"versions": version_rows(), "fast_path": fast_path_rows()}
    if model is not None:
        out["model"] = model_rows(model, call)
    return {k: [asdict(r) for r in rows] for k, rows in out.items()}


def render(data: dict) -> str:
    """The report as aligned text, one table per part."""
    titles = {"versions": "Versions", "fast_path": "Fast path", "model": "Model (decode parts on CUDA)"}
    lines = []
    for part, rows in data.items():
        lines.append(f"{titles[part]}:")
        width = max(len(r["name"]) for r in rows)
        vwidth = max(len(r["value"]) for r in rows)
        for r in rows:
            note = f"  {r['note']}" if r["note"] else ""
            lines.append(f"  {r['name']:<{width}}  {r['value']:<{vwidth}}  [{r['status']}]{note}")
        lines.append("")
    return "\n".join(lines)


def _call_keywords(items: list[str]) -> dict:
    """``KEY=VALUE`` words as keywords, each value a Python literal where it reads as one
    (``num_beams=2``, ``use_cache=False``), else the word itself (``gather=layer``)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--call takes KEY=VALUE words, not {item!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    """``hf_zero3 env [--model CONFIG_OR_DIR [--call KEY=VALUE ...]] [--json]``."""

    parser = argparse.ArgumentParser(prog="hf_zero3", description="hf_zero3's command line")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="installed versions, and which fast-path parts this install can run")
    env.add_argument("--model", help="a model directory or config.json: which decode parts it would get")
    env.add_argument(
        "--call",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="with --model, the generate() call to plan: generation keywords and decode, gather, prompt_length "
        f"(default {' '.join(f'{k}={v}' for k, v in DEFAULT_CALL.items())})",
    )
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        data = report(args.model, _call_keywords(args.call))
    except (ValueError, OSError) as exc:  # a config or path problem: one line, no traceback
        print(f"hf_zero3 env: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(data, indent=2) if args.json else render(data), file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

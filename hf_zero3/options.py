"""Every ``HF_ZERO3_*`` environment variable hf_zero3 reads, named in one registry, and the decode
path's options.

The memory plan's variables, one per field of :class:`~hf_zero3.compile.MemoryPlanConfig`
(``HF_ZERO3_<FIELD>``), come from its dataclass; :data:`ENVIRONMENT` holds all the others. The
memory plan's typo check accepts exactly these two sets, so a documented variable set for one
part of the package never makes another part refuse to start. A test holds this registry, the
names the code reads and the documentation's table to the same list.

:class:`DecodeOptions` says which parts of the fast decode path a lockstep call uses. Each field
left ``None`` comes from its environment variable, else from its default (the measured best), the
way accelerate's plugin dataclasses read ``ACCELERATE_*``. Every variable takes one grammar: a
switch (:func:`parse_switch`), or for a setting of several values one of them or a switch, on
meaning ``auto`` (:func:`parse_choice`); a value outside it raises instead of being guessed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Mapping

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_switch(name: str, raw: str) -> bool:
    """``raw`` (the value of variable ``name``) as a switch: 1/true/yes/on or 0/false/no/off, any
    case; anything else raises ``ValueError`` naming the variable."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a switch: set it to 1/true/yes/on or 0/false/no/off, or unset it")


def parse_choice(name: str, raw: str, choices: tuple[str, ...]) -> str:
    """A setting of several values (variable ``name``): one of ``choices``, or a switch (on:
    ``"auto"``, off: ``"off"``); anything else raises ``ValueError`` naming the variable."""
    value = raw.strip().lower()
    if value in choices:
        return value
    try:
        return "auto" if parse_switch(name, raw) else "off"
    except ValueError:
        raise ValueError(
            f"{name}={raw!r}: set it to one of {', '.join(choices)}, "
            "or a switch (1/true/yes/on: auto, 0/false/no/off: off)"
        ) from None


def _option(env: str, default, doc: str, choices: tuple[str, ...] = (), rollout=None):
    """A :class:`DecodeOptions` field: its variable, default and doc line; ``rollout``: its default
    in the rollouts of a TRL trainer ``Zero3Safe`` adapted (None: ``default``)."""
    rollout = default if rollout is None else rollout
    return field(
        default=None,
        metadata={"env": env, "default": default, "rollout": rollout, "doc": doc, "choices": choices},
    )


@dataclass(frozen=True)
class DecodeOptions:
    """Which parts of the fast decode path (``decode="compiled"``'s static loop) a lockstep call
    uses. Every part changes speed only: the tokens, the forwards and the agreements are the same
    with any of them off.

    Attributes:
        fuse_qkv: run a decode step's ``q_proj``/``k_proj``/``v_proj`` as one GEMM over a per-call
            weight copy (``HF_ZERO3_FUSE_QKV``; default on).
        triton_mlp: run SiLU MLPs through the Triton gate/up GEMM on CUDA (``HF_ZERO3_TRITON_MLP``;
            default on).
        split_k: ``down_proj`` and ``o_proj`` through the split-K Triton GEMM, with ``triton_mlp``
            (``HF_ZERO3_SPLIT_K``; default on).
        triton_attention: the Triton GQA decode-attention kernel: ``"auto"`` where batch x
            key/value heads reaches the GPU's SM count (at any batch where the decode step runs
            eagerly: the PyTorch form is unfused there), ``"always"`` wherever it runs, ``"off"``
            never (``HF_ZERO3_TRITON_ATTENTION``; default ``"auto"``).
        fuse_rope: where that kernel attends, Llama-style attention modules rotate, write the
            cache and attend in the one kernel (``HF_ZERO3_FUSE_ROPE``; default on).
        triton_qkv: with dependent launches, the fused q/k/v projection of a rope-kernel module
            runs the split-K Triton GEMM and the kernel sums its partials (``HF_ZERO3_TRITON_QKV``;
            default on).
        triton_norm: where the decode step runs eagerly (``compile_step`` off), each RMSNorm of a
            checked family as one Triton kernel instead of transformers' eight
            (``HF_ZERO3_TRITON_NORM``; default on; a compiled step fuses the norms itself).
        triton_rotary: where the decode step runs eagerly, the rotate-half rotary embedding of a
            checked family (Llama, Mistral, Qwen2, Qwen3) as one Triton kernel for q and one for k
            instead of ten (``HF_ZERO3_TRITON_ROTARY``; default on).
        dependent_launches: decode-step kernels as programmatic dependent launches: ``"auto"``
            where the GPU and Triton can (compute capability 9.0+), ``"on"`` the same with a
            warning where they cannot, ``"off"`` never (``HF_ZERO3_PDL``: one of them or a switch,
            on meaning ``"auto"``; default ``"auto"``).
        compile_prefill: compile the prompt's forward too (``HF_ZERO3_COMPILE_PREFILL``; default
            on, off in the rollouts of a TRL trainer ``Zero3Safe`` adapted; off: eager, without
            DeepSpeed's per-linear autograd Function). Compiled, a call's prompt forward is faster
            at small models and a process's first call is much longer; in a GRPO step the training
            dwarfs the prompt forward, so there it costs first-step seconds for no rollout time
            (benchmarks/HISTORY.md, First call and TRL rollouts).
        compile_step: compile the decode step (``HF_ZERO3_COMPILE_STEP``; default on, off in the
            rollouts of a TRL trainer ``Zero3Safe`` adapted; off: the model's own forward runs the
            steps, with the kernels above, and CUDA graphs capture it as they capture the compiled
            step). Off, a process compiles nothing for its first call (nor the greedy tail), and
            each step launches more kernels, as the compiled step fuses the model's pointwise work:
            a call decodes slower, which a GRPO step, where the training dominates, hardly shows
            (benchmarks/RESULTS.md and HISTORY.md, First call and TRL rollouts).
        compile_layers: with ``compile_step`` (and ``compile_prefill``), compile one decoder layer's
            forward, which every layer runs, instead of the whole model's, for the decode step (and
            the prompt's forward, a layer graph of its own) (``HF_ZERO3_COMPILE_LAYERS``; default
            off): Dynamo traces and inductor compiles one layer whatever the depth; the rest of the
            forward (embedding, masks, final norm and head) runs eagerly, inside the same CUDA
            graphs for the steps, and the fusion across layer boundaries is given up. Taken for the checked
            families whose layers all have one type; elsewhere the step compiles whole
            (:mod:`hf_zero3.decode.layer_compile`). Off by default: a shorter first call for a
            slower rollout (benchmarks/HISTORY.md, First call).
    """

    fuse_qkv: bool | None = _option("HF_ZERO3_FUSE_QKV", True, "q/k/v projections of a decode step as one GEMM")
    triton_mlp: bool | None = _option("HF_ZERO3_TRITON_MLP", True, "SiLU MLPs through the Triton gate/up GEMM")
    split_k: bool | None = _option("HF_ZERO3_SPLIT_K", True, "down_proj and o_proj through the split-K Triton GEMM")
    triton_attention: str | None = _option(
        "HF_ZERO3_TRITON_ATTENTION", "auto", "the Triton GQA decode-attention kernel", ("auto", "always", "off")
    )
    fuse_rope: bool | None = _option(
        "HF_ZERO3_FUSE_ROPE", True, "rotary embedding and cache write inside the attention kernel"
    )
    triton_qkv: bool | None = _option(
        "HF_ZERO3_TRITON_QKV", True, "fused q/k/v as split-K partials summed in the rope kernel"
    )
    triton_norm: bool | None = _option(
        "HF_ZERO3_TRITON_NORM", True, "an eager decode step's RMSNorms as one kernel each"
    )
    triton_rotary: bool | None = _option(
        "HF_ZERO3_TRITON_ROTARY", True, "an eager decode step's rotary embedding as one kernel for q and for k"
    )
    dependent_launches: str | None = _option(
        "HF_ZERO3_PDL", "auto", "decode kernels as programmatic dependent launches", ("auto", "on", "off")
    )
    compile_prefill: bool | None = _option(
        "HF_ZERO3_COMPILE_PREFILL", True, "the static loop compiles the prompt's forward", rollout=False
    )
    compile_step: bool | None = _option(
        "HF_ZERO3_COMPILE_STEP", True, "the static loop compiles the decode step", rollout=False
    )
    compile_layers: bool | None = _option(
        "HF_ZERO3_COMPILE_LAYERS", False, "the compiled step and prompt forward compile one decoder layer for all"
    )

    def __post_init__(self):
        for f in fields(self):
            value, choices = getattr(self, f.name), f.metadata["choices"]
            if value is None:
                continue
            if choices and value not in choices:
                raise ValueError(f"DecodeOptions.{f.name} must be one of {choices} or None, not {value!r}")
            if not choices and not isinstance(value, bool):
                raise ValueError(f"DecodeOptions.{f.name} must be True, False or None, not {value!r}")

    def resolved(self, env: Mapping[str, str] | None = None, rollout: bool = False) -> "DecodeOptions":
        """Every field set: this object's value, else its environment variable's (``env``:
        ``os.environ``), else the default (``rollout``: the call is a rollout of a TRL trainer
        ``Zero3Safe`` adapted, whose defaults differ where a field says so). A malformed variable
        raises ``ValueError`` (a lockstep call reads it inside the call, so every rank raises)."""
        env = os.environ if env is None else env
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                raw = env.get(f.metadata["env"], "")
                if not raw.strip():
                    value = f.metadata["rollout" if rollout else "default"]
                elif f.metadata["choices"]:
                    value = parse_choice(f.metadata["env"], raw, f.metadata["choices"])
                else:
                    value = parse_switch(f.metadata["env"], raw)
            values[f.name] = value
        return replace(self, **values)


#: The fast decode path's switches: one per :class:`DecodeOptions` field.
DECODE_SWITCHES: dict[str, str] = {
    f.metadata["env"]: f"{f.metadata['doc']} (DecodeOptions.{f.name})" for f in fields(DecodeOptions)
}

#: Every variable besides the memory plan's per-field ones.
ENVIRONMENT: dict[str, str] = {
    "HF_ZERO3_AGREE_TIMEOUT": "seconds an agreement waits for a rank that never arrives",
    "HF_ZERO3_PLAN_DUMP": "a directory where rank 0 writes the memory plan's profiles and plans",
    "HF_ZERO3_NATIVE": "the native prefetch gate: auto, cpu, or a switch (off: the PyTorch fallback)",
    "HF_ZERO3_BUILD_EXT": "setup.py: 1 compiles the native gate at install time",
    **DECODE_SWITCHES,
}

"""Model families whose code the fast decode path computes itself, keyed by transformers'
``config.model_type``.

A family names the transformers functions a decode step replaces: the MLP forward
(:mod:`..mlp_kernels`: the gate/up GEMM with SiLU, down split-K; Phi-3's fused gate/up MLP too),
the RMSNorm forward and the rotary embedding (:mod:`..norm_kernel`, :mod:`..rotary_kernel`, where
the step runs eagerly) and, for Llama, the
attention forward with its rotary embedding (:mod:`..gqa_attention`'s rope
kernel), each declared by the family's own module (:mod:`.llama`, :mod:`.mistral`, :mod:`.phi3`,
:mod:`.qwen2`, :mod:`.qwen3`). A replacement is taken only
where the module runs that very function (so a subclass that overrides it keeps its own) and the
function is the source hf_zero3 was checked against (``_upstream.transformers.CHECKED_SOURCES``):
a transformers release that changes what it computes makes the part fall back to the model's own
code, with the reason in ``hf_zero3_last_generate.decode_report.fallbacks``, instead of running the old
math. Everything else of the decode path (static buffers, compiled step, fused q/k/v GEMM, the
grouped-heads attention) works on any model through transformers' own interfaces.
"""

from __future__ import annotations

from ..._upstream import transformers as hf_up
from . import llama, mistral, phi3, qwen2, qwen3
from .family import Family

FAMILIES: dict[str, Family] = {m.FAMILY.model_type: m.FAMILY for m in (llama, mistral, phi3, qwen2, qwen3)}


def _checked(paths: tuple[str, ...]) -> bool:
    return all(hf_up.unchecked_reason(p) is None for p in paths)


def mlp_forwards() -> tuple:
    """The MLP forwards :mod:`..mlp_kernels` may compute (every family's that is the checked source)."""
    return tuple(hf_up.upstream_function(p) for f in FAMILIES.values() for p in f.mlp if _checked((p,)))


def fused_mlp_forwards() -> tuple:
    """The fused gate/up MLP forwards :mod:`..mlp_kernels` may compute (Phi-3's)."""
    return tuple(hf_up.upstream_function(p) for f in FAMILIES.values() for p in f.fused_mlp if _checked((p,)))


def norm_forwards() -> tuple:
    """The RMSNorm forwards :mod:`..norm_kernel` may compute (every family's that is the checked source)."""
    return tuple(hf_up.upstream_function(p) for f in FAMILIES.values() for p in f.norm if _checked((p,)))


def rotary_function(model) -> str | None:
    """The dotted path of ``model``'s family's ``apply_rotary_pos_emb`` that :mod:`..rotary_kernel`
    may replace (None: no family, none declared, or not the checked source)."""
    family = FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None))
    if family is None or not family.rotary or not _checked(family.rotary):
        return None
    return family.rotary[0]


def rope_forwards() -> tuple:
    """The attention forwards the rope kernel may compute (with their rotary helpers checked too)."""
    return tuple(
        hf_up.upstream_function(f.rope_attention[0])
        for f in FAMILIES.values()
        if f.rope_attention and _checked(f.rope_attention)
    )


def generation_inputs_reason(model, length: int) -> str | None:
    """Why a model whose class overrides ``prepare_inputs_for_generation`` cannot take the loop for a
    call of ``length`` tokens (None: its family's override is the source checked and, at that
    length, computes what GenerationMixin's does)."""
    cls = type(model)
    family = FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None))
    own = f"{cls.__name__} prepares its own generation inputs"
    path = family.generation_inputs if family is not None else None
    if path is None or hf_up.upstream_function(path) is not cls.prepare_inputs_for_generation:
        return own
    why = hf_up.unchecked_reason(path)
    if why is not None:
        return f"{own}, and {why}"
    limit = getattr(model.config, family.inputs_limit, None) if family.inputs_limit else None
    if isinstance(limit, int) and length > limit:
        return (
            f"{own}: it drops the cache once a sequence passes {family.inputs_limit} ({limit}), "
            f"and this call reaches {length} tokens"
        )
    return None


def fallbacks(model) -> tuple[str, ...]:
    """Why parts of ``model``'s family fall back to its own code (empty: none, or not a family)."""
    family = FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None))
    if family is None:
        return ()
    paths = family.mlp + family.fused_mlp + family.rope_attention + family.norm + family.rotary
    reasons = (hf_up.unchecked_reason(p) for p in paths)
    return tuple(dict.fromkeys(r for r in reasons if r is not None))

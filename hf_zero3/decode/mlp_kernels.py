"""A decode step's SiLU MLP (``down(silu(gate(x)) * up(x))``) with its gate/up half as one Triton
kernel, and its down projection and the attention's output projection as split-K Triton GEMMs.

Under ``torch.compile`` a Llama-style MLP at decode shapes is three cuBLAS GEMMs and inductor's
SiLU-mul kernel, and the gate and up GEMMs read their weights well below the GPU's memory
bandwidth. Here the gate/up pair is one kernel that reads both weights' slices in one pass and
writes the product (:mod:`hf_zero3.kernels.decode_gemm`, autotuned per shape on the GPU), faster
than the two cuBLAS GEMMs (``benchmarks/generation/decode_gemm_probe.py``; see the kernel probes
and the ablations in benchmarks/HISTORY.md). Down (e.g. 2048 output columns over an 8192
reduction) and ``o_proj`` (2048 over 2048) give a kernel with one program per output slice too
few programs; split four ways along the reduction they beat cuBLAS (same probe), and
their float32 partials' sum (with the cast to the model's dtype) folds into the kernel that
consumes them (the residual add and the next norm): no reduction kernel of its own, where
cuBLAS's split-K down launches one.

hf_zero3's static loop uses it for its decode steps only (at most 64 rows), on CUDA, for MLP
modules that run a family's checked MLP forward (:mod:`.families`: Llama, Mistral, Qwen2, Qwen3;
Phi-3's fused ``gate_up_proj``, whose two row halves the kernel reads as gate and up) whose
projections are plain bias-free ``nn.Linear`` layers
with a SiLU activation, without hooks or patched forwards (a LoRA layer, a quantized linear keep
the model's own MLP), and for the plain bias-free ``o_proj`` layers of attention modules. It reads
the gathered weights in place: no copy. ``DecodeOptions(triton_mlp=False)`` turns all of it off,
``split_k=False`` the split-K GEMMs only (down back to cuBLAS); both decided when a decode loop
is built.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from .._upstream import torch as torch_up
from ..kernels import decode_gemm
from . import families

_FORWARDS: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()


def _plain_linear(m) -> bool:
    return (
        type(m) is nn.Linear
        and m.bias is None
        and torch_up.runs_class_forward(m)
        and type(m.weight.data) is torch.Tensor
        and m.weight.dim() == 2
        and m.weight.is_contiguous()
    )


def _fused(mlp: nn.Module, fused: tuple) -> bool:
    """``mlp`` runs a family's checked fused MLP forward (Phi-3's ``gate_up_proj``, then
    ``up * act(gate)`` of its two halves, then ``down_proj``; ``fused``:
    :func:`.families.fused_mlp_forwards`'s, resolved by the caller)."""
    return type(mlp).forward in fused


def _forwards() -> tuple[tuple, tuple]:
    """(the checked MLP forwards, the checked fused ones), resolved once for a pass over a model's
    modules: resolving and checking them for every module was most of a call's bind."""
    return families.mlp_forwards(), families.fused_mlp_forwards()


def _gate_up(projs) -> tuple:
    """The gate and up weights of an MLP's projections, ``(gate, up, down)`` or ``(gate_up, down)``:
    a fused ``gate_up_proj``'s two row halves are contiguous views, taken where the forward runs, as
    ZeRO-3 gathers into the same Parameter."""
    if len(projs) == 2:
        w = projs[0].weight
        n = w.shape[0] // 2
        return w[:n], w[n:]
    return projs[0].weight, projs[1].weight


def applies(mlp: nn.Module, forwards: tuple[tuple, tuple] | None = None) -> bool:
    """``mlp`` runs a family's checked MLP forward (:func:`.families.mlp_forwards`, or a fused one:
    :func:`.families.fused_mlp_forwards`) with plain projections and a SiLU activation
    (``forwards``: :func:`_forwards`'s, where the caller checks every module of a model)."""
    if not torch_up.runs_class_forward(mlp):
        return False
    plain, fused = _forwards() if forwards is None else forwards
    if _fused(mlp, fused):
        names, act = ("gate_up_proj", "down_proj"), getattr(mlp, "activation_fn", None)
    elif type(mlp).forward in plain:
        names, act = ("gate_proj", "up_proj", "down_proj"), getattr(mlp, "act_fn", None)
    else:
        return False
    projs = [getattr(mlp, n, None) for n in names]
    if not all(_plain_linear(m) for m in projs):
        return False
    if not (isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")):
        return False
    if len(projs) == 2 and projs[0].out_features % 2:
        return False
    (gate, up), down = _gate_up(projs), projs[-1]
    ws = (gate, up, down.weight)
    return (
        len({(w.dtype, w.device) for w in ws}) == 1
        and gate.shape == up.shape
        and down.in_features == gate.shape[0]
        and ws[0].dtype in (torch.float16, torch.bfloat16)
    )


def applies_split(name: str, m: nn.Module) -> bool:
    """``m`` (named ``name``) is an attention module's plain bias-free half-precision ``o_proj``
    with a reduction long enough to split."""
    return (
        name.rsplit(".", 1)[-1] == "o_proj"
        and _plain_linear(m)
        and m.weight.dtype in (torch.float16, torch.bfloat16)
        and decode_gemm.split_for(m.in_features) > 1
    )


def plan(model: nn.Module, device, split: bool = True) -> tuple[str, ...]:
    """Names of ``model``'s modules the decode steps run through the kernels: the MLPs, and the
    ``o_proj`` layers with ``split`` (down and ``o_proj`` split-K; none off CUDA or without
    Triton); builds the kernels, outside any trace."""
    if torch.device(device).type != "cuda" or decode_gemm.load() is None:
        return ()
    forwards = _forwards()
    return tuple(
        name for name, m in model.named_modules() if applies(m, forwards) or (split and applies_split(name, m))
    )


def _split(op, x2d: torch.Tensor, weight: torch.Tensor, slices: int) -> torch.Tensor:
    """``x2d @ weight.T`` through the split-K ``op``: the partials' sum, in the model's dtype (as a
    GEMM rounds its float32 accumulator once)."""
    return op(x2d, weight, slices).sum(0).to(x2d.dtype)


def _fits(rows: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        rows.shape[0] <= decode_gemm.MAX_ROWS
        and rows.is_contiguous()
        and x.dtype == weight.dtype
        and not torch.is_autocast_enabled(x.device.type)
    )


def _ops(device, dependent: bool) -> tuple:
    """(gate/up op, split-K op): :func:`~hf_zero3.kernels.decode_gemm.load`'s, or with ``dependent``
    its programmatic dependent launches (the loop planned them: they are available)."""
    if dependent:
        ops = decode_gemm.load_dependent(device)
        if ops is not None:
            return ops
    return decode_gemm.load()[1:]


def _forward(mlp: nn.Module, split: bool, dependent: bool = False, fused: tuple | None = None):
    # the projections and the activation, not the MLP: the forward (kept per MLP in a weak
    # dictionary) must not hold its own key alive; ``fused`` as :func:`_fused` takes it, resolved
    # here where the caller did not
    fused = families.fused_mlp_forwards() if fused is None else fused
    *projs, act = _parts(mlp, fused)  # (gate, up, down) or (gate_up, down)
    down = projs[-1]
    gate_up_silu, split_op = _ops(down.weight.device, dependent)  # outside the trace, as the loop plans
    slices = decode_gemm.split_for(down.in_features) if split else 1

    def forward(x):
        rows = x.reshape(-1, x.shape[-1])
        gate, up = _gate_up(projs)
        if not _fits(rows, x, gate):  # the model's own computation (and autocast's casts)
            if len(projs) == 2:
                g, u = projs[0](x).chunk(2, dim=-1)
                return down(u * act(g))
            return down(act(projs[0](x)) * projs[1](x))
        h = gate_up_silu(rows, gate, up)
        out = _split(split_op, h, down.weight, slices) if slices > 1 else down(h)
        return out.view(*x.shape[:-1], down.out_features)

    return forward


def _split_forward(linear: nn.Linear, dependent: bool = False):
    # the weight, not the layer: the forward (kept per layer in a weak dictionary) must not hold
    # its own key alive; ZeRO-3 gathers into this same Parameter
    weight, n = linear.weight, linear.out_features
    split_op, slices = _ops(weight.device, dependent)[1], decode_gemm.split_for(linear.in_features)

    def forward(x):
        rows = x.reshape(-1, x.shape[-1])
        if not _fits(rows, x, weight):
            return F.linear(x, weight)  # the layer's own computation (plain: no bias)
        return _split(split_op, rows, weight, slices).view(*x.shape[:-1], n)

    return forward


def _part_names(m: nn.Module, fused: tuple) -> tuple[str, ...]:
    if _fused(m, fused):
        return ("gate_up_proj", "down_proj", "activation_fn")
    return ("gate_proj", "up_proj", "down_proj", "act_fn")


def _parts(m: nn.Module, fused: tuple) -> tuple:
    """What a kept forward of ``m`` closes over (a new one is made when any of it was replaced;
    ``fused``: as :func:`_fused` takes it)."""
    if isinstance(m, nn.Linear):
        return (m.weight,)
    return tuple(getattr(m, n) for n in _part_names(m, fused))


def bind(model: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    """The named modules (:func:`plan`) that still apply, once per call (the decode steps then
    patch only these)."""
    forwards = _forwards()
    return [m for name, m in torch_up.named_submodules(model, names) if applies(m, forwards) or applies_split(name, m)]


def counts(modules: list[nn.Module], split: bool) -> tuple[int, int]:
    """(MLPs, projections through split-K) among ``modules`` (:func:`bind`'s), for the stats."""
    mlps = [m for m in modules if not isinstance(m, nn.Linear)]
    downs = sum(1 for m in mlps if decode_gemm.split_for(m.down_proj.in_features) > 1) if split else 0
    return len(mlps), len(modules) - len(mlps) + downs


def use(modules: list[nn.Module], split: bool, dependent: bool = False):
    """Inside: ``modules`` (:func:`bind`) run through the kernels (``split``: down through the
    split-K kernel too; ``dependent``: the kernels as programmatic dependent launches; as the loop
    was planned)."""
    fused = families.fused_mlp_forwards()  # once for the step, not once per MLP
    return torch_up.instance_forwards((m, _kept_forward(m, split, dependent, fused)) for m in modules)


def _kept_forward(m: nn.Module, split: bool, dependent: bool, fused: tuple):
    """``m``'s kernel forward for ``(split, dependent)``, built once while its parts stay the same."""
    kept = _FORWARDS.setdefault(m, {})
    parts = _parts(m, fused)
    entry = kept.get((split, dependent))
    if entry is None or len(entry[0]) != len(parts) or any(a is not b for a, b in zip(entry[0], parts)):
        entry = kept[(split, dependent)] = (
            parts,
            _split_forward(m, dependent) if isinstance(m, nn.Linear) else _forward(m, split, dependent, fused),
        )
    return entry[1]

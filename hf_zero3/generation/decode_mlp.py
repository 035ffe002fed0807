"""A decode step's SiLU MLP (``down(silu(gate(x)) * up(x))``) with its gate/up half as one Triton
kernel.

Under ``torch.compile`` a Llama-style MLP at decode shapes is three cuBLAS GEMMs and inductor's
SiLU-mul kernel; on one H200 (Llama-3.2-1B shape) the gate and up GEMMs read their weights at
2.6-2.9 TB/s. Here the gate/up pair is one kernel that reads both weights' slices in one pass and
writes the product (:mod:`hf_zero3.kernels.decode_gemm`, autotuned per shape on the GPU): 19.9 vs
25.8 us at 64 rows, 18.3 vs 23.1 at 8 (``benchmarks/generation/decode_gemm_probe.py``). The down
projection keeps cuBLAS, which was faster there (14.4 vs 19.8 us).

hf_zero3's static loop uses it for its decode steps only (at most 64 rows), on CUDA, for MLP
modules of the classes below whose three projections are plain bias-free ``nn.Linear`` layers
with a SiLU activation, without hooks or patched forwards (a LoRA layer, a quantized linear keep
the model's own MLP). It reads the gathered weights in place: no copy. ``HF_ZERO3_TRITON_MLP=0``
turns it off (read when a decode loop is built).
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch
from torch import nn

from ..kernels import decode_gemm

__all__ = ["CLASSES", "enabled", "plan", "bind", "use", "applies"]

# MLP classes whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x))
CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
_FORWARDS: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()


def enabled() -> bool:
    return os.environ.get("HF_ZERO3_TRITON_MLP", "1").strip().lower() not in ("0", "false", "no", "off")


def _plain_linear(m) -> bool:
    return (type(m) is nn.Linear and m.bias is None and not m._forward_hooks and not m._forward_pre_hooks
            and "forward" not in vars(m) and type(m.weight.data) is torch.Tensor and m.weight.dim() == 2
            and m.weight.is_contiguous())


def applies(mlp: nn.Module) -> bool:
    """``mlp`` is one of :data:`CLASSES` with plain projections and a SiLU activation."""
    if type(mlp).__name__ not in CLASSES or mlp._forward_hooks or mlp._forward_pre_hooks or "forward" in vars(mlp):
        return False
    gate, up, down = (getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
    if not all(_plain_linear(m) for m in (gate, up, down)):
        return False
    act = getattr(mlp, "act_fn", None)
    if not (isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")):
        return False
    ws = (gate.weight, up.weight, down.weight)
    return (len({(w.dtype, w.device) for w in ws}) == 1 and gate.weight.shape == up.weight.shape
            and down.in_features == gate.out_features and ws[0].dtype in (torch.float16, torch.bfloat16))


def plan(model: nn.Module, device) -> tuple[str, ...]:
    """Names of ``model``'s MLP modules the decode steps run through the kernels (none off CUDA,
    without Triton, or with ``HF_ZERO3_TRITON_MLP=0``); builds the kernels, outside any trace."""
    if not enabled() or torch.device(device).type != "cuda" or decode_gemm.load() is None:
        return ()
    return tuple(name for name, m in model.named_modules() if applies(m))


def _forward(mlp: nn.Module):
    # the projections and the activation, not the MLP: the forward (kept per MLP in a weak
    # dictionary) must not hold its own key alive
    gate, up, down, act = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn
    _, gate_up_silu = decode_gemm.load()

    def forward(x):
        rows = x.reshape(-1, x.shape[-1])
        if (rows.shape[0] > decode_gemm.MAX_ROWS or not rows.is_contiguous() or x.dtype != gate.weight.dtype
                or torch.is_autocast_enabled(x.device.type)):
            return down(act(gate(x)) * up(x))  # the model's own computation (and autocast's casts)
        # down stays the model's (cuBLAS): a 2048-column output gives the narrow-slice kernel too
        # few programs (1xH200: 19.8 vs 14.4 us at 64 rows, decode_gemm_probe.py)
        return down(gate_up_silu(rows, gate.weight, up.weight)).view(*x.shape[:-1], down.out_features)

    return forward


def bind(model: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    """The named MLP modules (:func:`plan`) that still apply, once per call (the decode steps then
    patch only these)."""
    bound = []
    for name in names:
        try:
            mlp = model.get_submodule(name)
        except AttributeError:  # the model changed since the plan
            continue
        if applies(mlp):
            bound.append(mlp)
    return bound


@contextlib.contextmanager
def use(mlps: list[nn.Module]):
    """Inside: ``mlps`` (:func:`bind`) run through the kernels."""
    patched = []
    try:
        for mlp in mlps:
            fn = _FORWARDS.get(mlp)
            if fn is None:
                fn = _FORWARDS[mlp] = _forward(mlp)
            mlp.forward = fn
            patched.append(mlp)
        yield
    finally:
        for mlp in patched:
            vars(mlp).pop("forward", None)

"""An eager decode step's RMSNorms through one Triton kernel each (:mod:`hf_zero3.kernels.rms_norm`).

With the decode step eager (``DecodeOptions(compile_step=False)``, TRL rollouts' default) each
RMSNorm of the model's own forward launches eight kernels (transformers' Llama RMSNorm: the casts,
the square, the mean, the epsilon, the root, the two products); two norms a layer plus the final
one make them a large share of the step's launches, each short at decode shapes. Here each is one
kernel. A compiled step (or compiled layer) fuses the norms itself, so the loop patches the norms
only around steps that run eagerly (:class:`~hf_zero3.decode.features.NormKernel`).

Taken for modules that run a family's checked RMSNorm forward (:mod:`.families`: Llama, Mistral,
Qwen2, Qwen3, Phi-3), without hooks or patched forwards, with a half-precision weight, on CUDA; an
input the kernel does not take (another dtype, rows not contiguous, autocast on) runs the module's
own computation. ``DecodeOptions(triton_norm=False)`` turns it off.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .._upstream import torch as torch_up
from ..kernels import rms_norm
from . import families

_FORWARDS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def applies(m: nn.Module, forwards: tuple | None = None) -> bool:
    """``m`` runs a family's checked RMSNorm forward with a half-precision vector weight
    (``forwards``: :func:`.families.norm_forwards`'s, resolved once by a caller that checks every
    module of a model)."""
    forwards = families.norm_forwards() if forwards is None else forwards
    if type(m).forward not in forwards or not torch_up.runs_class_forward(m):
        return False
    w = getattr(m, "weight", None)
    return (
        isinstance(w, torch.Tensor)
        and type(w.data) is torch.Tensor
        and w.dim() == 1
        and w.dtype in (torch.float16, torch.bfloat16)
        and isinstance(getattr(m, "variance_epsilon", None), float)
    )


def plan(model: nn.Module, device) -> tuple[str, ...]:
    """Names of ``model``'s RMSNorms an eager decode step runs through the kernel (none off CUDA or
    without Triton); builds the kernel, outside any trace."""
    if torch.device(device).type != "cuda" or rms_norm.load() is None:
        return ()
    forwards = families.norm_forwards()
    return tuple(name for name, m in model.named_modules() if applies(m, forwards))


def bind(model: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    """The named modules (:func:`plan`) that still apply, once per call."""
    forwards = families.norm_forwards()
    return [m for _, m in torch_up.named_submodules(model, names) if applies(m, forwards)]


def use(modules: list[nn.Module]):
    """Inside: ``modules`` (:func:`bind`) run through the kernel."""
    return torch_up.instance_forwards((m, _kept_forward(m)) for m in modules)


def _forward(weight: torch.Tensor, eps: float):
    # the weight, not the module: the forward (kept per module in a weak dictionary) must not hold
    # its own key alive; ZeRO-3 gathers into this same Parameter
    norm = rms_norm.load()

    def forward(x):
        if x.dtype != weight.dtype or not x.is_contiguous() or torch.is_autocast_enabled(x.device.type):
            # the module's own computation (transformers' Llama RMSNorm)
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            return weight * h.to(x.dtype)
        return norm(x.view(-1, x.shape[-1]), weight, eps).view(x.shape)

    return forward


def _kept_forward(m: nn.Module):
    """``m``'s kernel forward, built once while its weight and epsilon stay the same."""
    kept = _FORWARDS.get(m)
    if kept is None or kept[0] is not m.weight or kept[1] != m.variance_epsilon:
        kept = _FORWARDS[m] = (m.weight, m.variance_epsilon, _forward(m.weight, m.variance_epsilon))
    return kept[2]

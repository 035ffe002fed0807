"""What hf_zero3's Triton kernels share: whether Triton and ``torch.library``'s Triton ops are
here, and how a kernel is launched. Triton's interpreter (``TRITON_INTERPRET=1``, which the CPU
tests use) turns ``@triton.jit`` functions into objects ``torch.library.wrap_triton`` does not
take; outside ``torch.compile`` the two launch alike, so an interpreted kernel is called directly."""

from __future__ import annotations

import importlib.util
import inspect
import os

import torch


def missing() -> str | None:
    """Why Triton kernels cannot be built here (None: they can)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if not hasattr(torch.library, "triton_op") or not hasattr(torch.library, "wrap_triton"):
        return f"torch {torch.__version__} has no torch.library.triton_op (torch >= 2.6)"
    return None


def interpreted() -> bool:
    """Triton runs its interpreter in this process (read when a kernel is built)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def launcher(kernel):
    """``kernel`` as ``torch.library.triton_op`` bodies launch it (``launcher(k)[grid](...)``)."""
    return kernel if interpreted() else torch.library.wrap_triton(kernel)


def op(name: str, mutates_args: tuple[str, ...], fake):
    """A decorator: the kernel's launch function as the ``torch.library`` op ``name``; a
    ``triton_op`` (``torch.compile`` traces into its Triton launch, CUDA graphs capture it), or under
    Triton's interpreter a ``custom_op`` with ``fake`` (same arguments, returns an empty output) as
    its shape function: a trace runs an op on fake tensors, which an interpreted kernel cannot read."""

    def wrap(fn):
        if not interpreted():
            return torch.library.triton_op(name, mutates_args=mutates_args)(fn)
        built = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        built.register_fake(fake)
        return built

    return wrap


def autotune(kernel, configs, key, **kwargs):
    """``triton.autotune`` with its results kept in Triton's cache directory (``cache_results``,
    where this Triton has it): each new process otherwise benchmarks every configuration of every
    shape again before its first decode step. ``TRITON_CACHE_DIR`` chooses where they live."""
    import triton

    if "cache_results" in inspect.signature(triton.autotune).parameters:
        kwargs["cache_results"] = True
    return triton.autotune(configs=configs, key=key, **kwargs)(kernel)

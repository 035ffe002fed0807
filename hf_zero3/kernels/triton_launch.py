"""What hf_zero3's Triton kernels share: whether Triton and ``torch.library``'s Triton ops are
here, and how a kernel is launched. Triton's interpreter (``TRITON_INTERPRET=1``, which the CPU
tests use) turns ``@triton.jit`` functions into objects ``torch.library.wrap_triton`` does not
take; outside ``torch.compile`` the two launch alike, so an interpreted kernel is called directly."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import os
from concurrent.futures import ThreadPoolExecutor

import torch


def missing() -> str | None:
    """Why Triton kernels cannot be built here (None: they can)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if not hasattr(torch.library, "triton_op") or not hasattr(torch.library, "wrap_triton"):
        return f"torch {torch.__version__} has no torch.library.triton_op (torch >= 2.6)"
    return None


@functools.cache
def jit_kernel(module: str, name: str):
    """The ``@triton.jit`` kernel ``name`` of ``hf_zero3.kernels.<module>`` (a module that imports
    Triton), imported on first use; None where Triton kernels cannot be built (:func:`missing`)."""
    if missing() is not None:
        return None
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


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
    import triton  # optional: triton

    if "cache_results" in inspect.signature(triton.autotune).parameters:
        kwargs["cache_results"] = True
    tuner = triton.autotune(configs=configs, key=key, **kwargs)(kernel)
    compile_before_timing(tuner)
    return tuner


def compile_before_timing(tuner) -> bool:
    """Make ``tuner`` (a ``triton.autotune`` kernel) compile all of a new shape's configurations at
    once before it times them, instead of one after another as each is timed. Triton's compiler
    releases the GIL, so threads compile the configurations side by side, and compiling is most of
    what a new shape's first launch costs (benchmarks/HISTORY.md, First call). The timing, the
    choice and the on-disk results are the autotuner's own. Where this Triton's autotuner has no
    ``prune_configs``/``_bench`` of the expected form it tunes as it did (False)."""
    prune, bench = getattr(tuner, "prune_configs", None), getattr(tuner, "_bench", None)
    if prune is None or bench is None or "config" not in inspect.signature(bench).parameters:
        return False
    pending: list = []  # the configurations of the shape being tuned, not yet compiled

    def prune_configs(kwargs):
        configs = prune(kwargs)
        pending[:] = configs if len(configs) > 1 else []
        return configs

    def timed(*args, config, **meta):
        if pending:  # the first timing of a shape (a cached choice times nothing)
            configs, pending[:] = list(pending), []
            _compile_all(tuner.fn, args, meta, configs)
        return bench(*args, config=config, **meta)

    tuner.prune_configs, tuner._bench = prune_configs, timed
    return True


def _compile_all(fn, args: tuple, meta: dict, configs: list) -> None:
    """Compile ``fn`` for each of ``configs`` with the launch's ``args`` and ``meta`` (Triton's
    ``warmup``: compiled and kept in the kernel's cache, not launched), on threads that use the
    caller's GPU. A configuration that fails to compile is left to the timing, which fails it again
    and scores or raises it as Triton does."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def one(config):
        try:
            with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
                fn.run(*args, **dict(meta, **config.all_kwargs(), warmup=True))
        except Exception:  # noqa: BLE001 - see the docstring: the timing meets it again
            pass

    with ThreadPoolExecutor(min(len(configs), os.cpu_count() or 1)) as pool:
        list(pool.map(one, configs))

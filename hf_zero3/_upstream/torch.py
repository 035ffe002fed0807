"""torch internals hf_zero3 reads. Checked against torch 2.11 (CUDA) and 2.13 (CPU)."""

from __future__ import annotations

import contextlib
import os

import torch
import torch._dynamo
import torch._inductor.config as inductor_config
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch._inductor import compile_fx
from torch._inductor.cpu_vec_isa import pick_vec_isa
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed import distributed_c10d

try:
    from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
except ImportError:  # a torch without it leaves Triton on its own ptxas throughout
    _set_triton_ptxas_path = None

CHECKED = "torch 2.11.0+cu130, 2.13.0+cpu"


def cuda_memory_fraction(device: torch.device) -> float:
    """The per-process cap set by ``torch.cuda.set_per_process_memory_fraction`` (1.0 if none).

    torch < 2.9 has no getter; treat it as uncapped there.
    """
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is None:
        return 1.0
    try:
        return float(getter(device))
    except Exception:
        return 1.0


def inductor_dependent_launch_options() -> dict:
    """Inductor options that generate its Triton kernels as programmatic dependent launches
    (``triton.enable_pdl``, torch >= 2.9: pytorch/pytorch#160928; off by default upstream,
    pytorch/pytorch#167687 was held back over regressions elsewhere); empty where this torch has none."""
    return {"triton.enable_pdl": True} if hasattr(inductor_config.triton, "enable_pdl") else {}


def inductor_options_without_alignment_asserts() -> dict:
    """Inductor options that leave out its run-time alignment checks of fallback kernels' outputs
    (``alignment_asserts``), for hf_zero3's own compiled functions.

    Inductor checks every output of a fallback kernel it can prove aligned, including an output
    the kernel leaves undefined: ``aten._scaled_dot_product_cudnn_attention`` without its
    log-sum-exp (inference) returns ``None`` there, and the check raises ``TypeError: expected
    Tensor()`` (pytorch/pytorch#196226, open). It shows in a prompt forward with a padding mask
    (which selects cuDNN attention on Hopper) after DeepCompile's process-wide patches, not in the
    same forward under plain ZeRO-3. The checks assert what the caching allocator guarantees;
    without them the kernels are the same.
    """
    return {"alignment_asserts": False} if hasattr(inductor_config, "alignment_asserts") else {}


def add_one_to_each(tensors: list) -> None:
    """``t += 1`` for every tensor of ``tensors`` in one launch (``torch._foreach_add_``: one
    kernel for the decode step's per-layer cache fill counts instead of one per layer)."""
    torch._foreach_add_(tensors, 1)


def mark_dynamic_if_possible(t: torch.Tensor, dim: int) -> None:
    """Dynamo compiles ``t``'s dimension ``dim`` as dynamic from its first graph, where it can
    (``torch._dynamo.maybe_mark_dynamic``)."""
    torch._dynamo.maybe_mark_dynamic(t, dim)


def forward_hook_counts(module: torch.nn.Module) -> tuple[int, int]:
    """How many forward and forward-pre hooks ``module`` itself has (``_forward_hooks``,
    ``_forward_pre_hooks``: ``nn.Module`` keeps them there and has no public getter)."""
    return len(module._forward_hooks), len(module._forward_pre_hooks)


def dynamo_compile_errors() -> tuple[type, ...]:
    """What ``torch.compile(fullgraph=True)`` raises when a function does not compile into one graph
    (``torch._dynamo.exc``): Dynamo's errors, the recompile limit among them."""
    return (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit)


def profiler_running() -> bool:
    """Whether a ``torch.profiler`` (or autograd profiler) records on this thread
    (``torch._C._autograd._profiler_enabled``): a ``record_function`` opened without one still
    costs its two operator calls."""
    return torch._C._autograd._profiler_enabled()


# Triton's kernel cache and its autotuning cache key every kernel by the ptxas it compiles with.
# Inductor points Triton at torch's bundled ptxas (``TRITON_PTXAS_PATH``, from
# ``_set_triton_ptxas_path`` in ``torch/_inductor/runtime/compile_tasks.py``; torch 2.11's is CUDA
# 12.8, Triton 3.6's own is 13.0) only when it compiles a kernel itself, not when it loads one from
# its FX graph cache. A first run therefore compiled hf_zero3's GEMMs with one ptxas and a run
# from warm caches with the other: every Triton kernel of the decode loop missed both caches again
# (benchmarks/RESULTS.md, first call). No upstream issue found; choosing it before any compile
# makes every process key its kernels alike.
def pin_triton_ptxas() -> None:
    """Point Triton at the ptxas Inductor would choose, now, unless ``TRITON_PTXAS_PATH`` is set."""
    if os.environ.get("TRITON_PTXAS_PATH") is not None or _set_triton_ptxas_path is None:
        return
    _set_triton_ptxas_path()


def runs_class_forward(module: torch.nn.Module) -> bool:
    """Calling ``module`` runs its class's ``forward`` and nothing else: no ``forward`` set on the
    instance, no forward or forward-pre hooks (what the decode step may replace with its own)."""
    return "forward" not in vars(module) and not module._forward_hooks and not module._forward_pre_hooks


@contextlib.contextmanager
def instance_forwards(pairs):
    """Inside: each module of ``pairs`` (``(module, forward)``) runs ``forward`` as its own
    (``nn.Module`` calls an instance's ``forward`` before its class's); after, each forward set
    here is removed again. ``pairs`` is read inside, so a forward built lazily that raises leaves
    the ones set before it removed."""
    patched = []
    try:
        for module, forward in pairs:
            module.forward = forward
            patched.append(module)
        yield
    finally:
        for module in patched:
            vars(module).pop("forward", None)


@contextlib.contextmanager
def graph_capture(graph: "torch.cuda.CUDAGraph", pool=None):
    """Capture into ``graph`` (sharing ``pool``, a graph's ``pool()``) on a side stream, as
    ``torch.cuda.graph`` does without what its ``__enter__`` does first in torch 2.11: a device
    synchronize and ``torch.cuda.empty_cache()``. Emptying the caching allocator returns every
    cached block (a gathered model's, a training step's) to the driver, so the memory is allocated
    anew after it, often at other addresses, which a kept graph cannot replay over: a decode call
    that captured made the next call capture again (benchmarks/RESULTS.md, Rollout decode). A capture
    that needs memory the cache holds still gets it: the allocator frees cached blocks and retries
    before it reports out-of-memory. (The emptying came with the capture context, pytorch/pytorch#63269.)"""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin(*(() if pool is None else (pool,)))
        try:
            yield
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)


def named_submodules(model: torch.nn.Module, names):
    """``(name, module)`` for each of ``names`` that is still a submodule of ``model`` (a name
    planned earlier whose module is gone since is skipped)."""
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        yield name, module


def module_has(module: torch.nn.Module, name: str) -> bool:
    """``hasattr(module, name)`` without ``nn.Module.__getattr__``'s failed lookup (it raises, and
    the caller runs this over every module of a model once per generate call): the instance's own
    attributes, its parameter, buffer and submodule tables, and its class."""
    return (
        name in module.__dict__
        or name in module._parameters
        or name in module._buffers
        or name in module._modules
        or hasattr(type(module), name)
    )


def default_store():
    """The c10d store every rank joined through (the agreement diagnostics write positions there)."""
    return distributed_c10d._get_default_store()


def group_timeout(group):
    """A process group's collective timeout (a ``timedelta``), or None when it cannot be read."""
    group = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:
            continue
    return None


def compiled_call(module: torch.nn.Module):
    """The in-place compiled ``__call__`` set by ``nn.Module.compile`` (None: not compiled)."""
    return getattr(module, "_compiled_call_impl", None)


def set_compiled_call(module: torch.nn.Module, impl) -> None:
    module._compiled_call_impl = impl


def mark_side_effectful(op) -> None:
    """Keep FX's and inductor's dead-code elimination from dropping ``op`` (output unused)."""
    torch.fx.node._side_effectful_functions.add(op)


def real_tensors():
    """Leave Dynamo's fake-tensor mode for the block (a compile pass running real collectives)."""
    return unset_fake_temporarily()


def dynamo_graph_count() -> int:
    """Graphs Dynamo has compiled in this process (its ``unique_graphs`` counter)."""
    return int(counters["stats"]["unique_graphs"])


def inductor_compile_module():
    """``torch._inductor.compile_fx``: torch.compile's inductor backend calls this module's
    ``compile_fx`` for each graph, looked up at each compile (the test launcher wraps it)."""
    return compile_fx


def probe_cpu_vec_isa() -> None:
    """Inductor's probe of the CPU's vector ISA (test programs built and run once per process,
    then cached): a process that forks ranks answers it for all of them."""
    pick_vec_isa()


# Dynamo refuses a module with backward hooks unless compiled autograd is on ("Module-level
# backwards hooks require compiled autograd"), also under ``no_grad``, where such a hook never fires
# (``BackwardHook.setup_input_hook`` and ``setup_output_hook`` return their tensors untouched when
# grad is off). DeepSpeed's ZeRO-3 puts one on every leaf module (``reduce_leaf_module_grads``; a
# MoE block such as Qwen3-MoE's or Mixtral's is made a leaf by default in DeepSpeed 0.19), so a
# compiled decode step of any MoE model under ZeRO-3 ran eagerly.
def backward_hooks_suspended(model: torch.nn.Module):
    """Inside (with gradients off only): the module backward hooks of ``model``'s modules do not
    run, which they would not under ``no_grad`` anyway, and a compiled forward traces no
    backward-hook wrapper."""
    entries = []
    if not torch.is_grad_enabled():
        for m in model.modules():
            for table in (m._backward_hooks, m._backward_pre_hooks):
                entries.extend((table, key) for key in list(table))
    return hooks_suspended(entries)


# Dynamo does not guard on nn.Module hooks by default (``torch._dynamo.config.
# skip_nnmodule_hook_guards``, True in torch 2.11-2.13): a compiled forward keeps running the hooks
# it was traced with after hooks are added or removed. A decode step compiled once per model class
# and called across many generate() calls must see the hooks each call has; found when a hook a
# test registered after the first compile never ran in the compiled steps.
def hook_guards():
    """Inside: forwards compiled here guard on their modules' hooks (a changed hook set recompiles)."""
    return torch._dynamo.config.patch(skip_nnmodule_hook_guards=False)


@contextlib.contextmanager
def hooks_suspended(entries):
    """Inside: the hooks ``entries`` names (``(hook table, handle id)`` pairs of torch's per-module
    tables) do not run; after, each table holds them again in its original order, a hook removed
    meanwhile stays removed and any hook added meanwhile comes after them. Dict work per table
    (it serves ZeRO-3's hooks on every module, ~430 tables for a 16-layer Llama, twice a call)."""
    suspended: dict[int, tuple[dict, list, dict]] = {}  # id(table) -> (table, its key order, removed)
    for table, key in entries:
        slot = suspended.get(id(table))
        if slot is None:
            slot = suspended[id(table)] = (table, list(table), {})
        slot[2][key] = table.pop(key)
    try:
        yield
    finally:
        for table, order, gone in suspended.values():
            if not table:  # the common case: only suspended hooks were there, none added since
                table.update((k, gone[k]) for k in order if k in gone)
                continue
            now = dict(table)
            table.clear()
            table.update((k, now[k] if k in now else gone[k]) for k in order if k in now or k in gone)
            table.update((k, fn) for k, fn in now.items() if k not in table)

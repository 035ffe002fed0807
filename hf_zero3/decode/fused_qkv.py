"""A decode step's query, key and value projections as one GEMM.

At decode shapes (a few to 64 rows) a GEMM over a small weight is bound by its launch and ramp,
not by reading the weight: the small key and value weights are read far below the GPU's memory
bandwidth, so the three projections as one GEMM over one concatenated weight take about the time
of one of them (see the ablations in benchmarks/HISTORY.md). The gate/up pair is not fused this
way: one GEMM over both weights is slower than the two (same section; :mod:`.mlp_kernels` fuses it
in a Triton kernel instead).

hf_zero3's static loop (:mod:`.static_loop`) uses it for its decode steps only: per call it
copies each attention module's three weights (and biases) into one buffer (the values change
between calls: a training step), and inside a decode step the three projection modules return
slices of one GEMM over it. Exactly the modules it can see are plain ``nn.Linear`` siblings named
``q_proj``/``k_proj``/``v_proj`` over the same input, without hooks or patched forwards (a LoRA
layer, a quantized linear, an accelerate hook keep their own); a projection called with another
input than its siblings' computes its own. The buffer lives for the call (it is as large as the
three weights: about 8 % of a Llama model's weights) and is freed at its end; a later call's
graphs replay only when its buffer lands at the same address (the static loop checks).
``DecodeOptions(fuse_qkv=False)`` turns it off from the next call on (the decode steps then run the model's
own projections; the graphs are captured again).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from .._upstream import torch as torch_up
from ..device_memory import read_cuda_memory
from ..kernels.decode_gemm import MAX_ROWS

NAMES = ("q_proj", "k_proj", "v_proj")
_FORWARDS: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()  # Linear -> its forward
_SLOTS: "weakref.WeakKeyDictionary[nn.Module, _Slot]" = weakref.WeakKeyDictionary()  # attention -> its slot


class _Slot:
    """One attention module's fused weight for the call, and the GEMM's parts until each sibling
    took its own. Kept per module across calls (the forwards read it; Dynamo guards on them)."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self.sizes: list[int] = []
        self.weight = self.bias = self.x = None
        self.out: dict = {}


def _forward(slot: _Slot, name: str, own: nn.Linear):
    own_ref = weakref.ref(own)  # the forward outlives no module: it must not hold its own

    def forward(x):
        if slot.x is not x or name not in slot.out:
            if slot.out:  # a sibling called with another input: this one computes its own
                mod = own_ref()
                return F.linear(x, mod.weight, mod.bias)
            # the parts stay views of the one GEMM's output (a decode step's rows are one token, so
            # every view its attention takes of them exists): a copy per part was three kernels a
            # layer in front of the fused rope kernel, which reads them through their strides
            parts = F.linear(x, slot.weight, slot.bias).split(slot.sizes, dim=-1)
            slot.x, slot.out = x, dict(zip(slot.names, parts))
        y = slot.out.pop(name)
        if not slot.out:
            slot.x = None  # nothing of the step outlives it
        return y

    return forward


def _fusable(parent: nn.Module) -> bool:
    mods = [getattr(parent, n, None) for n in NAMES]
    if any(type(m) is not nn.Linear for m in mods):
        return False
    if not all(torch_up.runs_class_forward(m) for m in mods):
        return False
    if len({m.in_features for m in mods}) != 1 or len({m.bias is None for m in mods}) != 1:
        return False
    ws = [m.weight for m in mods]
    if any(type(w.data) is not torch.Tensor for w in ws):  # a DTensor / quantized storage keeps its own
        return False
    return len({(w.dtype, w.device) for w in ws}) == 1 and all(
        w.dim() == 2 and w.numel() == m.in_features * m.out_features for w, m in zip(ws, mods)
    )


def plan(model: nn.Module) -> tuple[str, ...]:
    """Names of ``model``'s attention modules whose projections can be fused (while gathered)."""
    return tuple(name for name, m in model.named_modules() if _fusable(m))


# the weights' dtypes :func:`partials` takes: the Triton GEMMs' (a float32 model's projections keep
# cuBLAS's float32 GEMM, which the kernels' TF32 dot would not match; the CPU tests widen it to
# float32 under Triton's interpreter, whose bf16 dot is not exact)
PARTIAL_DTYPES = (torch.float16, torch.bfloat16)


def slot_of(parent: nn.Module) -> _Slot:
    """``parent``'s slot (made empty if it has none), for a forward built outside the compiled
    step's trace to hold. Inside a trace, Dynamo resolves a weak dictionary's lookup once, with no
    guard on the key: one compiled decoder layer run by every layer would read the first traced
    layer's fused weight in all of them."""
    slot = _SLOTS.get(parent)
    if slot is None:
        slot = _SLOTS[parent] = _Slot(NAMES)
    return slot


def partials(slot: _Slot, x: torch.Tensor, op, split: int):
    """The fused q/k/v GEMM of an attention module bound this call (its :func:`slot_of`) over
    ``x`` through the split-K ``op`` (:func:`hf_zero3.kernels.decode_gemm.load_dependent`'s): its
    three parts as float32 partial sums, views ``(split, rows, features)`` of one buffer, for a
    consumer that sums them itself (the fused rope kernel). None where that does not apply: nothing
    bound, biases, more rows than the kernel takes, another dtype than the weight's half precision,
    autocast."""
    if slot.weight is None or slot.bias is not None:
        return None
    rows = x.reshape(-1, x.shape[-1])
    w = slot.weight
    if (
        rows.shape[0] > MAX_ROWS
        or not rows.is_contiguous()
        or rows.dtype != w.dtype
        or w.dtype not in PARTIAL_DTYPES
        or torch.is_autocast_enabled(x.device.type)
    ):
        return None
    return op(rows, w, split).split(slot.sizes, dim=-1)


class Fused:
    """The fused weights of one call: :meth:`bind` copies them in, :meth:`use` routes the decode
    step's projections through them, :meth:`free` drops them."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self.buffer: torch.Tensor | None = None
        self.parents: list[nn.Module] = []

    @property
    def ptr(self) -> int:
        """The buffer's address (0: nothing fused this call): the graphs were captured with it."""
        return self.buffer.data_ptr() if self.buffer is not None else 0

    def bind(self, model: nn.Module) -> int:
        """Copy the current weights into one buffer; the number of attention modules fused (0 when
        it is off, the model no longer matches the plan, or the device lacks the memory)."""
        self.free()
        try:
            parents = [model.get_submodule(n) for n in self.names]
        except AttributeError:  # the model changed shape since the plan
            return 0
        if not parents or not all(_fusable(p) for p in parents):
            return 0
        first = getattr(parents[0], NAMES[0]).weight
        if len({(getattr(p, NAMES[0]).weight.dtype, getattr(p, NAMES[0]).weight.device) for p in parents}) != 1:
            return 0  # one buffer holds one dtype on one device
        layout = [
            (
                [getattr(p, n).out_features for n in NAMES],
                getattr(p, NAMES[0]).in_features,
                getattr(p, NAMES[0]).bias is not None,
            )
            for p in parents
        ]
        need = sum(sum(rows) * (width + bias) for rows, width, bias in layout)
        if first.is_cuda and read_cuda_memory(first.device).allocatable < 2 * need * first.element_size():
            return 0  # rank-local and safe: a decode step runs no collective, only its GEMMs differ
        self.buffer = torch.empty(need, dtype=first.dtype, device=first.device)
        self.parents = parents  # set first: free() clears whatever a failed copy left in the slots
        at = 0
        try:
            with torch.no_grad():
                for p, (rows, width, bias) in zip(parents, layout):
                    slot = slot_of(p)
                    n = sum(rows)
                    slot.weight = self.buffer[at : at + n * width].view(n, width)
                    torch.cat([getattr(p, name).weight for name in NAMES], out=slot.weight)
                    at += n * width
                    slot.bias = None
                    if bias:
                        slot.bias = self.buffer[at : at + n]
                        torch.cat([getattr(p, name).bias for name in NAMES], out=slot.bias)
                        at += n
                    slot.sizes = rows
        except RuntimeError:
            self.free()
            return 0
        return len(parents)

    @contextlib.contextmanager
    def use(self):
        """Inside: the bound modules' projections are slices of one GEMM (nothing when unbound)."""
        try:
            mods = [(_SLOTS[p], name, getattr(p, name)) for p in self.parents for name in NAMES]
            with torch_up.instance_forwards(
                (mod, _FORWARDS.get(mod) or _FORWARDS.setdefault(mod, _forward(slot, name, mod)))
                for slot, name, mod in mods
            ):
                yield
        finally:
            for p in self.parents:
                slot = _SLOTS[p]
                slot.x, slot.out = None, {}

    def free(self) -> None:
        for p in self.parents:
            slot = _SLOTS.get(p)
            if slot is not None:
                slot.weight = slot.bias = slot.x = None
                slot.out = {}
        self.parents, self.buffer = [], None

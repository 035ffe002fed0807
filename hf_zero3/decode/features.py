"""The parts of a decode step the static loop computes another way than the model's own code.

Each part is a :class:`Feature` with one life cycle: decided when a decode loop is built (its
constructor, from the model, the device and the resolved :class:`~hf_zero3.options.DecodeOptions`:
the modules it will take, part of what the loop's CUDA graphs are captured with), bound to the
model once per call after the prompt's forward (:meth:`~Feature.bind`: what still applies, this
call's weight copies), entered around every decode step (:meth:`~Feature.use`), and reported into
the call's one :class:`DecodeReport` (``hf_zero3_last_generate.decode_report``). :func:`plan`
builds them in the order they depend on each other: dependent launches, the attention, the fused
q/k/v projection, the MLP kernels, the rope attention, the norm and rotary kernels, and the compiled layers.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

from ..kernels import decode_gemm
from ..options import DecodeOptions
from . import fused_qkv, gqa_attention, layer_compile, mlp_kernels, norm_kernel, rotary_kernel
from .compiled import compiled_layer

log = logging.getLogger("hf_zero3.generation")


@dataclass
class DecodeReport:
    """What the static loop's decode steps computed their own way in one call (all zero / None /
    empty: the model's own code, or transformers' loop ran)."""

    attention: str | None = None  # the decode attention where it replaced the model's (GQA models)
    fused_projections: int = 0  # attention modules whose q/k/v projections ran as one GEMM
    mlp_kernels: int = 0  # MLP modules through the Triton gate/up GEMM
    split_k: int = 0  # projections (down, o_proj) through the split-K GEMM
    rope_attention: int = 0  # attention modules that rotated, wrote the cache and attended in one kernel
    compiled_layers: int = 0  # decoder layers that ran one compiled layer (DecodeOptions.compile_layers)
    norm_kernels: int = 0  # RMSNorms an eager step ran through the Triton norm kernel (DecodeOptions.triton_norm)
    rotary_kernel: bool = False  # an eager step rotated q and k in the Triton kernel (DecodeOptions.triton_rotary)
    dependent_launches: bool = False  # the steps' kernels were programmatic dependent launches
    qkv_partials: bool = False  # fused q/k/v ran split-K into the rope kernel, which summed the partials
    fallbacks: tuple[str, ...] = ()  # parts of the model family's fast path left to its own code, and why
    experts: str | None = None  # a MoE model's expert computation (transformers' experts implementation)
    ring_layers: int = 0  # sliding-window layers that slid as rings (hf_zero3.decode.ring_cache)
    linear_attention_layers: int = 0  # linear-attention layers whose states the steps updated in place


class Feature:
    """One part of a decode step (see the module docstring); the base class does nothing."""

    def bind(self, model, cache) -> None:
        """Once per call, after the prompt's forward (the static cache's tensors exist)."""

    def use(self, loop) -> contextlib.AbstractContextManager:
        """Around each decode step of ``loop`` (a :class:`~hf_zero3.decode.loop.DecodeLoop`)."""
        return contextlib.nullcontext()

    def after_step(self, cache) -> None:
        """After each decode step's forward."""

    @property
    def address(self) -> int:
        """A device address the step reads that the cache check does not cover (0: none)."""
        return 0

    def report(self, into: DecodeReport, compiled: bool) -> None:
        """Write this call's figures into ``into`` (``compiled``: the steps ran the compiled forward)."""

    def end(self) -> None:
        """The call ended: drop what it bound (a kept loop holds no module)."""


def dependent_launches(device, mode: str = "auto") -> bool:
    """The decode steps' kernels are programmatic dependent launches (``mode``:
    :attr:`~hf_zero3.options.DecodeOptions.dependent_launches`): each may start while the kernel
    before it finishes and waits for it only where it reads its output (the Triton GEMMs and the
    rope attention: :mod:`hf_zero3.kernels.decode_gemm`; inductor's kernels: its
    ``triton.enable_pdl``). A decode step is over a hundred short kernels, each with a ramp of its
    own, so this pays most at large batches (see the ablations in benchmarks/HISTORY.md). Where the
    GPU or Triton cannot (:func:`~hf_zero3.kernels.decode_gemm.dependent_unavailable`: before Hopper,
    on CPU) the steps launch as usual; asked for explicitly (``mode="on"``), one log line says why."""
    if mode == "off":
        return False
    why = decode_gemm.dependent_unavailable(device)
    if why is not None:
        if mode == "on" and why not in _PDL_REFUSED:
            _PDL_REFUSED.add(why)
            log.warning(
                "hf_zero3 lockstep: dependent launches asked for, but the decode steps launch as usual: %s", why
            )
        return False
    return True


_PDL_REFUSED: set = set()  # reasons already logged


class DependentLaunches(Feature):
    """Programmatic dependent launches of the steps' kernels (:func:`dependent_launches`); the
    other features and the compiled forward read :attr:`on`."""

    def __init__(self, device, mode: str):
        self.on = dependent_launches(device, mode)

    def report(self, into: DecodeReport, compiled: bool) -> None:
        into.dependent_launches = self.on and compiled


class Attention(Feature):
    """The decode steps attend with :mod:`.gqa_attention` (``name``: its PyTorch form or its
    Triton kernel; None: the model's own attention)."""

    def __init__(self, name: str | None):
        self.name = name

    def use(self, loop):
        return gqa_attention.use(loop.model, self.name)

    def report(self, into: DecodeReport, compiled: bool) -> None:
        into.attention = self.name


class FusedQKV(Feature):
    """Each attention module's q/k/v projections as one GEMM over a per-call weight copy
    (:mod:`.fused_qkv`)."""

    def __init__(self, names: tuple[str, ...]):
        self.fused = fused_qkv.Fused(names)
        self.layers = 0

    def bind(self, model, cache) -> None:
        # after the prefill (its peak does not hold the copy), before the cache check
        self.layers = self.fused.bind(model)

    def use(self, loop):
        return self.fused.use()

    @property
    def address(self) -> int:
        return self.fused.ptr

    def report(self, into: DecodeReport, compiled: bool) -> None:
        into.fused_projections = self.layers

    def end(self) -> None:
        self.fused.free()


class MLPKernels(Feature):
    """SiLU MLPs through the Triton gate/up GEMM, and with ``split`` the down and ``o_proj``
    projections through the split-K GEMM (:mod:`.mlp_kernels`)."""

    def __init__(self, names: tuple[str, ...], split: bool, dependent: bool):
        self.names, self.split, self.dependent = names, split, dependent
        self.bound: list = []

    def bind(self, model, cache) -> None:
        self.bound = mlp_kernels.bind(model, self.names)

    def use(self, loop):
        return mlp_kernels.use(self.bound, self.split, self.dependent)

    def report(self, into: DecodeReport, compiled: bool) -> None:
        into.mlp_kernels, into.split_k = mlp_kernels.counts(self.bound, self.split)

    def end(self) -> None:
        self.bound = []


class RopeAttention(Feature):
    """Llama attention modules that rotate, write the cache and attend in one kernel where the
    loop attends with the kernel (:func:`.gqa_attention.rope_plan`); with ``qkv`` (the split-K op
    of :func:`.gqa_attention.rope_qkv`) their fused q/k/v projection feeds it float32 partials."""

    def __init__(self, names: tuple[str, ...], dependent: bool, qkv, fused: FusedQKV):
        self.names, self.dependent, self.qkv, self.fused = names, dependent, qkv, fused
        self.bound: list = []
        self.rotaries: list = []

    def bind(self, model, cache) -> None:
        self.bound = gqa_attention.rope_bind(model, self.names, cache)
        self.rotaries = gqa_attention.rope_rotaries(model) if self.bound else []

    def use(self, loop):
        return gqa_attention.rope_use(self.bound, loop.mask, self.rotaries, self.dependent, self.qkv)

    def after_step(self, cache) -> None:
        gqa_attention.advance(self.bound, cache)  # the fill counts the fused layers left

    def report(self, into: DecodeReport, compiled: bool) -> None:
        into.rope_attention = len(self.bound)
        into.qkv_partials = bool(self.qkv and self.fused.layers and self.bound and compiled)

    def end(self) -> None:
        self.bound, self.rotaries = [], []


class NormKernel(Feature):
    """An eager step's RMSNorms through the Triton norm kernel (:mod:`.norm_kernel`); a compiled
    step or layer fuses them itself, so the norms are patched only around steps that run eagerly."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self.bound: list = []
        self.count = 0  # the norms this call's eager steps ran through the kernel

    def bind(self, model, cache) -> None:
        self.bound = norm_kernel.bind(model, self.names)
        self.count = 0

    def use(self, loop):
        if loop.step_kind != "eager" or not self.bound:
            return contextlib.nullcontext()
        self.count = len(self.bound)
        return norm_kernel.use(self.bound)

    def report(self, into: DecodeReport, compiled: bool) -> None:
        into.norm_kernels = self.count

    def end(self) -> None:
        self.bound = []  # the count stays: the call's report reads it after its end


class RotaryKernel(Feature):
    """An eager step's rotary embedding through the Triton rotary kernel (:mod:`.rotary_kernel`;
    ``path``: the family's ``apply_rotary_pos_emb``, None: off), replaced only around steps that
    run eagerly."""

    def __init__(self, path: str | None):
        self.replaced = rotary_kernel.Replaced(path) if path else None

    def bind(self, model, cache) -> None:
        if self.replaced is not None:
            self.replaced.reset()

    def use(self, loop):
        if loop.step_kind != "eager" or self.replaced is None:
            return contextlib.nullcontext()
        return self.replaced.use()

    def report(self, into: DecodeReport, compiled: bool) -> None:
        into.rotary_kernel = self.replaced is not None and self.replaced.hits > 0


class CompiledLayers(Feature):
    """The compiled decode step as one compiled decoder layer run by every layer
    (:mod:`.layer_compile`; ``name``: the layers' ``ModuleList``, None: the step compiles whole).
    A layer that does not compile (the loop reads :attr:`failed`) runs its own forward, and the
    loop compiles the whole step from the next one on."""

    def __init__(self, name: str | None, dependent: bool):
        self.layers = layer_compile.Layers(name)
        self.dependent = dependent
        self.count = 0

    @property
    def failed(self) -> str | None:
        return self.layers.failed

    def bind(self, model, cache) -> None:
        self.count = self.layers.bind(model, cache, compiled_layer(self.dependent))

    def use(self, loop):
        return self.layers.use() if loop.step_kind == "layers" else contextlib.nullcontext()

    def report(self, into: DecodeReport, compiled: bool) -> None:
        into.compiled_layers = self.count if compiled and self.failed is None else 0

    def end(self) -> None:
        self.layers.end()  # the count stays: the call's outcome reads the step's kind after its end


def plan(model, device, attention: str | None, options: DecodeOptions) -> list[Feature]:
    """The features of a loop for ``model`` on ``device`` (``attention``:
    :func:`.gqa_attention.choice`'s, part of the loop's key) under resolved ``options``; builds
    the kernels they launch, outside any trace."""
    dependent = DependentLaunches(device, options.dependent_launches)
    split = options.triton_mlp and options.split_k
    qkv = FusedQKV(fused_qkv.plan(model) if options.fuse_qkv else ())
    mlp = MLPKernels(mlp_kernels.plan(model, device, split) if options.triton_mlp else (), split, dependent.on)
    rope = gqa_attention.rope_plan(model, attention) if options.fuse_rope else ()
    qkv_op = gqa_attention.rope_qkv(device, dependent.on) if rope and qkv.fused.names and options.triton_qkv else None
    norms = NormKernel(norm_kernel.plan(model, device) if options.triton_norm else ())
    rotary = RotaryKernel(rotary_kernel.plan(model, device) if options.triton_rotary else None)
    parts = [dependent, Attention(attention), qkv, mlp, RopeAttention(rope, dependent.on, qkv_op, qkv), norms, rotary]
    if options.compile_step and options.compile_layers:
        name, why = layer_compile.plan(model)
        if why is not None:
            log.info("hf_zero3 lockstep: the decode step compiles whole, not one layer at a time: %s", why)
        parts.append(CompiledLayers(name, dependent.on))
    return parts

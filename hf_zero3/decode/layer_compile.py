"""The decode step, and the prompt's forward, compiled one decoder layer at a time
(``DecodeOptions.compile_layers``).

Compiling the whole model's forward makes Dynamo trace every decoder layer and inductor compile
each one's kernels, though the layers run the same code over weights of the same shapes: a
process's first call spends seconds per layer, warm caches included (benchmarks/HISTORY.md, First
call). Here the model's own forward runs the step and each decoder layer's forward goes through one
compiled function, traced and compiled once and run by every layer: a layer's parameters and its
part of the cache are that graph's inputs, not its constants. CUDA graphs capture the step as they
capture the whole compiled forward, so at replay none of the layers' Python runs.

One graph serves every layer only if no layer's code reads its own index as a constant, and a
layer reads the cache by it (``past_key_values.update(..., self.layer_idx)``). So each layer gets
a copy of the cache that holds its own layer only, and for the call its modules' ``layer_idx`` read
0. That is sound only where nothing else of a layer depends on its index: it is taken for the
checked families (:mod:`.families`) whose layers are one ``ModuleList`` of one class with one layer
type (``config.layer_types``), each layer's modules sharing one index; elsewhere the step compiles
whole (:func:`plan` says why). Where the layers still differ to Dynamo (a hook on one layer's
module, say: the graphs guard on hooks), a second layer compiling a graph of its own in one step
makes the step compile whole from the next one on, instead of compiling every layer apart. The
layers' compiled function is :func:`.compiled.compiled_layer` (the prompt's layers: its own, whose
prompt length turns dynamic; :func:`.prefill._layered_prefill`).
"""

from __future__ import annotations

import copy
import weakref

from torch import nn

from .._upstream import torch as torch_up
from .._upstream import transformers as hf_up
from . import families
from .compiled import COMPILE_ERRORS, failure_reason


def _indexed(layer: nn.Module) -> list[nn.Module]:
    """``layer``'s modules that hold a layer index (an ``int`` ``layer_idx`` of their own)."""
    return [m for m in layer.modules() if isinstance(vars(m).get("layer_idx"), int)]


def plan(model: nn.Module) -> tuple[str | None, str | None]:
    """(the qualified name of ``model``'s decoder layers, None) where one compiled layer can serve
    them all, else (None, why not)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in families.FAMILIES:
        return None, f"model type {getattr(config, 'model_type', None)!r} is not a checked family"
    kinds = set(getattr(config, "layer_types", None) or ())
    if len(kinds) > 1:
        return None, f"its layers are of several types ({', '.join(sorted(kinds))})"
    name = next(
        (n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and n.split(".")[-1] == "layers"), None
    )
    layers = model.get_submodule(name) if name is not None else ()
    if len(layers) < 2 or len({type(m) for m in layers}) != 1:
        return None, "no ModuleList 'layers' of two or more layers of one class"
    for i, layer in enumerate(layers):
        if len({m.layer_idx for m in _indexed(layer)}) != 1:
            return None, f"layer {i}'s modules do not hold one layer index"
    return name, None


def _forward(owner: "Layers", layer: nn.Module, view, indexed: list[nn.Module], key: str, compiled):
    ref = weakref.ref(layer)  # set as the layer's own attribute while a step runs: no cycle through it

    def forward(*args, **kwargs):
        m = ref()
        if owner.failed is not None or kwargs.get(key) is None:
            # the compiled layer failed (this step's remaining layers and later steps), or no cache
            # passed by the checked keyword: the layer's own forward
            return type(m).forward(m, *args, **kwargs)
        cache = kwargs[key]
        kwargs[key] = view
        saved = [x.layer_idx for x in indexed]
        for x in indexed:
            x.layer_idx = 0
        graphs = torch_up.dynamo_graph_count()
        try:
            out = compiled(m, *args, **kwargs)
        except COMPILE_ERRORS as exc:
            # raised while Dynamo traced or compiled, before the layer's graph ran: nothing of this
            # layer was written, so its own forward computes it (the earlier layers ran compiled)
            owner.failed = failure_reason(exc)
        else:
            if torch_up.dynamo_graph_count() != graphs:
                owner.compiled_in_step += 1
                if owner.compiled_in_step > 1:  # it ran; the step's other layers run their own forward
                    owner.failed = (
                        "a second layer compiled a graph of its own in one step (the compiled layer "
                        "guards on something that differs between layers, a hook say)"
                    )
            return out
        finally:
            for x, i in zip(indexed, saved):
                x.layer_idx = i
        kwargs[key] = cache
        return type(m).forward(m, *args, **kwargs)

    return forward


class Layers:
    """The decoder layers of one call: :meth:`bind` makes each layer's one-layer view of the cache,
    :meth:`use` routes the layers' forwards through the compiled layer, :meth:`end` drops them."""

    def __init__(self, name: str | None):
        self.name = name
        self.bound: list[tuple[nn.Module, object]] = []  # (layer, its forward through the compiled layer)
        self.failed: str | None = None  # why the compiled layer did not compile (kept with the loop)
        self.compiled_in_step = 0  # layer calls that compiled a graph in the current step

    def bind(self, model: nn.Module, cache, compiled) -> int:
        """The layers this call runs through ``compiled`` (0: none; the step compiles whole)."""
        self.bound = []
        key, layers = hf_up.cache_keyword(), getattr(cache, "layers", None)
        if self.name is None or key is None or layers is None:
            return 0
        try:
            modules = model.get_submodule(self.name)
        except AttributeError:  # the model changed shape since the plan
            return 0
        bound = []
        for layer in modules:
            indexed = _indexed(layer)
            index = {m.layer_idx for m in indexed}
            if "forward" in vars(layer) or len(index) != 1 or next(iter(index)) >= len(layers):
                return 0  # a patched forward, or a layer the plan did not see: the step compiles whole
            view = copy.copy(cache)
            view.layers = [layers[next(iter(index))]]
            bound.append((layer, _forward(self, layer, view, indexed, key, compiled)))
        self.bound = bound
        return len(bound)

    def use(self):
        """Inside: each bound layer's forward runs the compiled layer over its own view of the cache."""
        self.compiled_in_step = 0
        return torch_up.instance_forwards(self.bound)

    def end(self) -> None:
        self.bound = []

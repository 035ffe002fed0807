"""Everything the static loop keeps from one call to the next, in one place, and :func:`release`,
the one path that frees it (``hf_zero3.release_decode_graphs``).

Per model (weakly: a dropped model takes its entries with it): its loops, and why its forward, its
prompt's forward or its steps' capture failed. Per process: why the greedy tail did not compile,
the compiled functions, and the TF32 setting they were compiled under.
"""

from __future__ import annotations

import weakref

# -- freed by release(model): what one model holds or failed at -----------------------------------
LOOPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {shape: (addresses/state, DecodeLoop)}
FORWARD_FAILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> why its forward did not compile
PREFILL_FAILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> why its prompt forward did not
NO_GRAPHS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> why its steps were not captured
_PER_MODEL = (LOOPS, FORWARD_FAILED, PREFILL_FAILED, NO_GRAPHS)

# -- freed by release() (every model): the process's own failure ------------------------------------
TAIL_FAILED: list = []  # why the greedy tail did not compile (then it runs eagerly)

# -- kept across release(): they hold no model, no buffer and no graph, and forgetting them would
# cost what release() is not for. A new torch.compile of the same function is a new backend to
# Dynamo, so a dropped compiled function compiles the prompt forward, the decode step or the tail
# again (tens of seconds: benchmarks/RESULTS.md); the TF32 setting is the one those functions were compiled
# under, and a forgotten one lets a trainer's flip recompile them (see compiled.tf32_pinned).
COMPILED: dict = {}  # (model class or a layer function, dependent launches) -> its compiled __call__ or layer
ONCE: dict = {}  # function -> its torch.compile(fullgraph=True), built at first use
TF32: list = []  # whether TF32 matmuls were on in the process's first static-loop call


def release(model=None) -> None:
    """Free the static buffers and CUDA graphs the loop keeps for ``model`` (every model: None),
    and forget why its forward (or its prompt's) did not compile or its steps were not captured:
    after the cause is gone (a hook removed, say) the next call tries the compiled loop again. With
    ``model=None`` the greedy tail's compile failure is forgotten too (it is no model's)."""
    if model is None:
        for kept in _PER_MODEL:
            kept.clear()
        TAIL_FAILED.clear()
    else:
        for kept in _PER_MODEL:
            kept.pop(model, None)

"""The functions the static loop compiles, and how: the decode step's forward
(:func:`compiled_model_call`), or one decoder layer's (:func:`compiled_layer`), the prompt's forward
(:func:`prompt_logits`, or one decoder layer's in it) and the greedy tail (:func:`greedy_tail`), each
``torch.compile(fullgraph=True)`` with inductor's alignment asserts off; the errors that say a
compile or its code failed; and the TF32 setting they are pinned to. The compiled functions
themselves are kept in :mod:`.caches`."""

from __future__ import annotations

import contextlib
import inspect
import os
import traceback

import torch

from .._upstream import deepspeed as ds_up
from .._upstream import torch as torch_up
from .._upstream import transformers as hf_up
from .caches import COMPILED, ONCE, TF32

COMPILE_ERRORS = torch_up.dynamo_compile_errors()
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep  # torch's own frames (not a path that merely holds "torch")
# what a compiled prompt forward raises when its code fails as it runs (inductor's run-time asserts
# raise AssertionError or TypeError, a backend's kernel RuntimeError); out of memory is re-raised
RUN_ERRORS = (RuntimeError, TypeError, AssertionError)


def failure_reason(exc: BaseException) -> str:
    """One line: the error's first line, and Dynamo's own pointer to what it could not trace
    (its ``Developer debug context``: the function, file or operator) when it gives one; for
    another error (a CUDA-graph capture's), the innermost line that raised it outside torch."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    why = f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"
    context = [ln for ln in lines[1:] if ln.startswith("Developer debug context:")]
    if context:
        why += f" [{context[0][len('Developer debug context:') :].strip()[:300]}]"
    frames = (
        [ln for ln in lines[lines.index("from user code:") + 1 :] if ln.startswith("File ")]
        if "from user code:" in lines
        else []
    )
    if frames:
        why += f" at {frames[-1][:200]}"  # the innermost traced line
    elif exc.__traceback__ is not None:  # not Dynamo's: the innermost line outside torch itself
        here = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_TORCH_DIR)]
        if here:
            why += f" at {os.path.basename(here[-1].filename)}:{here[-1].lineno} in {here[-1].name}"
    return why


def forward_kwargs(model) -> dict:
    """What the loop's forwards pass besides the inputs: the last position's logits only, and no
    MoE router logits. A config's ``output_router_logits`` (TRL sets it for GRPO's auxiliary loss)
    would compute the load-balancing loss in every step, work a step does not use, and one whose
    host copy a CUDA graph cannot capture: every step of such a rollout ran uncaptured."""
    params = inspect.signature(type(model).forward).parameters
    out = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    if "output_router_logits" in params:
        out["output_router_logits"] = False
    return out


def compiled_model_call(cls, dependent: bool = False):
    """``cls.__call__`` compiled into one graph (hooks included, as transformers compiles it),
    once per class: an unbound function holds no model alive. Its graphs guard on the modules'
    hooks (``_upstream.torch.hook_guards``): a call with other hooks compiles again. ``dependent``:
    inductor's kernels are programmatic dependent launches (:func:`.features.dependent_launches`)."""
    return _compiled_with_hook_guards(cls, cls.__call__, dependent)


def _compiled_with_hook_guards(key, target, dependent: bool):
    """``target`` compiled into one graph with the decode options (inductor's alignment asserts
    off; ``dependent``: programmatic dependent launches), called with hook guards on; built once
    per ``(key, dependent)`` and kept in :data:`.caches.COMPILED`."""
    fn = COMPILED.get((key, dependent))
    if fn is None:
        options = torch_up.inductor_options_without_alignment_asserts()
        if dependent:
            options.update(torch_up.inductor_dependent_launch_options())
        compiled = torch.compile(target, fullgraph=True, **({"options": options} if options else {}))

        def fn(*args, **kwargs):
            with torch_up.hook_guards():
                return compiled(*args, **kwargs)

        COMPILED[(key, dependent)] = fn
    return fn


@contextlib.contextmanager
def bookkeeping_hooks_suspended(model):
    """Inside a ``no_grad`` decode forward: the hooks on ``model`` that only do training bookkeeping
    do not run (nothing for them to do, and each would stop a compiled forward): checkpointing's
    input-require-grads hook, the DeepSpeed engine's forward prologue/epilogue, and module backward
    hooks (ZeRO-3's on its leaf modules, a MoE block's among them)."""
    with (
        hf_up.input_grad_hooks_suspended(model),
        ds_up.engine_forward_hooks_suspended(model),
        torch_up.backward_hooks_suspended(model),
    ):
        yield


def _layer_call(layer, *args, **kwargs):
    """One decoder layer's forward (:mod:`.layer_compile`): its own code object, so its graphs (one
    for every layer) and its recompile limit are apart from the whole step's."""
    return type(layer).forward(layer, *args, **kwargs)


def _prompt_layer_call(layer, *args, **kwargs):
    """One decoder layer's forward in a prompt's forward: apart from :func:`_layer_call`, so the
    prompt length that turns dynamic here leaves the decode step's layer graph static."""
    return type(layer).forward(layer, *args, **kwargs)


def compiled_layer(dependent: bool = False, prompt: bool = False):
    """:func:`_layer_call` (``prompt``: :func:`_prompt_layer_call`) compiled into one graph, once
    per process (``dependent``: as :func:`compiled_model_call`'s). Its graphs guard on the layers' hooks
    as the whole step's do."""
    target = _prompt_layer_call if prompt else _layer_call
    return _compiled_with_hook_guards(target, target, dependent)


def prompt_logits(model, **kwargs):
    """The prompt's forward, to the last position's logits. Its own function, so Dynamo keeps its
    graphs (one per batch size, the prompt length dynamic) apart from the decode step's: the step
    compiles ``Module.__call__``, whose code object (and recompile limit, and automatic-dynamic
    record) would otherwise be shared, and a prompt's length would turn the step's shapes dynamic."""
    return model(**kwargs).logits[:, -1]


def compiled_once(fn):
    """``fn`` compiled into one graph, built once per process (:func:`prompt_logits`,
    :func:`greedy_tail`: their own code objects, so their own Dynamo caches). Inductor's default
    Python wrapper: a C++ wrapper for the prompt forward gave no gain and a slower first compile
    (see the ablations in benchmarks/HISTORY.md)."""
    compiled = ONCE.get(fn)
    if compiled is None:
        options = torch_up.inductor_options_without_alignment_asserts()
        compiled = ONCE[fn] = torch.compile(fn, fullgraph=True, **({"options": options} if options else {}))
    return compiled


def record_token(nxt, unfinished, pad, eos, out, idx, own, alive, tok, pos) -> None:
    """After a step's token choice, in place on the loop's buffers: EOS masking, the token written
    out, the row and "any row alive" flags, the next input token and its position."""
    if eos is not None:
        nxt = torch.where(unfinished, nxt, pad)
    out.index_copy_(1, idx, nxt.view(-1, 1))
    if eos is not None:
        unfinished &= ~torch.isin(nxt, eos)
    unfinished &= idx + 1 < own  # token idx + 1 reached this rank's max_length
    alive.index_copy_(0, idx, unfinished.any().view(1))
    tok.copy_(nxt)
    idx.add_(1)
    pos.add_(1)


def _argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, -1)`` (the first index of the maximum) in two stages: the maximum of
    each of ``split`` equal chunks of the vocabulary, then the first chunk holding the row's
    maximum. Inductor does not split an argmax reduction, and one program per row over a 128k
    vocabulary leaves most of the GPU idle; chunks give it a program per (row, chunk)."""
    b, v = logits.shape
    split = next((s for s in (32, 16, 8, 4, 2) if v % s == 0 and v // s >= 2048), 1)
    if split == 1:
        return torch.argmax(logits, dim=-1)
    width = v // split
    best, where = logits.reshape(b, split, width).max(dim=-1)  # first maximum within each chunk
    chunk = torch.argmax(best, dim=-1)  # the first chunk with the row's maximum
    return chunk * width + where.gather(1, chunk[:, None]).squeeze(1)


def greedy_tail(logits, *buffers) -> None:
    """A greedy step after the forward: the argmax of the model's logits (that of their float32
    copy, ties to the first index) and :func:`record_token`. Compiled: one reduction and one
    pointwise kernel instead of about ten launches per step (an eager bf16 argmax over the
    vocabulary alone is a sizeable part of a decode step)."""
    record_token(_argmax_rows(logits), *buffers)


@contextlib.contextmanager
def tf32_pinned():
    """TF32 matmuls on or off as in the process's first static-loop call, for this call. Dynamo
    guards a compiled function on that global setting, and a trainer that flips it between
    rollouts (GRPO under DeepCompile did) recompiled the prompt forward and the decode step at the
    next rollout (tens of seconds each); with the setting pinned they keep one graph."""
    now = torch.backends.cuda.matmul.allow_tf32
    if not TF32:
        TF32.append(now)
    torch.backends.cuda.matmul.allow_tf32 = TF32[0]
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = now

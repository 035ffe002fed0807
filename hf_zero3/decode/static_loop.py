"""hf_zero3's own decode loop for compiled decoding: static buffers, one compiled forward, and on
CUDA several decode steps per CUDA-graph launch.

Transformers' compiled decoding (``cache_implementation="static"``) still runs its Python loop
every token: input preparation, the logits processors, sampling, the stopping criteria and a
host sync each step. With the whole model gathered, that loop and not the GPU sets the speed.
This loop keeps every per-token tensor in a static buffer (the token, its position, the EOS mask,
the generated tokens) and updates it in place, so one decode step is a fixed sequence of kernels:
the compiled forward (``torch.compile(fullgraph=True)``), the logits processors, sampling or
argmax, EOS masking. On CUDA those steps are captured into CUDA graphs of several steps each
(``graph_steps``), replayed between two lockstep stop agreements with no host sync in between;
on CPU the same steps run one by one.

Lockstep semantics are those of the transformers loop it replaces under compiled decoding
(:mod:`.lockstep`): the same agreed step budget, a stop agreement every ``sync_every`` steps on
the previous check's flags (``stop="sync"``; :func:`~hf_zero3.generation.lockstep.stop_schedule`:
the flags are a device copy read one check late, so no check waits for the GPU) or none
(``stop="fixed"``), the same number of forwards on every rank, EOS masking with the pad token, and
the same output (a rank's output ends where its own rows were all done). Ranks that take this loop
and ranks that take transformers' loop (compiled or eager) issue the same agreements at the same
steps: the call's first agreement settles the schedule for the group.

Across calls: the loop (its static buffers and CUDA graphs) is kept per model and shape (batch,
cache length, sampling, processors and their values, EOS ids; at most ``KEEP`` per model) and a
later call replays its graphs only while everything a replayed graph reads is what it was captured
with: the parameters' and buffers' storage, every tensor of the static cache, the call's fused
q/k/v weight copy (:mod:`.fused_qkv`), and the model's plain state (``training`` flags,
PEFT adapter switches, hook counts, config fields: what the compiled forward's guards would
check). Gathered parameters land at the same addresses from one region to the next when the
allocation sequence repeats (back to back, after a layer-wise forward, after a training step);
when anything moved, the call captures anew. Kept graphs hold their memory pool
(one decode step's temporaries) until :func:`release` (``hf_zero3.release_decode_graphs``).
Grouped-query models decode with :mod:`.gqa_attention` (the KV cache read once per step, not
once per query head; on CUDA one Triton kernel per layer where it pays, with a Llama layer's
rotary embedding and cache write inside it), Llama-style SiLU MLPs
with :mod:`.mlp_kernels` (the gate/up pair as one Triton kernel, down and ``o_proj`` split-K,
CUDA), and the decode steps run
DeepSpeed's forward prologue/epilogue hooks and gradient checkpointing's input-require-grads hook
off (nothing for them to do in a gathered region under ``no_grad``). The prompt's forward is
compiled too (its own function, the prompt length dynamic: one graph per batch size for every
prompt length; eager, without DeepSpeed's per-linear autograd Function, where it does not compile
or with ``DecodeOptions(compile_prefill=False)``) and queued before the loop is looked up, so that host work
overlaps it. Greedy steps without processors end in one compiled tail (the argmax of the model's
logits in two stages, the same token as their float32 copy's; EOS masking and the token
bookkeeping).

It runs only where it is exact; anything else decodes through transformers (compiled or eager),
with the reason in ``hf_zero3_last_generate.loop_reason``: logits processors or stopping criteria
other than the tensor-only ones below, a streamer, ``return_dict_in_generate``, extra model
inputs, a cache that is not transformers' ``StaticCache``, or a forward that does not compile
into one graph (then the loop runs it eagerly). Like any CUDA graph, a replayed step runs no
Python: forward hooks on the model run when a step is captured, not when it is replayed.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import logging
import time
import weakref

import torch

from .._upstream import deepspeed as ds_up
from .._upstream import torch as torch_up
from .._upstream import transformers as hf_up
from ..options import DecodeOptions
from . import families, features, gqa_attention, logits_processors

__all__ = ["GRAPH_SAFE_CRITERIA", "unsupported", "decode", "failure", "release"]

log = logging.getLogger("hf_zero3.generation")

# Criteria the loop computes itself: the step budget, and EOS on the token just chosen.
GRAPH_SAFE_CRITERIA = frozenset({"MaxLengthCriteria", "EosTokenCriteria"})
_MODEL_KWARGS = frozenset(
    {
        "attention_mask",
        *hf_up.CACHE_KEYWORDS,
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "logits_to_keep",
        "cache_position",
        "position_ids",
    }
)
_COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit)
# what a compiled prompt forward raises when its code fails as it runs (inductor's run-time asserts
# raise AssertionError or TypeError, a backend's kernel RuntimeError); out of memory is re-raised
_RUN_ERRORS = (RuntimeError, TypeError, AssertionError)
_COMPILED: dict = {}  # (model class, dependent launches) -> its compiled __call__
_FAILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> why its forward did not compile
_PREFILL_FAILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> why its prompt forward did not
_TAIL_FAILED: list = []  # why the greedy tail did not compile (then it runs eagerly)
_NO_GRAPHS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> why its steps were not captured
_LOOPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {shape: (addresses/state, _Loop)}
KEEP = 2  # loops (static buffers and CUDA graphs) kept per model


def _static_layers(cache) -> bool:
    from transformers.cache_utils import StaticLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is StaticLayer for layer in layers)


def unsupported(
    model, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs, length: int
) -> str | None:
    """Why this call cannot take the loop (None: it can); ``length``: prompt + the agreed step
    budget. Local: ranks that decide differently still agree at the same steps."""
    from transformers.generation.utils import GenerationMixin

    if model in _FAILED:
        return _FAILED[model]
    if type(model).prepare_inputs_for_generation is not GenerationMixin.prepare_inputs_for_generation:
        return f"{type(model).__name__} prepares its own generation inputs"
    if streamer is not None:
        return "a streamer was passed"
    if generation_config.return_dict_in_generate:
        asked = [k for k in _PER_STEP_OUTPUTS if getattr(generation_config, k, False)]
        if asked:  # the sequences alone (TRL's GKD and GOLD ask so) come back in transformers' output class
            return f"return_dict_in_generate with {', '.join(asked)} (per-step outputs)"
    if getattr(generation_config, "is_assistant", False):
        return "assisted decoding"
    for p in logits_processor or ():
        why = logits_processors.unsupported(p)
        if why is not None:
            return why
    for c in stopping_criteria or ():
        if type(c).__name__ not in GRAPH_SAFE_CRITERIA:
            return f"stopping criterion {type(c).__name__} is not one the loop computes"
    extra = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _MODEL_KWARGS)
    if extra:
        return f"model inputs {extra} are not static"
    positions = model_kwargs.get("position_ids")
    if positions is not None and positions.dim() != 2:
        return "position_ids are not 2-D (one position per token)"
    mask = model_kwargs.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        return "attention_mask is not a 2-D padding mask"
    cache = hf_up.generation_cache(model_kwargs)
    if cache is None or not _static_layers(cache):
        return "the cache is not transformers' StaticCache (StaticLayer layers)"
    room = _cache_length(cache)
    if length > room:
        return f"the static cache holds {room} tokens, fewer than prompt + new tokens ({length})"
    return None


#: Generation options that ask transformers' loop for per-step tensors the static loop does not keep.
_PER_STEP_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def _cache_length(cache) -> int:
    """Tokens every layer of a static cache holds."""
    return min(layer.max_cache_len for layer in cache.layers)


def _why(exc: BaseException) -> str:
    """One line: the error's first line, and Dynamo's own pointer to what it could not trace
    (its ``Developer debug context``: the function, file or operator) when it gives one."""
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
    return why


def failure(model) -> str | None:
    """Why ``model``'s forward did not compile into one graph (None: it did, or was not tried)."""
    return _FAILED.get(model)


def _forward_kwargs(model) -> dict:
    params = inspect.signature(type(model).forward).parameters
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def _compiled_call(cls, dependent: bool = False):
    """``cls.__call__`` compiled into one graph (hooks included, as transformers compiles it),
    once per class: an unbound function holds no model alive. Its graphs guard on the modules'
    hooks (``_upstream.torch.hook_guards``): a call with other hooks compiles again. ``dependent``:
    inductor's kernels are programmatic dependent launches (:func:`.features.dependent_launches`)."""
    fn = _COMPILED.get((cls, dependent))
    if fn is None:
        options = torch_up.inductor_options_without_alignment_asserts()
        if dependent:
            options.update(torch_up.inductor_dependent_launch_options())
        compiled = torch.compile(cls.__call__, fullgraph=True, **({"options": options} if options else {}))

        def fn(model, **kwargs):
            with torch_up.hook_guards():
                return compiled(model, **kwargs)

        _COMPILED[(cls, dependent)] = fn
    return fn


def _prompt_logits(model, **kwargs):
    """The prompt's forward, to the last position's logits. Its own function, so Dynamo keeps its
    graphs (one per batch size, the prompt length dynamic) apart from the decode step's: the step
    compiles ``Module.__call__``, whose code object (and recompile limit, and automatic-dynamic
    record) would otherwise be shared, and a prompt's length would turn the step's shapes dynamic."""
    return model(**kwargs).logits[:, -1]


_ONCE: dict = {}  # function -> its torch.compile(fullgraph=True), built at first use


def _compiled_once(fn):
    """``fn`` compiled into one graph, built once per process (:func:`_prompt_logits`,
    :func:`_greedy_tail`: their own code objects, so their own Dynamo caches). Inductor's default
    Python wrapper: a C++ wrapper for the prompt forward gave no gain and a slower first compile
    (see the ablations in benchmarks/RESULTS.md)."""
    compiled = _ONCE.get(fn)
    if compiled is None:
        options = torch_up.inductor_options_without_alignment_asserts()
        compiled = _ONCE[fn] = torch.compile(fn, fullgraph=True, **({"options": options} if options else {}))
    return compiled


def _record_token(nxt, unfinished, pad, eos, out, idx, own, alive, tok, pos) -> None:
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


def _greedy_tail(logits, *buffers) -> None:
    """A greedy step after the forward: the argmax of the model's logits (that of their float32
    copy, ties to the first index) and :func:`_record_token`. Compiled: one reduction and one
    pointwise kernel instead of about ten launches per step (an eager bf16 argmax over the
    vocabulary alone is a sizeable part of a decode step)."""
    _record_token(_argmax_rows(logits), *buffers)


def _prompt_inputs(input_ids, model_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's padding mask (long) and positions: the caller's, or transformers' from the mask."""
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask.to(torch.long)
    positions = model_kwargs.get("position_ids")
    if positions is None:
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return mask, positions.expand(input_ids.shape[0], -1)


def _prefill(model, input_ids, mask, positions, cache, compile: bool = True) -> tuple[torch.Tensor, str]:
    """The prompt's forward into the static cache: (its last position's logits, "compiled" or
    "eager"). Compiled (``_prompt_logits``) with the prompt length dynamic, so prompts of any
    length share one graph per batch size, and with the decode steps' hook suspensions; eager as
    transformers runs it, without DeepSpeed's per-linear autograd Function under ``no_grad``, where
    it does not compile or its compiled code fails as it runs (the reason kept per model, one log
    line) or without ``compile`` (:attr:`~hf_zero3.options.DecodeOptions.compile_prefill`).
    Compilation fails before any kernel runs, so the eager forward after it starts clean; after a
    run-time failure the static cache is emptied first."""
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        **hf_up.cache_arguments(cache),
        **_forward_kwargs(model),
    )
    if compile and model not in _PREFILL_FAILED:
        dims = {}
        for name in ("input_ids", "attention_mask", "position_ids"):
            # contiguous (a sliced prompt's row stride is not its length: Dynamo would guard on
            # that and compile again) and a new view, so the mark stays off the caller's tensor
            t = kwargs[name].contiguous().view(kwargs[name].shape)
            if t.shape[1] > 1:
                torch._dynamo.maybe_mark_dynamic(t, 1)
            dims[name] = t
        try:
            with (
                hf_up.input_grad_hooks_suspended(model),
                ds_up.engine_forward_hooks_suspended(model),
                torch_up.hook_guards(),
            ):
                return _compiled_once(_prompt_logits)(model, **{**kwargs, **dims}), "compiled"
        except _COMPILE_ERRORS as exc:
            _PREFILL_FAILED[model] = why = f"the prompt's forward does not compile into one graph ({_why(exc)})"
            log.warning("hf_zero3 lockstep: eager prefill: %s", why)
        except torch.OutOfMemoryError:
            raise
        except _RUN_ERRORS as exc:
            # the compiled code failed as it ran (a backend's kernel or one of inductor's run-time
            # asserts): the eager forward computes the same logits; local, as a prefill gathers nothing
            _PREFILL_FAILED[model] = why = f"the compiled prompt forward failed as it ran ({_why(exc)})"
            log.warning("hf_zero3 lockstep: eager prefill: %s", why)
            cache.reset()  # the layers it wrote before failing start again from an empty cache
    with ds_up.zero3_linear_without_autograd():
        return model(**kwargs).logits[:, -1], "eager"


def _eos_ids(stopping_criteria, device) -> torch.Tensor | None:
    ids = [c.eos_token_id for c in stopping_criteria or () if hasattr(c, "eos_token_id")]
    if not ids:
        return None
    return torch.cat([torch.as_tensor(i, device=device).flatten() for i in ids]).to(torch.long)


class _Loop:
    """The static buffers of one (model, batch, cache length, options) and the CUDA graphs of its
    decode steps, kept across calls (see :func:`_loop_for`); per call, :meth:`start` fills them in
    place and :meth:`end` drops the call's objects (the model among them: a kept loop holds none)."""

    def __init__(
        self,
        batch: int,
        length: int,
        device,
        eos: torch.Tensor | None,
        sample: bool,
        parts: list[features.Feature] = (),
        processors: list = (),
    ):
        self.mask = torch.ones(batch, length, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.tok = torch.zeros(batch, dtype=torch.long, device=device)
        self.idx = torch.zeros(1, dtype=torch.long, device=device)
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.eos = eos
        self.own = torch.zeros((), dtype=torch.long, device=device)
        self.pad = torch.zeros((), dtype=torch.long, device=device)
        self.out = torch.zeros(batch, length, dtype=torch.long, device=device)  # a call's tokens, at most length
        self.alive = torch.ones(length, dtype=torch.bool, device=device)
        self.sample = sample
        self.logits = logits_processors.LoopProcessors(processors, device)  # this loop's processors, on its buffers
        self.features = list(parts)  # the decode step's parts computed our way (features.plan)
        self.dependent = any(isinstance(f, features.DependentLaunches) and f.on for f in self.features)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # steps per graph -> graph
        self.cache_ptrs = None  # the cache tensors the graphs were captured with
        self.cache_small = None  # per layer, its small tensors (length counters) the graphs read
        self.cache_big = None  # per layer, the addresses of its other tensors (keys, values)
        self.warm = False  # a step ran (compiled, warmed up for capture) in this or an earlier call
        self.compiled = True
        self.model = self.cache = self.prompt = self.processors = None

    def start(
        self, model, input_ids, mask, positions, cache, processors, generation_config, stopping_criteria, budget, vocab
    ):
        """Fill the buffers for one call (``mask``, ``positions``: the prompt's, from
        :func:`_prompt_inputs`) after its prompt's forward was queued."""
        self.model, self.processors, self.cache = model, processors, cache
        b, p = input_ids.shape
        self.prompt = input_ids
        self.logits.start(processors, input_ids, vocab)
        # the cache's whole length: prompt padding, then every position a decode step may fill
        self.mask.fill_(1)
        self.mask[:, :p] = mask
        self.pos.copy_(positions[:, -1])
        self.idx.zero_()
        self.unfinished.fill_(True)
        # this rank's own step budget (its max_length), which may be below the group's agreed one:
        # its rows are done there, as transformers' MaxLengthCriteria has them
        lengths = [c.max_length for c in stopping_criteria or () if type(c).__name__ == "MaxLengthCriteria"]
        self.own.fill_(min([budget] + [int(n) - p for n in lengths]))
        pad = hf_up.pad_token_tensor(generation_config)
        self.pad.copy_((pad if pad is not None else torch.tensor(0)).flatten()[0])
        self.out[:, :budget].fill_(self.pad)
        self.alive.fill_(True)
        self.extra = _forward_kwargs(model)
        self.call = _compiled_call(type(model), self.dependent) if self.compiled else type(model).__call__

    def bind(self) -> None:
        """After the prefill: each feature binds to this call's model and cache (the fused q/k/v
        copy is made here, so the prefill's peak does not hold it), then the check of what the
        graphs were captured with."""
        for f in self.features:
            f.bind(self.model, self.cache)
        self.bind_cache()

    def report(self) -> features.DecodeReport:
        report = features.DecodeReport(fallbacks=families.fallbacks(self.model))
        for f in self.features:
            f.report(report, self.compiled)
        return report

    def end(self) -> None:
        for f in self.features:
            f.end()
        self.logits.end()
        self.model = self.cache = self.prompt = self.processors = self.call = None

    def bind_cache(self) -> None:
        """After the prefill (a static cache allocates its tensors at its first update): graphs
        captured with other cache tensors are dropped. Every tensor a layer holds counts, not only
        its keys and values: transformers 5.17 builds a new cache each call, whose keys and values
        usually land where the last call's were (the same allocation sequence) while its one-element
        length counters need not. Those small tensors are handed back the ones the graphs read
        (their values copied in), so a new cache at the old keys and values replays the graphs."""
        big = tuple(_tensor_ptrs(layer, big=True) for layer in self.cache.layers)
        if self.cache_small is not None and big == self.cache_big:
            # the keys and values are where the captured ones were, so those are gone: the small
            # tensors the graphs read belong to no other live cache
            for layer, small in zip(self.cache.layers, self.cache_small):
                for name, kept in small.items():
                    now = vars(layer).get(name)
                    if (
                        isinstance(now, torch.Tensor)
                        and now is not kept
                        and now.shape == kept.shape
                        and now.dtype == kept.dtype
                        and now.device == kept.device
                    ):
                        kept.copy_(now)
                        setattr(layer, name, kept)
        ptrs = (
            tuple(_tensor_ptrs(layer) for layer in self.cache.layers)
            + (_tensor_ptrs(self.cache),)
            + tuple(f.address for f in self.features)
        )
        if ptrs != self.cache_ptrs:
            self.graphs.clear()
            self.warm = False  # the next step runs uncaptured (any recompile happens outside a capture)
            self.cache_ptrs, self.cache_big = ptrs, big
            self.cache_small = [
                {k: v for k, v in vars(layer).items() if isinstance(v, torch.Tensor) and v.numel() <= _SMALL}
                for layer in self.cache.layers
            ]

    def step(self) -> None:
        """One decode step, in place on the static buffers (the unit a CUDA graph captures); the
        last step's tail (or the prompt's) moved ``pos`` to this step's position."""
        kwargs = dict(
            input_ids=self.tok.view(-1, 1),
            attention_mask=self.mask,
            position_ids=self.pos.view(-1, 1),
            use_cache=True,
            **hf_up.cache_arguments(self.cache),
            **self.extra,
        )
        with contextlib.ExitStack() as parts:
            for f in self.features:
                parts.enter_context(f.use(self))
            parts.enter_context(hf_up.input_grad_hooks_suspended(self.model))
            parts.enter_context(ds_up.engine_forward_hooks_suspended(self.model))
            try:
                out = self.call(self.model, **kwargs)
            except _COMPILE_ERRORS as exc:
                # Dynamo/inductor failed before running a kernel (a graph break, the recompile limit:
                # a hook with Python state, say): this step and the rest run the forward eagerly
                if not self.compiled:
                    raise
                why = f"the forward does not compile into one graph ({_why(exc)})"
                _FAILED[self.model] = why
                log.warning("hf_zero3 lockstep: static loop without torch.compile: %s", why)
                self.call, self.compiled = type(self.model).__call__, False
                out = self.call(self.model, **kwargs)
        for f in self.features:
            f.after_step(self.cache)
        self._choose(out.logits[:, -1])

    def _choose(self, logits: torch.Tensor) -> None:
        buffers = (self.unfinished, self.pad, self.eos, self.out, self.idx, self.own, self.alive, self.tok, self.pos)
        if not self.sample and not self.processors:
            if not _TAIL_FAILED:
                try:
                    return _compiled_once(_greedy_tail)(logits, *buffers)
                except _COMPILE_ERRORS as exc:  # before any kernel ran: the eager tail does the same
                    _TAIL_FAILED.append(_why(exc))
                    log.warning("hf_zero3 lockstep: greedy steps without a compiled tail: %s", _TAIL_FAILED[0])
            return _greedy_tail(logits, *buffers)
        scores = self.logits(logits.to(torch.float32), self.idx, self.prompt)
        if self.sample:
            nxt = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            nxt = torch.argmax(scores, dim=-1)
        _record_token(nxt, *buffers)
        self.logits.record(self.tok)

    def finished(self) -> bool:
        return not bool(self.unfinished.any())  # the one host sync, at a stop agreement

    def result(self, tokens: int) -> tuple[torch.Tensor, int | None]:
        """(prompt + this rank's tokens, the step its rows were all done at or None)."""
        alive = self.alive[:tokens].tolist()
        done_at = alive.index(False) + 1 if False in alive else None
        own = done_at if done_at is not None else tokens
        return torch.cat([self.prompt, self.out[:, :own]], dim=-1), done_at


_SCALARS = frozenset((bool, int, float, str, type(None)))
# nn.Module's own tables (parameters, buffers, submodules, hooks): never plain state (hooks are counted)
_MODULE_TABLES = frozenset(k for k, v in vars(torch.nn.Module()).items() if isinstance(v, dict))


_SMALL = 16  # elements: a cache tensor this small is a counter, handed back rather than compared


def _tensor_ptrs(obj, big: bool = False) -> tuple:
    """(name, address) of every tensor attribute of ``obj`` (``big``: only those above ``_SMALL``)."""
    return tuple(
        (k, v.data_ptr())
        for k, v in sorted(vars(obj).items())
        if isinstance(v, torch.Tensor) and (not big or v.numel() > _SMALL)
    )


def _plain_state(obj, skip=None) -> tuple:
    """An object's plain attributes (flags, names, sizes: what Dynamo specializes a graph on),
    without those ``skip(name)`` is true for. One pass over ``vars(obj)``, type checks before any
    call, ``nn.Module``'s own tables (parameters, submodules, hooks: never plain) passed over by
    name: it runs over every module of the model once per call, while the prompt's forward runs."""
    items = []
    scalars, tables = _SCALARS, _MODULE_TABLES
    for k, v in vars(obj).items():
        t = type(v)
        if t not in scalars:
            if k in tables:
                continue
            if t is list or t is tuple or isinstance(v, (list, tuple)):
                if not all(type(x) is str for x in v):
                    continue
                v = tuple(v)
            elif (
                isinstance(v, dict)
                and v
                and all(type(x) in scalars for x in v.values())
                and all(type(x) is str for x in v)
            ):
                v = tuple(sorted(v.items()))  # PEFT's per-adapter scaling, r, lora_alpha
            else:
                continue
        if skip is None or not skip(k):
            items.append((k, v))
    return tuple(items)


def _module_state(model) -> tuple:
    """What a replayed graph cannot re-check and a compiled forward would (its guards): every
    module's flags and plain attributes (``training``, PEFT's active/disabled adapters), its hook
    counts, and the config's plain fields. ZeRO-3's own bookkeeping (``ds_*``, its pre-backward
    reference count, which a training step moves) is left out."""
    skip = ds_up.is_module_bookkeeping
    state = []
    for m in model.modules():
        state.append(_plain_state(m, skip))
        state.append((len(m._forward_hooks), len(m._forward_pre_hooks)))
    config = getattr(model, "config", None)
    if config is not None:
        state.append(_plain_state(config))
    return tuple(state)


def _loop_key(
    model,
    input_ids,
    processors,
    generation_config,
    eos_key,
    cache,
    attention: str | None,
    options: DecodeOptions,
) -> tuple[tuple, tuple] | None:
    """(what a loop's buffers and graphs are shaped by, the addresses and state they were captured
    with); None when a processor holds something other than plain values (its graph would bake
    in a tensor the next call may not pass again)."""
    procs = logits_processors.key(processors)
    if procs is None:
        return None
    dev = input_ids.device
    shape = (
        type(model),
        input_ids.shape[0],
        _cache_length(cache),
        str(dev),
        bool(generation_config.do_sample),
        procs,
        eos_key,
        attention,
        options,
    )
    params = list(model.parameters())
    where = (
        tuple(t.data_ptr() for t in params),
        tuple(t.data_ptr() for t in model.buffers()),
        tuple(t.dtype for t in params),
        torch.is_autocast_enabled(dev.type),
        torch.get_autocast_dtype(dev.type),
        _module_state(model),
    )
    return shape, where


def _loop_for(
    model, input_ids, processors, generation_config, eos, eos_key, cache, options: DecodeOptions
) -> tuple[_Loop, bool]:
    """(the loop for this call, whether an earlier call's); at most ``KEEP`` per model, most recent
    first, and one per shape and ``options`` (resolved): a loop whose addresses or state no longer
    match is replaced. Host work only (no device sync): it runs while the prompt's forward does."""
    device = input_ids.device
    attention = gqa_attention.choice(model, device, input_ids.shape[0], options.triton_attention)
    key = _loop_key(model, input_ids, processors, generation_config, eos_key, cache, attention, options)
    if key is not None:
        kept = _LOOPS.setdefault(model, collections.OrderedDict())
        entry = kept.get(key[0])
        if entry is not None and entry[0] == key[1]:
            kept.move_to_end(key[0])
            return entry[1], True
    loop = _Loop(
        input_ids.shape[0],
        _cache_length(cache),
        input_ids.device,
        eos,
        bool(generation_config.do_sample),
        features.plan(model, device, attention, options),
        list(processors or ()),
    )
    if key is not None:
        kept[key[0]] = (key[1], loop)
        kept.move_to_end(key[0])
        while len(kept) > KEEP:
            kept.popitem(last=False)
    return loop, False


def _forget(model, loop: _Loop) -> None:
    kept = _LOOPS.get(model, {})
    for shape in [s for s, (_, held) in kept.items() if held is loop]:
        del kept[shape]


def release(model=None) -> None:
    """Free the static buffers and CUDA graphs the loop keeps for ``model`` (every model: None),
    and forget why its forward (or its prompt's) did not compile or its steps were not captured: after the cause is
    gone (a hook removed, say) the next call tries the compiled loop again."""
    if model is None:
        _LOOPS.clear()
        _FAILED.clear()
        _PREFILL_FAILED.clear()
        _NO_GRAPHS.clear()
    else:
        for kept in (_LOOPS, _FAILED, _PREFILL_FAILED, _NO_GRAPHS):
            kept.pop(model, None)


class _Runner:
    """Runs one call's decode steps. A loop's first step ever runs uncaptured (it compiles the
    forward, and it is the warm-up CUDA-graph capture needs; a real step, its token kept); on CUDA
    the rest replay CUDA graphs of ``graph_steps`` steps and of each shorter run between two stop
    agreements the calls meet (the first window after the prompt's token: at most
    ``graph_steps`` graphs, one memory pool), each captured once per loop and replayed by later calls while the
    parameters, the cache and the model's state are those they were captured with; on CPU, or
    with ``graph_steps=0``, steps run one by one."""

    def __init__(self, loop: _Loop, graph_steps: int):
        self.loop = loop
        self.graph_steps = graph_steps if loop.mask.is_cuda and loop.model not in _NO_GRAPHS and loop.compiled else 0
        self.capture_s = 0.0  # host seconds spent capturing this call's graphs
        self.captured: set[int] = set()
        self.reused = False  # replayed a graph an earlier call captured

    def _first(self) -> None:
        side = torch.cuda.Stream() if self.graph_steps else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            self.loop.step()
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        if not self.loop.compiled:
            self.graph_steps = 0  # an eager forward may sync the host: no capture
        self.loop.warm = True

    def _capture(self, n: int) -> "torch.cuda.CUDAGraph":
        t = time.perf_counter()
        g = torch.cuda.CUDAGraph()
        graphs = self.loop.graphs
        pool = next(iter(graphs.values())).pool() if graphs else None
        with torch.cuda.graph(g, pool=pool):
            for _ in range(n):
                self.loop.step()
        self.capture_s += time.perf_counter() - t
        graphs[n] = g
        self.captured.add(n)
        return g

    def run(self, n: int) -> None:
        if n > 0 and not self.loop.warm:
            self._first()
            n -= 1
        while n > 0:
            if not self.graph_steps:
                self.loop.step()
                n -= 1
                continue
            size = min(n, self.graph_steps)
            g = self.loop.graphs.get(size)
            if g is None:
                try:
                    g = self._capture(size)
                except RuntimeError as exc:  # an op that syncs the host cannot be captured; nothing ran
                    _NO_GRAPHS[self.loop.model] = _why(exc)
                    log.warning(
                        "hf_zero3 lockstep: decode steps not captured as CUDA graphs: %s", _NO_GRAPHS[self.loop.model]
                    )
                    self.loop.graphs.clear()
                    self.graph_steps = 0
                    continue
            elif size not in self.captured:
                self.reused = True
            g.replay()
            n -= size


class _Snapshot:
    """A late stop check's value (:func:`hf_zero3.generation.lockstep.stop_schedule`): at each
    check, whether some row was unfinished at the previous check. The flag is copied to pinned
    host memory after the steps queued before a check and read at the next one, when those steps
    have long run (the GPU is decoding the steps queued after them): no check waits for the GPU."""

    def __init__(self, loop: _Loop):
        self.loop = loop
        cuda = loop.unfinished.is_cuda
        self.host = torch.ones((), dtype=torch.bool, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None

    def previous(self) -> bool:
        """The previous check's flag (True at the first check), then this check's snapshot."""
        if self.event is not None:
            self.event.synchronize()
        seen = bool(self.host)
        self.host.copy_(self.loop.unfinished.any(), non_blocking=self.event is not None)
        if self.event is not None:
            self.event.record()
        return seen


_TF32: list = []  # whether TF32 matmuls were on in the process's first static-loop call


@contextlib.contextmanager
def _tf32_pinned():
    """TF32 matmuls on or off as in the process's first static-loop call, for this call. Dynamo
    guards a compiled function on that global setting, and a trainer that flips it between
    rollouts (GRPO under DeepCompile did) recompiled the prompt forward and the decode step at the
    next rollout (~25 s each at a 0.5B shape); with the setting pinned they keep one graph."""
    now = torch.backends.cuda.matmul.allow_tf32
    if not _TF32:
        _TF32.append(now)
    torch.backends.cuda.matmul.allow_tf32 = _TF32[0]
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = now


@_tf32_pinned()
def decode(
    model,
    call,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    model_kwargs,
    graph_steps: int,
    options: DecodeOptions,
) -> torch.Tensor:
    """Generate with the static loop, in lockstep with ``call`` (a :class:`.lockstep._Call`): the
    agreements of transformers' loop under lockstep, at the same steps. ``options``: resolved
    (:meth:`DecodeOptions.resolved`)."""
    torch_up.pin_triton_ptxas()  # before the first compile: warm caches hit in every process
    budget = int(call.budget)
    cache = hf_up.generation_cache(model_kwargs)
    eos = _eos_ids(stopping_criteria, input_ids.device)
    eos_key = None if eos is None else tuple(eos.tolist())  # read before the prefill is queued
    mask, positions = _prompt_inputs(input_ids, model_kwargs)
    # the prompt's forward is queued first: the host looks up (or builds) the loop while it runs
    logits, prefill = _prefill(model, input_ids, mask, positions, cache, options.compile_prefill)
    loop, kept = _loop_for(model, input_ids, logits_processor, generation_config, eos, eos_key, cache, options)
    try:
        loop.start(
            model,
            input_ids,
            mask,
            positions,
            cache,
            logits_processor,
            generation_config,
            stopping_criteria,
            budget,
            logits.shape[-1],
        )
        runner = _Runner(loop, graph_steps)
        loop._choose(logits)  # the first token, from the prompt's logits
        loop.bind()
        every, fixed = call.every, call.cfg.stop == "fixed"
        seen = _Snapshot(loop) if call.late else None
        tokens = 1  # the prefill chose token 1; before forward k + 1 the loop asks to go on (k = tokens)
        while tokens < budget:
            nxt = budget if fixed else min(budget, (tokens // every + 1) * every)
            if not fixed and tokens % every == 0:
                unfinished = seen.previous() if seen is not None else not loop.finished()
                if not call.agree_step(call.rt.join is None and unfinished):
                    break
            runner.run(nxt - tokens)
            tokens = nxt
        out, done_at = loop.result(tokens)
        report = loop.report()
    except BaseException:
        _forget(model, loop)  # a call cut short leaves no half-captured loop behind
        raise
    finally:
        loop.end()
    if not loop.compiled:
        _forget(model, loop)  # later calls take transformers' loop (failure() says why)
    call.finish_loop(
        tokens,
        done_at,
        compiled=loop.compiled,
        graph_steps=runner.graph_steps,
        capture_s=runner.capture_s,
        loop_reused=kept,
        graphs_reused=runner.reused,
        prefill=prefill,
        prefill_reason=_PREFILL_FAILED.get(model),
        report=report,
    )
    if generation_config.return_dict_in_generate:
        return hf_up.decoder_only_output(out, cache)
    return out

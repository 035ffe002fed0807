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

Lockstep semantics are those of the transformers loop it replaces (:mod:`.lockstep`): the same
agreed step budget, a stop agreement every ``sync_every`` steps (``stop="sync"``) or none
(``stop="fixed"``), the same number of forwards on every rank, EOS masking with the pad token,
and the same output (a rank's output ends where its own rows were all done). Ranks that take
this loop and ranks that take transformers' issue the same agreements at the same steps.

It runs only where it is exact; anything else decodes through transformers (compiled or eager),
with the reason in ``hf_zero3_last_generate.loop_reason``: logits processors or stopping criteria
other than the tensor-only ones below, a streamer, ``return_dict_in_generate``, extra model
inputs, a cache that is not transformers' ``StaticCache``, or a forward that does not compile
into one graph (then the loop runs it eagerly). Like any CUDA graph, a replayed step runs no
Python: forward hooks on the model run when a step is captured, not when it is replayed.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
import weakref

import torch

__all__ = ["GRAPH_SAFE_PROCESSORS", "GRAPH_SAFE_CRITERIA", "unsupported", "decode", "failure"]

log = logging.getLogger("hf_zero3.generation")

# Tensor-only processors: they read the scores, never the (growing) input ids or host state.
GRAPH_SAFE_PROCESSORS = frozenset({"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper",
                                   "MinPLogitsWarper", "InfNanRemoveLogitsProcessor"})
# Criteria the loop computes itself: the step budget, and EOS on the token just chosen.
GRAPH_SAFE_CRITERIA = frozenset({"MaxLengthCriteria", "EosTokenCriteria"})
_MODEL_KWARGS = frozenset({"attention_mask", "past_key_values", "use_cache", "output_attentions",
                           "output_hidden_states", "return_dict", "logits_to_keep", "cache_position",
                           "position_ids"})
_COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit)
_COMPILED: dict = {}  # model class -> its compiled __call__
_FAILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> why its forward did not compile
_NO_GRAPHS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> why its steps were not captured


def _static_layers(cache) -> bool:
    from transformers.cache_utils import StaticLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is StaticLayer for layer in layers)


def unsupported(model, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs,
                length: int) -> str | None:
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
        return "return_dict_in_generate=True"
    if getattr(generation_config, "is_assistant", False):
        return "assisted decoding"
    for p in logits_processor or ():
        if type(p).__name__ not in GRAPH_SAFE_PROCESSORS:
            return f"logits processor {type(p).__name__} is not one the loop captures"
    for c in stopping_criteria or ():
        if type(c).__name__ not in GRAPH_SAFE_CRITERIA:
            return f"stopping criterion {type(c).__name__} is not one the loop computes"
    extra = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _MODEL_KWARGS)
    if extra:
        return f"model inputs {extra} are not static"
    positions = model_kwargs.get("position_ids")
    if positions is not None and positions.dim() != 2:
        return "position_ids are not 2-D (one position per token)"
    cache = model_kwargs.get("past_key_values")
    if cache is None or not _static_layers(cache):
        return "the cache is not transformers' StaticCache (StaticLayer layers)"
    room = _cache_length(cache)
    if length > room:
        return f"the static cache holds {room} tokens, fewer than prompt + new tokens ({length})"
    return None


def _cache_length(cache) -> int:
    """Tokens every layer of a static cache holds."""
    return min(layer.max_cache_len for layer in cache.layers)


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def failure(model) -> str | None:
    """Why ``model``'s forward did not compile into one graph (None: it did, or was not tried)."""
    return _FAILED.get(model)


def _forward_kwargs(model) -> dict:
    params = inspect.signature(type(model).forward).parameters
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def _compiled_call(cls):
    """``cls.__call__`` compiled into one graph (hooks included, as transformers compiles it),
    once per class: an unbound function holds no model alive."""
    fn = _COMPILED.get(cls)
    if fn is None:
        fn = _COMPILED[cls] = torch.compile(cls.__call__, fullgraph=True)
    return fn


def _eos_ids(stopping_criteria, device) -> torch.Tensor | None:
    ids = [c.eos_token_id for c in stopping_criteria or () if hasattr(c, "eos_token_id")]
    if not ids:
        return None
    return torch.cat([torch.as_tensor(i, device=device).flatten() for i in ids]).to(torch.long)


class _Loop:
    """The static state of one call and the steps that update it in place."""

    def __init__(self, model, input_ids, processors, generation_config, stopping_criteria, model_kwargs, budget):
        self.model, self.processors = model, processors
        self.cache = model_kwargs["past_key_values"]
        dev = input_ids.device
        b, p = input_ids.shape
        self.prompt = input_ids
        mask = model_kwargs.get("attention_mask")
        mask = torch.ones_like(input_ids) if mask is None else mask.to(torch.long)
        self.prompt_mask = mask
        # the cache's whole length: prompt padding, then every position a decode step may fill
        self.mask = torch.ones(b, _cache_length(self.cache), dtype=torch.long, device=dev)
        self.mask[:, :p] = mask
        positions = model_kwargs.get("position_ids")  # transformers' (from the mask), or the caller's
        if positions is None:
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        self.prompt_positions = positions.expand(b, -1)
        self.pos = torch.empty(b, dtype=torch.long, device=dev).copy_(self.prompt_positions[:, -1])  # dense strides
        self.tok = torch.zeros(b, dtype=torch.long, device=dev)
        self.idx = torch.zeros(1, dtype=torch.long, device=dev)
        self.unfinished = torch.ones(b, dtype=torch.bool, device=dev)
        self.eos = _eos_ids(stopping_criteria, dev)
        # this rank's own step budget (its max_length), which may be below the group's agreed one:
        # its rows are done there, as transformers' MaxLengthCriteria has them
        lengths = [c.max_length for c in stopping_criteria or () if type(c).__name__ == "MaxLengthCriteria"]
        own = min([budget] + [int(n) - p for n in lengths])
        self.own = torch.tensor(own, dtype=torch.long, device=dev)
        pad = generation_config._pad_token_tensor
        self.pad = (pad if pad is not None else torch.tensor(0)).to(dev, torch.long).flatten()[0]
        self.out = torch.full((b, budget), int(self.pad), dtype=torch.long, device=dev)
        self.alive = torch.ones(budget, dtype=torch.bool, device=dev)
        self.sample = bool(generation_config.do_sample)
        self.extra = _forward_kwargs(model)
        self.call = _compiled_call(type(model))  # called as call(model, ...)
        self.compiled = True

    def prefill(self) -> None:
        """The prompt's forward (eager, as transformers does it) and the first token."""
        out = self.model(input_ids=self.prompt, attention_mask=self.prompt_mask, position_ids=self.prompt_positions,
                         past_key_values=self.cache, use_cache=True, **self.extra)
        self._choose(out.logits[:, -1])

    def step(self) -> None:
        """One decode step, in place on the static buffers (the unit a CUDA graph captures)."""
        self.pos.add_(1)
        kwargs = dict(input_ids=self.tok.view(-1, 1), attention_mask=self.mask, position_ids=self.pos.view(-1, 1),
                      past_key_values=self.cache, use_cache=True, **self.extra)
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
        self._choose(out.logits[:, -1])

    def _choose(self, logits: torch.Tensor) -> None:
        scores = logits.to(torch.float32)
        for proc in self.processors or ():
            scores = proc(self.prompt, scores)  # tensor-only processors ignore the ids
        if self.sample:
            nxt = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            nxt = torch.argmax(scores, dim=-1)
        if self.eos is not None:
            nxt = torch.where(self.unfinished, nxt, self.pad)
        self.out.index_copy_(1, self.idx, nxt.view(-1, 1))
        if self.eos is not None:
            self.unfinished &= ~torch.isin(nxt, self.eos)
        self.unfinished &= self.idx + 1 < self.own  # token idx + 1 reached this rank's max_length
        self.alive.index_copy_(0, self.idx, self.unfinished.any().view(1))
        self.tok.copy_(nxt)
        self.idx.add_(1)

    def finished(self) -> bool:
        return not bool(self.unfinished.any())  # the one host sync, at a stop agreement

    def result(self, tokens: int) -> tuple[torch.Tensor, int | None]:
        """(prompt + this rank's tokens, the step its rows were all done at or None)."""
        alive = self.alive[:tokens].tolist()
        done_at = alive.index(False) + 1 if False in alive else None
        own = done_at if done_at is not None else tokens
        return torch.cat([self.prompt, self.out[:, :own]], dim=-1), done_at


class _Runner:
    """Runs decode steps: the first one uncaptured (it compiles the forward, and it is the warm-up
    CUDA-graph capture needs; a real step, its token kept), the rest replayed from CUDA graphs of
    up to ``graph_steps`` steps, each size captured once per call (CUDA), or one by one (CPU, or
    ``graph_steps=0``). Graphs are captured per call: the gathered parameters get new storage at
    every region entry, and a graph holds the addresses it was captured with."""

    def __init__(self, loop: _Loop, graph_steps: int):
        self.loop = loop
        self.graph_steps = graph_steps if loop.prompt.is_cuda and loop.model not in _NO_GRAPHS else 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.warm = False
        self.capture_s = 0.0  # host seconds spent capturing this call's graphs

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
        self.warm = True

    def _capture(self, n: int) -> "torch.cuda.CUDAGraph":
        t = time.perf_counter()
        g = torch.cuda.CUDAGraph()
        pool = next(iter(self.graphs.values())).pool() if self.graphs else None
        with torch.cuda.graph(g, pool=pool):
            for _ in range(n):
                self.loop.step()
        self.capture_s += time.perf_counter() - t
        return g

    def run(self, n: int) -> None:
        if n > 0 and not self.warm:
            self._first()
            n -= 1
        while n > 0:
            if not self.graph_steps:
                self.loop.step()
                n -= 1
                continue
            size = min(self.graph_steps, n)  # sizes: graph_steps, the stretch between agreements, a remainder
            if size not in self.graphs:
                try:
                    self.graphs[size] = self._capture(size)
                except RuntimeError as exc:  # an op that syncs the host cannot be captured; nothing ran
                    _NO_GRAPHS[self.loop.model] = _why(exc)
                    log.warning("hf_zero3 lockstep: decode steps not captured as CUDA graphs: %s",
                                _NO_GRAPHS[self.loop.model])
                    self.graph_steps = 0
                    continue
            self.graphs[size].replay()
            n -= size


def decode(model, call, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs,
           graph_steps: int) -> torch.Tensor:
    """Generate with the static loop, in lockstep with ``call`` (a :class:`.lockstep._Call`): the
    agreements of transformers' loop under lockstep, at the same steps."""
    budget = int(call.budget)
    loop = _Loop(model, input_ids, logits_processor, generation_config, stopping_criteria, model_kwargs, budget)
    runner = _Runner(loop, graph_steps)
    loop.prefill()
    every, fixed = call.cfg.sync_every, call.cfg.stop == "fixed"
    tokens = 1  # the prefill chose token 1; before forward k + 1 the loop asks to go on (k = tokens)
    while tokens < budget:
        if not fixed and tokens % every == 0 and not call.agree_unfinished(call.rt.join is None and not loop.finished()):
            break
        nxt = budget if fixed else min(budget, (tokens // every + 1) * every)
        runner.run(nxt - tokens)
        tokens = nxt
    out, done_at = loop.result(tokens)
    call.finish_loop(tokens, done_at, compiled=loop.compiled, graph_steps=runner.graph_steps,
                     capture_s=runner.capture_s)
    return out

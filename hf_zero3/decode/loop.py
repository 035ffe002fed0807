"""The static loop's buffers (:class:`DecodeLoop`): one (model, batch, cache length, options)'s
per-token tensors, updated in place so that a decode step is a fixed sequence of kernels (the unit
a CUDA graph captures), and the check of what its graphs were captured with."""

from __future__ import annotations

import contextlib
import logging

import torch

from .._upstream import transformers as hf_up
from . import families, features, logits_processors, ring_cache
from .caches import FORWARD_FAILED, TAIL_FAILED
from .compiled import (
    COMPILE_ERRORS,
    bookkeeping_hooks_suspended,
    compiled_model_call,
    compiled_once,
    failure_reason,
    forward_kwargs,
    greedy_tail,
    record_token,
)

log = logging.getLogger("hf_zero3.generation")

_SMALL = 16  # elements: a cache tensor this small is a counter, handed back rather than compared


def _tensor_ptrs(obj, big: bool = False) -> tuple:
    """(name, address) of every tensor ``obj`` holds, a linear-attention layer's per-state tensors
    included (``big``: only those above ``_SMALL``)."""
    return tuple((k, v.data_ptr()) for k, v in hf_up.layer_state_tensors(obj) if not big or v.numel() > _SMALL)


class DecodeLoop:
    """The static buffers of one (model, batch, cache length, options) and the CUDA graphs of its
    decode steps, kept across calls (see :func:`.loop_cache.loop_for`); per call, :meth:`start`
    fills them in place and :meth:`end` drops the call's objects (the model among them: a kept loop
    holds none)."""

    def __init__(
        self,
        batch: int,
        length: int,
        device,
        eos: torch.Tensor | None,
        sample: bool,
        parts: list[features.Feature] = (),
        processors: list = (),
        compile_step: bool = True,
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
        # DecodeOptions.compile_layers: the step as the model's forward with one compiled layer
        self.layers = next((f for f in self.features if isinstance(f, features.CompiledLayers)), None)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # steps per graph -> graph
        self.cache_ptrs = None  # the cache tensors the graphs were captured with
        self.cache_small = None  # per layer, its small tensors (length counters) the graphs read
        self.cache_big = None  # per layer, the addresses of its other tensors (keys, values)
        self.moved: tuple[str, ...] = ()  # this call: what kept graphs read that moved (they were dropped)
        self.warm = False  # a step ran (compiled, warmed up for capture) in this or an earlier call
        self.compile_step = compile_step  # DecodeOptions.compile_step: off, the model's forward runs the steps
        self.compiled = True  # False: the step's forward did not compile and runs eagerly, uncaptured
        self.model = self.cache = self.prompt = self.processors = None
        self.rings = False  # the call's cache has ring layers (ring_cache): the loop builds the step's masks

    def start(
        self, model, input_ids, mask, positions, cache, processors, generation_config, stopping_criteria, budget, vocab
    ):
        """Fill the buffers for one call (``mask``, ``positions``: the prompt's, from
        :func:`.prefill.prompt_inputs`) after its prompt's forward was queued."""
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
        self.extra = forward_kwargs(model)

    def _choose_call(self) -> None:
        whole = self.step_kind == "compiled"
        self.call = compiled_model_call(type(self.model), self.dependent) if whole else type(self.model).__call__

    @property
    def step_kind(self) -> str:
        """How the decode steps ran: ``"compiled"`` (the whole forward), ``"layers"`` (the model's
        forward, each decoder layer through one compiled layer: ``compile_layers``), or ``"eager"``
        (asked for, or the forward did not compile)."""
        if not (self.compiled and self.compile_step):
            return "eager"
        layers = self.layers
        if layers is not None and layers.count and layers.failed is None:
            return "layers"
        return "compiled"

    def bind(self) -> None:
        """After the prefill: each feature binds to this call's model and cache (the fused q/k/v
        copy is made here, so the prefill's peak does not hold it; the compiled layers' views of
        the cache, which decide whether the step runs them), then the check of what the graphs were
        captured with."""
        for f in self.features:
            f.bind(self.model, self.cache)
        self.rings = bool(ring_cache.rings(self.cache))
        self._choose_call()
        self.bind_cache()

    def report(self) -> features.DecodeReport:
        report = features.DecodeReport(
            fallbacks=families.fallbacks(self.model),
            experts=hf_up.experts_implementation(self.model),
            ring_layers=len(ring_cache.rings(self.cache)),
            linear_attention_layers=hf_up.linear_attention_layers(self.cache),
        )
        for f in self.features:
            f.report(report, self.compiled)
        return report

    def end(self) -> None:
        for f in self.features:
            f.end()
        self.logits.end()
        self.model = self.cache = self.prompt = self.processors = self.call = None

    def _moved(self, ptrs: tuple, big: tuple) -> tuple[str, ...]:
        """What the kept graphs were captured with that this call holds elsewhere (``ptrs``, ``big``:
        :meth:`bind_cache`'s): the cache's keys and values, its other tensors, a feature's copy."""
        n = len(self.cache.layers)
        moved = []
        if big != self.cache_big:
            moved.append("cache keys/values")
        elif ptrs[: n + 1] != self.cache_ptrs[: n + 1]:
            moved.append("cache counters")
        for f, now, then in zip(self.features, ptrs[n + 1 :], self.cache_ptrs[n + 1 :]):
            if now != then:
                moved.append(type(f).__name__)
        return tuple(moved)

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
        self.moved = ()
        if ptrs != self.cache_ptrs:
            if self.graphs:
                self.moved = self._moved(ptrs, big)
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
            parts.enter_context(bookkeeping_hooks_suspended(self.model))
            if self.rings:  # sliding layers as rings: this step's masks, in the attention's form (features set it)
                kwargs["attention_mask"] = ring_cache.step_masks(self.model, self.cache, self.mask)
            try:
                out = self.call(self.model, **kwargs)
            except COMPILE_ERRORS as exc:
                # Dynamo/inductor failed before running a kernel (a graph break, the recompile limit:
                # a hook with Python state, say): this step and the rest run the forward eagerly
                if self.step_kind == "eager":
                    raise
                why = f"the forward does not compile into one graph ({failure_reason(exc)})"
                FORWARD_FAILED[self.model] = why
                log.warning("hf_zero3 lockstep: static loop without torch.compile: %s", why)
                self.call, self.compiled = type(self.model).__call__, False
                out = self.call(self.model, **kwargs)
        if self.step_kind == "compiled" and self.call is type(self.model).__call__:
            # the compiled layers failed in this step (the only way the two disagree): the whole
            # step compiles from the next one
            log.warning(
                "hf_zero3 lockstep: the decode step compiles whole, not one layer at a time: %s", self.layers.failed
            )
            self._choose_call()
        for f in self.features:
            f.after_step(self.cache)
        self._choose(out.logits[:, -1])

    def _choose(self, logits: torch.Tensor) -> None:
        buffers = (self.unfinished, self.pad, self.eos, self.out, self.idx, self.own, self.alive, self.tok, self.pos)
        if not self.sample and not self.processors:
            if self.compile_step and not TAIL_FAILED:
                try:
                    return compiled_once(greedy_tail)(logits, *buffers)
                except COMPILE_ERRORS as exc:  # before any kernel ran: the eager tail does the same
                    TAIL_FAILED.append(failure_reason(exc))
                    log.warning("hf_zero3 lockstep: greedy steps without a compiled tail: %s", TAIL_FAILED[0])
            return greedy_tail(logits, *buffers)
        scores = self.logits(logits.to(torch.float32), self.idx, self.prompt)
        if self.sample:
            nxt = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            nxt = torch.argmax(scores, dim=-1)
        record_token(nxt, *buffers)
        self.logits.record(self.tok)

    def finished(self) -> bool:
        return not bool(self.unfinished.any())  # the one host sync, at a stop agreement

    def result(self, tokens: int) -> tuple[torch.Tensor, int | None]:
        """(prompt + this rank's tokens, the step its rows were all done at or None)."""
        alive = self.alive[:tokens].tolist()
        done_at = alive.index(False) + 1 if False in alive else None
        own = done_at if done_at is not None else tokens
        return torch.cat([self.prompt, self.out[:, :own]], dim=-1), done_at

"""Which decode path a ``generate()`` call takes, decided in one place: :func:`plan`.

A call learns what decides its path in three moments: what it asked (:class:`DecodeRequest`, read
before lockstep or transformers change its arguments), how lockstep's first agreement gathered the
model, and, once transformers has prepared them, its cache, logits processors and stopping
criteria (:class:`LoopInputs`). Lockstep calls :func:`plan` at each moment with what it knows;
``hf_zero3 env --model`` calls it for a model built on the meta device. Each returns a
:class:`DecodePlan`: the decode step (compiled or eager) and the decoding loop (hf_zero3's static
loop or transformers') with one reason each, which the warning, the call's report
(``hf_zero3_last_generate.decode_reason`` / ``.loop_reason``) and ``hf_zero3 env`` print as they
are. Local and cheap: a decode step gathers nothing inside a whole-model region, so ranks deciding
differently still issue the same collectives.

What the loop computes its own way (attention, MLP kernels, fused projections, compiled layers) is
decided where the loop is built, from :class:`~hf_zero3.options.DecodeOptions`, and reported in
:class:`~hf_zero3.decode.features.DecodeReport`; a forward that then fails to compile is
remembered (:mod:`.caches`) and is the loop part's reason in the next plan.

The step compiles with ``decode="compiled"`` always, unless the model or the options cannot (beam
search, encoder-decoder models, a cache passed in or another cache implementation, a model
transformers does not mark compileable), or the region gathers layer by layer (ZeRO-3's hooks run
in every forward). ``decode="auto"`` (the default): the same, on CUDA only (beside DeepCompile's
training graphs too: the decode step is its own compiled function), and not where the
generation config sets ``disable_compile``, except in the rollouts of a TRL trainer ``Zero3Safe``
adapted: TRL sets it (GRPO, RLOO, Distillation) to keep transformers from compiling, so there the
call takes hf_zero3's static loop and, where that loop cannot take the call, decodes eagerly rather
than through transformers' compiled loop; ``"compiled"`` overrides ``disable_compile`` for both
loops. ``decode="eager"``: never.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._upstream import transformers as hf_up
from . import eligibility

DECODE_MODES = ("auto", "eager", "compiled")


def gen_value(model, kwargs: dict, name: str, default=None):
    """A generation option as ``generate()`` will read it: the keyword, the passed generation
    config, the model's."""
    if name in kwargs:
        return kwargs[name]
    gen_cfg = kwargs.get("generation_config")
    if gen_cfg is not None and getattr(gen_cfg, name, None) is not None:
        return getattr(gen_cfg, name)
    return getattr(getattr(model, "generation_config", None), name, default)


@dataclass(frozen=True)
class DecodeRequest:
    """What a call asked that decides its path, read from its arguments before anything changes
    them (:meth:`of`)."""

    mode: str = "auto"  # LockstepConfig.decode
    trl: str | None = (
        None  # the TRL trainer whose rollout this is (its disable_compile keeps only transformers' loop off)
    )
    encoder_decoder: bool = False
    num_beams: int = 1
    cache_passed: bool = False
    cache_implementation: str | None = None
    max_new_tokens: int | None = None
    use_cache: bool | None = None
    disable_compile: bool = False
    on_cuda: bool = True

    @classmethod
    def of(cls, model, mode: str, kwargs: dict, trl: str | None = None) -> DecodeRequest:
        return cls(
            mode=mode,
            trl=trl,
            encoder_decoder=bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False)),
            num_beams=int(gen_value(model, kwargs, "num_beams", 1) or 1),
            cache_passed=hf_up.passed_cache(kwargs) is not None,
            cache_implementation=gen_value(model, kwargs, "cache_implementation"),
            max_new_tokens=gen_value(model, kwargs, "max_new_tokens"),
            use_cache=gen_value(model, kwargs, "use_cache"),
            disable_compile=bool(gen_value(model, kwargs, "disable_compile")),
            on_cuda=getattr(getattr(model, "device", None), "type", "cpu") == "cuda",
        )

    @property
    def own_loop_only(self) -> bool:
        """``decode="auto"`` with ``disable_compile`` set: transformers' compiled loop stays off
        (``"compiled"`` overrides it for both loops)."""
        return self.mode == "auto" and self.disable_compile


@dataclass(frozen=True)
class LoopInputs:
    """What transformers prepared for its decoding loop (``_sample``'s arguments), and ``length``:
    prompt + the agreed step budget."""

    generation_config: object
    model_kwargs: dict
    logits_processor: object = ()
    stopping_criteria: object = ()
    streamer: object = None
    length: int = 0


@dataclass(frozen=True)
class DecodePlan:
    """A call's decode path, part by part: ``step`` ``"compiled"`` (a static KV cache and a
    compiled step) or ``"eager"``, with ``step_reason``; ``loop`` ``"hf_zero3"`` (the static
    loop), ``"transformers"`` (its compiled loop), or None while undecided (before the cache
    exists) or with an eager step, with ``loop_reason``; ``known``: what it was made from
    (``"request"``, ``"gathering"``, ``"cache"``, ``"loop"``: see :func:`plan`)."""

    step: str
    step_reason: str | None = None
    loop: str | None = None
    loop_reason: str | None = None
    known: str = "request"

    @property
    def compiled(self) -> bool:
        return self.step == "compiled"


def _step_reason(model, request: DecodeRequest) -> str | None:
    """Why the call cannot decode compiled, from what it asked."""
    if request.mode == "eager":
        return "decode='eager'"
    if request.encoder_decoder:
        return "encoder-decoder model"
    if request.num_beams > 1:
        return "beam search (num_beams > 1)"
    if request.cache_passed:
        return "a cache was passed in"
    if request.cache_implementation not in (None, "static"):
        return f"cache_implementation={request.cache_implementation!r}"
    if not request.max_new_tokens:
        # with max_length only, a rank with a longer prompt would decode past its static cache
        # while the group runs the agreed (largest) step budget
        return "max_new_tokens is not set (a static cache needs it)"
    if request.use_cache is False and request.trl is None:
        # TRL's GKD sets it while gradient checkpointing is on (a training-mode concern); in its
        # rollouts the static loop decodes with its cache, as the other TRL trainers do
        return "use_cache=False"
    if request.own_loop_only and request.trl is None:
        return "disable_compile=True (decode='compiled' overrides it)"
    if not hf_up.can_compile_fullgraph(model):
        return f"transformers does not mark {type(model).__name__} compileable (_can_compile_fullgraph)"
    if request.mode == "auto" and not request.on_cuda:
        return "decode='auto' compiles on CUDA only (decode='compiled' forces it)"
    return None


def region_reason(gather: str) -> str | None:
    """Why the agreed gathering allows no compiled step (None: it does; no ZeRO-3 hook runs inside)."""
    if gather in ("all", "held"):
        return None
    return f"the model is gathered {gather!r} (ZeRO-3's hooks run in every forward)"


def plan(
    model,
    request: DecodeRequest,
    *,
    gather: str | None = None,
    model_kwargs: dict | None = None,
    loop: LoopInputs | None = None,
) -> DecodePlan:
    """The decode path of ``model``'s call, from what is known: ``request`` alone (before
    generating), with ``gather`` (lockstep's agreed gathering), with ``model_kwargs`` (transformers'
    prepared cache), with ``loop`` (the decoding loop's inputs: the loop part is decided)."""
    known = (
        "loop" if loop is not None else "cache" if model_kwargs is not None else "gathering" if gather else "request"
    )
    why = _step_reason(model, request)
    if why is None and gather is not None:
        why = region_reason(gather)
    if why is None and model_kwargs is not None:
        broken = hf_up.contract_problems()
        if broken:  # a release that moved what the compiled path reads: never a silent fallback
            why = broken[0]
        elif not getattr(hf_up.generation_cache(model_kwargs), "is_compileable", False):
            why = "the cache transformers prepared is not compileable"
    if why is not None:
        return DecodePlan("eager", why, known=known)
    if loop is None:
        return DecodePlan("compiled", known=known)
    why = eligibility.unsupported(
        model,
        loop.logits_processor,
        loop.stopping_criteria,
        loop.generation_config,
        loop.streamer,
        loop.model_kwargs,
        loop.length,
    )
    if why is None:
        return DecodePlan("compiled", loop="hf_zero3", known=known)
    if request.own_loop_only:  # TRL's disable_compile: not transformers' compiled loop
        step_why = f"disable_compile=True ({request.trl}) and not hf_zero3's loop: {why}"
        return DecodePlan("eager", step_why, None, why, known=known)
    return DecodePlan("compiled", loop="transformers", loop_reason=why, known=known)

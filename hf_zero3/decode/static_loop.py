"""hf_zero3's own decode loop for compiled decoding: static buffers, one compiled forward, and on
CUDA several decode steps per CUDA-graph launch.

Transformers' compiled decoding (``cache_implementation="static"``) still runs its Python loop
every token: input preparation, the logits processors, sampling, the stopping criteria and a
host sync each step. With the whole model gathered, that loop and not the GPU sets the speed.
This loop keeps every per-token tensor in a static buffer (the token, its position, the EOS mask,
the generated tokens) and updates it in place, so one decode step is a fixed sequence of kernels:
the compiled forward (``torch.compile(fullgraph=True)``; with ``DecodeOptions(compile_step=False)``,
a TRL rollout's default, the model's own forward, nothing compiled), the logits processors,
sampling or argmax, EOS masking. On CUDA those steps are captured into CUDA graphs of several steps each
(``graph_steps``), replayed between two lockstep stop agreements with no host sync in between;
on CPU the same steps run one by one.

Lockstep semantics are those of the transformers loop it replaces under compiled decoding
(:mod:`hf_zero3.generation.lockstep`): the same agreed step budget, a stop agreement every
``sync_every`` steps on the previous check's flags (``stop="sync"``;
:func:`~hf_zero3.generation.config.stop_schedule`: the flags are a device copy read one check
late, so no check waits for the GPU) or none (``stop="fixed"``), the same number of forwards on
every rank, EOS masking with the pad token, and the same output (a rank's output ends where its own
rows were all done). Ranks that take this loop and ranks that take transformers' loop (compiled or
eager) issue the same agreements at the same steps: the call's first agreement settles the schedule
for the group.

Across calls: the loop (its static buffers and CUDA graphs) is kept per model and shape (batch,
cache length, sampling, processors and their values, EOS ids; at most :data:`.loop_cache.KEEP` per
model) and a later call replays its graphs only while everything a replayed graph reads is what it
was captured with: the parameters' and buffers' storage, every tensor of the static cache, the
call's fused q/k/v weight copy (:mod:`.fused_qkv`), and the model's plain state (``training`` flags,
PEFT adapter switches, hook counts, config fields: what the compiled forward's guards would check).
Gathered parameters land at the same addresses from one region to the next when the allocation
sequence repeats (back to back, after a layer-wise forward, after a training step); when anything
moved, the call captures anew. Kept graphs hold their memory pool (one decode step's temporaries)
until :func:`release` (``hf_zero3.release_decode_graphs``). Grouped-query models decode with
:mod:`.gqa_attention` (the KV cache read once per step, not once per query head; on CUDA one Triton
kernel per layer where it pays, with a Llama layer's rotary embedding and cache write inside it),
Llama-style SiLU MLPs with :mod:`.mlp_kernels` (the gate/up pair as one Triton kernel, down and
``o_proj`` split-K, CUDA), and the decode steps run DeepSpeed's forward prologue/epilogue hooks and
gradient checkpointing's input-require-grads hook off (nothing for them to do in a gathered region
under ``no_grad``). The prompt's forward is compiled too (its own function, the prompt length
dynamic: one graph per batch size for every prompt length; eager, without DeepSpeed's per-linear
autograd Function, where it does not compile or with ``DecodeOptions(compile_prefill=False)``, the
default in a TRL trainer's rollouts) and
queued before the loop is looked up, so that host work overlaps it. Greedy steps without processors
end in one compiled tail (the argmax of the model's logits in two stages, the same token as their
float32 copy's; EOS masking and the token bookkeeping).

It runs only where it is exact; anything else decodes through transformers (compiled or eager),
with the reason in ``hf_zero3_last_generate.loop_reason``: logits processors or stopping criteria
other than the tensor-only ones below, a streamer, ``return_dict_in_generate``, extra model
inputs, a cache that is not transformers' ``StaticCache``, or a forward that does not compile
into one graph (then the loop runs it eagerly). Like any CUDA graph, a replayed step runs no
Python: forward hooks on the model run when a step is captured, not when it is replayed.

The parts, one job each: :mod:`.eligibility` (whether a call can take the loop), :mod:`.prefill`
(the prompt's inputs and forward), :mod:`.compiled` (the compiled functions and their options),
:mod:`.loop` (the static buffers and one decode step), :mod:`.loop_cache` (which kept loop a call
may reuse), :mod:`.graph_runner` (CUDA-graph capture and replay, late stop checks),
:mod:`.caches` (everything kept across calls, and :func:`release`), :mod:`.stops` (what the loop
needs from lockstep's call) and :mod:`.phases` (profiler ranges). This module is the driver:
:func:`decode` reads as one call.
"""

from __future__ import annotations

import torch

from .._upstream import torch as torch_up
from .._upstream import transformers as hf_up
from ..options import DecodeOptions
from . import layer_compile
from .caches import NO_GRAPHS, PREFILL_FAILED
from .caches import release as release  # the decode engine's entry points, named here
from .compiled import tf32_pinned
from .eligibility import GRAPH_SAFE_CRITERIA as GRAPH_SAFE_CRITERIA
from .eligibility import failure as failure
from .features import DecodeReport
from .graph_runner import GraphRunner, StopSnapshot
from .loop import DecodeLoop
from .loop_cache import forget_loop, loop_for
from .phases import phase
from .prefill import eos_ids, prompt_inputs, run_prefill
from .ring_cache import make_rings
from .stops import LoopOutcome, LoopStats, StopAgreement, StopSchedule


@tf32_pinned()
def decode(
    model,
    call: StopAgreement,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    model_kwargs,
    graph_steps: int | None,
    options: DecodeOptions,
) -> torch.Tensor:
    """Generate with the static loop, in lockstep with ``call`` (a :class:`.stops.StopAgreement`):
    the agreements of transformers' loop under lockstep, at the same steps. ``options``: resolved
    (:meth:`DecodeOptions.resolved`)."""
    torch_up.pin_triton_ptxas()  # before the first compile: warm caches hit in every process
    with phase("decode"):
        stops = call.schedule()
        cache = hf_up.generation_cache(model_kwargs)
        eos = eos_ids(stopping_criteria, input_ids.device)
        eos_key = None if eos is None else tuple(eos.tolist())  # read before the prefill is queued
        mask, positions = prompt_inputs(input_ids, model_kwargs)
        # the prompt's forward is queued first: the host looks up (or builds) the loop while it runs
        with phase("prefill"):
            layers = layer_compile.plan(model)[0] if options.compile_prefill and options.compile_layers else None
            logits, prefill = run_prefill(model, input_ids, mask, positions, cache, options.compile_prefill, layers)
        with phase("loop_lookup"):
            loop, kept = loop_for(model, input_ids, logits_processor, generation_config, eos, eos_key, cache, options)
        try:
            with phase("start"):
                loop.start(
                    model,
                    input_ids,
                    mask,
                    positions,
                    cache,
                    logits_processor,
                    generation_config,
                    stopping_criteria,
                    stops.budget,
                    logits.shape[-1],
                )
                runner = GraphRunner(loop, graph_steps)
            with phase("first_token"):
                loop._choose(logits)  # the first token, from the prompt's logits
            with phase("bind"):
                loop.bind()
            tokens = _decode_steps(call, stops, loop, runner)
            with phase("result"):
                out, done_at = loop.result(tokens)
                report = loop.report()
        except BaseException:
            forget_loop(model, loop)  # a call cut short leaves no half-captured loop behind
            raise
        finally:
            loop.end()
        if not loop.compiled:
            forget_loop(model, loop)  # later calls take transformers' loop (failure() says why)
        call.finish_loop(
            LoopOutcome(
                tokens,
                done_at,
                compiled=loop.compiled,
                stats=LoopStats(
                    graph_steps=runner.graph_steps,
                    graph_capture_s=runner.capture_s,
                    graph_reason=NO_GRAPHS.get(model),
                    loop_reused=kept,
                    graphs_reused=runner.reused,
                    graphs_moved=loop.moved,
                    prefill=prefill,
                    prefill_reason=PREFILL_FAILED.get(model),
                    step=loop.step_kind,
                    decode_report=report if report is not None else DecodeReport(),
                ),
            )
        )
    if generation_config.return_dict_in_generate:
        return hf_up.decoder_only_output(out, cache)
    return out


def _decode_steps(call: StopAgreement, stops: StopSchedule, loop: DecodeLoop, runner: GraphRunner) -> int:
    """The steps after the prompt's token, with a stop agreement every ``stops.every`` steps (none
    with ``stops.fixed``), where transformers' loop under lockstep has them; returns the tokens
    decoded (the forwards run, the prompt's included)."""
    budget, every, fixed = stops.budget, stops.every, stops.fixed
    seen = StopSnapshot(loop) if stops.late else None
    tokens = 1  # the prefill chose token 1; before forward k + 1 the loop asks to go on (k = tokens)
    while tokens < budget:
        nxt = budget if fixed else min(budget, (tokens // every + 1) * every)
        if not fixed and tokens % every == 0:
            with phase("snapshot"):
                unfinished = seen.previous() if seen is not None else not loop.finished()
            with phase("agree"):
                go = call.agree_step(not stops.joined and unfinished)
            if not go:
                break
        runner.run(nxt - tokens)
        tokens = nxt
    return tokens


def ready_cache(model, cache, length: int, span: int = 0) -> None:
    """``cache`` made ready for a call of ``length`` tokens (bucketed to ``span``), before either
    loop's prompt forward: a sliding-window layer the call cannot fill is a static layer (before its
    counter moves), and one it would fill slides as a ring (where the model takes the loop's masks)."""
    hf_up.sliding_layers_unslid(cache, length)
    make_rings(model, cache, length, span)

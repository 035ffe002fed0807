"""DeepSpeed's ``HybridEngineRollout`` (its OPSD rollout) with EOS restored and a synchronized stop.

DeepSpeed 0.19.8's rollout passes ``eos_token_id=None`` to ``generate()`` so that every ZeRO-3
rank runs ``max_new_tokens`` decode forwards, then pads everything after each row's first EOS.
That never hangs but always pays for the longest possible rollout (DeepSpeed PR #8390, a
group-aware early stop, is still open). :func:`early_stop` hands the rollout's ``generate()`` to
lockstep generation with the tokenizer's EOS: decoding stops once every row of every rank of the
gather group has ended (the stop checks of :func:`hf_zero3.lockstep`), and the output is padded back to
``prompt + max_new_tokens`` columns, so DeepSpeed's post-processing returns exactly what it
returned before. With the model gathered for the call (``gather="all"``) the rollout can decode
through hf_zero3's compiled static loop (``decode="compiled"``, or ``"auto"`` on CUDA), with the
same agreements and outputs.
"""

from __future__ import annotations

import functools

import torch

from .._upstream import deepspeed as ds_up
from ..generation.config import LockstepConfig, lockstep_config
from ..generation.lockstep import lockstep as apply_lockstep


def early_stop(rollout, lockstep: LockstepConfig | None = None, **options):
    """Give ``rollout`` (a ``deepspeed.runtime.rollout.HybridEngineRollout``) an early stop; returns it.

    Covers the default ``model.generate()`` path (greedy and sampling). DeepSpeed's own CUDA-graph
    greedy path (``use_graph_capture``) and continuous batching keep their fixed step counts. The
    engine's model is left in lockstep (:func:`hf_zero3.lockstep`): its other ``generate()`` calls
    agree their stop too, as every ZeRO-3 generation must.
    ``model.hf_zero3_last_generate.forwards`` tells how many decode forwards the last call ran.
    ``lockstep`` and ``options`` are :func:`hf_zero3.lockstep`'s, with ``stop="sync"`` (the early
    stop itself): ``gather="all"`` with ``decode="compiled"`` takes the static decode loop
    (``loop`` in the report says which ran).
    """
    cfg = lockstep_config(lockstep, **options)
    if cfg.stop != "sync":
        raise ValueError(f"early_stop stops when the group's rows end: stop must be 'sync', not {cfg.stop!r}")
    if getattr(rollout.generate, "_hf_zero3", False):
        return rollout
    engine = rollout.engine
    apply_lockstep(engine, cfg)
    module = ds_up.hybrid_rollout_module(rollout)
    tokenizer = ds_up.hybrid_rollout_tokenizer(rollout)
    original = rollout.generate

    @functools.wraps(original)
    def generate(request, sampling):
        graph = getattr(rollout, "use_graph_capture", False) and sampling.temperature <= 0.0
        if sampling.continuous_batch_size is not None or graph or tokenizer.eos_token_id is None:
            return original(request, sampling)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        bound = module.generate

        def generate_until_group_eos(input_ids, **kwargs):
            if kwargs.get("eos_token_id") is None:
                kwargs["eos_token_id"] = tokenizer.eos_token_id
            out = bound(input_ids, **kwargs)
            width = input_ids.shape[1] + int(kwargs["max_new_tokens"])
            if out.shape[1] < width:  # stopped early: the columns DeepSpeed expects, as padding
                out = torch.nn.functional.pad(out, (0, width - out.shape[1]), value=pad)
            return out

        module.__dict__["generate"] = generate_until_group_eos  # this call only
        try:
            return original(request, sampling)
        finally:
            module.__dict__.pop("generate", None)

    generate._hf_zero3 = True
    rollout.generate = generate
    return rollout

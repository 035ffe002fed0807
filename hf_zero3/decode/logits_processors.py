"""Logits processors inside the static loop's CUDA graphs.

A captured decode step cannot read the growing ``input_ids`` transformers hands its processors:
the step replays with the same tensors every time. Processors that read only the scores
(temperature, top-k, top-p, min-p) run as they are. Three that read the sequence so far are
computed from the loop's own buffers instead, with transformers' arithmetic:

* ``MinNewTokensLengthLogitsProcessor`` (``min_new_tokens``) and ``MinLengthLogitsProcessor``
  (``min_length``): EOS scores set to ``-inf`` while the sequence is shorter than asked; the length
  is the loop's token counter against a threshold filled in per call.
* ``RepetitionPenaltyLogitsProcessor`` (``repetition_penalty``, TRL exposes it): every token seen so
  far (the prompt past ``prompt_ignore_length``, a number or, as transformers passes it, each
  row's left padding; then each recorded token, pad included as transformers appends it) marked in
  a per-row vocabulary mask filled when the call starts, and the marked scores divided by the
  penalty (multiplied where negative): transformers' gather/scatter over the same set.

Each is taken only where its ``__call__`` is the source this was checked against
(``_upstream.transformers.CHECKED_SOURCES``); otherwise the call keeps transformers' loop, and
``loop_reason`` says why.
"""

from __future__ import annotations

import math

import torch

from .._upstream import transformers as hf_up

# Tensor-only processors: they read the scores, never the (growing) input ids or host state.
TENSOR_ONLY = frozenset(
    {
        "TemperatureLogitsWarper",
        "TopKLogitsWarper",
        "TopPLogitsWarper",
        "MinPLogitsWarper",
        "InfNanRemoveLogitsProcessor",
    }
)
_GEN = "transformers.generation.logits_process."
# processors the loop computes from its buffers -> the transformers function it reproduces
COMPUTED = {
    "MinNewTokensLengthLogitsProcessor": _GEN + "MinNewTokensLengthLogitsProcessor.__call__",
    "MinLengthLogitsProcessor": _GEN + "MinLengthLogitsProcessor.__call__",
    "RepetitionPenaltyLogitsProcessor": _GEN + "RepetitionPenaltyLogitsProcessor.__call__",
}


def unsupported(proc) -> str | None:
    """Why the loop cannot run ``proc`` inside its captured steps (None: it can)."""
    name = type(proc).__name__
    if name in TENSOR_ONLY:
        return None
    if name not in COMPUTED:
        return f"logits processor {name} is not one the loop captures"
    why = hf_up.unchecked_reason(COMPUTED[name])
    if why is not None:
        return f"logits processor {name}: {why}"
    if name == "RepetitionPenaltyLogitsProcessor" and getattr(proc, "logits_indices", None) is not None:
        return "repetition_penalty over packed sequences"
    return None


def key(procs) -> tuple | None:
    """What a loop's graphs bake in of ``procs``: names and plain values (of a processor the loop
    computes, only the penalty: lengths, EOS ids and the ignored prompt go to buffers filled per
    call); None where a processor holds anything else (its graph would bake in a tensor the next
    call may not pass again)."""
    out = []
    for p in procs or ():
        name = type(p).__name__
        if name in COMPUTED:
            out.append((name, getattr(p, "penalty", None)))
            continue
        if any(type(v) not in _SCALARS for v in vars(p).values()):
            return None
        out.append((name, tuple(sorted(vars(p).items()))))
    return tuple(out)


_SCALARS = (int, float, bool, str, type(None))


class LoopProcessors:
    """The processors of one loop (one :func:`key`), on buffers of its own: :meth:`start` fills
    them per call, :meth:`__call__` runs every processor in transformers' order, :meth:`record`
    marks the step's token."""

    def __init__(self, procs, device):
        self.names = [type(p).__name__ for p in procs or ()]
        self.procs: list = []
        self.device = device
        n = len(self.names)
        self.threshold = torch.zeros(n, dtype=torch.long, device=device)  # min-length kinds: idx below it
        self.eos_masks: dict[int, torch.Tensor] = {}  # min-length kinds: EOS ids over the vocabulary
        self.seen: dict[int, torch.Tensor] = {}  # repetition penalty: (batch, vocab + 1) tokens seen

    def start(self, procs, input_ids: torch.Tensor, vocab: int) -> None:
        """Per call, before its first token: this call's processor objects (same :func:`key`)."""
        self.procs = list(procs or ())
        p = input_ids.shape[1]
        thresholds = []
        for i, (name, proc) in enumerate(zip(self.names, self.procs)):
            if name == "MinNewTokensLengthLogitsProcessor":
                thresholds.append(proc.prompt_length_to_skip + proc.min_new_tokens - p)
            elif name == "MinLengthLogitsProcessor":
                thresholds.append(proc.min_length - p)
            else:
                thresholds.append(0)
            if name in ("MinNewTokensLengthLogitsProcessor", "MinLengthLogitsProcessor"):
                mask = self.eos_masks.get(i)
                if mask is None or mask.shape[0] != vocab:
                    mask = self.eos_masks[i] = torch.zeros(vocab, dtype=torch.bool, device=self.device)
                mask.copy_(torch.isin(torch.arange(vocab, device=self.device), proc.eos_token_id.to(self.device)))
            elif name == "RepetitionPenaltyLogitsProcessor":
                seen = self.seen.get(i)
                if seen is None or seen.shape != (input_ids.shape[0], vocab + 1):
                    seen = self.seen[i] = torch.zeros(
                        input_ids.shape[0], vocab + 1, dtype=torch.bool, device=self.device
                    )
                seen.zero_()
                ids, ignore = input_ids, proc.prompt_ignore_length
                if isinstance(ignore, int):
                    ids = ids[:, ignore:]
                elif ignore is not None:  # per row: the positions before it count as past the vocabulary
                    at = torch.arange(ids.shape[1], device=ids.device)
                    ids = ids.masked_fill(at[None, :] < ignore.to(ids.device)[:, None], vocab)
                seen.scatter_(1, ids.clamp(max=vocab), True)
        if thresholds:
            self.threshold.copy_(torch.tensor(thresholds), non_blocking=True)

    def __call__(self, scores: torch.Tensor, idx: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
        """``scores`` (float32) after every processor; ``idx``: tokens recorded so far (device)."""
        for i, (name, proc) in enumerate(zip(self.names, self.procs)):
            if name in ("MinNewTokensLengthLogitsProcessor", "MinLengthLogitsProcessor"):
                short = idx < self.threshold[i]  # (1,): the sequence is still shorter than asked
                scores = torch.where(self.eos_masks[i] & short, -math.inf, scores)
            elif name == "RepetitionPenaltyLogitsProcessor":
                penalized = torch.where(scores < 0, scores * proc.penalty, scores / proc.penalty)
                scores = torch.where(self.seen[i][:, : scores.shape[-1]], penalized, scores)
            else:
                scores = proc(prompt, scores)  # tensor-only: the ids are not read
        return scores

    def end(self) -> None:
        """The call ended: drop its processor objects (the buffers stay for the next call)."""
        self.procs = []

    def record(self, token: torch.Tensor) -> None:
        """After the step's token (pad for a finished row) was recorded."""
        for seen in self.seen.values():
            seen.scatter_(1, token.view(-1, 1).clamp(max=seen.shape[1] - 1), True)

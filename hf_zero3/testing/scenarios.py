"""Generation scenarios for tests and the demo: prompts whose greedy continuations hit EOS at
chosen, different steps, found on the unsharded reference model (so every rank agrees)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EosScenario:
    eos_token_id: int
    early: list[tuple[list[int], int]]  # (prompt, EOS step 1-based) finishing early
    late: list[list[int]]  # prompts with no EOS within `steps`
    steps: int


def greedy_continuation(reference, prompt: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            min_new_tokens=steps,
        )
    return out[0, len(prompt) :].tolist()


def find_eos_scenario(
    reference,
    *,
    steps: int = 20,
    early_by: int = 4,
    prompt_len: int = 4,
    candidates: int = 48,
    vocab_low: int = 3,
    seed: int = 0,
) -> EosScenario:
    """Pick an EOS token and prompts: some hit it within ``early_by`` steps, some never within
    ``steps``. Deterministic for a given reference model."""
    g = torch.Generator().manual_seed(seed)
    vocab = reference.config.vocab_size
    prompts = [torch.randint(vocab_low, vocab, (prompt_len,), generator=g).tolist() for _ in range(candidates)]
    conts = [greedy_continuation(reference, p, steps) for p in prompts]
    best = None
    for i, c in enumerate(conts):
        for pos in range(1, early_by):
            tok = c[pos]
            if tok < vocab_low or tok in c[:pos]:
                continue
            early = [(p, cc.index(tok) + 1) for p, cc in zip(prompts, conts) if tok in cc[:early_by]]
            late = [p for p, cc in zip(prompts, conts) if tok not in cc]
            if late and (best is None or len(late) > len(best.late)):
                best = EosScenario(tok, early, late, steps)
        if best is not None and len(best.late) >= 4:
            break
    if best is None:
        raise RuntimeError("no prompt set with divergent EOS steps found; change seed")
    return best

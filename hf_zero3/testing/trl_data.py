"""Prompts and a reward for TRL trainers in tests: conversations TRL formats with the tokenizer's
chat template (with :func:`~hf_zero3.testing.models.tiny_tokenizer`'s Qwen2.5 template they are
left-padded to mixed lengths, as users' prompts reach a rollout), and a reward that needs no model."""

from __future__ import annotations

#: Short user turns of different lengths.
CHAT_PROMPTS = (
    "Say hi.",
    "Count to 3.",
    "Name a color.",
    "Add 2 and 2.",
    "Spell cat.",
    "Pick a number.",
    "Say bye.",
    "Name a fruit.",
)


def chat_prompts(n: int = len(CHAT_PROMPTS)):
    """A ``datasets.Dataset`` whose ``prompt`` column holds the first ``n`` prompts as one-turn
    conversations (TRL's conversational format)."""
    from datasets import Dataset  # optional: datasets

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in CHAT_PROMPTS[:n]]})


def length_reward(completions, **kwargs) -> list[float]:
    """A GRPO reward: shorter completions score higher."""
    return [-len(str(c)) / 100.0 for c in completions]

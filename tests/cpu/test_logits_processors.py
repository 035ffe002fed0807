"""The processors the static loop computes on its own buffers (min_new_tokens, min_length,
repetition_penalty) against transformers' own processors on the growing ``input_ids``, step by
step: the same scores, bit for bit, with left padding, several EOS ids, ids past the output
vocabulary and a prompt prefix ignored. Processors it cannot compute keep transformers' loop."""

import torch
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
)

from hf_zero3.decode import logits_processors as lp

VOCAB, PROMPT, STEPS = 40, 5, 6


def _run(procs, prompt):
    """Each step: transformers' processors on the full sequence, and the loop's on its buffers."""
    g = torch.Generator().manual_seed(0)
    loop = lp.LoopProcessors(procs, "cpu")
    loop.start(procs, prompt, VOCAB)
    idx = torch.zeros(1, dtype=torch.long)
    seq = prompt
    for _ in range(STEPS):
        scores = torch.randn(prompt.shape[0], VOCAB, generator=g) * 3
        want = scores.clone()
        for p in procs:
            want = p(seq, want)
        got = loop(scores.clone(), idx, prompt)
        assert torch.equal(got, want), (seq, got - want)
        token = torch.argmax(want, -1)
        token[0] = 1  # the EOS id, as a finished row's pad or an early end
        loop.record(token)
        idx += 1
        seq = torch.cat([seq, token[:, None]], 1)


def test_min_new_tokens_min_length_and_repetition_penalty_match_transformers():
    prompt = torch.randint(2, VOCAB, (3, PROMPT), generator=torch.Generator().manual_seed(1))
    prompt[1, :2] = 0  # left padding (pad id 0 is in the sequence, as transformers sees it)
    prompt[2, 0] = VOCAB + 3  # an id past the output vocabulary (a larger embedding)
    eos = [1, 7]
    procs = [
        RepetitionPenaltyLogitsProcessor(1.4),
        MinNewTokensLengthLogitsProcessor(PROMPT, 3, eos),
        MinLengthLogitsProcessor(PROMPT + 2, eos),
        TemperatureLogitsWarper(0.7),
    ]
    _run(procs, prompt)
    _run([RepetitionPenaltyLogitsProcessor(0.8, prompt_ignore_length=2)], prompt)
    # per row, as transformers passes each row's left padding
    _run([RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=torch.tensor([0, 2, 1]))], prompt)


def test_the_loop_takes_these_processors_and_names_the_others():
    assert lp.unsupported(RepetitionPenaltyLogitsProcessor(1.2)) is None
    assert lp.unsupported(MinNewTokensLengthLogitsProcessor(4, 2, 1)) is None
    assert lp.unsupported(RepetitionPenaltyLogitsProcessor(1.2, prompt_ignore_length=torch.tensor([1, 2]))) is None
    assert "NoRepeatNGramLogitsProcessor" in lp.unsupported(NoRepeatNGramLogitsProcessor(2))
    # their keys hold only what the graphs bake in (the penalty); lengths and EOS ids are buffers
    new_tokens = lp.key([MinNewTokensLengthLogitsProcessor(4, 2, [1, 7])])
    assert new_tokens == lp.key([MinNewTokensLengthLogitsProcessor(6, 3, [2])])
    rep = lp.key([RepetitionPenaltyLogitsProcessor(1.2, prompt_ignore_length=torch.tensor([1, 2]))])
    assert rep == lp.key([RepetitionPenaltyLogitsProcessor(1.2)]) != lp.key([RepetitionPenaltyLogitsProcessor(1.3)])


def test_a_changed_upstream_processor_keeps_transformers_loop(monkeypatch):
    """A transformers release whose repetition penalty computes something else: the loop refuses
    the processor (the call keeps transformers' loop) instead of computing the old math."""
    from hf_zero3._upstream import transformers as hf_up

    def changed(self, input_ids, scores):
        return scores / self.penalty

    monkeypatch.setattr(RepetitionPenaltyLogitsProcessor, "__call__", changed)
    hf_up._FINGERPRINTS.clear()
    why = lp.unsupported(RepetitionPenaltyLogitsProcessor(1.2))
    assert why is not None and "not the code hf_zero3 was checked against" in why, why

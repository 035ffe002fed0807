"""One lockstep options object: ``LockstepConfig`` holds every lockstep option and its default;
every entry point takes one (``lockstep=``) and its fields as keywords over it, and no entry point
writes the fields out again."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from transformers import LlamaForCausalLM

import hf_zero3
from hf_zero3.generation.lockstep import LOCKSTEP_FIELDS, LockstepConfig
from hf_zero3.testing import models
from hf_zero3.trl.rollout import early_stop


def test_fields_are_keyword_only_and_their_defaults_live_in_the_dataclass():
    with pytest.raises(TypeError):
        LockstepConfig("fixed")  # keyword-only: a positional build cannot shift a field
    assert LOCKSTEP_FIELDS == tuple(f.name for f in dataclasses.fields(LockstepConfig))
    for entry in (hf_zero3.lockstep, hf_zero3.lockstep_generate, hf_zero3.Zero3Safe.__init__, early_stop):
        written = set(inspect.signature(entry).parameters) & set(LOCKSTEP_FIELDS)
        assert not written, f"{entry.__qualname__} writes out LockstepConfig's fields {written} again"


def test_zero3safe_takes_the_object_and_its_fields_as_keywords():
    assert hf_zero3.Zero3Safe().lockstep == LockstepConfig()
    cb = hf_zero3.Zero3Safe(sync_every=4)
    assert cb.lockstep.sync_every == 4 and cb.lockstep.stop == "sync"
    cb = hf_zero3.Zero3Safe(LockstepConfig(stop="fixed", gather="all"), gather="layerwise", decode="eager")
    assert (cb.lockstep.stop, cb.lockstep.gather, cb.lockstep.decode) == ("fixed", "layerwise", "eager")
    assert cb.gather == "layerwise"  # eval regions gather as the config says
    with pytest.raises(ValueError, match="gather must be one of"):
        hf_zero3.Zero3Safe(gather="sometimes")
    with pytest.raises(TypeError, match="unknown lockstep option.*sync_evry.*LockstepConfig's fields are stop"):
        hf_zero3.Zero3Safe(sync_evry=4)
    with pytest.raises(TypeError, match="lockstep must be a hf_zero3.LockstepConfig"):
        hf_zero3.Zero3Safe("all")


def test_lockstep_stores_the_object_with_keywords_over_it():
    model = LlamaForCausalLM(models.tiny_llama_config())
    hf_zero3.lockstep(model, LockstepConfig(stop="fixed", bucket=32), graph_steps=4)
    stored = hf_zero3.runtime_of(model).generation.config
    assert (stored.stop, stored.bucket, stored.graph_steps) == ("fixed", 32, 4)
    with pytest.raises(ValueError, match="sync_every must be a positive int"):
        hf_zero3.lockstep(model, sync_every=0)
    with pytest.raises(TypeError, match="unknown lockstep option"):
        hf_zero3.lockstep(model, stops="fixed")


def test_early_stop_keeps_its_own_stop_rule():
    class Rollout:  # refused before the rollout is touched
        pass

    with pytest.raises(ValueError, match="early_stop stops when the group's rows end"):
        early_stop(Rollout(), LockstepConfig(stop="fixed"))

"""Patches of accelerate / DeepSpeed happen only for the feature that needs them and can be undone
(issue #11): ``hf_zero3.unpatch()`` and ``hf_zero3.patching()``."""

from __future__ import annotations

import hf_zero3
from hf_zero3._upstream import patches
from hf_zero3.testing import run_ranks


def _originals():
    from accelerate import Accelerator
    from deepspeed.runtime.engine import DeepSpeedEngine

    return DeepSpeedEngine.compile, Accelerator._prepare_deepspeed


def test_constructing_zero3safe_patches_nothing():
    hf_zero3.unpatch()
    before = _originals()
    hf_zero3.Zero3Safe()
    assert patches.installed() == [] and _originals() == before


def test_unpatch_restores_the_originals():
    from hf_zero3.accelerate import enable_memory_plan, memory_plan_enabled

    hf_zero3.unpatch()
    before = _originals()
    enable_memory_plan()
    assert memory_plan_enabled() and _originals()[0] is not before[0] and _originals()[1] is not before[1]
    assert sorted(hf_zero3.unpatch()) == sorted(
        [
            "deepspeed.DeepSpeedEngine.compile: default schedule",
            "accelerate.Accelerator._prepare_deepspeed: memory plan",
        ]
    )
    assert _originals() == before and not memory_plan_enabled()


def test_patching_context_undoes_only_what_it_installed():
    from hf_zero3.accelerate import enable_memory_plan

    hf_zero3.unpatch()
    before = _originals()
    with hf_zero3.patching():
        enable_memory_plan()
        enable_memory_plan()  # idempotent
        assert len(patches.installed()) == 2
    assert patches.installed() == [] and _originals() == before


def _plugin_without_deepcompile():
    from hf_zero3 import Zero3DeepSpeedPlugin
    from hf_zero3.testing import strict_zero3_config

    Zero3DeepSpeedPlugin(hf_ds_config=strict_zero3_config(world_size=1))
    return patches.installed()


def test_the_plugin_patches_only_for_deepcompile_zero3():
    assert run_ranks(_plugin_without_deepcompile, 1, timeout=90, pg_timeout=30) == [[]]

"""accelerate / DeepSpeed behaviours the memory plan is injected around, each patch named after what
it works around. Checked against accelerate 1.15.0 and 1.16.0 and DeepSpeed 0.19.8 (``CHECKED``).

The functions here only build a patch and return its undo; :mod:`hf_zero3._upstream.patches`
decides when one is installed (only while the memory plan is enabled) and removes it again
(``hf_zero3.unpatch()``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from accelerate import Accelerator
from deepspeed.runtime.engine import DeepSpeedEngine

CHECKED = "accelerate 1.15.0, 1.16.0, deepspeed 0.19.8"


def patch_deepspeed_compile_default_schedule(default_schedule: Callable[[Any], list | None]) -> Callable[[], None]:
    """Give ``DeepSpeedEngine.compile`` a schedule when its caller passes none.

    Works around accelerate (1.15; the call was added in huggingface/accelerate#3069) calling
    ``engine.compile(backend=..., compile_kwargs=...)`` after ``deepspeed.initialize`` with no
    ``schedule``, while DeepSpeed 0.19.8 has no config key for one. ``default_schedule(engine)``
    returns the schedule to use (None: DeepSpeed's default). Returns the undo function.
    """
    original = DeepSpeedEngine.compile
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        if bound.arguments.get("schedule") is None:
            bound.arguments["schedule"] = default_schedule(self)
        return original(*bound.args, **bound.kwargs)

    DeepSpeedEngine.compile = compile

    def undo():
        DeepSpeedEngine.compile = original

    return undo


def patch_accelerate_prepare_deepspeed(
    before: Callable[[Any], Any], after: Callable[[Any, Any, Any], None]
) -> Callable[[], None]:
    """Run ``before(accelerator)`` ahead of ``Accelerator._prepare_deepspeed`` and
    ``after(accelerator, engine, before's result)`` once the engine exists.

    Works around two behaviours of accelerate 1.15 and 1.16: ``deepspeed_config_process`` raises on any
    ``"auto"`` leaf it does not fill, anywhere in the DeepSpeed config (so a third-party section
    must be resolved before it runs), and the DeepSpeed launcher (``prepare_deepspeed_cmd_env``)
    exports none of the YAML's ``dynamo_config``, so ``_prepare_deepspeed`` never calls
    ``engine.compile`` under ``accelerate launch``. Returns the undo function.
    """
    original = Accelerator._prepare_deepspeed

    @functools.wraps(original)
    def _prepare_deepspeed(self, *args, **kwargs):
        state = before(self)
        result = original(self, *args, **kwargs)
        engine = getattr(getattr(self, "deepspeed_engine_wrapped", None), "engine", None)
        if engine is not None:
            after(self, engine, state)
        return result

    Accelerator._prepare_deepspeed = _prepare_deepspeed

    def undo():
        Accelerator._prepare_deepspeed = original

    return undo

"""Every work-around for an upstream behaviour lives here, named after what it works around.

Each entry names the library versions it was written against and, where one exists, the upstream
issue. Remove an entry once the oldest supported release no longer needs it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

#: The releases hf_zero3 is tested against (README "Supported versions").
TESTED = {
    "torch": "2.13.0 (CPU, CI); 2.11 (CUDA 13, GPU runs)",
    "deepspeed": "0.19.8",
    "transformers": "5.23.0",
    "accelerate": "1.15.0",
    "trl": "1.16.0",
    "peft": "0.21.2",
}
MINIMUM = {"deepspeed": "0.18.0", "transformers": "5.0.0", "accelerate": "1.10.0", "torch": "2.6.0"}


def cuda_memory_fraction(device: torch.device) -> float:
    """The per-process cap set by ``torch.cuda.set_per_process_memory_fraction`` (1.0 if none).

    torch < 2.9 has no getter; treat it as uncapped there.
    """
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is None:
        return 1.0
    try:
        return float(getter(device))
    except Exception:
        return 1.0


def transformers_generation_hooks_present() -> None:
    """Lockstep generation overrides two private ``GenerationMixin`` methods that every decoding
    loop of transformers 5.x goes through: ``_has_unfinished_sequences`` (the loop condition,
    whose ``synced_gpus`` branch all-reduces over WORLD every step) and ``_prepare_generated_length``
    (where ``max_length`` is fixed). Refuse to run, naming the fix, if a release removes them."""
    from transformers.generation.utils import GenerationMixin

    missing = [n for n in ("_has_unfinished_sequences", "_prepare_generated_length")
               if not hasattr(GenerationMixin, n)]
    if missing:
        import transformers

        raise RuntimeError(
            f"hf_zero3 lockstep generation needs GenerationMixin.{', '.join(missing)}, which "
            f"transformers {transformers.__version__} no longer has; install a tested release "
            f"(transformers=={TESTED['transformers']}) or upgrade hf_zero3.")


def check_versions() -> list[str]:
    """Problems with the installed versions, as messages naming the fix (empty when fine)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    problems = []
    for pkg, low in MINIMUM.items():
        try:
            have = version(pkg)
        except PackageNotFoundError:
            problems.append(f"{pkg} is not installed; pip install '{pkg}>={low}'")
            continue
        if Version(have.split("+")[0]) < Version(low):
            problems.append(f"{pkg} {have} is older than the oldest supported {low}; "
                            f"pip install -U '{pkg}>={low}'")
    return problems


# --- accelerate x DeepCompile -------------------------------------------------------------------

def patch_deepspeed_compile_default_schedule(default_schedule: Callable[[Any], list | None]) -> Callable[[], None]:
    """Give ``DeepSpeedEngine.compile`` a schedule when its caller passes none.

    Works around accelerate (1.15; the call was added in huggingface/accelerate#3069) calling
    ``engine.compile(backend=..., compile_kwargs=...)`` after ``deepspeed.initialize`` with no
    ``schedule``, while DeepSpeed 0.19.8 has no config key for one. ``default_schedule(engine)``
    returns the schedule to use (None: DeepSpeed's default). Returns the undo function.
    """
    from deepspeed.runtime.engine import DeepSpeedEngine

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


def patch_accelerate_prepare_deepspeed(before: Callable[[Any], Any],
                                       after: Callable[[Any, Any, Any], None]) -> Callable[[], None]:
    """Run ``before(accelerator)`` ahead of ``Accelerator._prepare_deepspeed`` and
    ``after(accelerator, engine, before's result)`` once the engine exists.

    Works around two accelerate 1.15 behaviours: ``deepspeed_config_process`` raises on any
    ``"auto"`` leaf it does not fill, anywhere in the DeepSpeed config (so a third-party section
    must be resolved before it runs), and the DeepSpeed launcher (``prepare_deepspeed_cmd_env``)
    exports none of the YAML's ``dynamo_config``, so ``_prepare_deepspeed`` never calls
    ``engine.compile`` under ``accelerate launch``. Returns the undo function.
    """
    from accelerate import Accelerator

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

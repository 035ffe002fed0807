"""TRL internals the TRL adapter relies on. Checked against trl 1.16.0 (``CHECKED``).

GRPO and ``DistillationTrainer`` run a tool loop (``_tool_call_loop``) whose rounds of
``_generate_single_turn`` depend on the rank's own completions; GKD draws
``random.random() <= self.lmbda`` per rank in ``training_step``; ``LogCompletionsCallback`` and
``WeaveCallback`` split prompts unevenly across ranks and call the module-level
``trl.trainer.callbacks._generate_completions``.
"""

from __future__ import annotations

import importlib
import inspect
import types

CHECKED = "trl 1.16.0"

TOOL_LOOP = "_tool_call_loop"
#: GRPO / RLOO / DistillationTrainer: generation, then the padding of its results into tensors
GENERATE = "_generate"
SCORE_COMPLETIONS = "_generate_and_score_completions"
#: trainer modules that import ``trl.trainer.utils.pad`` by name (looked up as a module global)
PAD_USERS = ("trl.trainer.grpo_trainer", "trl.trainer.rloo_trainer", "trl.trainer.distillation_trainer")
#: GRPO/RLOO's instance copy of ``args.pad_to_multiple_of`` (prompts and completions are padded with it)
PAD_TO_MULTIPLE_OF = "pad_to_multiple_of"
SINGLE_TURN = "_generate_single_turn"
GENERATE_COMPLETIONS = ("trl.trainer.callbacks", "_generate_completions")
#: re-registers DeepSpeed's eager ZeRO-3 hooks after each gathered generation
ADD_HOOKS = ("trl.models.utils", "add_hooks")
#: the gathering context behind ``unwrap_model_for_generation`` (looked up as a module global by it)
UNWRAP_FOR_GENERATION = ("trl.models.utils", "_unwrap_model_for_generation")


def is_trl_trainer(trainer) -> bool:
    return type(trainer).__module__.startswith("trl.")


def has_tool_loop(trainer) -> bool:
    """GRPO / DistillationTrainer: a tool loop that regenerates per rank."""
    return callable(getattr(trainer, TOOL_LOOP, None)) and callable(getattr(trainer, SINGLE_TURN, None))


def uses_vllm(trainer) -> bool:
    return bool(getattr(trainer, "use_vllm", False))


def single_turn_placeholder_args(trainer, eos_id: int) -> tuple[tuple, dict]:
    """Arguments of a one-row ``_generate_single_turn`` call whose output is thrown away."""
    params = inspect.signature(getattr(trainer, SINGLE_TURN)).parameters
    kwargs = {"num_generations": 1} if "num_generations" in params else {}
    return ([[int(eos_id)]], None, {}), kwargs


def tokenizer_of(trainer):
    """The text tokenizer of a TRL trainer (``_tokenizer`` on GRPO, else ``processing_class``)."""
    tok = getattr(trainer, "_tokenizer", None) or getattr(trainer, "processing_class", None)
    return getattr(tok, "tokenizer", tok)  # a processor wraps its tokenizer


def per_rank_draw_trainer(trainer) -> bool:
    """GKD: ``training_step`` draws ``random.random() <= self.lmbda`` on each rank unshared. (Checked
    by class: ``on_init_end`` runs before GKD's ``__init__`` sets ``lmbda``.)"""
    return any(
        c.__module__.startswith("trl.experimental.gkd") and c.__name__ == "GKDTrainer" for c in type(trainer).__mro__
    )


def wrap_module_function(location: tuple[str, str], wrap):
    """Replace the module-level function at ``location`` ((module, name), e.g. :data:`ADD_HOOKS`) by
    ``wrap(original)``; returns the undo. TRL looks these up by module global at call time."""
    module = importlib.import_module(location[0])
    original = getattr(module, location[1])
    setattr(module, location[1], wrap(original))
    return lambda: setattr(module, location[1], original)


#: ``trl.trainer.utils.add_fused_lm_head`` installs an instance ``forward`` named this, closing over
#: its settings (read by :func:`fused_lm_head_settings`).
FUSED_FORWARD = "_fused_forward"
_FUSED_CELLS = (
    "original_forward",
    "temperature",
    "outputs",
    "final_logit_softcapping",
    "logit_scale",
    "text_config",
    "cast_lm_head_to_fp32",
)


def fused_lm_head_settings(model) -> dict | None:
    """The settings of TRL's fused LM head on ``model`` (its instance ``forward``), or None."""
    fwd = getattr(model, "__dict__", {}).get("forward")
    func = getattr(fwd, "__func__", None) if isinstance(fwd, types.MethodType) else None
    # functools.wraps renamed it after the model's forward; its code object keeps TRL's name
    if func is None or func.__code__.co_name != FUSED_FORWARD or func.__closure__ is None:
        return None
    cells = dict(zip(func.__code__.co_freevars, (c.cell_contents for c in func.__closure__)))
    missing = [n for n in _FUSED_CELLS if n not in cells]
    if missing:
        raise RuntimeError(
            f"hf_zero3: TRL's fused LM head no longer closes over {missing}; this TRL is newer than "
            f"the tested {CHECKED}: upgrade hf_zero3 or turn DeepCompile off for this trainer"
        )
    s = {n: cells[n] for n in _FUSED_CELLS}
    text_config = s.pop("text_config")
    s["router_aux_loss_coef"] = getattr(text_config, "router_aux_loss_coef", 0.0)
    s["output_router_logits"] = bool(getattr(text_config, "output_router_logits", False))
    return s


def fused_output_class():
    from trl.trainer.utils import FusedCausalLMOutput  # optional: trl

    return FusedCausalLMOutput

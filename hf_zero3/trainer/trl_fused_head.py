"""TRL's fused LM head, made traceable for DeepCompile: per-token log-probs from the model's logits.

GRPO (and TRL's other trainers that score completions) call ``model(..., fused_lm_head=True)``,
which TRL's ``add_fused_lm_head`` routes to a forward that runs the backbone, then projects only the
labelled positions through the LM head in tiles: a boolean-mask index (a data-dependent shape, so a
Dynamo graph break), DeepSpeed's ``GatheredParameters`` around ``lm_head.weight`` and a custom
autograd function. Under DeepCompile that head runs outside every compiled graph, where ZeRO-3's
eager hooks are gone: its backward gathers the weight, lets it go before returning, and the
gradient meets a partitioned (0-element) parameter ("The size of tensor a (0) must match the size
of tensor b (1024)"), while Dynamo also traces DeepSpeed's gather/free code into graphs that
DeepCompile's profiler cannot run ("a leaf Variable that requires grad is being used in an
in-place operation").

:func:`replace_fused_head` swaps that forward, on the policy model of a DeepCompile ZeRO-3 trainer
only, for one that computes the same outputs from the model's own logits with static shapes
(``masked_fill`` instead of indexing), so the LM head is inside the compiled graph and DeepCompile
gathers it and reduces its gradient natively. The cost is TRL's saving: the ``(batch, seq, vocab)``
logits are materialized (in fp32 for the log-softmax), as in TRL's unfused path.
"""

from __future__ import annotations

import functools
import logging
import types

import torch

from .._upstream import trl as trl_up

log = logging.getLogger("hf_zero3.trl")


def logits_head_outputs(
    logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0, outputs: tuple = ("log_probs",)
) -> dict:
    """TRL's per-token fields (``log_probs``, ``entropy``, ``log_sum_sq_probs``, ``mean_logits``,
    ``is_top1``; 0 where ``labels == -100``) from already-shifted ``logits`` [B, T, V] and ``labels``
    [B, T]: ``z = logits / temperature``. The model's forward has applied its own logit scale and
    softcap already (TRL's head applies them because it starts from hidden states)."""
    mask = labels != -100
    z = logits.float() / temperature
    log_z = torch.logsumexp(z, dim=-1)
    target = z.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    out = {"log_probs": (target - log_z).masked_fill(~mask, 0.0), "label_mask": mask}
    if "entropy" in outputs:
        p = torch.softmax(z, dim=-1)
        out["entropy"] = (log_z - (p * z).sum(-1)).masked_fill(~mask, 0.0)
    with torch.no_grad():  # TRL marks these three non-differentiable
        if "log_sum_sq_probs" in outputs:
            out["log_sum_sq_probs"] = torch.logsumexp(2 * (z - log_z.unsqueeze(-1)), dim=-1).masked_fill(~mask, 0.0)
        if "mean_logits" in outputs:
            out["mean_logits"] = z.mean(-1).masked_fill(~mask, 0.0)
        if "is_top1" in outputs:
            out["is_top1"] = (z.argmax(-1) == labels) & mask
    return out


def replace_fused_head(model) -> bool:
    """Swap TRL's fused-head forward on ``model`` (or the model PEFT wraps) for the logits-based
    one; False when no TRL fused head is installed there."""
    for target in _candidates(model):
        settings = trl_up.fused_lm_head_settings(target)
        if settings is None:
            continue
        if settings["cast_lm_head_to_fp32"]:
            log.warning(
                "hf_zero3.trl: cast_lm_head_to_fp32 is not honoured by the logits-based LM head used under "
                "DeepCompile: the LM head projects in the model's dtype, the log-softmax runs in fp32"
            )
        target.forward = types.MethodType(_logits_forward(settings), target)
        log.info(
            "hf_zero3.trl: %s's fused LM head replaced by a logits-based one (DeepCompile compiles the LM "
            "head with the backbone; the logits are materialized)",
            type(target).__name__,
        )
        return True
    return False


def _candidates(model):
    seen, todo = [], [model]
    while todo:
        m = todo.pop(0)
        if m is None or any(m is s for s in seen):
            continue
        seen.append(m)
        todo += [getattr(m, "base_model", None), getattr(getattr(m, "base_model", None), "model", None)]
    return seen


def _logits_forward(s: dict):
    original_forward = s["original_forward"]
    output_cls = trl_up.fused_output_class()

    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            for name, value in (
                ("labels", labels),
                ("shift_labels", shift_labels),
                ("num_items_in_batch", num_items_in_batch),
            ):
                if value is not None:
                    kwargs[name] = value
            return original_forward(*args, **kwargs)
        kwargs["use_cache"] = False
        if s["output_router_logits"]:  # MoE: as TRL's head (and the model's forward) do
            kwargs.setdefault("output_router_logits", True)
        out = original_forward(*args, **kwargs)
        logits = out.logits
        if shift_labels is None:
            logits, labels = logits[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        labels = labels.to(logits.device)
        fields = logits_head_outputs(logits, labels, temperature=s["temperature"], outputs=tuple(s["outputs"]))
        mask = fields["label_mask"]
        loss = -fields["log_probs"].sum() / (
            mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        )
        aux_loss = getattr(out, "aux_loss", None)
        if aux_loss is not None and kwargs.get("output_router_logits"):
            loss = loss + s["router_aux_loss_coef"] * aux_loss
        return output_cls(loss=loss, aux_loss=aux_loss, **fields)

    functools.update_wrapper(forward, getattr(original_forward, "__func__", original_forward))  # generate() reads it
    forward._hf_zero3_logits_head = True
    return forward

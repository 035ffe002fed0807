"""An eager decode step's rotary embedding through the Triton rotary kernel
(:mod:`hf_zero3.kernels.rotary`): transformers' ``apply_rotary_pos_emb`` of the model's family
replaced, around each eager step, by one kernel launch for the query and one for the key.

With the decode step eager (``DecodeOptions(compile_step=False)``, TRL rollouts' default), the
attention forwards of the families without the rope attention kernel (Qwen2, Qwen3, Mistral; Llama
where the loop attends without the Triton kernel) rotate q and k in ten short kernels a layer. The
replacement computes the checked function (``_upstream.transformers.CHECKED_SOURCES``: the same
rotate-half math in every family here) with the same roundings, and hands anything the kernel does
not take (another ``unsqueeze_dim``, a layout it cannot read, mixed dtypes, CPU tensors, autocast)
to the function it replaced. It is set as the family module's global only around eager steps (a
compiled step fuses the rotation itself), and restored after each.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

from ..kernels import rotary
from . import families


def plan(model, device) -> str | None:
    """The dotted path of the ``apply_rotary_pos_emb`` an eager step of ``model`` replaces (its
    family's, where it is the checked source), or None (none off CUDA or without Triton)."""
    if torch.device(device).type != "cuda" or rotary.load() is None:
        return None
    return families.rotary_function(model)


class Replaced:
    """The replacement of one family's ``apply_rotary_pos_emb`` (``path``), kept across calls;
    :attr:`hits`: the calls the kernel computed since the last :meth:`reset`."""

    def __init__(self, path: str):
        self.module_name, _, self.name = path.rpartition(".")
        self.hits = 0

    def reset(self) -> None:
        self.hits = 0

    @contextlib.contextmanager
    def use(self):
        """Inside: the family module's global is the kernel's function (restored after)."""
        module = importlib.import_module(self.module_name)
        own = getattr(module, self.name)
        setattr(module, self.name, self._function(own))
        try:
            yield
        finally:
            setattr(module, self.name, own)

    def _function(self, own):
        rotate = rotary.load()

        def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
            unsqueeze = kwargs.get("unsqueeze_dim", args[0] if args else 1)
            if (
                len(args) + len(kwargs) > 1
                or (kwargs and "unsqueeze_dim" not in kwargs)
                or unsqueeze != 1
                or torch.is_autocast_enabled(q.device.type)
                or not (rotary.fits(q, cos, sin) and rotary.fits(k, cos, sin))
            ):
                return own(q, k, cos, sin, *args, **kwargs)
            self.hits += 1
            return rotate(q, cos, sin), rotate(k, cos, sin)

        return apply_rotary_pos_emb

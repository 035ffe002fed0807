"""Rank-side helpers shared by the CPU multi-process tests (imported inside spawned ranks)."""

from __future__ import annotations

import torch


def build_engine(config_fn_name: str = "tiny_llama_config", *, hf_aware: bool = True, seed: int = 0,
                 world_size: int | None = None, **config_overrides):
    """A strict ZeRO-3 DeepSpeed engine around a tiny model; returns (engine, reference copy).

    ``hf_aware=False`` builds the model plainly and lets ``deepspeed.initialize`` partition it,
    so transformers cannot see ZeRO-3 (no ``HfDeepSpeedConfig``), as in custom RL loops.
    """
    import deepspeed
    import torch.distributed as dist

    from hf_zero3.testing import models, strict_zero3_config

    ws = world_size or dist.get_world_size()
    ds = strict_zero3_config(world_size=ws)
    cfg = getattr(models, config_fn_name)(**config_overrides)
    model = (models.zero3_model(cfg, ds, seed=seed) if hf_aware
             else models.plain_model(cfg, seed=seed))
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    engine.eval()
    return engine, models.unsharded_copy(engine.module)


class ForwardCounter:
    """Counts top-level forwards of a module (decode steps, prefill included), in a tensor: a
    compiled forward (Dynamo) and a replayed CUDA graph count as an eager one does."""

    def __init__(self, module):
        self.n = torch.zeros((), dtype=torch.long, device=next(module.parameters()).device)
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.n.add_(1)

    def take(self) -> int:
        n = int(self.n)
        self.n.zero_()
        return n

"""Rank-side helpers shared by the CPU multi-process tests (imported inside spawned ranks)."""

from __future__ import annotations

from hf_zero3.testing.spy import ForwardCounter  # noqa: F401 - imported from here by the tests


def build_engine(
    config_fn_name: str = "tiny_llama_config",
    *,
    hf_aware: bool = True,
    seed: int = 0,
    world_size: int | None = None,
    **config_overrides,
):
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
    model = models.zero3_model(cfg, ds, seed=seed) if hf_aware else models.plain_model(cfg, seed=seed)
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    engine.eval()
    return engine, models.unsharded_copy(engine.module)

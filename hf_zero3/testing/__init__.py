"""Test utilities: a multi-process launcher, strict ZeRO-3 configs, models built in code, a
collective spy, and prompts and a reward for TRL trainers.

Public so users can test their own integration the way hf_zero3 tests itself.
"""

from .configs import STRICT_ZERO3, strict_zero3_config, trainer_zero3_config
from .launcher import DistributedFailure, RankReport, free_port, mark, run_ranks
from .models import (
    llama_1b_shape_config,
    llama_8b_shape_config,
    plain_model,
    qwen2_0_5b_shape_config,
    small_llama_config,
    small_qwen2_config,
    tiny_llama_config,
    tiny_qwen2_config,
    tiny_t5_config,
    tiny_tokenizer,
    unsharded_copy,
    zero3_model,
)
from .spy import CollectiveSpy, ForwardCounter
from .trl_data import CHAT_PROMPTS, chat_prompts, length_reward

__all__ = [
    "run_ranks",
    "DistributedFailure",
    "RankReport",
    "mark",
    "free_port",
    "STRICT_ZERO3",
    "strict_zero3_config",
    "trainer_zero3_config",
    "tiny_llama_config",
    "tiny_qwen2_config",
    "tiny_t5_config",
    "small_llama_config",
    "small_qwen2_config",
    "llama_1b_shape_config",
    "llama_8b_shape_config",
    "qwen2_0_5b_shape_config",
    "tiny_tokenizer",
    "zero3_model",
    "plain_model",
    "unsharded_copy",
    "CollectiveSpy",
    "ForwardCounter",
    "CHAT_PROMPTS",
    "chat_prompts",
    "length_reward",
]

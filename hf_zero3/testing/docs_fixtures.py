"""What a documentation example finds predefined when the docs test runs it (nothing downloaded).

Every ``python`` block of README.md and docs/ marked ``<!-- example: ranks=N -->`` is run by
``tests/cpu/test_docs_examples.py`` on N gloo ranks through
``run_ranks(run_example, N, init="deepspeed")``, in a fresh temporary working directory holding
``ds_config.json``, with these names already defined, as a user has them before the code shown:

* ``model``: a tiny ``LlamaForCausalLM`` built plainly in fp32 (:func:`tiny_model`);
* ``tokenizer``: a word-level ``PreTrainedTokenizerFast`` over the model's 96 ids (:func:`tiny_tokenizer`);
* ``train_dataset``, ``eval_dataset``: small causal-LM token datasets (:func:`token_datasets`);
* ``ds_config``: the dict in ``ds_config.json``, strict ZeRO-3 on CPU with ``"auto"`` sizes
  and ``torch_adam`` (:func:`example_ds_config`).

A block asserts what it wants checked; the docs test checks that it finished on every rank.
"""

from __future__ import annotations

import json
import os
from typing import Any

from . import models
from .configs import trainer_zero3_config

__all__ = [
    "EXAMPLE_NAMES",
    "tiny_tokenizer",
    "tiny_model",
    "token_datasets",
    "example_ds_config",
    "example_namespace",
    "write_ds_config",
    "run_example",
]

#: The names a ``ranks`` example may use without defining them.
EXAMPLE_NAMES = ("model", "tokenizer", "train_dataset", "eval_dataset", "ds_config")

_SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0, 1, 2, 3: pad, bos, eos, unk (tiny_llama_config's)
_WORDS = (
    list("abcdefghijklmnopqrstuvwxyz")
    + list("0123456789")
    + list(".,!?:;'\"-()")
    + (
        "the a is and to of in it hi hello say count name color add spell cat dog pick number bye "
        "fruit red blue green one two three yes no ok what who how why good day world model token "
        "rank step stop go end done"
    ).split()
)


def tiny_tokenizer():
    """A word-level tokenizer whose 96 ids match :func:`~hf_zero3.testing.models.tiny_llama_config`.

    Lower-case letters, digits, punctuation and a few dozen English words, split on whitespace
    and punctuation; anything else is ``<unk>``. ``pad``/``bos``/``eos`` are ids 0/1/2, padding
    on the left (as generation wants), so ``tokenizer(texts, padding=True, return_tensors="pt")``
    is ready for ``generate()``.
    """
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_SPECIAL + _WORDS)}
    assert len(vocab) == 96, len(vocab)
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(_SPECIAL)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
    )


def tiny_model(seed: int = 0):
    """A tiny ``LlamaForCausalLM`` (2 layers, hidden 32, GQA 4/2 heads, vocab 96) in fp32, built
    the plain way, before any DeepSpeed config exists: ``deepspeed.initialize`` (or the Trainer)
    partitions it."""
    config = models.tiny_llama_config()
    model = models.plain_model(config, seed=seed)
    model.generation_config.eos_token_id = config.eos_token_id
    return model


def token_datasets(n_train: int = 16, n_eval: int = 4):
    """``(train_dataset, eval_dataset)``: rows of 8 counting token ids, ``labels`` = ``input_ids``."""
    from .trainer_job import TokenDataset

    return TokenDataset(n_train, seed=1), TokenDataset(n_eval, seed=2)


def example_ds_config() -> dict[str, Any]:
    """Strict ZeRO-3 (nothing stays gathered between uses) with the Trainer's ``"auto"`` values.

    No ``train_batch_size``: DeepSpeed derives it. (accelerate on CPU counts one process where
    there are several, so the ``"auto"`` it would fill there is wrong.)
    """
    config = trainer_zero3_config()
    del config["train_batch_size"]
    return config


def write_ds_config(directory: str) -> str:
    path = os.path.join(directory, "ds_config.json")
    with open(path, "w") as f:
        json.dump(example_ds_config(), f, indent=2)
    return path


def example_namespace() -> dict[str, Any]:
    """The globals an example block starts with (see the module docstring)."""
    train_dataset, eval_dataset = token_datasets()
    with open("ds_config.json") as f:
        ds_config = json.load(f)
    return {
        "__name__": "__main__",
        "model": tiny_model(),
        "tokenizer": tiny_tokenizer(),
        "train_dataset": train_dataset,
        "eval_dataset": eval_dataset,
        "ds_config": ds_config,
    }


def run_example(code: str, label: str, workdir: str) -> dict[str, Any]:
    """Rank side of a docs example: run ``code`` in ``workdir`` with :func:`example_namespace`.

    ``label`` (``file:line``) names the code in tracebacks. Returns ``{"rank", "ran"}``.
    """
    import torch.distributed as dist

    from .launcher import mark

    rank = dist.get_rank() if dist.is_initialized() else 0
    os.chdir(workdir)  # run_ranks already gave each CPU rank its share of the cores
    namespace = example_namespace()
    mark(f"running {label}")
    exec(compile(code, label, "exec"), namespace)
    mark(f"finished {label}")
    return {"rank": rank, "ran": True}

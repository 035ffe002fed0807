"""A tiny but real ``transformers.Trainer`` job under strict ZeRO-3, shared by tests and the demo."""

from __future__ import annotations

import torch

from . import models
from .configs import trainer_zero3_config

SEQ_LEN = 8


class TokenDataset(torch.utils.data.Dataset):
    """Deterministic token rows; ``labels`` = ``input_ids`` (causal LM)."""

    def __init__(self, n: int, seed: int, vocab: int = 96, seq_len: int = SEQ_LEN):
        g = torch.Generator().manual_seed(seed)
        # a learnable pattern: each row counts upward from a random start
        starts = torch.randint(3, vocab - seq_len, (n,), generator=g)
        self.rows = [torch.arange(int(s), int(s) + seq_len) for s in starts]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}


def make_trainer(
    output_dir: str,
    *,
    callbacks=(),
    max_steps: int = 6,
    eval_steps: int | None = None,
    n_eval: int = 5,
    seq2seq: bool = False,
    progress: bool = False,
    seed: int = 0,
    eval_on_start: bool = False,
    ds_extra: dict | None = None,
):
    """Build a Trainer (or Seq2SeqTrainer) on a tiny Llama partitioned by ``zero.Init``.

    Call on every rank after ``deepspeed.init_distributed(dist_backend="gloo")``.
    """
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments

    cfg = models.tiny_llama_config()
    cls = models.model_class_for(cfg)  # import before zero.Init
    args_cls = Seq2SeqTrainingArguments if seq2seq else TrainingArguments
    extra = dict(predict_with_generate=True, generation_max_length=SEQ_LEN + 6) if seq2seq else {}
    args = args_cls(
        output_dir=output_dir,
        use_cpu=True,
        deepspeed=trainer_zero3_config(extra=ds_extra),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=1,
        max_steps=max_steps,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=seed,
        data_seed=seed,
        eval_strategy="steps" if eval_steps else "no",
        eval_steps=eval_steps,
        eval_on_start=eval_on_start,
        disable_tqdm=not progress,
        dataloader_num_workers=0,
        **extra,
    )
    torch.manual_seed(seed)
    model = cls._from_config(cfg)  # TrainingArguments made ZeRO-3 visible: zero.Init applies
    model.generation_config.pad_token_id = cfg.pad_token_id
    trainer_cls = Seq2SeqTrainer if seq2seq else Trainer
    return trainer_cls(
        model=model,
        args=args,
        train_dataset=TokenDataset(32, seed=1),
        eval_dataset=TokenDataset(n_eval, seed=2),
        callbacks=list(callbacks),
    )


def train_losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]

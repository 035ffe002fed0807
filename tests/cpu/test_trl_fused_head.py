"""TRL's fused LM head under DeepCompile (issue #12): hf_zero3 replaces it, on the policy model of a
DeepCompile ZeRO-3 trainer only, by a logits-based head DeepCompile can compile with the backbone.
The replacement must give TRL's outputs and gradients (fp32, CPU), keep the unfused path, and be
installed exactly when accelerate will call ``engine.compile()``."""

import pytest
import torch

from hf_zero3.testing import mark


def _tiny(seed: int):
    from transformers import Qwen2ForCausalLM

    from hf_zero3.testing import models

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(models.tiny_qwen2_config(vocab_size=96)).float()


ALL_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.mark.parametrize("shifted", [False, True])
def test_logits_head_gives_trls_outputs_and_gradients(shifted):
    from trl.trainer.utils import add_fused_lm_head

    from hf_zero3.trainer.trl_fused_head import replace_fused_head

    trl_model, ours = _tiny(0), _tiny(0)
    for m in (trl_model, ours):
        add_fused_lm_head(m, temperature=0.7, outputs=ALL_OUTPUTS)
    assert replace_fused_head(ours) and not replace_fused_head(torch.nn.Linear(2, 2))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt part, as GRPO masks it
    labels[1, -3:] = -100  # padding
    # pre-shifted labels (context parallelism) have the input's length: the last position scores nothing
    shift = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    kw = {"shift_labels": shift} if shifted else {"labels": labels}
    out_t = trl_model(input_ids=ids, fused_lm_head=True, **kw)
    out_o = ours(input_ids=ids, fused_lm_head=True, **kw)
    for name in ALL_OUTPUTS:
        a, b = getattr(out_t, name), getattr(out_o, name)
        if name == "is_top1":
            assert torch.equal(a.bool(), b.bool()), name
        else:
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5), (name, (a - b).abs().max())
    assert torch.equal(out_t.label_mask, out_o.label_mask)
    assert torch.allclose(out_t.loss, out_o.loss, atol=1e-6)
    (out_t.loss + out_t.entropy.sum()).backward()
    (out_o.loss + out_o.entropy.sum()).backward()
    for (n, p), (_, q) in zip(trl_model.named_parameters(), ours.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), n
    # the unfused path (generation, plain forwards) is the model's own
    plain_t, plain_o = trl_model(input_ids=ids).logits, ours(input_ids=ids).logits
    assert torch.equal(plain_t, plain_o)


def test_a_softcapped_models_logits_are_not_transformed_twice():
    """Gemma2 softcaps inside its forward; TRL's head applies the softcap itself because it starts
    from hidden states. The logits head must not apply it again."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from hf_zero3.trainer.trl_fused_head import replace_fused_head

    cfg = Gemma2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=2.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        m = Gemma2ForCausalLM(cfg).float()
        with torch.no_grad():
            m.lm_head.weight.mul_(20)  # logits well beyond the cap, so a double softcap shows
        add_fused_lm_head(m, temperature=0.8, outputs=("log_probs", "entropy"))
        models.append(m)
    assert replace_fused_head(models[1])
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(2))
    a, b = (m(input_ids=ids, labels=ids, fused_lm_head=True) for m in models)
    assert torch.allclose(a.log_probs, b.log_probs, atol=1e-5) and torch.allclose(a.entropy, b.entropy, atol=1e-5)


def _grpo_head_rank(tmpdir: str, deepcompile: bool, torch_compile: bool, peft: bool, user_pad=None):
    from fixtures import trl_jobs
    from trl import GRPOConfig, GRPOTrainer

    import hf_zero3
    from hf_zero3.testing import tiny_tokenizer, trainer_zero3_config

    ds = trainer_zero3_config(extra={"compile": {"deepcompile": True}} if deepcompile else None)
    args = trl_jobs._args(
        GRPOConfig,
        tmpdir,
        num_generations=2,
        max_completion_length=8,
        deepspeed=ds,
        torch_compile=torch_compile,
        pad_to_multiple_of=user_pad,
    )
    tok = tiny_tokenizer()
    model = trl_jobs._model(tok)
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=trl_jobs.length_reward,
        args=args,
        train_dataset=trl_jobs.chat_prompts(),
        processing_class=tok,
        callbacks=[hf_zero3.Zero3Safe()],
        peft_config=peft_config,
    )
    # what on_train_begin does before the first (compiled) forward; TRL installs its head after init
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, hf_zero3.Zero3Safe):
            cb.on_train_begin(trainer.args, trainer.state, trainer.control, model=trainer.model)
    from hf_zero3._upstream import patches
    from hf_zero3.trainer.trl_adapter import before_training

    pad_patch = "trl.trainer.grpo_trainer.pad: the group's length while aligning"
    aligned = pad_patch in patches.installed()
    hf_zero3.unpatch()
    before_training(trainer)  # a second train() after an unpatch(): the alignment comes back
    realigned = pad_patch in patches.installed()
    base = trainer.model.get_base_model() if peft else trainer.model
    fwd = base.__dict__.get("forward")
    return dict(
        ours=bool(getattr(fwd, "_hf_zero3_logits_head", False)),
        pad=trainer.pad_to_multiple_of,
        aligned=(aligned, realigned),
        trls=getattr(getattr(getattr(fwd, "__func__", None), "__code__", None), "co_name", None) == "_fused_forward",
    )


@pytest.mark.parametrize(
    "deepcompile,torch_compile,peft,user_pad,expect",
    [
        (True, True, False, None, True),
        (True, True, True, None, True),
        (True, True, False, 16, True),  # the user's padding multiple is kept
        (True, False, False, None, False),  # accelerate never compiles: TRL's head stays
        (False, True, False, None, False),  # torch.compile without DeepCompile: TRL's head stays
    ],
)
def test_zero3safe_replaces_the_head_only_for_deepcompile_training(
    tmp_path, deepcompile, torch_compile, peft, user_pad, expect
):
    """Under DeepCompile training, also: sequences padded to a multiple (one graph per length bucket,
    not per length) unless the user chose one."""
    from hf_zero3.testing import run_ranks
    from hf_zero3.trl import DEEPCOMPILE_PAD_TO_MULTIPLE_OF

    r = run_ranks(
        _grpo_head_rank,
        1,
        args=(str(tmp_path), deepcompile, torch_compile, peft, user_pad),
        init="deepspeed",
        timeout=180,
        pg_timeout=60,
    )[0]
    assert r["ours"] is expect and r["trls"] is (not expect), r
    assert r["pad"] == (user_pad or (DEEPCOMPILE_PAD_TO_MULTIPLE_OF if expect else None)), r
    assert r["aligned"] == (expect, expect), r  # group-length padding under DeepCompile only


def _grpo_losses_rank(tmpdir: str):
    """GRPO (2 steps, strict ZeRO-3, eager: DeepCompile needs CUDA) with TRL's fused head, then the
    same job with hf_zero3's logits head swapped in at train begin (as under DeepCompile)."""
    from fixtures import trl_jobs
    from transformers import TrainerCallback

    import hf_zero3
    from hf_zero3.trainer.trl_fused_head import replace_fused_head

    class Swap(TrainerCallback):
        swapped = False

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            Swap.swapped = replace_fused_head(model)

    out = {}
    for name, callbacks in (("trl", []), ("ours", [Swap()])):
        mark(f"grpo {name}")
        trainer = trl_jobs.grpo_trainer(f"{tmpdir}/{name}", callbacks=[hf_zero3.Zero3Safe(), *callbacks])
        trainer.train()
        logs = trl_jobs._result(trainer)["logs"]
        # GRPO's loss is ~0 by construction; the gradient norm and the entropy go through the head
        out[name] = [(h["loss"], h["grad_norm"], h["entropy"]) for h in logs if "loss" in h]
    out["swapped"] = Swap.swapped
    return out


def test_grpo_trains_alike_with_the_logits_head_under_zero3(tmp_path):
    from hf_zero3.testing import run_ranks

    r0, r1 = run_ranks(_grpo_losses_rank, 2, args=(str(tmp_path),), init="deepspeed", timeout=300, pg_timeout=30)
    for r in (r0, r1):
        assert r["swapped"] and len(r["ours"]) == len(r["trl"]) > 0
        for ours, trl in zip(r["ours"], r["trl"]):
            assert ours == pytest.approx(trl, rel=1e-4, abs=1e-6), r
            assert ours[1] > 0 and ours[2] > 0  # real gradients and entropies were compared
    assert r0["ours"] == r1["ours"]

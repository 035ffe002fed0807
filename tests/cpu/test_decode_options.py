"""DecodeOptions: one grammar for every decode switch, explicit values over the environment,
defaults the measured best, and bad values refused by name."""

from dataclasses import fields, replace

import pytest

from hf_zero3.options import DECODE_SWITCHES, ENVIRONMENT, DecodeOptions, parse_switch


def test_every_switch_reads_one_grammar():
    for raw in ("1", "true", "YES", " on "):
        assert parse_switch("HF_ZERO3_X", raw) is True
    for raw in ("0", "False", "no", "OFF"):
        assert parse_switch("HF_ZERO3_X", raw) is False
    for raw in ("2", "maybe", "enabled"):
        with pytest.raises(ValueError, match=r"HF_ZERO3_X='.*' is not a switch"):
            parse_switch("HF_ZERO3_X", raw)


def test_defaults_are_every_part_on_and_attention_by_the_sm_count():
    """Every part on, but one compiled layer for every layer (the step compiles whole)."""
    assert DecodeOptions().resolved({}) == DecodeOptions(
        fuse_qkv=True,
        triton_mlp=True,
        split_k=True,
        triton_attention="auto",
        fuse_rope=True,
        triton_qkv=True,
        triton_norm=True,
        triton_rotary=True,
        dependent_launches="auto",
        compile_prefill=True,
        compile_step=True,
        compile_layers=False,
    )


def test_a_trl_rollout_compiles_the_prompt_forward_and_the_step_only_when_asked():
    rollout = DecodeOptions().resolved({}, rollout=True)
    assert rollout == replace(DecodeOptions().resolved({}), compile_prefill=False, compile_step=False)
    assert DecodeOptions(compile_prefill=True).resolved({}, rollout=True).compile_prefill is True
    assert DecodeOptions().resolved({"HF_ZERO3_COMPILE_PREFILL": "1"}, rollout=True).compile_prefill is True
    assert DecodeOptions(compile_step=True).resolved({}, rollout=True).compile_step is True
    assert DecodeOptions().resolved({"HF_ZERO3_COMPILE_STEP": "on"}, rollout=True).compile_step is True


@pytest.mark.parametrize("field", [f for f in fields(DecodeOptions) if not f.metadata["choices"]], ids=lambda f: f.name)
def test_each_boolean_variable_turns_its_part_off_and_an_explicit_value_wins(field):
    env, default = field.metadata["env"], field.metadata["default"]
    for raw, expected in (("", default), ("0", False), ("no", False), ("on", True)):
        assert getattr(DecodeOptions().resolved({env: raw}), field.name) is expected, raw
    explicit = DecodeOptions(**{field.name: True}).resolved({env: "0"})
    assert getattr(explicit, field.name) is True
    with pytest.raises(ValueError, match=env):
        DecodeOptions().resolved({env: "2"})


def test_the_three_way_settings():
    # the attention kernel: auto / always / off, a switch's "no" turns it off (it once stayed on)
    for raw, expected in (("", "auto"), ("always", "always"), ("no", "off"), ("0", "off"), ("1", "auto")):
        assert DecodeOptions().resolved({"HF_ZERO3_TRITON_ATTENTION": raw}).triton_attention == expected, raw
    with pytest.raises(ValueError, match="HF_ZERO3_TRITON_ATTENTION='sometimes'"):
        DecodeOptions().resolved({"HF_ZERO3_TRITON_ATTENTION": "sometimes"})
    # dependent launches, by the same grammar: a switch's on is "auto"; "on" (a warning where the
    # GPU cannot) is named
    for raw, expected in (("", "auto"), ("auto", "auto"), ("1", "auto"), ("on", "on"), ("off", "off"), ("0", "off")):
        assert DecodeOptions().resolved({"HF_ZERO3_PDL": raw}).dependent_launches == expected, raw
    with pytest.raises(ValueError, match="HF_ZERO3_PDL='sometimes'"):
        DecodeOptions().resolved({"HF_ZERO3_PDL": "sometimes"})


def test_the_native_gate_variable_takes_the_same_grammar(monkeypatch):
    from hf_zero3 import native_gate

    for raw, expected in (("", "auto"), ("auto", "auto"), ("cpu", "cpu"), ("0", "off"), ("no", "off"), ("on", "auto")):
        monkeypatch.setenv("HF_ZERO3_NATIVE", raw)
        assert native_gate._want() == expected, raw
    monkeypatch.setenv("HF_ZERO3_NATIVE", "gpu")
    with pytest.raises(ValueError, match="HF_ZERO3_NATIVE='gpu'"):
        native_gate._want()


def test_bad_explicit_values_raise_at_construction():
    with pytest.raises(ValueError, match="fuse_rope must be True, False or None"):
        DecodeOptions(fuse_rope="no")
    with pytest.raises(ValueError, match="triton_attention must be one of"):
        DecodeOptions(triton_attention="sometimes")
    import hf_zero3

    with pytest.raises(TypeError, match="decode_options must be a hf_zero3.DecodeOptions"):
        hf_zero3.LockstepConfig(decode_options={"fuse_rope": False}).validate()


def test_the_registry_names_one_variable_per_option():
    assert set(DECODE_SWITCHES) == {f.metadata["env"] for f in fields(DecodeOptions)}
    assert set(DECODE_SWITCHES) <= set(ENVIRONMENT)

"""``hf_zero3 env``: the console script runs, and each row says what the install runs (checked
against the real install, a simulated old or new release, and models built on the meta device);
the output shown in docs/troubleshooting.md is checked by test_docs_examples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_zero3 import env
from hf_zero3._upstream import transformers as hf_up
from hf_zero3._upstream import versions

ROOT = Path(__file__).resolve().parents[2]


def _rows(rows) -> dict:
    return {r.name: r for r in rows}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from hf_zero3.testing import models

    path = tmp_path_factory.mktemp("llama")
    models.tiny_llama_config().save_pretrained(path)
    return path


def test_the_console_script_prints_every_part_as_json(llama_dir):
    script = Path(sys.executable).parent / "hf_zero3"
    assert script.exists(), "pyproject's [project.scripts] entry is not installed"
    out = subprocess.run(
        [str(script), "env", "--json", "--model", str(llama_dir)], capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert list(data) == ["versions", "fast_path", "model"]
    assert all(set(r) == {"name", "value", "status", "note"} for rows in data.values() for r in rows)


def test_version_rows_are_the_installed_releases_against_the_sets():
    rows = _rows(env.version_rows())
    assert list(rows) == ["python", *env.PACKAGES]
    for pkg in env.PACKAGES:
        assert rows[pkg].value == versions.installed(pkg)
        # CI installs one release set exactly: every library is a tested release
        assert rows[pkg].status == env.OK and rows[pkg].note.startswith("tested"), rows[pkg]


def test_a_release_below_the_floor_or_newer_than_checked_is_named(monkeypatch):
    have = {"transformers": "5.10.0", "accelerate": "9.0.0", "trl": None}
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda pkg: have[pkg] if pkg in have else real(pkg))
    rows = _rows(env.version_rows())
    assert (
        rows["transformers"].status == env.NO and "pip install -U 'transformers>=5.17.0'" in rows["transformers"].note
    )
    assert rows["accelerate"].status == env.WARN and "newer than the newest checked" in rows["accelerate"].note
    assert rows["trl"].status == env.NO and rows["trl"].value == "not installed"


def test_fast_path_rows_on_this_cpu_install():
    rows = _rows(env.fast_path_rows())
    assert rows["CUDA"].status == env.NO and "eagerly" in rows["CUDA"].note
    assert rows["Triton"].status == env.OK and rows["Triton"].value == versions.installed("triton")
    assert rows["DeepCompile"].status == env.NO and "CUDA only" in rows["DeepCompile"].note
    assert rows["native prefetch gate"].value == "PyTorch fallback" and rows["native prefetch gate"].note
    assert rows["decode attention kernel"].status == env.WARN
    contract = rows["generation contract"]
    assert contract.status == env.OK and repr(hf_up.cache_keyword()) in contract.value
    checked = [r for r in rows.values() if r.value == "checked"]
    assert len(checked) == len(hf_up.CHECKED_SOURCES) and all(r.status == env.OK for r in checked)


def test_fast_path_rows_on_a_newer_transformers_name_it(newer_transformers):
    newer_transformers()
    rows = env.fast_path_rows()
    fenced = [r for r in rows if r.value == "model's own code"]
    assert len(fenced) == len(hf_up.CHECKED_SOURCES)
    assert all(r.status == env.WARN and "5.99.0" in r.note for r in fenced)


def test_a_renamed_cache_keyword_breaks_the_contract_row(monkeypatch):
    from transformers.generation.utils import GenerationMixin

    def prepare_inputs_for_generation(self, input_ids, kv_cache=None, **kwargs):
        return {}

    monkeypatch.setattr(GenerationMixin, "prepare_inputs_for_generation", prepare_inputs_for_generation)
    hf_up.recheck_generation()
    try:
        row = _rows(env.fast_path_rows())["generation contract"]
    finally:
        monkeypatch.undo()
        hf_up.recheck_generation()
    assert row.status == env.NO and "the KV cache's keyword" in row.note


def test_model_rows_of_a_llama_config(llama_dir):
    rows = _rows(env.model_rows(str(llama_dir)))
    assert rows["model"].value == "LlamaForCausalLM (llama, bfloat16)"
    assert rows["family"].value == "llama" and rows["compileable"].value == "True"
    assert rows["decode attention"].value == "hf_zero3 GQA attention"
    layers = 2  # tiny_llama_config's num_hidden_layers
    assert rows["rope kernel"].value == f"{layers} attention modules"
    assert rows["MLP kernels"].value == f"{layers} MLP modules"
    assert rows["fused q/k/v"].value == f"{layers} attention modules"
    assert "fallback" not in rows
    again = _rows(env.model_rows(str(llama_dir / "config.json")))  # the file itself
    assert again["model"].value == rows["model"].value


def test_model_rows_of_a_model_without_a_family_or_on_a_newer_release(tmp_path, llama_dir, newer_transformers):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    rows = _rows(env.model_rows(str(tmp_path)))
    assert rows["family"].status == env.WARN and rows["family"].value == "none"
    assert rows["decode attention"].value == "model's own" and rows["rope kernel"].value == "0 attention modules"
    newer_transformers()
    rows = env.model_rows(str(llama_dir))
    assert any(r.name == "fallback" and "5.99.0" in r.note for r in rows)
    assert _rows(rows)["MLP kernels"].value == "0 MLP modules"


def test_a_config_file_without_model_type_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match="no model_type"):
        env.model_rows(str(path))


def test_model_rows_of_the_families_beyond_dense_attention(tmp_path):
    """Each family the static loop now takes says what it needs: Phi-3's own generation inputs (up
    to its limit), sliding windows as rings, the experts implementation, linear-attention states."""
    from hf_zero3.testing import models

    made = {}
    for name in ("tiny_phi3_config", "tiny_gemma3_config", "tiny_qwen3_moe_config", "tiny_qwen3_5_config"):
        getattr(models, name)().save_pretrained(tmp_path / name)
        made[name] = _rows(env.model_rows(str(tmp_path / name)))
    phi = made["tiny_phi3_config"]["generation inputs"]
    assert phi.status == env.OK and "original_max_position_embeddings (4096)" in phi.note
    window = made["tiny_gemma3_config"]["sliding windows"]
    assert window.status == env.OK and window.value == "5 layers of 4 tokens" and "rings" in window.note
    assert made["tiny_qwen3_moe_config"]["experts"].value in ("grouped_mm", "batched_mm", "eager")
    assert made["tiny_qwen3_5_config"]["linear attention"].value == "3 layers"


@pytest.mark.parametrize("field", ["pad_token_id", "eos_token_id"])
def test_a_token_id_outside_the_vocabulary_is_one_clear_line(tmp_path, field):
    from hf_zero3.testing import models

    models.tiny_qwen2_config(**{field: 151643}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"{field} 151643 lies outside the vocabulary \\(vocab_size 96\\)"):
        env.model_rows(str(tmp_path))
    script = Path(sys.executable).parent / "hf_zero3"
    out = subprocess.run([str(script), "env", "--model", str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("hf_zero3 env: "), out.stderr  # after transformers' warning

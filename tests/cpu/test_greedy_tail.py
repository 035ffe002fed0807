"""The static loop's greedy tail (hf_zero3.decode.compiled): the two-stage argmax is
torch.argmax's token (the first index of the maximum, ties across and within vocabulary chunks
included), and the compiled tail leaves every loop buffer as the eager one does."""

import torch


def _logits(rows: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, vocab, generator=g)
    top = x.max() + 1
    x[0, [5, vocab - 3]] = top  # a tie across chunks: the first index wins
    x[1, [vocab // 2 + 1, vocab // 2 + 2]] = top  # a tie inside one chunk
    x[2, :] = 0.0  # all equal: index 0
    return x


def test_two_stage_argmax_is_torch_argmax():
    from hf_zero3.decode.compiled import _argmax_rows

    for vocab in (128256, 32000, 4096, 96, 4099):  # chunks: 32, 8, 2, none, none
        x = _logits(5, vocab)
        assert torch.equal(_argmax_rows(x), torch.argmax(x, dim=-1)), vocab
        bf = x.to(torch.bfloat16)  # bf16 rounding makes many more ties
        assert torch.equal(_argmax_rows(bf), torch.argmax(bf, dim=-1)), vocab


def test_compiled_tail_matches_the_eager_tail():
    from hf_zero3.decode import compiled as gd

    def buffers(eos):
        return dict(
            unfinished=torch.tensor([True, True, False, True, True]),
            pad=torch.tensor(0),
            eos=eos,
            out=torch.zeros(5, 8, dtype=torch.long),
            idx=torch.tensor([3]),
            own=torch.tensor(6),
            alive=torch.ones(8, dtype=torch.bool),
            tok=torch.zeros(5, dtype=torch.long),
            pos=torch.tensor([7, 8, 9, 10, 11]),
        )

    x = _logits(5, 32000)
    for eos in (None, torch.tensor([int(torch.argmax(x[3]))])):  # row 3 hits EOS in the second case
        eager, compiled = buffers(eos), buffers(eos)
        gd.greedy_tail(x, *eager.values())
        torch.compile(gd.greedy_tail, fullgraph=True)(x, *compiled.values())
        for name in eager:
            if eager[name] is not None:
                assert torch.equal(eager[name], compiled[name]), name
        assert eager["idx"].item() == 4 and eager["pos"].tolist() == [8, 9, 10, 11, 12]
        assert eager["out"][:, 3].tolist() == [
            int(torch.argmax(x[0])),
            int(torch.argmax(x[1])),
            0,
            int(torch.argmax(x[3])),
            int(torch.argmax(x[4])),
        ]
        assert eager["unfinished"].tolist() == [True, True, False, eos is None, True]


def test_a_capture_error_says_where_it_was_raised():
    """A CUDA-graph capture's error (no Dynamo frames in it) names the innermost line outside torch
    that raised it: what a user reports when a model's decode step cannot be captured."""
    from hf_zero3.decode import compiled

    def host_copy():
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")

    try:
        host_copy()
    except RuntimeError as exc:
        why = compiled.failure_reason(exc)
    assert why.startswith("RuntimeError: Cannot copy between CPU and CUDA tensors")
    assert why.endswith("in host_copy") and "test_greedy_tail.py:" in why


def test_a_capture_error_in_a_library_under_a_torch_named_path_names_that_library(tmp_path):
    """Only torch's own frames are skipped: a library installed under a path that holds a ``torch``
    folder (a venv at ``/opt/torch/.venv``) is still named."""
    import importlib.util

    from hf_zero3.decode import compiled

    folder = tmp_path / "torch" / ".venv" / "site-packages"
    folder.mkdir(parents=True)
    (folder / "modeling_x.py").write_text("def forward():\n    raise RuntimeError('host copy')\n")
    spec = importlib.util.spec_from_file_location("modeling_x", folder / "modeling_x.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.forward()
    except RuntimeError as exc:
        why = compiled.failure_reason(exc)
    assert why.endswith("modeling_x.py:2 in forward"), why

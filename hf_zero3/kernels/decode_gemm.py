"""Triton GEMMs for decode shapes (a few to 64 rows against a large weight): ``x @ W.T`` and the
MLP's ``silu(x @ Wg.T) * (x @ Wu.T)`` in one kernel.

At decode shapes a GEMM only streams its weight, and cuBLAS's kernels for them stay below the
GPU's memory bandwidth, with a floor of a few microseconds per launch (see the kernel probes and
the ablations in benchmarks/HISTORY.md). These kernels give every program a narrow slice of output
columns (``BLOCK_N``) over all rows and the whole reduction (no split-K), and the gate/up pair
reads both weights' slices in one pass and writes the product (no [rows x 2 x intermediate]
intermediate, no separate SiLU kernel). A weight with few output columns and a long reduction
(down: 2048 x 8192) gets too few programs that way, and cuBLAS's split-K is faster there. Compared
with cuBLAS by ``benchmarks/generation/decode_gemm_probe.py`` (see the kernel probes and the
ablations in benchmarks/HISTORY.md): the gate/up kernel beats cuBLAS + inductor's SiLU-mul, the
plain GEMM does not and is not used; the decode step's MLP uses the gate/up kernel through
:mod:`hf_zero3.decode.mlp_kernels`.

Programmatic dependent launch (:func:`load_dependent`; the decode loop's ``dependent_launches``
option, on by default on Hopper): at decode shapes each GEMM is short (microseconds) and pays a ramp of its own;
launched as a dependent of the kernel before it, a GEMM's programs are resident and waiting when
that kernel finishes, and release the kernel after them at once. A stack
of the step's GEMMs in one CUDA graph runs faster with dependent launches than without
(``tests/gpu/test_dependent_launch_gpu.py``).

Tiles load without masks where every block a launch may take divides the weight's rows and the
reduction (:func:`_even`, the kernels' ``EVEN``): compiled for sm_90, a mask on a weight tile's rows
can take every register and spill at 64 rows, and the unmasked split-K GEMMs are faster
(``benchmarks/generation/decode_gemm_probe.py`` with ``PROBE_MASKED=1``; see the ablations in
benchmarks/HISTORY.md).

Loaded lazily; :func:`is_available` as in :mod:`.gqa_decode` (Triton, ``torch.library``).
"""

from __future__ import annotations

import torch

from . import triton_launch

DEFAULT = dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
# the launch configurations the probe and autotuning try (each fits an H100/H200 SM's shared memory)
CONFIGS = [
    dict(BLOCK_N=bn, BLOCK_K=bk, num_stages=st, num_warps=w)
    for bn, bk, st, w in [
        (16, 128, 4, 4), (16, 256, 3, 4), (32, 128, 4, 4), (32, 256, 3, 4), (32, 128, 5, 4), (64, 128, 4, 4),
        (64, 64, 5, 4), (32, 128, 4, 8), (16, 512, 2, 4), (64, 128, 3, 4), (64, 64, 4, 8), (128, 64, 4, 8),
    ]
]  # fmt: skip
# split-K launches (SPLIT slices of the reduction, each a whole number of BLOCK_K): more programs
# for weights with few output columns (o_proj, down) at the cost of float32 partials
SPLIT_CONFIGS = [
    dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT=sp, num_stages=st, num_warps=w)
    for bn, bk, sp, st, w in [
        (64, 128, 4, 4, 4), (32, 128, 4, 4, 4), (64, 256, 4, 3, 4), (32, 256, 2, 3, 4),
        (64, 128, 8, 4, 4), (128, 128, 4, 3, 8), (32, 128, 8, 4, 4), (32, 128, 2, 4, 4),
        (16, 128, 2, 4, 4), (16, 256, 2, 3, 4), (32, 64, 4, 4, 4), (64, 64, 8, 4, 4),
    ]
]  # fmt: skip
MAX_ROWS = 64
_PLAIN = dict(PDL=False)  # a plain launch's kernel arguments (no dependent start)
_state: dict = {}


def is_available() -> bool:
    return triton_launch.missing() is None


def _kernels():
    """The raw kernels (:func:`_ops` wraps them in autotuning and ``torch.library`` ops), imported
    on first use: importing Triton is not free, and its interpreter switch is read then."""
    if "kernels" not in _state:
        from . import decode_gemm_triton as k  # optional: triton (the kernels import it)

        _state["kernels"] = (k.linear_kernel, k.gate_up_kernel, k.linear_split_kernel)
    return _state["kernels"]


def _even(n: int, k: int, configs) -> bool:
    """Every launch configuration in ``configs`` (the one given, or all the autotuner may pick)
    has blocks dividing ``n`` output columns and a reduction (slice) of ``k``: the kernels then load
    their tiles unmasked (the ``EVEN`` constexpr; a masked weight tile spilled registers)."""
    return all(n % c["BLOCK_N"] == 0 and k % c["BLOCK_K"] == 0 for c in configs)


def _call(
    kernel, x: torch.Tensor, weights: tuple[torch.Tensor, ...], meta: dict, dependent: dict | None = None
) -> torch.Tensor:
    """Launch ``kernel`` over ``x`` (2-D, contiguous rows) and same-shaped ``weights``: one
    program per ``BLOCK_N`` output columns, ``meta`` the launch configuration (empty: the
    autotuner's); ``dependent``: a programmatic dependent launch's arguments (:func:`_dependent`),
    launched by Triton itself (``torch.library.wrap_triton`` takes no launch attributes)."""
    import triton  # optional: triton

    m, k = x.shape
    n = weights[0].shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    meta = dict(meta)
    even = meta.pop("EVEN", None)  # given: the probe's masked tiles on a shape the blocks divide
    even = _even(n, k, [meta] if meta else CONFIGS) if even is None else even
    grid = (triton.cdiv(n, meta["BLOCK_N"]),) if meta else (lambda cfg: (triton.cdiv(n, cfg["BLOCK_N"]),))
    (kernel if dependent else triton_launch.launcher(kernel))[grid](
        x,
        *weights,
        out,
        m,
        n,
        x.stride(0),
        weights[0].stride(0),
        out.stride(0),
        K=k,
        BLOCK_M=max(16, triton.next_power_of_2(m)),
        EVEN=even,
        **meta,
        **(dependent or _PLAIN),
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """``x @ weight.T`` for 2-D ``x`` of at most 64 rows (contiguous rows and weight), one launch
    configuration (the probe's entry; :func:`load` gives the autotuned ops)."""
    return _call(_kernels()[0], x, (weight,), cfg or DEFAULT)


def gate_up_silu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` (rounded to the model's dtype where eager rounds), one
    launch configuration."""
    return _call(_kernels()[1], x, (gate, up), cfg or DEFAULT)


def _call_split(
    kernel, x: torch.Tensor, weight: torch.Tensor, split: int, meta: dict, dependent: dict | None = None
) -> torch.Tensor:
    """Launch the split-K ``kernel``: one program per ``BLOCK_N`` output columns and reduction
    slice; float32 partials ``[split, rows, N]`` (``dependent``: as :func:`_call`'s)."""
    import triton  # optional: triton

    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    meta = dict(meta)
    even = meta.pop("EVEN", None)  # given: the probe's masked tiles on a shape the blocks divide
    grid = (triton.cdiv(n, meta["BLOCK_N"]), split) if meta else (lambda cfg: (triton.cdiv(n, cfg["BLOCK_N"]), split))
    if even is None:  # the autotuner prunes the blocks that do not divide a slice (_split_prune)
        even = k % split == 0 and _even(
            n, k // split, [meta] if meta else [c for c in SPLIT_CONFIGS if (k // split) % c["BLOCK_K"] == 0]
        )
    (kernel if dependent else triton_launch.launcher(kernel))[grid](
        x,
        weight,
        out,
        m,
        n,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        out.stride(1),
        K=k,
        SPLIT=split,
        BLOCK_M=max(16, triton.next_power_of_2(m)),
        EVEN=even,
        **meta,
        **(dependent or _PLAIN),
    )
    return out


def linear_split(x: torch.Tensor, weight: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Split-K ``x @ weight.T`` as float32 partials ``[SPLIT, rows, N]`` (their sum is the product;
    in a compiled step inductor folds the sum into the consumer's kernel), one launch
    configuration; the reduction length must be a multiple of ``SPLIT * BLOCK_K``."""
    k = x.shape[1]
    if k % (cfg["SPLIT"] * cfg["BLOCK_K"]):
        raise ValueError(
            f"split-K needs the reduction ({k}) to be a multiple of SPLIT * BLOCK_K ({cfg['SPLIT']} * {cfg['BLOCK_K']})"
        )
    return _call_split(_kernels()[2], x, weight, cfg["SPLIT"], {key: v for key, v in cfg.items() if key != "SPLIT"})


def split_for(k: int) -> int:
    """The reduction slices :func:`load`'s split-K op takes for a reduction of ``k``: four from 2048
    (the decode GEMM probe's fastest for down, 8192, and o_proj, 2048, at 8 and 64 rows), two from
    1024, else 1 (too short to split); each slice a multiple of 64."""
    for split, least in ((4, 2048), (2, 1024)):
        if k >= least and k % (split * 64) == 0:
            return split
    return 1


def _split_prune(configs, named_args, **kwargs):
    k, split = kwargs.get("K", named_args.get("K")), kwargs.get("SPLIT", named_args.get("SPLIT"))
    # none left (a slice no BLOCK_K divides) is Triton's AutotunerError, never a wrong sum
    return [c for c in configs if k % (split * c.kwargs["BLOCK_K"]) == 0]


def load():
    """The ops ``(linear, gate_up_silu, linear_split)`` (``linear_split(x, w, split)``: float32
    partials, :func:`split_for` slices), autotuned over :data:`CONFIGS` (:data:`SPLIT_CONFIGS`) per shape on the GPU
    (one fixed configuration under Triton's interpreter), registered through
    ``torch.library.triton_op`` so that ``torch.compile`` traces them; built once, outside any
    trace. None when Triton is missing or the build fails (``_state["error"]`` says why)."""
    if "ops" in _state or "error" in _state:
        return _state.get("ops")
    reason = triton_launch.missing()
    if reason is not None:
        _state["error"] = reason
        return None
    try:
        _state["ops"] = _ops()
    except Exception as exc:
        _state["error"] = f"building the Triton GEMMs failed: {type(exc).__name__}: {exc}"
    return _state.get("ops")


def dependent_unavailable(device) -> str | None:
    """Why the GEMMs cannot be launched as programmatic dependent launches on ``device`` (None: they
    can): they need an NVIDIA GPU of compute capability 9.0 or newer (Hopper) and a Triton with
    grid dependency control (``tl.extra.cuda.gdc_wait``, Triton >= 3.4), outside its interpreter."""
    reason = triton_launch.missing()
    if reason is not None:
        return reason
    if triton_launch.interpreted():
        return "Triton's interpreter runs the kernels (TRITON_INTERPRET=1)"
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip:
        return f"programmatic dependent launch needs an NVIDIA GPU, not {device}"
    major = torch.cuda.get_device_capability(device)[0]
    if major < 9:
        return f"programmatic dependent launch needs compute capability 9.0 or newer, this GPU has {major}.x"
    try:
        import triton.language.extra.cuda as tl_cuda  # optional: triton
    except ImportError as exc:
        return f"Triton has no CUDA language extras: {exc}"
    if not hasattr(tl_cuda, "gdc_wait"):
        import triton  # optional: triton

        return f"Triton {triton.__version__} has no grid dependency control (tl.extra.cuda.gdc_wait, Triton >= 3.4)"
    return None


def load_dependent(device):
    """The ops ``(gate_up_silu, linear_split)`` as :func:`load`'s, launched as programmatic
    dependent launches (the kernels' ``PDL`` start, ``launch_pdl``); None where
    :func:`dependent_unavailable` says why. ``torch.library.custom_op`` ops that launch the
    autotuned kernels themselves (inductor's calls of a ``triton_op`` kernel take no launch
    attributes): in a compiled decode step they are calls a CUDA graph captures, as any kernel."""
    if dependent_unavailable(device) is not None or load() is None:
        return None
    if "dependent" not in _state:
        _state["dependent"] = _dependent_ops()
    return _state["dependent"]


#: A dependent launch's kernel and launch arguments.
_DEPENDENT = dict(PDL=True, launch_pdl=True)


def _dependent_ops():
    tuned_gate_up, tuned_split = _state["tuned"]

    @torch.library.custom_op("hf_zero3::decode_gate_up_silu_dependent", mutates_args=())
    def gate_up_op(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return _call(tuned_gate_up, x, (gate, up), {}, _DEPENDENT)

    @gate_up_op.register_fake
    def _(x, gate, up):
        return x.new_empty(x.shape[0], gate.shape[0])

    @torch.library.custom_op("hf_zero3::decode_linear_split_dependent", mutates_args=())
    def split_op(x: torch.Tensor, weight: torch.Tensor, split: int) -> torch.Tensor:
        return _call_split(tuned_split, x, weight, split, {}, _DEPENDENT)

    @split_op.register_fake
    def _(x, weight, split):
        return x.new_empty(split, x.shape[0], weight.shape[0], dtype=torch.float32)

    return gate_up_op, split_op


def _ops():
    import triton  # optional: triton

    linear_kernel, gate_up_kernel, split_kernel = _kernels()
    if triton_launch.interpreted():
        tuned_linear, tuned_gate_up, tuned_split, fixed = linear_kernel, gate_up_kernel, split_kernel, DEFAULT
        fixed_split = dict(DEFAULT, BLOCK_K=64)
    else:
        configs = [
            triton.Config(
                {"BLOCK_N": c["BLOCK_N"], "BLOCK_K": c["BLOCK_K"]}, num_warps=c["num_warps"], num_stages=c["num_stages"]
            )
            for c in CONFIGS
        ]
        tuned_linear = triton_launch.autotune(linear_kernel, configs, ["M", "N", "K"])
        tuned_gate_up = triton_launch.autotune(gate_up_kernel, configs, ["M", "N", "K"])
        split_configs = {(c["BLOCK_N"], c["BLOCK_K"], c["num_stages"], c["num_warps"]) for c in SPLIT_CONFIGS}
        tuned_split = triton_launch.autotune(
            split_kernel,
            [
                triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_stages=st, num_warps=w)
                for bn, bk, st, w in sorted(split_configs)
            ],
            ["M", "N", "K", "SPLIT"],
            prune_configs_by={"early_config_prune": _split_prune},
        )
        fixed = fixed_split = {}
    _state["tuned"] = (tuned_gate_up, tuned_split)

    @torch.library.triton_op("hf_zero3::decode_linear", mutates_args=())
    def linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _call(tuned_linear, x, (weight,), fixed)

    @torch.library.triton_op("hf_zero3::decode_gate_up_silu", mutates_args=())
    def gate_up_op(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return _call(tuned_gate_up, x, (gate, up), fixed)

    @torch.library.triton_op("hf_zero3::decode_linear_split", mutates_args=())
    def split_op(x: torch.Tensor, weight: torch.Tensor, split: int) -> torch.Tensor:
        return _call_split(tuned_split, x, weight, split, fixed_split)

    return linear_op, gate_up_op, split_op

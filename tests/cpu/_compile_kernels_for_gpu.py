"""Run as a script (without TRITON_INTERPRET): compile every hf_zero3 Triton kernel for an sm_90
(H100/H200) target with Triton's real compiler, to PTX and a cubin (ptxas), no GPU needed; prints
one JSON line: {kernel: "ok" | error}, or {"skip": why} when Triton has no NVIDIA backend here."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    import triton

    try:
        import triton.backends.nvidia.compiler  # noqa: F401
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        print(json.dumps({"skip": f"Triton's NVIDIA backend is not importable here: {exc}"}))
        return
    from hf_zero3.kernels import decode_gemm_triton as gemm
    from hf_zero3.kernels import gqa_decode

    assert gqa_decode.load() is not None, gqa_decode.unavailable_reason()
    jit = gqa_decode._state["jit"]
    target = GPUTarget("cuda", 90, 32)

    def signature(fn, pointers, scale="fp32"):
        return {
            p.name: ("constexpr" if p.is_constexpr else pointers.get(p.name) or (scale if p.name == "scale" else "i64"))
            for p in fn.params
        }

    attention = dict(KV=8, G=4, BLOCK_G=16, D=64, BLOCK_D=64, DV=64, BLOCK_DV=64, BLOCK=64, PRECISION="tf32", L=192)
    plain = dict(PDL=False)
    cases = []
    # A direct launch types the Python-float scale fp32; inductor's call of a triton_op inside a
    # compiled graph types it fp64 (the GPU found a kernel that compiled only the first way)
    for mask in (0, 1, 2):
        m = "*i1" if mask == 1 else "*bf16"
        for scale in ("fp32", "fp64"):
            cases.append(
                (
                    f"gqa_decode_attention mask={mask} scale={scale}",
                    jit["attention"],
                    dict(Q="*bf16", K="*bf16", V="*bf16", M=m, O="*bf16"),
                    {**attention, "MASK": mask},
                    scale,
                )
            )
            cases.append(
                (
                    f"gqa_decode_rope_attention mask={mask} scale={scale}",
                    jit["rope"],
                    dict(
                        Q="*bf16",
                        KN="*bf16",
                        VN="*bf16",
                        COS="*bf16",
                        SIN="*bf16",
                        KC="*bf16",
                        VC="*bf16",
                        P="*i64",
                        M=m,
                        O="*bf16",
                    ),
                    {**attention, "MASK": mask, "PDL": False, "SPLIT": 1, "EARLY": False},
                    scale,
                )
            )
    # the decode loop's own 2-D padding mask (int64, nonzero attends), read in place
    cases.append(
        (
            "gqa_decode_rope_attention padding mask scale=fp64",
            jit["rope"],
            dict(
                Q="*bf16",
                KN="*bf16",
                VN="*bf16",
                COS="*bf16",
                SIN="*bf16",
                KC="*bf16",
                VC="*bf16",
                P="*i64",
                M="*i64",
                O="*bf16",
            ),
            {**attention, "MASK": 1, "PDL": False, "SPLIT": 1, "EARLY": False},
            "fp64",
        )
    )
    tiles = dict(K=2048, BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, EVEN=True)  # unmasked tiles (blocks divide)
    ragged = dict(tiles, EVEN=False)  # masked tiles: a shape the blocks do not divide
    cases += [
        ("decode_linear", gemm.linear_kernel, dict(X="*bf16", W="*bf16", O="*bf16"), {**tiles, **plain}, None),
        ("decode_linear ragged", gemm.linear_kernel, dict(X="*bf16", W="*bf16", O="*bf16"), {**ragged, **plain}, None),
        (
            "decode_gate_up_silu ragged",
            gemm.gate_up_kernel,
            dict(X="*bf16", WG="*bf16", WU="*bf16", O="*bf16"),
            {**ragged, **plain},
            None,
        ),
        (
            "decode_linear_split ragged",
            gemm.linear_split_kernel,
            dict(X="*bf16", W="*bf16", P="*fp32"),
            {**ragged, "SPLIT": 4, **plain},
            None,
        ),
        (
            "decode_gate_up_silu",
            gemm.gate_up_kernel,
            dict(X="*bf16", WG="*bf16", WU="*bf16", O="*bf16"),
            {**tiles, **plain},
            None,
        ),
        (
            "decode_linear_split",
            gemm.linear_split_kernel,
            dict(X="*bf16", W="*bf16", P="*fp32"),
            {**tiles, "SPLIT": 4, **plain},
            None,
        ),
    ]
    # programmatic dependent launches (DecodeOptions.dependent_launches): grid dependency control
    # must be in the code, and the launch attribute in the kernel's metadata
    dependent = dict(PDL=True)
    cases += [
        (
            "decode_gate_up_silu dependent",
            gemm.gate_up_kernel,
            dict(X="*bf16", WG="*bf16", WU="*bf16", O="*bf16"),
            {**tiles, **dependent},
            None,
        ),
        (
            "decode_linear_split dependent",
            gemm.linear_split_kernel,
            dict(X="*bf16", W="*bf16", P="*fp32"),
            {**tiles, "SPLIT": 4, **dependent},
            None,
        ),
        (
            "gqa_decode_rope_attention dependent",
            jit["rope"],
            dict(
                Q="*bf16",
                KN="*bf16",
                VN="*bf16",
                COS="*bf16",
                SIN="*bf16",
                KC="*bf16",
                VC="*bf16",
                P="*i64",
                M="*i64",
                O="*bf16",
            ),
            {**attention, "MASK": 1, "PDL": True, "SPLIT": 1, "EARLY": True},
            "fp64",
        ),
        # the fused q/k/v GEMM's float32 partials summed in the kernel (HF_ZERO3_TRITON_QKV)
        (
            "gqa_decode_rope_attention dependent, q/k/v partials",
            jit["rope"],
            dict(
                Q="*fp32",
                KN="*fp32",
                VN="*fp32",
                COS="*bf16",
                SIN="*bf16",
                KC="*bf16",
                VC="*bf16",
                P="*i64",
                M="*i64",
                O="*bf16",
            ),
            {**attention, "MASK": 1, "PDL": True, "SPLIT": 4, "EARLY": True},
            "fp64",
        ),
    ]
    out = {}
    for name, fn, pointers, constants, scale in cases:
        try:
            pdl = bool(constants.get("PDL"))
            compiled = triton.compile(
                ASTSource(fn, signature(fn, pointers, scale), constants),
                target=target,
                options={"launch_pdl": True} if pdl else None,
            )
            ptx = compiled.asm.get("ptx", "")
            if not compiled.asm.get("cubin"):
                out[name] = "no cubin"
            elif pdl and not (
                "griddepcontrol.wait" in ptx
                and "griddepcontrol.launch_dependents" in ptx
                and compiled.metadata.launch_pdl
            ):
                out[name] = "dependent launch: grid dependency control or launch_pdl missing"
            elif not pdl and ("griddepcontrol" in ptx or "prefetch.global" in ptx):
                out[name] = "grid dependency control in a kernel not launched as a dependent"
            else:
                out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - what failed to compile is the result
            out[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    print(json.dumps(out))


if __name__ == "__main__":
    main()

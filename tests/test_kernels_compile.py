"""tidyrl's Triton kernels compile for the GPUs people train on, without one: Triton compiles to a given target
(sm_75 T4, sm_80 A100, sm_90 H100/H200) down to a cubin with the ptxas it ships. Triton's interpreter
(tests/test_ops.py, tests/test_lean_decode.py) checks what they compute; this checks what only compiling shows
(types across loops, ops a backend lacks), so that a kernel cannot first fail on a GPU lent for minutes.
Where Triton is installed (CUDA builds of torch bring it; CI's oldest-versions leg has it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (it comes with CUDA builds of torch)")

# In a process of its own: a test before may have imported Triton with TRITON_INTERPRET=1 (interpreted kernels).
SCRIPT = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tidyrl.models import fused_decode, fused_logprobs

decode = fused_decode._kernels()
norm, rope, silu_mul = decode.add_rms_norm_kernel, decode.rope_and_cache_kernel, decode.silu_and_mul_kernel
partials, block_sums, pick = decode.draw_partials_kernel, decode.draw_block_sums_kernel, decode.draw_pick_kernel
attend = decode.rope_cache_attend_kernel
forward, backward, _ = fused_logprobs._kernels()
for cc in (75, 80, 90):
    for dt in ("bf16", "fp16"):
        kernels = [
            (norm, {"x_ptr": f"*{dt}", "delta_ptr": f"*{dt}", "weight_ptr": f"*{dt}", "sum_ptr": f"*{dt}",
                    "out_ptr": f"*{dt}", "eps": "fp32", "N": "constexpr", "HAS_DELTA": "constexpr",
                    "BLOCK": "constexpr"}, {"N": 896, "HAS_DELTA": True, "BLOCK": 1024}, 4),
            (rope, {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "cos_ptr": f"*{dt}", "sin_ptr": f"*{dt}",
                    "keys_ptr": f"*{dt}", "values_ptr": f"*{dt}", "at_ptr": "*i64", "q_out_ptr": f"*{dt}", "C": "i32",
                    "q_row": "i32", "k_row": "i32", "v_row": "i32", "H": "constexpr", "HKV": "constexpr",
                    "D": "constexpr"}, {"H": 14, "HKV": 2, "D": 64}, 1),
            (attend, {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "cos_ptr": f"*{dt}",
                      "sin_ptr": f"*{dt}", "keys_ptr": f"*{dt}", "values_ptr": f"*{dt}", "at_ptr": "*i64",
                      "bias_ptr": f"*{dt}", "out_ptr": f"*{dt}", "C": "i32", "q_row": "i32", "k_row": "i32",
                      "v_row": "i32", "bias_row": "i32", "scale": "fp32", "R": "constexpr", "R_P2": "constexpr",
                      "HKV": "constexpr", "D": "constexpr", "BLOCK_N": "constexpr"},
             {"R": 7, "R_P2": 16, "HKV": 2, "D": 64, "BLOCK_N": 64}, 4),
            (partials, {"logits_ptr": f"*{dt}", "row_stride": "i32", "t_ptr": "*i64", "eos_ptr": "*i64",
                        "ban_until": "i32", "temperature": "fp32", "partials_ptr": "*fp32", "V": "constexpr",
                        "NBLOCKS": "constexpr", "N_EOS": "constexpr", "SCALED": "constexpr", "BLOCK": "constexpr"},
             {"V": 151936, "NBLOCKS": 149, "N_EOS": 2, "SCALED": True, "BLOCK": 1024}, 4),
            (block_sums, {"logits_ptr": f"*{dt}", "row_stride": "i32", "t_ptr": "*i64", "eos_ptr": "*i64",
                          "ban_until": "i32", "temperature": "fp32", "partials_ptr": "*fp32", "sums_ptr": "*fp32",
                          "V": "constexpr", "NBLOCKS": "constexpr", "NB_P2": "constexpr", "N_EOS": "constexpr",
                          "SCALED": "constexpr", "BLOCK": "constexpr"},
             {"V": 151936, "NBLOCKS": 149, "NB_P2": 256, "N_EOS": 2, "SCALED": True, "BLOCK": 1024}, 4),
            (pick, {"logits_ptr": f"*{dt}", "row_stride": "i32", "u_ptr": "*fp64", "u_row_stride": "i32",
                    "t_ptr": "*i64", "eos_ptr": "*i64", "ban_until": "i32", "temperature": "fp32",
                    "partials_ptr": "*fp32", "sums_ptr": "*fp32", "token_ptr": "*i64", "logp_ptr": "*fp32",
                    "V": "constexpr", "NBLOCKS": "constexpr", "NB_P2": "constexpr", "N_EOS": "constexpr",
                    "SCALED": "constexpr", "BLOCK": "constexpr"},
             {"V": 151936, "NBLOCKS": 149, "NB_P2": 256, "N_EOS": 2, "SCALED": True, "BLOCK": 1024}, 4),
            (silu_mul, {"gate_up_ptr": f"*{dt}", "out_ptr": f"*{dt}", "row_stride": "i32", "I": "constexpr",
                        "BLOCK": "constexpr"}, {"I": 4864, "BLOCK": 1024}, 4),
            (forward, {"logits_ptr": f"*{dt}", "ids_ptr": "*i64", "lse_ptr": "*fp32", "logp_ptr": "*fp32",
                       "ent_ptr": "*fp32", "T": "i32", "V": "constexpr", "stride_b": "i32", "stride_t": "i32",
                       "WITH_ENTROPY": "constexpr", "BLOCK": "constexpr"},
             {"V": 151936, "WITH_ENTROPY": True, "BLOCK": 4096}, 8),
            (backward, {"logits_ptr": f"*{dt}", "ids_ptr": "*i64", "lse_ptr": "*fp32", "grad_ptr": "*fp32",
                        "out_ptr": f"*{dt}", "T": "i32", "V": "constexpr", "stride_b": "i32", "stride_t": "i32",
                        "BLOCK": "constexpr"}, {"V": 151936, "BLOCK": 4096}, 8),
        ]
        for fn, signature, constexprs, warps in kernels:
            compiled = triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", cc, 32), options={"num_warps": warps})
            assert len(compiled.asm["cubin"]) > 1000
            print(f"sm_{cc} {dt} {fn.__name__} ok")
'''


def test_every_triton_kernel_compiles_for_sm75_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.count(" ok") == 3 * 2 * 9, done.stdout

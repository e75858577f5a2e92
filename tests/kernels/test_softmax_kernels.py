"""The kernels compiled for an H100 (sm_90) without a GPU: Triton lowers them to PTX on the host,
where the width of every global load shows whether the causal loads are 16-byte vectors."""

import re

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from neox.kernels import softmax_kernels  # noqa: E402

_softmax_forward_kernel = softmax_kernels._softmax_forward_kernel
_softmax_backward_kernel = softmax_kernels._softmax_backward_kernel

FORWARD_ARGS = ["x_ptr", "y_ptr", "mask_ptr", "scale", "n_rows", "n_heads", "sq", "sk"]
FORWARD_ARGS += ["mask_stride_b", "mask_stride_h", "mask_stride_q", "mask_stride_k"]
BACKWARD_ARGS = ["y_ptr", "dy_ptr", "dx_ptr", "scale", "n_rows", "sq", "sk"]


def global_loads(kernel, names, constants, num_warps) -> set[str]:
    """The ld.global forms in the PTX of `kernel` for bf16 tensors, Sk divisible by 16."""
    types = {name: "*bf16" for name in names if name.endswith("_ptr")}
    types |= {name: "i32" for name in names if name not in types}
    types |= {"scale": "fp32", "mask_ptr": "*u8"} if "mask_ptr" in names else {"scale": "fp32"}
    signature = {name: types[name] for name in names} | {name: "constexpr" for name in constants}
    # Launch-time specialisation: pointers 16-byte aligned, n_rows and Sk multiples of 16.
    aligned = [i for i, n in enumerate(names) if n.endswith("_ptr") or n in ("n_rows", "sk")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(triton.jit(kernel), signature, constants, attrs)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
    )
    return set(re.findall(r"ld\.global[.\w]*", compiled.asm["ptx"]))


@pytest.mark.parametrize("rows,single_block", [(1, True), (2, True), (1, False)])
def test_causal_loads_are_16_byte_vectors(rows, single_block):
    common = {"CAUSAL": True, "BLOCK": 1024, "SINGLE_BLOCK": single_block, "ROWS": rows}
    forward = {**common, "HAS_MASK": False, "VEC": 8}
    assert global_loads(_softmax_forward_kernel, FORWARD_ARGS, forward, 4) == {"ld.global.v4.b32"}
    backward = {**common, "VEC": 8}
    assert global_loads(_softmax_backward_kernel, BACKWARD_ARGS, backward, 4) == {
        "ld.global.v4.b32"
    }


def test_exact_causal_bound_gives_element_loads():
    """VEC=1 (a row length that is not whole vectors) is what every launch used to do."""
    constants = {"CAUSAL": True, "HAS_MASK": False, "BLOCK": 1024, "SINGLE_BLOCK": True}
    constants |= {"ROWS": 1, "VEC": 1}
    assert "ld.global.b16" in global_loads(_softmax_forward_kernel, FORWARD_ARGS, constants, 4)

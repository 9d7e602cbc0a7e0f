"""[Note: fused quantize kernels]: the quantized collectives' encode and decode compiled into fused kernels give
the eager ops' codes, scales and values bit for bit (checked on CPU through Inductor's C++ backend, and on CUDA
by a gpu test); a compile that fails falls back to the eager ops with one warning; CPU runs eager by default."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

from fsdp2lite._runtime import fused_quantize
from fsdp2lite._runtime.quantize import decode, encode


@pytest.fixture
def fused_here() -> Iterator[str]:
    """Compile on the device the test runs on; forget what was compiled or failed afterwards."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with mock.patch.object(fused_quantize, "FUSED_DEVICES", ("cuda", "cpu")):
        yield device
    fused_quantize._compiled.clear()
    fused_quantize._failed.clear()
    torch._dynamo.reset()


def _values(device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(3 * 256 + 40, generator=g) * torch.logspace(-3, 2, 3 * 256 + 40)  # a short last block
    flat[300:556] = 0.0  # an all-zero block: the scale's floor
    rows = torch.randn(4, 512, generator=g)  # the all-to-all's rank-major rows
    return [flat.to(device), rows.to(device)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_fused_encode_and_decode_are_bit_identical(fused_here: str) -> None:
    kinds = ["int8", *(["fp8"] if hasattr(torch, "float8_e4m3fn") else [])]
    for values in _values(fused_here):
        for kind in kinds:
            eager = encode(values, 256, kind)
            fused = fused_quantize.run_fused("encode", encode, values, 256, kind)
            assert _same(eager[0], fused[0]) and _same(eager[1], fused[1]), (kind, values.shape)
            codes, scales = eager[0].reshape(-1, eager[0].shape[-1]), eager[1].reshape(-1, eager[1].shape[-1])
            for dtype in (torch.bfloat16, torch.float32):
                expected = decode(codes, scales, 256, dtype)
                got = fused_quantize.run_fused("decode", decode, codes, scales, 256, dtype)
                assert _same(expected, got), (kind, dtype, values.shape)
    assert not fused_quantize._failed and set(fused_quantize._compiled) == {"encode", "decode"}


def test_a_failed_compile_falls_back_with_one_warning(fused_here: str) -> None:
    def broken(fn, **kwargs):  # noqa: ANN001, ANN202
        def run(*args):  # noqa: ANN002, ANN202
            raise RuntimeError("no triton here\nmore detail")

        return run

    values = _values(fused_here)[0]
    with mock.patch.object(torch, "compile", broken):
        with pytest.warns(RuntimeWarning, match=r"compiling the quantized collectives' encode .* \(no triton here\)"):
            codes, scales = fused_quantize.run_fused("encode", encode, values, 256, "int8")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: the eager ops from then on, silently
            again = fused_quantize.run_fused("encode", encode, values, 256, "int8")
    eager = encode(values, 256, "int8")
    assert _same(codes, eager[0]) and _same(scales, eager[1]) and _same(again[0], eager[0])


def test_cpu_runs_the_eager_ops_by_default() -> None:
    with mock.patch.object(torch, "compile", side_effect=AssertionError("compiled on CPU")):
        codes, _ = fused_quantize.run_fused("encode", encode, torch.ones(256), 256, "int8")
    assert torch.equal(codes, torch.full((256,), 127, dtype=torch.int8))

"""fsdp2lite's NF4 dequantization and matmul (finetune/nf4_linear.py) and the run-by-run loss
(finetune/head_loss.py): torchao's values bit for bit, and the temporaries their notes claim, counted through
the CPU allocator (benchmarks/_founding.py's LiveBytes) against torchao's and the full logits'."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _founding import LiveBytes  # noqa: E402

from fsdp2lite.finetune import head_loss, nf4_linear  # noqa: E402

pytest.importorskip("torchao", reason="the NF4 reference is torchao's: pip install torchao")


def nf4(shape: tuple[int, int], seed: int = 0) -> tuple[object, object]:
    """(torchao's NF4Tensor of a random bf16 weight, the same bytes as fsdp2lite's NF4Rows)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from fsdp2lite.finetune.nf4_rows import rows_of

    weight = torch.randn(shape, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(seed))
    whole = to_nf4(weight)
    return whole, rows_of(whole)


def extra_bytes(fn: object) -> tuple[object, int]:
    """``fn()``'s result and the most bytes live beside it while it ran (the result's own excluded)."""
    with LiveBytes() as live:
        live.mark("start")
        result = fn()  # type: ignore[operator]
        live.mark("end")
    own = result.untyped_storage().nbytes() if isinstance(result, torch.Tensor) else 0
    return result, live.peak_between("start", "end") - live.live_at("start") - own


@pytest.mark.parametrize("shape", [(256, 512), (640, 1024), (300, 128 * 64)])
def test_dequantize_is_torchaos_bit_for_bit_in_any_pieces(monkeypatch: pytest.MonkeyPatch, shape: tuple) -> None:
    whole, rows = nf4(shape)
    expected = whole.get_original_weight()  # type: ignore[attr-defined]
    for piece in (nf4_linear.PIECE_VALUES, 4096, 3 * shape[1]):  # one piece; many; a last one cut short
        monkeypatch.setattr(nf4_linear, "PIECE_VALUES", piece)
        got = nf4_linear.dequantize(rows.codes, rows.scalers, rows.whole, fused=False)  # type: ignore[attr-defined]
        assert torch.equal(got, expected), (shape, piece)


def test_dequantize_holds_what_it_says_and_torchao_twelve_times_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 2048 x 4096 in pieces of 1 Mi values: the block scales and one piece's int32 index beside the result
    (``dequantize_bytes``); torchao's whole-weight dequantization holds int64 indices and halves of its size."""
    monkeypatch.setattr(nf4_linear, "PIECE_VALUES", 2**20)
    shape = (2048, 4096)
    whole, rows = nf4(shape)
    _, ours = extra_bytes(lambda: nf4_linear.dequantize(rows.codes, rows.scalers, rows.whole, fused=False))
    assert 0 <= ours - nf4_linear.dequantize_bytes(shape, compiled=False) <= 4096, ours  # and the 256-pair table
    _, theirs = extra_bytes(whole.get_original_weight)  # type: ignore[attr-defined]
    assert theirs > 12 * ours, (theirs, ours)


def test_nf4_weight_multiplies_as_torchaos_linear_nf4() -> None:
    """F.linear on an NF4Weight (what a gathered QLoRA weight is): forward and input gradient equal torchao's."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

    whole, rows = nf4((384, 256))
    weight = nf4_linear.NF4Weight(rows.codes, rows.scalers, rows.whole)  # type: ignore[attr-defined]
    x = torch.randn(3, 5, 256, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randn(3, 5, 384, dtype=torch.bfloat16)
    ours = F.linear(x, weight)
    (grad_ours,) = torch.autograd.grad(ours, x, y)
    theirs = linear_nf4(x, whole)
    (grad_theirs,) = torch.autograd.grad(theirs, x, y)
    assert torch.equal(ours, theirs) and torch.equal(grad_ours, grad_theirs)
    assert torch.equal(weight.to(torch.float32), whole.get_original_weight().float())  # type: ignore[attr-defined]
    with pytest.raises(NotImplementedError, match="aten.add.Tensor on an NF4Weight .* never written"):
        weight + 1  # noqa: B018


def test_a_kernel_choice_not_known_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(nf4_linear.KERNEL_ENV, "triton")
    with pytest.raises(ValueError, match="FSDP2LITE_NF4_KERNEL='triton': expected compiled or eager"):
        nf4_linear.compiled_kernel(torch.device("cpu"))
    monkeypatch.setenv(nf4_linear.KERNEL_ENV, "eager")
    assert not nf4_linear.compiled_kernel(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel is CUDA's default: needs a GPU")
def test_the_compiled_kernel_is_torchaos_bit_for_bit_on_cuda() -> None:
    for shape in ((256, 512), (28672 // 16, 8192)):
        whole, rows = nf4(shape)
        expected = whole.get_original_weight()  # type: ignore[attr-defined]
        got = nf4_linear.dequantize(rows.codes.cuda(), rows.scalers.cuda(), rows.whole.to(torch.device("cuda")))  # type: ignore[attr-defined]
        assert torch.equal(got.cpu(), expected), shape


def test_the_run_by_run_loss_is_the_full_losses_and_holds_one_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """ChunkedHeadLoss against F.cross_entropy on the full fp32 logits (fp32 head: the same values up to the
    sum's order; ignored labels; runs of 40 tokens, the last short): loss and hidden gradient; and what each
    holds beside its inputs: one run's ``run_bytes`` against the full logits several times over."""
    vocab, width, tokens = 1000, 64, 100
    monkeypatch.setattr(head_loss, "CHUNK_LOGIT_BYTES", 4 * vocab * 40)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, width, generator=generator) * 0.1
    hidden = torch.randn(tokens, width, generator=generator, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[::7] = head_loss.IGNORE_INDEX

    def ours() -> torch.Tensor:
        loss = head_loss.ChunkedHeadLoss.apply(hidden, weight, None, labels)
        loss.backward()
        return loss

    def theirs() -> torch.Tensor:
        loss = F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")
        loss.backward()
        return loss

    loss, held = extra_bytes(ours)
    grad = hidden.grad.clone()  # type: ignore[union-attr]
    hidden.grad = None
    expected, full = extra_bytes(theirs)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(grad, hidden.grad, rtol=1e-5, atol=1e-6)
    assert held <= head_loss.run_bytes(vocab, tokens) + 2 * hidden.numel() * 4, held  # a run, the hidden gradient
    assert full > 3 * held, (full, held)

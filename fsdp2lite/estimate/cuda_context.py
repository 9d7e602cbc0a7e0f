"""The CUDA context: device memory the driver and CUDA's libraries take before PyTorch allocates anything.

A 24 GiB card does not give PyTorch 24 GiB: the CUDA context (the driver's per-process state, the kernels
of CUDA's libraries loaded lazily as they are first used) takes its share first, and ``--budget`` is the card.
The budget search therefore takes the context off the budget before any setting is compared with it.
Measured on a GPU (``torch.cuda.mem_get_info`` before and after the first CUDA call, beside
``torch.cuda.memory_reserved``): one figure per GPU kind; a kind not measured yet uses the measured one,
and the answer says it is assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20


@dataclass(frozen=True)
class CudaContext:
    """The context's bytes and where the figure comes from."""

    nbytes: int
    source: str


MEASURED: dict[str, CudaContext] = {
    "h200": CudaContext(
        619 * MIB, "measured on an H200 on 2026-11-28 (torch 2.11+cu130, driver 580.159.04; docs/finetune.md)"
    ),
}
REFERENCE = "h200"  # the kind whose figure stands in for the kinds not measured


def cuda_context(gpu: str | None) -> CudaContext:
    """The context of ``gpu`` (a name of ``estimate.timing.GPUS``; None: not named): measured, or the
    reference kind's figure, said to be assumed."""
    if gpu in MEASURED:
        return MEASURED[gpu]  # type: ignore[index]
    reference = MEASURED[REFERENCE]
    kind = f"{gpu}" if gpu else "the GPU (not named: --gpu)"
    return CudaContext(reference.nbytes, f"assumed for {kind}: the figure measured on an H200, not on it")

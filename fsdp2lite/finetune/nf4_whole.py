"""What every piece of one NF4 weight shares, and NF4's block sizes (torchao ``to_nf4``'s defaults)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 64  # values per NF4 block (one absmax scale each)
SCALER_BLOCK_SIZE = 256  # scales per block of the second (int8) quantization


@dataclass(frozen=True)
class WholeNF4:
    """What every row piece of one NF4 weight shares ([Note: NF4 padded by rows])."""

    shape: torch.Size  # the whole weight's (rows, columns)
    dtype: torch.dtype  # the compute dtype it was quantized from and dequantizes to
    quantization_factor: torch.Tensor  # (numel / (64 * 256),) one per block of 256 scales
    scaler_mean: torch.Tensor  # () the mean of all block scales, subtracted before their quantization
    nf4: torch.Tensor  # (16,) the NF4 code table

    def to(self, device: torch.device) -> WholeNF4:
        """The same constants on ``device`` (itself when they are there)."""
        if self.quantization_factor.device == device:
            return self
        parts = (t.to(device) for t in (self.quantization_factor, self.scaler_mean, self.nf4))
        return WholeNF4(self.shape, self.dtype, *parts)

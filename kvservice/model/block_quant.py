"""A weight kept in GGUF's block quantization (Q4_1, Q8_0) for small-batch matmuls.

W[n, k] = scale[n, k // 32] * code[n, k] + min[n, k // 32], the product and then the sum
rounded to float32: exactly the float32 weight the GGUF loader dequantizes (Q8_0 has no
min: 0); a bfloat16 model's weight is that value rounded to bfloat16, as the loader rounds
it. Decoding a few requests streams every weight once per step, so the C++ kernel
(`block_quant_linear` in `kvservice.model.cpu_kernels`) that reads 1.25 bytes a weight instead
of 4 (the float32 copy a bfloat16 model computes with on a CPU without bfloat16 matmuls)
is faster than a float32 matmul; `dequantize` and `linear_reference` are the PyTorch
formulas it is tested against.

The kernel's layout: panels of 16 output rows, k-major, so one k's 16 codes are adjacent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 32  # weights per scale and min
PANEL = 16  # output rows per panel


@dataclass(frozen=True, slots=True)
class BlockQuantWeight:
    """A [N, K] weight in the kernel's panel layout."""

    codes: torch.Tensor  # int8 [N / 16, K, 16]
    scales: torch.Tensor  # float32 [N / 16, K / 32, 16]
    mins: torch.Tensor  # float32 [N / 16, K / 32, 16]

    @staticmethod
    def is_supported_shape(num_rows: int, num_cols: int) -> bool:
        return num_rows % PANEL == 0 and num_cols % BLOCK == 0

    @classmethod
    def from_rows(cls, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> BlockQuantWeight:
        """From row-major codes int8 [N, K] and float32 scales/mins [N, K / 32]."""
        num_rows, num_cols = codes.shape
        assert cls.is_supported_shape(num_rows, num_cols), (num_rows, num_cols)
        assert scales.shape == mins.shape == (num_rows, num_cols // BLOCK), (scales.shape, mins.shape)

        def panels(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(num_rows // PANEL, PANEL, t.shape[1]).transpose(1, 2).contiguous()

        return cls(panels(codes.to(torch.int8)), panels(scales.float()), panels(mins.float()))

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0] * PANEL, self.codes.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] in `dtype` (float32 or bfloat16), rounded as the kernel and the GGUF loader round it."""
        num_rows, num_cols = self.shape
        scales = self.scales.repeat_interleave(BLOCK, dim=1)  # [P, K, 16]
        mins = self.mins.repeat_interleave(BLOCK, dim=1)
        weight = scales * self.codes.float() + mins
        return weight.transpose(1, 2).reshape(num_rows, num_cols).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] float32 or bfloat16 -> x W^T + bias [M, N] in x's dtype, with the C++ kernel
        (which must be loaded); W and bias in x's dtype too."""
        return torch.ops.kvservice.block_quant_linear(x.contiguous(), self.codes, self.scales, self.mins, bias)

    def linear_reference(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The PyTorch formula of `linear`: float32 products and sums, one rounding to x's dtype."""
        weight = self.dequantize(x.dtype).float()
        return F.linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)

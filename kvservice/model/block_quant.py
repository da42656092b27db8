"""A weight kept in GGUF's block quantization (Q4_1, Q8_0) for small-batch matmuls.

W[n, k] = scale[n, k // 32] * code[n, k] + min[n, k // 32], the product and then the sum
rounded to float32: exactly the float32 weight the GGUF loader dequantizes (Q8_0 has no
min: 0); a bfloat16 model's weight is that value rounded to bfloat16, as the loader rounds
it. Decoding a few requests streams every weight once per step, so the C++ kernel
(`block_quant_linear` in `kvservice.model.cpu_kernels`) reads them as stored: 4-bit codes
(Q4_1) or 8-bit ones (Q8_0), and GGUF's own float16 scales and mins: 0.625 or 1.125 bytes a
weight instead of 4 for float32. `dequantize` and `linear_reference` are the PyTorch formulas
it is tested against.

The kernel's layout: panels of 16 output rows, k-major, so one k's 16 codes are adjacent;
4-bit codes two k's to a byte (k even in the low nibble, k + 1 in the high one).
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

    codes: torch.Tensor  # uint8 [N / 16, K / 2, 16] (4-bit pairs) or int8 [N / 16, K, 16]
    scales: torch.Tensor  # float16 [N / 16, K / 32, 16]
    mins: torch.Tensor  # float16 [N / 16, K / 32, 16]

    @staticmethod
    def is_supported_shape(num_rows: int, num_cols: int) -> bool:
        return num_rows % PANEL == 0 and num_cols % BLOCK == 0

    @classmethod
    def from_rows(cls, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> BlockQuantWeight:
        """From row-major codes int8 [N, K] and float32 scales/mins [N, K / 32] that are float16
        values (GGUF stores them so). Codes in [0, 16) are kept as 4-bit pairs."""
        num_rows, num_cols = codes.shape
        assert cls.is_supported_shape(num_rows, num_cols), (num_rows, num_cols)
        assert scales.shape == mins.shape == (num_rows, num_cols // BLOCK), (scales.shape, mins.shape)
        halves = scales.half(), mins.half()
        if not all(torch.equal(h.float(), t.float()) for h, t in zip(halves, (scales, mins))):
            raise ValueError("block-quantized scales and mins must be float16 values")

        def panels(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(num_rows // PANEL, PANEL, t.shape[1]).transpose(1, 2).contiguous()

        panel_codes = panels(codes.to(torch.int8))  # [P, K, 16]
        if int(codes.min()) >= 0 and int(codes.max()) < 16:
            pairs = panel_codes.view(torch.uint8).view(panel_codes.shape[0], num_cols // 2, 2, PANEL)
            panel_codes = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
        return cls(panel_codes, panels(halves[0]), panels(halves[1]))

    @property
    def is_4bit(self) -> bool:
        return self.codes.dtype == torch.uint8

    @property
    def shape(self) -> tuple[int, int]:
        num_cols = self.codes.shape[1] * (2 if self.is_4bit else 1)
        return self.codes.shape[0] * PANEL, num_cols

    def panel_codes(self) -> torch.Tensor:
        """The codes as int8 [P, K, 16], unpacked."""
        if not self.is_4bit:
            return self.codes
        low, high = self.codes & 0x0F, self.codes >> 4
        return torch.stack((low, high), dim=2).flatten(1, 2).to(torch.int8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] in `dtype` (float32 or bfloat16), rounded as the kernel and the GGUF loader round it."""
        num_rows, num_cols = self.shape
        scales = self.scales.float().repeat_interleave(BLOCK, dim=1)  # [P, K, 16]
        mins = self.mins.float().repeat_interleave(BLOCK, dim=1)
        weight = scales * self.panel_codes().float() + mins
        return weight.transpose(1, 2).reshape(num_rows, num_cols).to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] float32 or bfloat16 -> x W^T + bias [M, N] in x's dtype, with the C++ kernel
        (which must be loaded); W and bias in x's dtype too."""
        return torch.ops.kvservice.block_quant_linear(x.contiguous(), self.codes, self.scales, self.mins, bias)

    def linear_reference(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The PyTorch formula of `linear`: float32 products and sums, one rounding to x's dtype."""
        weight = self.dequantize(x.dtype).float()
        return F.linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)

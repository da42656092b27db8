"""The LM head's greedy tokens without every logit in float32 (`csrc/greedy_head.cpp`).

A decode step of 16 greedy requests on SmolLM2 spent ~5 ms of ~40 in the LM head: 16 rows
times 49,152 outputs of 576 float32 multiply-adds, at the matmul kernel's peak, for one
largest logit a row. The C++ op estimates every logit with 8-bit integer dot products (AVX-512
VNNI; AVX2's vpmaddubsw with x's integers within 63), bounds each estimate's error, and
computes in float32 only the panels of 16 logits that may hold the largest, as
`block_quant_linear` computes them: the token is the full logits'
argmax, bit for bit, for batches of `MIN_ROWS` or more (fewer rows take other sums there, and
read the weights at memory speed either way).

`GreedyHead.build` lays the LM head's block-quantized codes out for VNNI and vpmaddubsw (4 k's of one output
in 4 adjacent bytes, offset to unsigned) and sums each block's |weights| for the bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvservice.model.block_quant import BLOCK, BlockQuantWeight

MIN_ROWS = 4  # block_quant_linear sums every k in order from 4 rows on (the op's exact part does)
_BUILD_PANELS = 256  # panels prepared at a time: bounds the float64 temporaries (~30 MiB)


@dataclass(frozen=True, slots=True)
class GreedyHead:
    weight: BlockQuantWeight
    vnni_codes: torch.Tensor  # uint8 [P, K / 4, 16, 4]: code + code_offset
    code_offset: int  # 128 for signed 8-bit codes, 0 for 4-bit ones
    abs_sums: torch.Tensor  # float32 [P, K / 32, 16]: sum of |scale * code| + |min| per block, rounded up
    with_mins: bool  # False where every min is zero (Q8_0): the estimates skip them

    @classmethod
    def build(cls, weight: BlockQuantWeight) -> GreedyHead:
        offset = 0 if weight.is_4bit else 128
        codes = weight.panel_codes()  # int8 [P, K, 16]
        num_panels, num_cols, panel = codes.shape
        vnni = (codes.to(torch.int16) + offset).to(torch.uint8)
        vnni = vnni.view(num_panels, num_cols // 4, 4, panel).transpose(2, 3).contiguous()
        abs_sums = torch.empty(weight.scales.shape, dtype=torch.float32)
        for p0 in range(0, num_panels, _BUILD_PANELS):
            p1 = min(p0 + _BUILD_PANELS, num_panels)
            scales = weight.scales[p0:p1].double().repeat_interleave(BLOCK, dim=1)
            mins = weight.mins[p0:p1].double().repeat_interleave(BLOCK, dim=1)
            # scale * code is exact in float64 (and in float32): an 11-bit times an 8-bit integer.
            per_weight = (scales * codes[p0:p1].double()).abs() + mins.abs()
            sums = per_weight.view(p1 - p0, num_cols // BLOCK, BLOCK, panel).sum(2)
            rounded = sums.float()
            abs_sums[p0:p1] = torch.where(
                rounded.double() < sums, torch.nextafter(rounded, torch.tensor(float("inf"))), rounded
            )
        return cls(weight, vnni, offset, abs_sums, bool(weight.mins.any()))

    def tokens(self, x: torch.Tensor) -> list[int] | None:
        """Each row's argmax of x W^T (x: float32 [M, K], M >= MIN_ROWS); None if a row has a
        value that is not finite (the caller then computes the logits in full)."""
        w = self.weight
        tokens = torch.ops.kvservice.greedy_head(
            x.contiguous(), self.vnni_codes, self.code_offset, w.codes, w.scales, w.mins, self.abs_sums, self.with_mins
        )
        result: list[int] = tokens.tolist()
        return None if min(result, default=0) < 0 else result

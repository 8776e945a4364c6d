"""FP8 block quantization (formats.fp8.quant_block): the whole-block path (views, one fp32 copy divided in place) and
the padded path give the same bytes, from fp32 or bf16, and the caller's weight is left as it was."""

import torch

from dsflash.formats import fp8


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def test_whole_blocks_match_the_padded_path_and_leave_the_input_alone():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 160, generator=g) * 0.02
    w[:32, :32] = 0  # an all-zero block: the floor on amax, codes 0
    w[40, 70] = 3e4  # a block whose other values go subnormal in E4M3
    w[70, 5] = float("nan")
    before = w.clone()
    q, s = fp8.quant_block(w[:, :128], 32)  # 3 x 4 whole blocks
    qp, sp = fp8.quant_block(w, 32)  # 160 columns: a padded last block column
    assert torch.equal(w.isnan(), before.isnan()) and torch.equal(w.nan_to_num(), before.nan_to_num())
    assert torch.equal(_bytes(q), _bytes(qp[:, :128])) and torch.equal(_bytes(s), _bytes(sp[:, :4]))
    assert torch.equal(_bytes(q[:32, :32]), torch.zeros(32, 32, dtype=torch.uint8))
    assert q[70, 5].float().isnan()
    # bf16 in (the head's weight): the same bytes as its exact fp32 copy
    wb = torch.where(w.isnan(), 0.0, w)[:, :128].to(torch.bfloat16)
    qb, sb = fp8.quant_block(wb, 32)
    qf, sf = fp8.quant_block(wb.float(), 32)
    assert torch.equal(_bytes(qb), _bytes(qf)) and torch.equal(_bytes(sb), _bytes(sf))
    # and the values are the weight to E4M3's precision
    back = fp8.dequant_block(qb, sb, 32)
    assert ((back - wb.float()).abs() <= wb.float().abs() * 2**-4 + 1e-30 + 2**-9 * back.abs().max()).all()

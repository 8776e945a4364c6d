"""Huge-page host buffers for the streamed weights: aligned, zeroed, equal copies; small or device tensors untouched."""

import torch

from dsflash.runtime.cpu import hugepages


def test_large_buffers_are_huge_page_aligned_and_zero():
    a = hugepages.empty(hugepages.MIN_BYTES + 123)
    assert a.shape == (hugepages.MIN_BYTES + 123,) and a.ctypes.data % hugepages.HUGE == 0
    assert not a.any()
    a[:] = 7  # writable
    small = hugepages.empty(100)
    assert small.shape == (100,) and not small.any()


def test_copies_equal_the_tensor_and_outlive_it():
    t = torch.randn(1024, 2048).bfloat16()  # 4 MiB
    c = hugepages.copy(t[:, ::1])
    assert torch.equal(c, t) and c.is_contiguous() and c.data_ptr() % hugepages.HUGE == 0
    del t
    assert torch.isfinite(c.float()).all()  # the mapping lives with the tensor
    s = torch.randn(3, 5)
    assert hugepages.copy(s) is s


def test_a_tensor_off_the_host_is_left_where_it_is():
    t = torch.empty(4096, 4096, device="meta")
    assert hugepages.copy(t).device.type == "meta"

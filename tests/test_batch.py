import numpy as np
import pytest
import torch

from mlaprefill.batch import PrefillBatch


def test_accepts_lists_arrays_and_cpu_tensors():
    for q, c in [([3, 1], [0, 130]),
                 (np.array([3, 1], np.int32), np.array([0, 130], np.uint16)),
                 (torch.tensor([3, 1]), torch.tensor([0, 130], dtype=torch.int32))]:
        b = PrefillBatch(q, c, page_size=64)
        assert b.query_lens.dtype == np.int64 and b.context_lens.dtype == np.int64
        assert b.query_lens.tolist() == [3, 1] and b.context_lens.tolist() == [0, 130]
        assert b.num_reqs == 2 and b.num_query_tokens == 4 and b.num_context_tokens == 130
        assert b.max_query_len == 3 and b.max_context_len == 130
        assert b.cu_query_lens.tolist() == [0, 3, 4]


def test_copies_input_and_is_read_only():
    q = np.array([2, 5])
    b = PrefillBatch(q, [0, 0], page_size=16)
    q[0] = 99
    assert b.query_lens.tolist() == [2, 5]
    with pytest.raises(ValueError):
        b.query_lens[0] = 1


def test_block_table_only_shape_and_dtype_read():
    bt = torch.zeros(2, 3, dtype=torch.int32)
    b = PrefillBatch([1, 1], [64, 192], page_size=64, block_table=bt)
    assert b.block_table is bt


@pytest.mark.parametrize("kwargs, match", [
    (dict(query_lens=[], context_lens=[]), r"empty"),
    (dict(query_lens=[1, 2], context_lens=[0]),
     r"query_lens has 2 requests but context_lens has 1"),
    (dict(query_lens=[1, 2], context_lens=[0, -3]), r"context_lens\[1\] = -3 is negative"),
    (dict(query_lens=[1, -2], context_lens=[0, 3]), r"query_lens\[1\] = -2"),
    (dict(query_lens=[4, 0, 1], context_lens=[0, 3, 1]), r"query_lens\[1\] = 0.*Drop request 1"),
    (dict(query_lens=[1.0, 2.0], context_lens=[0, 0]), r"query_lens has dtype float64"),
    (dict(query_lens=[1, 2], context_lens=[True, False]), r"context_lens\[0\] is the bool True"),
    # a bool among ints: np.asarray makes it an int array, so it is checked per element
    (dict(query_lens=[1, 1, 1], context_lens=[0, 0, True]), r"context_lens\[2\] is the bool"),
    (dict(query_lens=(1, np.bool_(True)), context_lens=[0, 0]), r"query_lens\[1\] is the bool"),
    (dict(query_lens=np.array([True, False]), context_lens=[0, 0]), r"query_lens has dtype bool"),
    (dict(query_lens=torch.tensor([1.0]), context_lens=[0]), r"query_lens has dtype torch.float32"),
    (dict(query_lens=[[1, 2]], context_lens=[[0, 0]]), r"query_lens must be 1-D"),
    (dict(query_lens=[1, 1], context_lens=[2**31 - 1, 1]), r"context_lens sums to 2147483648"),
    (dict(query_lens=[2**30, 2**30], context_lens=[0, 0]), r"query_lens sums to .*overflows int32"),
    (dict(query_lens=[2], context_lens=[2**31 - 2]), r"request 0: context_lens \+ query_lens"),
    (dict(query_lens=[1], context_lens=[0], page_size=0), r"page_size must be a positive int"),
])
def test_validation_messages(kwargs, match):
    kwargs.setdefault("page_size", 64)
    with pytest.raises(ValueError, match=match):
        PrefillBatch(**kwargs)


@pytest.mark.parametrize("bt, match", [
    (torch.zeros(2, 2, dtype=torch.int32),
     r"too short for request 1: context_lens\[1\] = 129 needs 3 pages.*max_blocks=2"),
    (torch.zeros(2, 3, dtype=torch.int64), r"block_table has dtype torch.int64; expected int32"),
    (np.zeros((2, 3), np.float32), r"block_table has dtype float32"),
    (torch.zeros(3, 3, dtype=torch.int32), r"block_table has shape \(3, 3\)"),
    (torch.zeros(6, dtype=torch.int32), r"block_table has shape \(6,\)"),
    ([[0, 1]], r"block_table must be an int32 tensor"),
])
def test_block_table_errors(bt, match):
    with pytest.raises(ValueError, match=match):
        PrefillBatch([1, 1], [64, 129], page_size=64, block_table=bt)


class _FakeCudaTensor:
    """Looks like a CUDA tensor; any value access fails the test (it would sync)."""

    __module__ = "torch"
    device = torch.device("cuda", 0)
    dtype = torch.int32

    def __getattr__(self, name):
        raise AssertionError(f"touched .{name} of a CUDA tensor")

    def __array__(self, *a, **k):
        raise AssertionError("read the values of a CUDA tensor")


def test_cuda_tensor_rejected_without_reading():
    with pytest.raises(ValueError, match=r"context_lens is a tensor on cuda:0; host data"):
        PrefillBatch([1], _FakeCudaTensor(), page_size=64)
    with pytest.raises(ValueError, match=r"query_lens is a tensor on cuda:0"):
        PrefillBatch(_FakeCudaTensor(), [1], page_size=64)


def test_meta_tensor_block_table_accepted():
    # Only shape/dtype are read, so a block table on any device (here: meta) is fine.
    bt = torch.empty(1, 4, dtype=torch.int32, device="meta")
    assert PrefillBatch([1], [256], page_size=64, block_table=bt).num_reqs == 1


@pytest.mark.parametrize("query_lens, context_lens, match", [
    # int64 sum of 4 x 2**62 wraps to 0: was accepted with num_context_tokens == 0
    ([1] * 4, [2**62] * 4, r"context_lens\[0\] = 4611686018427387904 overflows int32"),
    ([1, 1], [0, 2**31], r"context_lens\[1\] = 2147483648 overflows int32"),
    ([2**31, 1], [0, 0], r"query_lens\[0\] = 2147483648 overflows int32.*split request 0"),
    ([1], np.array([2**63], np.uint64), r"context_lens\[0\] = 9223372036854775808 overflows"),
    ([1], [2**64], r"context_lens\[0\] = 18446744073709551616 overflows int32"),
    ([1], [-2**63 - 1], r"context_lens\[0\] = -9223372036854775809 is negative"),
    ([1, 1], torch.tensor([2**40, 0]), r"context_lens\[0\] = 1099511627776 overflows int32"),
])
def test_lengths_beyond_int32_rejected_before_summing(query_lens, context_lens, match):
    with pytest.raises(ValueError, match=match):
        PrefillBatch(query_lens, context_lens, page_size=4)


def test_page_size_beyond_int32_rejected():
    with pytest.raises(ValueError, match=r"page_size = 1099511627776 overflows int32"):
        PrefillBatch([1], [1], page_size=2**40)


def test_object_arrays_of_ints_are_read_or_refused_clearly():
    """Was: ``PrefillBatch(np.array([3, 2], dtype=object), ...)`` raised a bare StopIteration."""
    import numpy as np

    batch = PrefillBatch(np.array([3, 2], dtype=object), np.array([5, 0], dtype=object),
                         page_size=4)
    assert batch.query_lens.tolist() == [3, 2] and batch.context_lens.tolist() == [5, 0]
    for bad, words in (([3, 2**70], "overflows int32"), ([3, -2**70], "is negative"),
                       ([3, -2], "needs >= 1 new token")):
        with pytest.raises(ValueError, match=words):
            PrefillBatch(np.array(bad, dtype=object), [1, 1], page_size=4)

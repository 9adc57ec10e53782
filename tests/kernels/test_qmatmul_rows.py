"""matmul_q8 on a few rows (2-16: a serving pass's decoding sequences, a verify block).

The transposed 512-bit direct path (path 4, the default from ft_from rows on AVX512-VNNI) takes
W's rows two at a time, each vector of x loaded once for both, and Q8_0 has its own group decoder
there. Contract: the same bits as the folding direct path (2), the panels (1) and the 256-bit
direct path (0) for any number of W rows (pairs and a lone last row, in and across the blocks of
16 rows and the chunks of groups), any row count, any thread split; and no decoder reads past the
end of the weight buffer.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from test_qmatmul_int8 import activations, product, setup

from k3kit.kernels import qmatmul

pytestmark = pytest.mark.skipif(not qmatmul.native_available(), reason="native kernel not built")

TYPES = [T.Q8_0, T.Q4_K, T.Q6_K, T.MXFP4, T.IQ1_S, T.IQ3_XXS]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_pairs_of_w_rows_match_the_other_paths(qtype: T) -> None:
    """W row counts that leave a lone row in a block of 16 or in the last block, k long enough
    that 8 rows of x are walked in several chunks of groups (k = 7168) plus a partial last group
    where the type has one (k = 7168 + 32 or + 256)."""
    qk = GGML_QUANT_SIZES[qtype][0]
    for k in (7168, 7168 + qk):
        for n_out in (1, 2, 17, 35):
            rng, raw = setup(qtype, n_out, k, n_out)
            for m in (2, 3, 8, 13):
                x = activations(rng, m, k)
                ft = product(qtype, raw, x, n_out, path=4)
                for path in (0, 1, 2):
                    np.testing.assert_array_equal(product(qtype, raw, x, n_out, path=path), ft)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.MXFP4, T.Q4_K], ids=lambda t: t.name)
def test_rows_alone_and_among_others_on_odd_thread_splits(qtype: T) -> None:
    """Batch invariance where 2 and 3 threads split W's rows into odd counts (161 rows)."""
    n_out, k = 161, 7168
    rng, raw = setup(qtype, n_out, k, 70)
    x = activations(rng, 16, k)
    alone = np.concatenate([product(qtype, raw, x[r:r + 1], n_out) for r in range(16)])
    for m in (2, 5, 8, 16):
        for threads in (1, 2, 3):
            np.testing.assert_array_equal(product(qtype, raw, x[:m], n_out, threads=threads), alone[:m])


def _buffer_before_a_guard_page(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    """nbytes ending exactly where an unreadable page starts: reading one byte past them faults."""
    page = mmap.PAGESIZE
    size = (nbytes + page - 1) // page * page
    mm = mmap.mmap(-1, size + page)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.mprotect(ctypes.c_void_p(addr + size), page, 0) != 0:
        pytest.skip("mprotect unavailable")
    return mm, memoryview(mm)[size - nbytes:size]


@pytest.mark.parametrize("qtype", [T.Q8_0, T.MXFP4], ids=lambda t: t.name)
def test_last_group_reads_stay_inside_the_weights(qtype: T) -> None:
    """The weights placed right before a PROT_NONE page: every path and row count still runs
    (a read past the last group would kill the process) and gives the usual bits."""
    n_out, k = 5, 7168
    rng, raw = setup(qtype, n_out, k, 80)
    mm, view = _buffer_before_a_guard_page(raw.nbytes)
    guarded = np.frombuffer(view, dtype=np.uint8)
    guarded[:] = raw
    for m in (1, 2, 8):
        x = activations(rng, m, k)
        for path in (-1, 0, 1, 2, 4):
            np.testing.assert_array_equal(product(qtype, guarded, x, n_out, path=path),
                                          product(qtype, raw, x, n_out, path=path))
    del guarded, view
    mm.close()

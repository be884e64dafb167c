from fractions import Fraction

import numpy as np
import pytest
import scipy.sparse as sp

from nv.errors import NVError
from nv.phase1.prune import _column_bitmap, greedy_prune


def brute_force(mask):
    """Same greedy rule on a dense mask, rescanning every step with exact fractions."""
    rows, cols = list(range(mask.shape[0])), list(range(mask.shape[1]))
    while rows and cols:
        sub = mask[np.ix_(rows, cols)]
        if sub.all():
            break
        row_frac = [Fraction(int((~sub[i]).sum()), len(cols)) for i in range(len(rows))]
        col_frac = [Fraction(int((~sub[:, j]).sum()), len(rows)) for j in range(len(cols))]
        i, j = max(range(len(rows)), key=lambda k: (row_frac[k], -k)), max(
            range(len(cols)), key=lambda k: (col_frac[k], -k)
        )
        if row_frac[i] >= col_frac[j]:
            del rows[i]
        else:
            del cols[j]
    if not (rows and cols):
        return [], []
    return rows, cols


@pytest.mark.parametrize("seed", range(60))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    shape = tuple(rng.integers(1, 25, size=2))
    density = rng.choice([0.3, 0.6, 0.85, 0.95])
    # skewed column popularity, like token frequencies
    col_p = np.minimum(1.0, density * 2 * rng.random(shape[1]) ** 0.5)
    mask = rng.random(shape) < col_p
    result = greedy_prune(sp.csr_matrix(mask))
    rows, cols = brute_force(mask)
    assert result.rows.tolist() == rows
    assert result.cols.tolist() == cols
    assert mask[np.ix_(result.rows, result.cols)].all()


def test_stored_zero_is_missing_and_ties_drop_the_row():
    m = sp.csr_matrix(np.array([[-0.5, -1.5, -2.0], [-3.0, -1.0, 0.0], [-1.0, -2.0, -4.0]]))
    m.data[m.data == -1.5] = 0.0  # a stored zero counts as missing
    result = greedy_prune(m)
    # fractions tie at 1/3 (row 0 vs column 1): the row goes first, then column 2
    assert (result.rows.tolist(), result.cols.tolist()) == ([1, 2], [0, 1])


def test_already_dense():
    result = greedy_prune(sp.csr_matrix(np.ones((4, 7), dtype=bool)))
    assert result.rows.tolist() == [0, 1, 2, 3]
    assert result.cols.tolist() == list(range(7))


def test_fully_empty():
    result = greedy_prune(sp.csr_matrix((5, 9), dtype=bool))
    assert result.rows.size == 0 and result.cols.size == 0


def test_single_row():
    result = greedy_prune(sp.csr_matrix(np.array([[1, 0, 1, 1, 0]], dtype=bool)))
    assert result.rows.tolist() == [0]
    assert result.cols.tolist() == [0, 2, 3]


def test_rejects_dense_input():
    with pytest.raises(NVError, match="needs a 2-D scipy.sparse observation mask"):
        greedy_prune(np.ones((2, 2)))


def test_column_bitmap_across_blocks():
    mask = np.random.default_rng(3).random((37, 21)) < 0.4
    bits = _column_bitmap(sp.csr_matrix(mask), block=8)
    unpacked = np.unpackbits(bits, axis=1).astype(bool)
    assert (unpacked[:, :37] == mask.T).all()
    assert not unpacked[:, 37:].any()  # the last byte's padding bits: column counts sum every bit

"""Whether the products running now belong to a batched decode step.

A product of few rows runs as GEMVs (one read of the weight), of more rows as matrices; where the matrices run fast
(AMX, or the fp32 panel kernel) the crossover sits at 1-6 rows, which is right for prefill. A batched decode step
keeps every row on the GEMV kernels up to their maximum instead: a GEMV row's sums do not depend on the other rows,
so each sequence of a batch gets the bits it gets alone (the batching issue's exactness). The price: on AMX a batch
of more than ~5 rows may run slower than the matrix kernels would run it.
"""

from __future__ import annotations

import contextlib
import contextvars

_decoding: contextvars.ContextVar[bool] = contextvars.ContextVar("dsflash_decoding", default=False)


@contextlib.contextmanager
def decoding():
    """The products inside run one decode token per row (Runner.decode's batched step; a speculative verify's
    positions and a draft's block)."""
    token = _decoding.set(True)
    try:
        yield
    finally:
        _decoding.reset(token)


def is_decoding() -> bool:
    return _decoding.get()

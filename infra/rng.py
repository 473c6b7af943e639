"""Per-row random streams for the samplers: uniform draws where each row of a batch may have its own
generator, so that a sequence gets the same sample in any batch, process or world size.

`uniform(shape, generator, device, cols=...)` returns only some columns of a draw, yet every row's
generator draws the full row, in a fixed pattern of chunks from column 0, and keeps the columns asked
for. So a sampler that computes the head on a few positions still consumes LLaDA's full-sequence stream
and gives each column its number of the full draw (tests/test_sample.py checks it against one full
draw), and neither depends on `cols`, which the sampler computes over the whole batch. One code path for
every device: a CUDA generator draws and discards as many numbers as a CPU one, in the same chunks.
Leaf module: imports nothing from the project.
"""
import math

import torch

# Elements per draw when a row's stream is walked in chunks: bounds the memory of the discarded numbers
# (128 MB in float64) without changing them (a chunked draw is the one-shot draw's numbers in order).
CHUNK = 1 << 24


def uniform(shape, generator, device, dtype=torch.float64, active=None, cols=None) -> torch.Tensor:
    """U[0, 1) draws of `shape`, made on the generator's device, moved to `device`. generator: one
    torch.Generator, or a list of shape[0], one per row (row i then depends on its own only). active: with
    per-row generators, the rows that draw (the others get 0.5 and leave their stream alone). cols: a slice
    of dim 1, the only columns returned; the generator still draws the others and discards them, in
    chunks of whole columns that start at column 0 whatever `cols` is, so the columns kept and the
    stream's end are those of the full draw."""
    if generator is None:
        raise ValueError("this call samples at random but generator is None; pass e.g. generator="
                         "torch.Generator().manual_seed(0) (a CPU generator gives the same samples on every device)")
    rows = generator if isinstance(generator, (list, tuple)) else None
    if rows is not None and len(rows) != shape[0]:
        raise ValueError(f"got {len(rows)} per-row generators for a batch of {shape[0]} rows")
    if rows is None and cols is None:
        return torch.rand(shape, generator=generator, device=generator.device, dtype=dtype).to(device)
    lo, hi = (0, shape[1]) if cols is None else (cols.start, cols.stop)
    out = torch.empty((shape[0], hi - lo, *shape[2:]), dtype=dtype, device=device)
    step = max(1, CHUNK // max(1, math.prod(shape[2:])))                         # columns per draw
    for i, g in enumerate(rows or [generator] * shape[0]):
        if rows is not None and active is not None and not active[i]:
            out[i] = 0.5
            continue
        for c in range(0, shape[1], step):
            draw = torch.rand((min(step, shape[1] - c), *shape[2:]), generator=g, device=g.device, dtype=dtype)
            a, b = max(lo, c), min(hi, c + step)                                 # the kept columns of this draw
            if a < b:
                out[i, a - lo:b - lo] = draw[a - c:b - c]
    return out

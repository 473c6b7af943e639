"""Every random number of a run: seeds named by what they are for, and the samplers' per-row uniforms.

Seeds. No draw uses the global RNG (LoRA dropout aside, which train.py seeds per update): each is a
blake2b hash of its purpose and global index, e.g. derive_seed(seed, "rollout", task, step, i) for sequence
i's rollout noise, so a sequence gets the same randomness in any batch, process or world size. The mask
seeds S_j of the importance estimator (mask_seed) hash tagged, packed integers instead of a repr
(packed_seed): the same hash over a fixed byte layout of integers only.

Uniforms. `uniform(shape, generator, device, cols=...)` returns only some columns of a draw, yet every row's
generator draws the full row, in a fixed pattern of chunks from column 0, and keeps the columns asked
for. So a sampler that computes the head on a few positions still consumes LLaDA's full-sequence stream
and gives each column its number of the full draw (tests/test_sample.py checks it against one full
draw), and neither depends on `cols`, which the sampler computes over the whole batch. One code path for
every device: a CUDA generator draws and discards as many numbers as a CPU one, in the same chunks.
Leaf module: imports nothing from the project.
"""
import hashlib
import math
import struct

import torch


# -----------------------------------------------------------------------------------------------------
# seeds: a hash of what the draw is for

def _blake64(data: bytes) -> int:
    # blake2b, not hash(): the same in every process and Python version, and neighbours come out unrelated.
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def derive_seed(*parts) -> int:
    """A 63-bit seed from (run seed, purpose, step, ...), e.g. derive_seed(0, "rollout", "text", 3, 7)."""
    return _blake64(repr(parts).encode()) & (2**63 - 1)  # repr: parts may be strings and floats


def generator(device, *parts) -> torch.Generator:
    """A torch.Generator on `device` seeded with derive_seed(*parts)."""
    return torch.Generator(device=device).manual_seed(derive_seed(*parts))


def packed_seed(tag: bytes, *ints: int) -> int:
    """The estimator's seeds: blake2b of a tag and packed non-negative ints < 2**63 (the caller checks), top 63 bits."""
    return _blake64(tag + struct.pack(f"<{len(ints)}q", *ints)) >> 1


# -----------------------------------------------------------------------------------------------------
# uniforms: per-row streams for the samplers


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

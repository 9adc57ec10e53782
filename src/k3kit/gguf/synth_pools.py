"""The random bytes of a synthetic kimi-k3 model: one pool of valid random blocks per type, and
each tensor's lazy source (a window into its pool, or sane values for the F32 tensors whose
meaning needs a range).

Kept apart from the plan so that generating bytes at disk speed (no float generation, no
quantization, no per-tensor Python work) is one concern with one memory bound: two pools per
type, whatever the size of the model.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from k3kit.gguf import synth_blocks
from k3kit.gguf.synth_types import BF16, F16, F32, MXFP4, Q8_0

POOL_BYTES = 16 << 20
F32_POOL_BYTES = 4 << 20


class Pools:
    """One pool of valid random blocks per type; every tensor is a window into it, repeated.

    Each pool (at most POOL_BYTES of random blocks) is kept twice over, so a pool-sized window
    at any block offset is contiguous. A tensor is the pool read from a seed- and name-dependent
    offset and repeated until it is long enough, handed to the writer in pool-sized chunks:
    memory stays at two pools per type whatever the size of the model.
    """

    def __init__(self, seed: int, largest: dict[GGMLQuantizationType, int] | None = None) -> None:
        self.seed = seed
        self._largest = largest or {}
        self._doubled: dict[GGMLQuantizationType, np.ndarray] = {}

    def _pool(self, qtype: GGMLQuantizationType) -> np.ndarray:
        """Random blocks: the cap in bytes, or less for small models (the largest tensor fits)."""
        if qtype not in (Q8_0, MXFP4, F32, F16, BF16) and qtype not in synth_blocks.GENERATORS:
            raise ValueError(f"no random pool for {qtype.name}")
        _, block_bytes = GGML_QUANT_SIZES[qtype]
        cap = F32_POOL_BYTES if qtype == F32 else POOL_BYTES
        size = max(1, -(-min(cap, self._largest.get(qtype, cap)) // block_bytes)) * block_bytes
        rng = np.random.default_rng([self.seed, int(qtype)])
        if qtype == F32:
            return rng.normal(0.0, 0.02, size // 4).astype(np.float32).view(np.uint8)
        if qtype in (F16, BF16):
            return _float16_pool(rng, size // 2, qtype)
        if qtype in synth_blocks.GENERATORS:
            return synth_blocks.random_blocks(qtype, size // block_bytes, rng).reshape(-1)
        # raw generator output is ~5x faster than rng.bytes; any bytes are valid int8 / nibbles
        pool = rng.bit_generator.random_raw(-(-size // 8)).view(np.uint8)[:size].copy()
        if qtype == Q8_0:
            # d ~ 1e-4..2e-4: |w| <= 0.025, std ~ 0.011 ~ 1/sqrt(7168)
            blocks = pool.reshape(-1, 34)
            d = rng.uniform(1e-4, 2e-4, len(blocks)).astype(np.float16)
            blocks[:, :2] = d.view(np.uint8).reshape(-1, 2)
        else:
            # E8M0 118..120: 2^-9..2^-7 times e2m1 values up to 6: |w| <= 0.047, std ~ 0.01
            blocks = pool.reshape(-1, 17)
            blocks[:, 0] = rng.integers(118, 121, len(blocks), dtype=np.uint8)
        return pool

    def doubled(self, qtype: GGMLQuantizationType) -> np.ndarray:
        """The pool of qtype laid out twice (built on first use)."""
        got = self._doubled.get(qtype)
        if got is None:
            pool = self._pool(qtype)
            got = self._doubled[qtype] = np.concatenate([pool, pool])
        return got

    def window(self, qtype: GGMLQuantizationType, name: str, nbytes: int) -> Iterator[np.ndarray]:
        """The tensor's bytes as pool-sized chunks (zero-copy views)."""
        buf = self.doubled(qtype)
        size = len(buf) // 2
        _, block_bytes = GGML_QUANT_SIZES[qtype]
        off = (zlib.crc32(name.encode()) ^ (self.seed * 0x9E3779B1)) % (size // block_bytes) * block_bytes
        for start in range(0, nbytes, size):
            yield buf[off:off + min(size, nbytes - start)]


def _float16_pool(rng: np.random.Generator, n: int, qtype: GGMLQuantizationType) -> np.ndarray:
    """n normal(0, 0.02) weights (the F32 pool's) as F16, or as BF16 rounded to nearest even."""
    x = rng.normal(0.0, 0.02, n).astype(np.float32)
    if qtype == F16:
        return x.astype(np.float16).view(np.uint8)
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).view(np.uint8)


def _small_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _f32_values(name: str, n: int, seed: int) -> np.ndarray | None:
    """Values for F32 tensors whose meaning needs a sane range; None = small random from the pool."""
    if name.endswith(("_norm.weight",)):
        return np.ones(n, dtype=np.float32)
    rng = _small_rng(seed, name)
    if name.endswith(".ssm_a"):
        # the converter stores -exp(A_log); A_log ~ U(0, ln 16) like Mamba/KDA initialisation
        return -np.exp(rng.uniform(0.0, np.log(16.0), n)).astype(np.float32)
    if name.endswith(".ssm_dt.bias"):
        return rng.uniform(-0.5, 0.5, n).astype(np.float32)
    if name.endswith(".exp_probs_b.bias"):
        return rng.normal(0.0, 0.01, n).astype(np.float32)
    if name.endswith("res_score.weight"):
        return rng.normal(0.0, 0.05, n).astype(np.float32)
    return None


def _source(pools: Pools, name: str, qtype: GGMLQuantizationType, nbytes: int, n_elem: int,
            seed: int) -> Callable[[], np.ndarray | Iterator[np.ndarray]]:
    if qtype == F32:
        def make() -> np.ndarray | Iterator[np.ndarray]:
            vals = _f32_values(name, n_elem, seed)
            return vals.view(np.uint8) if vals is not None else pools.window(F32, name, nbytes)
        return make
    return lambda: pools.window(qtype, name, nbytes)

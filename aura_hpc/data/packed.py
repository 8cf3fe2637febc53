"""Reading a prepared directory, and the deterministic global order of training sequences."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from aura_hpc.data.prepare import prepare_hint, read_manifest
from aura_hpc.errors import DataError


class PackedTokens:
    """Memory-mapped train/val token streams cut into sequences of seq_len+1 tokens."""

    def __init__(self, path: str | Path, seq_len: int) -> None:
        self.path = Path(path)
        manifest = read_manifest(self.path)
        if manifest is None:
            raise DataError(f"data.path {str(self.path)!r} is not a prepared directory (no manifest.json) (fix: {prepare_hint(self.path)})")
        self.manifest: dict[str, Any] = manifest
        self.seq_len = seq_len
        dtype = np.dtype(manifest["dtype"])
        self.splits: dict[str, np.ndarray] = {}
        for split in ("train", "val"):
            f = self.path / f"{split}.bin"
            expected = int(manifest[f"{split}_tokens"])
            size = f.stat().st_size if f.exists() else -1
            if size != expected * dtype.itemsize:
                raise DataError(
                    f"{f} holds {max(size, 0) // dtype.itemsize} tokens but the manifest says {expected} (fix: re-run prepare with --force)"
                )
            self.splits[split] = np.memmap(f, dtype=dtype, mode="r") if expected else np.zeros(0, dtype=dtype)

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.manifest["tokenizer"]["eos_id"])

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"

    def num_sequences(self, split: str = "train") -> int:
        return max(0, (len(self.splits[split]) - 1) // self.seq_len)

    def sequences(self, split: str, indices: list[int]) -> np.ndarray:
        """A (len(indices), seq_len+1) int64 array: inputs are [:, :-1], targets [:, 1:]."""
        data, t = self.splits[split], self.seq_len
        return np.stack([np.asarray(data[i * t : i * t + t + 1], dtype=np.int64) for i in indices])


class GlobalOrder:
    """Sample order: a fresh seeded permutation of all sequences per epoch.

    Global sample position p maps to (epoch, offset); the same (seed, p) always gives the same
    sequence, so a resumed run sees exactly the batches it would have seen.
    """

    def __init__(self, n: int, seed: int) -> None:
        if n <= 0:
            raise DataError("the training split has no complete sequence (fix: more data or a smaller data.seq_len)")
        self.n, self.seed = n, seed
        self._cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._cache.get(epoch)
        if perm is None:
            if len(self._cache) > 2:
                self._cache.pop(min(self._cache))
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._cache[epoch] = perm
        return perm

    def indices(self, start: int, count: int) -> list[int]:
        out = []
        for p in range(start, start + count):
            epoch, off = divmod(p, self.n)
            out.append(int(self._perm(epoch)[off]))
        return out


def batch_start(step: int, micro: int, rank: int, world: int, batch: int, accum: int) -> int:
    """First global sample position of (step, micro-step, rank).

    Within a step, slot = micro * world + rank: 2 ranks x accum 1 and 1 rank x accum 2 read the
    same samples, which is what makes DDP and gradient accumulation equivalent.
    """
    per_step = batch * world * accum
    return step * per_step + (micro * world + rank) * batch

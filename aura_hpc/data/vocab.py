"""The vocabulary a run's data has, before any worker starts (memory plans, checks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def tokenizer_vocab(cfg: Any) -> int:
    """The prepared data's vocabulary; for data not prepared yet (the built-in corpus) data.vocab_size, an upper bound."""
    from aura_hpc.data import storage
    from aura_hpc.data.manifest import check_manifest
    from aura_hpc.errors import DataError

    if getattr(cfg.data, "stream", False) and cfg.data.tokenizer:
        from aura_hpc.data.stream import tokenizer_folder
        from aura_hpc.data.tokenizer import STREAM_TOKENIZER_FIX, read_saved

        try:
            return read_saved(tokenizer_folder(cfg.data.tokenizer), STREAM_TOKENIZER_FIX).vocab_size
        except DataError:
            pass
    elif cfg.data.path:
        try:
            if cfg.data.path.startswith("s3://"):
                manifest = (
                    storage.read_manifest(cfg.data.path, storage.Policy(tries=cfg.data.read_tries, timeout_s=cfg.data.read_timeout_s)) or {}
                )
            else:
                where = Path(cfg.data.path) / "manifest.json"
                manifest = check_manifest(json.loads(where.read_text()), str(where))
            return int(manifest["tokenizer"]["vocab_size"])
        except (OSError, ValueError, KeyError, DataError):
            pass
    return cfg.model.vocab_size or cfg.data.vocab_size

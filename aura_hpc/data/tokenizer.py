"""The tokenizer of a prepared directory: a byte-level BPE trained on the input, or an existing one
loaded (a local folder with `tokenizers` alone, a hub name through transformers), saved as a
transformers-loadable folder that both transformers 4.x and 5 read."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aura_hpc.errors import DataError, first_line

EOS_TOKEN = "<|endoftext|>"
# What a prepared directory's tokenizer/ may hold (transformers' tokenizer files): a copied tokenizer
# folder brings only these, so that anything else found there is known not to be prepare's.
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
        "vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json",
        "config.json",
    }
)  # fmt: skip


@dataclass
class _Tok:
    backend: Any  # a tokenizers.Tokenizer: encode_batch runs on Rust threads
    vocab_size: int
    eos_id: int


def train_tokenizer(texts: Iterator[str], vocab_size: int, out: Path) -> _Tok:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    # NFC: text from PDFs, macOS and some scrapes spells "niño" as n + i + n + U+0303 + o (NFD); byte-level BPE
    # cuts at every combining accent, so the two spellings of one Spanish word shared no token (4 tokens vs 17).
    bpe = ByteLevelBPETokenizer(unicode_normalizer="nfc")
    bpe.train_from_iterator(
        texts,
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        show_progress=False,
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, unk_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    tok.save_pretrained(str(out))
    _portable_tokenizer_class(out)
    return _Tok(tok.backend_tokenizer, id_space(tok.backend_tokenizer), int(tok.eos_token_id))


def id_space(backend: Any) -> int:
    """How many token ids a tokenizer can emit: its highest id plus one. Its vocabulary size counts tokens, and a
    vocabulary with gaps (ids 0, 1, 70000: size 3) took uint16 and numpy wrapped 70000 to 4464, unsaid."""
    ids = backend.get_vocab(with_added_tokens=True).values()
    return max(backend.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)


def _portable_tokenizer_class(folder: Path) -> None:
    """transformers 5 names the class `TokenizersBackend`, which 4.x cannot load, and 4.51 strips
    "Fast" (`PreTrainedTokenizer`); the name both releases load the same tokenizer.json with is
    `PreTrainedTokenizerFast`, so a prepared folder is the same whichever release wrote it (data
    prepared with one release must train and sample with the other, e.g. laptop vs cluster image)."""
    path = folder / "tokenizer_config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return
    if cfg.get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizer"):
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _special_token(folder: Path, name: str) -> str | None:
    for f in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            value = json.loads((folder / f).read_text(encoding="utf-8")).get(name)
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            return value
    return None


def load_tokenizer(name_or_path: str, out: Path) -> _Tok:
    folder = Path(name_or_path)
    if (folder / "tokenizer.json").is_file():
        # A local transformers tokenizer folder: load it with `tokenizers` alone (importing
        # transformers' AutoTokenizer costs ~2.7 s here) and copy the folder unchanged.
        backend = _backend(folder / "tokenizer.json", "pass a folder with a complete tokenizer.json, or omit --tokenizer to train one")
        eos = _special_token(folder, "eos_token")
        eos_id = backend.token_to_id(eos) if eos else None
        if eos_id is None:
            raise DataError(f"tokenizer {name_or_path!r} has no eos token (fix: use a tokenizer that defines eos_token)")
        out.mkdir(parents=True)
        for name in sorted(TOKENIZER_FILES):
            if (folder / name).is_file():
                shutil.copyfile(folder / name, out / name)
        return _Tok(backend, id_space(backend), int(eos_id))
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as exc:
        raise DataError(
            f"tokenizer {name_or_path!r} could not be loaded ({str(exc).splitlines()[0]}) "
            "(fix: pass a folder with tokenizer.json, or omit --tokenizer to train one)"
        ) from None
    if not getattr(tok, "is_fast", False):
        raise DataError(f"tokenizer {name_or_path!r} is not a fast tokenizer (fix: use one with a tokenizer.json)")
    if tok.eos_token_id is None:
        raise DataError(f"tokenizer {name_or_path!r} has no eos token (fix: use a tokenizer that defines eos_token)")
    tok.save_pretrained(str(out))
    _portable_tokenizer_class(out)
    return _Tok(tok.backend_tokenizer, id_space(tok.backend_tokenizer), int(tok.eos_token_id))


# The fix for a stream's tokenizer folder, which the user gave (not one this package wrote).
STREAM_TOKENIZER_FIX = "a data.tokenizer folder saved by transformers' save_pretrained, or a prepared directory's tokenizer/"


def read_saved(folder: Path, fix: str = "prepare again with --force") -> _Tok:
    """A tokenizer folder this package wrote (a resumed build's), or a stream's: `tokenizers` alone."""
    backend = _backend(folder / "tokenizer.json", fix)
    eos = _special_token(folder, "eos_token") or EOS_TOKEN
    eos_id = backend.token_to_id(eos)
    if eos_id is None:
        raise DataError(f"tokenizer in {folder} has no eos token (fix: {fix})")
    return _Tok(backend, id_space(backend), int(eos_id))


def _backend(path: Path, fix: str) -> Any:
    """tokenizers' Tokenizer from `path`; a damaged or cut-off file is one line, not the library's traceback."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception (serde's message), OSError for a missing file
        raise DataError(f"{path} could not be read as a tokenizer ({first_line(exc)}) (fix: {fix})") from None

"""What `prepare` and streams read: input files (local or s3://) resolved, paragraphs, JSON/Parquet
records and Hub datasets through `datasets`, and the refusal of what is not text."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aura_hpc.data import storage
from aura_hpc.errors import DataError
from aura_hpc.errors import first_line as _first_line

log = logging.getLogger("aura_hpc")
TEXT_SUFFIXES = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def input_folders(inputs: list[str]) -> list[Path]:
    """The local folders among the inputs (given or matched by a glob), resolved."""
    found = []
    for item in inputs:
        if storage.is_remote(item):
            continue
        matches = [Path(m) for m in sorted(glob.glob(item, recursive=True))] if glob.has_magic(item) else [Path(item)]
        found += [m.resolve() for m in matches if m.is_dir()]
    return found


def _suffix(name: str) -> str:
    return os.path.splitext(name.rsplit("/", 1)[-1])[1].lower()


def resolve_inputs(inputs: list[str], keep_links: bool = False) -> list[Path | str]:
    """Files, folders (recursive), globs and s3:// prefixes to a sorted list of supported files
    (local ones as resolved Paths, objects as s3:// URLs). `keep_links`: local ones as absolute paths that keep their
    symbolic links, in that order (a stream names its files so: a LAN node whose corpus.txt links to quijote_v2.txt on
    another disk holds the same stream as one with the file itself); a file given twice is still listed once."""
    files: list[Path | str] = []
    for item in inputs:
        if storage.is_remote(item):
            storage.check_url(item, "input")
            listed = storage.objects(item.rstrip("/") if not glob.has_magic(item) else item)
            found = [u for u in listed if _suffix(u) in TEXT_SUFFIXES]
            if skipped := [u for u in listed if _suffix(u) not in TEXT_SUFFIXES]:  # said, as for a local folder
                log.warning("prepare skips %d object(s) at %s that are not %s: %s", len(skipped), item, "/".join(TEXT_SUFFIXES), skipped[0])
            if not found:
                raise DataError(f"no .txt/.jsonl/.parquet objects at {item} (fix: check the bucket and prefix)")
            files += found
            continue
        matches = [Path(m) for m in sorted(glob.glob(item, recursive=True))] if glob.has_magic(item) else [Path(item)]
        if not matches or not all(m.exists() for m in matches):
            raise DataError(f"input {item!r} does not exist (fix: pass .txt/.jsonl/.parquet files, a folder or a glob)")
        if glob.has_magic(item) and (ours := [m for m in matches if _in_prepared(m)]):
            # `prepare 'corpus/**/*.json' --out corpus/prepared` run again: the glob took the output's own manifest and
            # tokenizer files for input, and was refused with --out corpus/prepared-prepared, which the glob takes too.
            log.warning("prepare skips %d file(s) matched by %s inside a prepared directory: %s", len(ours), item, ours[0])
            matches = [m for m in matches if m not in ours]
        for m in matches:
            if m.is_fifo() or m.is_char_device() or m.is_socket():  # read more than once (sizes, pieces, the tokenizer's sample)
                raise DataError(
                    f"input {str(m)!r} is a pipe or device, and prepare reads its inputs more than once "
                    f"(fix: write it to a file first, e.g. cat {m} > corpus.txt, then prepare corpus.txt)"
                )
            if m.is_dir():
                _not_a_saved_dataset(m)
                found = [p for p in m.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(m).parts)]
                _not_a_dataset_repository(m, found)
                files += sorted(p for p in found if p.suffix.lower() in TEXT_SUFFIXES)
                other = sorted(p.relative_to(m) for p in found if p.suffix.lower() not in TEXT_SUFFIXES)
                if other:  # said, not skipped in silence: a corpus of extension-less files would otherwise be half read
                    shown = ", ".join(str(p) for p in other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else "")
                    # Renamed to .txt, a .jsonl.gz was read as text: gzip's bytes, refused as not UTF-8 or as NUL bytes.
                    packed = any(p.suffix.lower() in (".gz", ".zst", ".bz2", ".xz", ".zip") for p in other)
                    how = "decompress them (e.g. gunzip), or rename plain-text ones to .txt" if packed else "rename them to .txt"
                    log.warning(
                        "prepare skips %d file(s) in %s that are not %s: %s (%s to include them)",
                        len(other),
                        m,
                        "/".join(TEXT_SUFFIXES),
                        shown,
                        how,
                    )
            elif m.suffix.lower() in TEXT_SUFFIXES:
                files.append(m)
            else:
                raise DataError(f"input {str(m)!r} has an unsupported type {m.suffix!r} (fix: use {', '.join(TEXT_SUFFIXES)})")
    if not files:
        raise DataError(f"no .txt/.jsonl/.parquet files found in {inputs} (fix: point at the files or their folder)")
    if keep_links:
        by_target = {f.resolve(): Path(os.path.abspath(f)) for f in sorted(files, key=str, reverse=True) if isinstance(f, Path)}
        local = sorted(by_target.values())
    else:
        local = sorted({f.resolve() for f in files if isinstance(f, Path)})
    remote = sorted({f for f in files if isinstance(f, str)})
    return [*local, *remote]


def _in_prepared(path: Path) -> bool:
    """Whether `path` lies in a directory prepare wrote (one whose manifest.json is prepare's)."""
    from aura_hpc.data.out_dir import our_manifest

    for folder in path.parents:
        with contextlib.suppress(OSError, ValueError):
            if (folder / "manifest.json").is_file() and our_manifest(json.loads((folder / "manifest.json").read_text(encoding="utf-8"))):
                return True
    return False


def _not_a_saved_dataset(folder: Path) -> None:
    """A folder `datasets` wrote with save_to_disk, given as text: its Arrow files were skipped with advice to rename them
    to .txt, and its metadata JSON refused for a --text-column."""
    if (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file():
        raise DataError(f"input {str(folder)!r} is a dataset saved by datasets' save_to_disk, not text files (fix: --dataset {folder})")
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = [str(s) for s in json.loads((folder / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]]
        except (OSError, ValueError, KeyError, TypeError):
            splits = ["train"]
        raise DataError(
            f"input {str(folder)!r} is a DatasetDict saved by datasets' save_to_disk (splits {', '.join(splits)}), not text files "
            f"(fix: --dataset {folder / (splits or ['train'])[0]}, one split)"
        )


# Keys only a Hub dataset card's YAML header has: a README.md written as text does not start with them.
CARD_KEYS = ("configs", "dataset_info", "task_categories", "size_categories", "pretty_name")


# The Hub's names for a split's files (datasets' push_to_hub: data/train-00000-of-00004.parquet): a repository's.
HUB_SHARD = re.compile(r"(?:^|/)(train|validation|test)-\d{5}-of-\d{5}[^/]*$")
# Words datasets takes for a split in a file or folder name (its SPLIT_KEYWORDS): a cheap look before its own.
SPLIT_WORDS = {"train", "training", "validation", "valid", "dev", "val", "test", "testing", "eval", "evaluation"}


def _not_a_dataset_repository(folder: Path, files: list[Path]) -> None:
    """A dataset repository (a Hub snapshot: `hf download --repo-type dataset ... --local-dir`), given as text: its card
    (README.md) was trained as text, and its test and validation files beside the train ones. A corpus whose own
    file names only say a split (train.txt beside test.txt) is read as given, and that is said."""
    texts = [p.relative_to(folder).as_posix() for p in files if p.suffix.lower() in TEXT_SUFFIXES]
    why = []
    if (folder / "README.md").is_file():
        with contextlib.suppress(Exception):  # a card whose YAML does not parse is no card
            from huggingface_hub.repocard import metadata_load

            if any(key in (metadata_load(folder / "README.md") or {}) for key in CARD_KEYS):
                why.append("its README.md is a dataset card")
    shards = {m.group(1) for t in texts if (m := HUB_SHARD.search(t.lower()))}
    if "train" in shards and len(shards) > 1:
        why.append(f"its files are the Hub's shards of the splits {', '.join(sorted(shards))}")
    if why:
        raise DataError(
            f"input {str(folder)!r} is a dataset repository ({'; '.join(why)}): read as text, all of it would be trained "
            f"(fix: prepare --dataset {folder}, or data.dataset={folder} with data.stream=true: its train split is read; "
            "or pass the training files themselves)"
        )
    words = {w for t in texts for w in re.split(r"[-._ 0-9/]+", t.lower())}
    if not words & {"train", "training"} or not words & (SPLIT_WORDS - {"train", "training"}):
        return  # else datasets' 1 s import for nothing
    splits: list[str] = []
    with contextlib.suppress(Exception):  # no file datasets would read: nothing named as a split
        from datasets.data_files import get_data_patterns

        splits = [str(s) for s in get_data_patterns(str(folder))]  # how load_dataset names its splits, by file and folder names
    if "train" in splits and len(splits) > 1:
        log.warning(
            "%s holds files named for the splits %s: they are all read alike (if some are held out, pass the training files themselves)",
            folder,
            ", ".join(splits),
        )


LONGEST_PARAGRAPH = 1 << 20  # characters: past it, a "paragraph" is a file of one document per line


def split_paragraphs(text: str) -> list[str]:
    """The text's units (each one goes to train or validation whole): paragraphs, or the lines of one too long
    to be one (a file without blank lines was one unit: nothing of it in validation, one encoding call)."""
    parts = [p for p in re.split(r"\r?\n[ \t\r]*\n", text) if p.strip()]  # \r: Windows line ends (CRLF)
    parts = [line for p in parts for line in (p.split("\n") if len(p) > LONGEST_PARAGRAPH else [p]) if line.strip()]
    parts = [piece for p in parts for piece in bounded(p)]
    return [p.strip("\r\n").replace("\r\n", "\n") + "\n\n" for p in parts]  # the same tokens as the LF text


def bounded(line: str) -> list[str]:
    """A line longer than LONGEST_PARAGRAPH in pieces cut before a space (where the byte-level pre-tokenizer
    cuts too): one encoding call took ~175 bytes a character, a 20 MB line 3.5 GB, an 80 MB one a laptop's memory."""
    pieces, at = [], 0
    # An index walked through the line: the rest copied after each cut made a 200M-character line take 18 s.
    while len(line) - at > LONGEST_PARAGRAPH:
        cut = line.rfind(" ", at + LONGEST_PARAGRAPH // 2, at + LONGEST_PARAGRAPH)
        cut = cut if cut > at else at + LONGEST_PARAGRAPH
        pieces.append(line[at:cut])
        at = cut
    return [*pieces, line[at:]] if at else [line]


def open_dataset(
    builder: str, data_files: list[str] | None, name: str | None, subset: str | None, split: str, source: str, revision: str | None = None
) -> Any:
    """A streaming `datasets` dataset (hub name, local dataset folder, or local files of a builder)."""
    import datasets

    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors reach us as exceptions, said in one line
    datasets.disable_progress_bars()
    if name and name.startswith("~"):  # a local folder under the home (load_dataset took `~/c4` for a Hub name)
        name = str(Path(name).expanduser())
    try:
        if data_files is not None:
            return datasets.load_dataset(builder, data_files=data_files, split="train", streaming=True)
        saved = Path(name or "").expanduser()
        if name and (saved / "state.json").is_file():  # Dataset.save_to_disk's folder: load_dataset says "use load_from_disk"
            ds = datasets.load_from_disk(str(saved))
            return ds.to_iterable_dataset(num_shards=max(1, len(ds.cache_files)))
        return datasets.load_dataset(name, subset, split=split, streaming=True, revision=revision or None)
    except FileNotFoundError as exc:
        raise DataError(f"dataset {source!r} not found ({exc}) (fix: check the name/path, or --subset/--split)") from None
    except ValueError as exc:
        if data_files is not None:
            raise _unreadable(source, builder, exc) from None
        raise DataError(f"dataset {source!r} could not be loaded: {_first_line(exc)} (fix: check --subset/--split)") from None
    except ConnectionError as exc:
        raise DataError(f"dataset {source!r} needs the network ({exc}) (fix: download it first, or use local files)") from None


def dataset_folder_files(name: str) -> list[Path]:
    """A local dataset folder's files (its hidden ones, such as .git, left out); none for a Hub name.
    What a key over them sees change: a Hub name's revision is not followed, a folder's edits are."""
    folder = Path(name).expanduser()
    if not folder.is_dir():
        return []
    return [f for f in sorted(folder.rglob("*")) if f.is_file() and not any(part.startswith(".") for part in f.relative_to(folder).parts)]


def dataset_shards(name: str, subset: str | None, split: str, revision: str | None = None) -> int:
    """How many shards (data files) a dataset streams from: its pieces."""
    return max(1, int(getattr(open_dataset("", None, name, subset, split, name, revision), "n_shards", 1) or 1))


def records(
    builder: str,
    data_files: list[str] | None,
    name: str | None,
    subset: str | None,
    split: str,
    column: str,
    source: str,
    shard: tuple[int, int] | None = None,
    revision: str | None = None,
) -> Iterator[str]:
    """Stream the text column of a dataset through `datasets`; `shard` = (index, of how many)."""
    ds = open_dataset(builder, data_files, name, subset, split, source, revision)
    if shard is not None and shard[1] > 1:
        ds = ds.shard(num_shards=shard[1], index=shard[0])
    first = True
    for row in _rows(ds, builder, data_files is not None, source):
        if first and column not in row:
            raise DataError(f"column {column!r} not in {source!r}; its columns are {', '.join(map(str, row))} (fix: --text-column NAME)")
        text = row[column]
        if first:
            check_column(source, column, text)
            first = False
        if isinstance(text, str) and (text := row_text(text)).strip():
            yield text


def _rows(ds: Any, builder: str, local: bool, source: str) -> Iterator[Any]:
    """`ds`'s rows; what goes wrong while reading them (a file that is not what its name says, a stream cut
    off) is one line naming the input, not pyarrow's or the codec's traceback without a file name."""
    from datasets.exceptions import DatasetGenerationError

    rows = iter(ds)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except (ValueError, OSError, DatasetGenerationError) as exc:  # UnicodeDecodeError and pyarrow's ArrowInvalid too
            if local:
                raise _unreadable(source, builder, exc) from None
            raise DataError(
                f"dataset {source!r} stopped while being read: {_first_line(exc)} (fix: check the network and re-run "
                "prepare; or save the dataset locally and pass its files)"
            ) from None
        yield row


_FORMS = {
    "json": "UTF-8 JSON: one object per line, or one array of objects",
    "parquet": "a Parquet file (write it again with pandas or pyarrow)",
    "csv": "UTF-8 CSV with a header row",
}


def _unreadable(source: str, builder: str, exc: BaseException) -> DataError:
    cause = exc.__cause__ or exc.__context__ if type(exc).__name__ == "DatasetGenerationError" else exc
    if isinstance(cause, OSError):  # the disk or the permissions, not the format (EIO on NFS, EACCES)
        return DataError(f"{source!r} could not be read: {_first_line(cause)} (fix: check the file, its permissions and its disk)")
    return DataError(
        f"{source!r} could not be read as {builder}: {_first_line(cause or exc)} (fix: make it {_FORMS.get(builder, f'valid {builder}')})"
    )


def check_column(source: Path | str, column: str, value: object) -> None:
    """The first row's text column holds text (or nothing): a list or a number in it was skipped row by
    row, and the whole input read (twice, downloads included) before "no text" was said."""
    if value is not None and not isinstance(value, str):
        raise DataError(
            f"column {column!r} of {str(source)!r} holds {type(value).__name__}, not text "
            "(fix: --text-column NAME of the column that holds the text, or data.text_column when streaming)"
        )


def row_text(text: str) -> str:
    """One row's text of a dataset (Parquet, JSON lines, the Hub) without its NUL characters. A row is not a file: one
    stray NUL among millions of rows (scraped text, a JSON escape \u0000) stopped `prepare`, and every retry of a
    stream at the same window, with a fix no one can apply to a Hub dataset. Removed, as the tokenizer would have
    to; a whole file that holds NULs is still refused as binary (check_text). A lone surrogate (a JSON escape of half
    an emoji, `\ud83d`, cut in scraped text) is no UTF-8: the tokenizer raised on it, mid-prepare, and a stream stopped
    at that window on every retry. It becomes U+FFFD, as a decoder replaces a bad byte."""
    if "\0" in text:
        text = text.replace("\0", "")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = _SURROGATE.sub("\ufffd", text)
    return text


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(source: Path | str, text: str) -> None:
    """Refuse what is not text before the tokenizer trainer sees it: NUL bytes (a binary file, or a
    disk image) make one giant pre-token, and byte-level BPE training then runs for hours."""
    at = text.find("\0")
    if at >= 0:
        raise DataError(
            f"{source} holds NUL bytes (first at character {at}): it is binary, not text (fix: remove it from the inputs, "
            "or strip the NULs with tr -d '\\000')"
        )

"""Getting a run directory ready before any worker starts: data, checks, config.yaml."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import yaml

from aura_hpc.config import RunConfig, embedding_rows, load_run_file
from aura_hpc.config.deepspeed import check_kept_copy, kept_in_run_dir
from aura_hpc.errors import ConfigError, DataError, LaunchError, shown
from aura_hpc.launch.run_lock import RunLock, check_free


def builtin_data_dir(cfg: RunConfig) -> Path:
    from aura_hpc.data.corpus import CORPUS_VERSION

    return Path(cfg.output_dir) / "prepared" / f"{CORPUS_VERSION}-bpe{cfg.data.vocab_size}"


def _newest_complete_checkpoint(run_dir: Path) -> Path | None:
    steps = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "COMPLETE.json").is_file())
    return steps[-1] if steps else None


def _file_digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _trained_with(ckpt: Path) -> str | None:
    """The checksum of the tokenizer a checkpoint was written with: as its commit marker recorded it (a damaged
    copy of the file, which the workers set aside for the previous checkpoint, read as "another tokenizer" and
    refused the run), else the file's own."""
    try:
        recorded = json.loads((ckpt / "COMPLETE.json").read_text(encoding="utf-8"))["files"]["tokenizer/tokenizer.json"]["sha256"]
        if isinstance(recorded, str) and len(recorded) == 64:
            return recorded
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return _file_digest(ckpt / "tokenizer" / "tokenizer.json")


def _stream_tokenizer_of(ckpt: Path) -> str:
    """The data.tokenizer the checkpoint's run encoded with, where it is still there; else a copy of the checkpoint's
    own to make (a checkpoint's folder is pruned as the run goes on)."""
    try:
        then = str(yaml.safe_load((ckpt / "config.yaml").read_text(encoding="utf-8"))["data"]["tokenizer"])
        folder = Path(then).expanduser()
        if then and any((f / "tokenizer.json").is_file() for f in (folder, folder / "tokenizer")):
            return f"{then}, the one it was trained with"
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        pass
    return f"a copy of {ckpt / 'tokenizer'} made outside checkpoints/ (cp -r {ckpt / 'tokenizer'} DIR)"


def _check_same_tokenizer(cfg: RunConfig) -> None:
    """Resuming on data prepared with another tokenizer would load embeddings of another vocabulary."""
    ckpt = _newest_complete_checkpoint(cfg.run_dir)
    if ckpt is None or not (cfg.data.tokenizer if cfg.data.stream else cfg.data.path):
        return
    theirs = _trained_with(ckpt)
    if cfg.data.stream:  # encoded with data.tokenizer: another one of the same size loaded the embeddings as they were
        from aura_hpc.data.stream import tokenizer_folder

        ours = _file_digest(tokenizer_folder(cfg.data.tokenizer) / "tokenizer.json")
        if theirs is not None and ours is not None and theirs != ours:
            raise DataError(
                f"data.tokenizer {cfg.data.tokenizer} is another tokenizer than the one run {cfg.run_dir} was trained with "
                f"(checkpoint {ckpt.name}) (fix: --set data.tokenizer={_stream_tokenizer_of(ckpt)}, or start a new --run-name)"
            )
        return
    if cfg.data.path.startswith("s3://"):  # the manifest holds the hash of its tokenizer.json
        from aura_hpc.data.cache import for_data
        from aura_hpc.data.packed import PackedTokens

        ours = PackedTokens(cfg.data.path, cfg.data.seq_len, cache=for_data(cfg.data)).manifest["tokenizer"].get("sha256")
    else:
        ours = _file_digest(Path(cfg.data.path) / "tokenizer" / "tokenizer.json")
    if theirs is not None and ours is not None and theirs != ours:
        raise DataError(
            f"data.path {cfg.data.path} was prepared with another tokenizer than the one run {cfg.run_dir} was trained with "
            f"(checkpoint {ckpt.name}) (fix: resume with the data the run was trained on, or start a new --run-name)"
        )


def _check_zero_world_size(cfg: RunConfig, world_size: int) -> None:
    """ZeRO partitions resume only at the world size that wrote them: refused here, once, before any worker."""
    ckpt = _newest_complete_checkpoint(cfg.run_dir)
    if ckpt is None or not cfg.dist.strategy.startswith("zero"):
        return
    try:
        meta = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # the workers verify the checkpoint and say what is wrong with it
    written_on = meta.get("world_size")
    if str(meta.get("strategy", "")).startswith("zero") and isinstance(written_on, int) and written_on != world_size:
        raise ConfigError(
            f"checkpoint {ckpt.name} holds DeepSpeed ZeRO partitions for {written_on} ranks and this run has {world_size}: "
            f"ZeRO checkpoints resume at the world size they were written at (fix: resume on {written_on} processes, or convert "
            "it with DeepSpeed's ds_to_universal; fsdp checkpoints reshard to any world size)"
        )


SHARDED = {"fsdp", "zero1", "zero2", "zero3"}  # each writes its own kind of shards


def _check_resume_compatible(cfg: RunConfig, world_size: int, exact_world: bool = True) -> None:
    _check_same_tokenizer(cfg)
    if exact_world:  # LAN nodes may run other process counts than this one: the workers judge the world they make
        _check_zero_world_size(cfg, world_size)
    old = cfg.run_dir / "config.yaml"
    if not old.exists() or not (cfg.run_dir / "checkpoints").is_dir():
        return
    try:
        previous = load_run_file(old)
    except ConfigError:
        return  # an unreadable old config: the checkpoint's own fingerprint is checked at resume
    if previous.model_fingerprint() != cfg.model_fingerprint():
        raise ConfigError(
            f"run directory {cfg.run_dir} holds checkpoints of a different model shape or data.seq_len "
            "(fix: use a new --run-name, or resume with the original config)"
        )
    was, now = previous.dist.strategy, cfg.dist.strategy
    if was != now and SHARDED & {was, now}:
        raise ConfigError(
            f"run directory {cfg.run_dir} holds checkpoints written under dist.strategy={was}; {now} lays the weights and "
            f"the optimizer's state out differently (fix: resume with --set dist.strategy={was}, or use a new --run-name)"
        )
    for setting, was_value, now_value in (
        ("train.seed", previous.train.seed, cfg.train.seed),
        ("data.shuffle_window", previous.data.shuffle_window, cfg.data.shuffle_window),
    ):
        if was_value != now_value:  # samples_seen counts along one order: another would train some sequences twice
            raise ConfigError(
                f"run directory {cfg.run_dir} holds checkpoints trained in the sample order of {setting}={was_value}; with "
                f"{now_value} the rest of the epoch would train some sequences twice and others never (fix: resume with "
                f"--set {setting}={was_value}, or use a new --run-name)"
            )
    if previous.train.optimizer != cfg.train.optimizer:
        raise ConfigError(
            f"run directory {cfg.run_dir} holds checkpoints of train.optimizer={previous.train.optimizer}, whose state "
            f"{cfg.train.optimizer} cannot take (fix: resume with --set train.optimizer={previous.train.optimizer}, or a new --run-name)"
        )


def preflight_stream(cfg: RunConfig) -> None:
    """A stream's source and tokenizer, checked before any worker starts (its size is not known)."""
    from aura_hpc.data.stream import plan_pieces, tokenizer_folder
    from aura_hpc.data.tokenizer import STREAM_TOKENIZER_FIX, read_saved

    folder = tokenizer_folder(cfg.data.tokenizer)
    vocab = read_saved(folder, STREAM_TOKENIZER_FIX).vocab_size
    if cfg.model.vocab_size and cfg.model.vocab_size != vocab:
        raise ConfigError(
            f"model.vocab_size {cfg.model.vocab_size} does not match data.tokenizer ({vocab}) (fix: --set model.vocab_size=0)"
        )
    embedding_rows(cfg.model, vocab)
    pieces = plan_pieces(cfg.data)  # lists the source: a missing prefix or refused credentials show here
    from aura_hpc import console

    console.info(f"streaming {cfg.data.dataset or cfg.data.path}: {len(pieces)} piece(s), tokenized as training reaches them")
    check_sample_prompt(cfg, folder)


def preflight_data(cfg: RunConfig, world_size: int) -> None:
    """Data checks that need no GPU: refuse before any worker starts."""
    if cfg.data.stream:
        preflight_stream(cfg)
        return
    from aura_hpc.data import storage
    from aura_hpc.data.cache import for_data
    from aura_hpc.data.packed import PackedTokens
    from aura_hpc.data.prepare import prepare_hint

    remote = storage.is_remote(cfg.data.path)
    path = Path(cfg.data.path)
    if not remote and path.is_file():
        out = path.with_name(f"{path.stem}-prepared")
        raise DataError(
            f"data.path {path} is a file; the trainer reads a prepared directory (tokenizer + packed tokens) "
            f"(fix: python -m aura_hpc prepare {path} --out {out}, then --set data.path={out})"
        )
    if not remote and not path.exists():
        raise DataError(f"data.path {path} does not exist (fix: {prepare_hint(path)}, or correct the path)")
    if not remote and not (path / "manifest.json").is_file():
        raise DataError(f"data.path {path} is not a prepared directory (no manifest.json) (fix: {prepare_hint(path)})")
    cache = for_data(cfg.data)
    data = PackedTokens(cfg.data.path, cfg.data.seq_len, cache=cache)  # local token files present and as long as the manifest says
    vocab = data.vocab_size
    if cfg.model.vocab_size and cfg.model.vocab_size != vocab:
        raise ConfigError(
            f"model.vocab_size {cfg.model.vocab_size} does not match the data's tokenizer ({vocab}) "
            "(fix: --set model.vocab_size=0 to take it from the data)"
        )
    embedding_rows(cfg.model, vocab)
    if remote:
        check_remote_shards(data, cfg)
    check_sample_prompt(cfg, data.tokenizer_dir)
    from aura_hpc.config.checks import too_few_sequences

    refusal = too_few_sequences(cfg, data.num_sequences("train"), world_size)
    if refusal:
        raise DataError(refusal)


def check_remote_shards(data: Any, cfg: RunConfig) -> None:
    """Every shard the manifest lists is in the bucket at its size (one listing, no download), and
    what a node must hold at once fits its cache."""
    from aura_hpc.data import storage

    found = storage.listing(storage.join(data.location, "shards"), data.cache.policy)
    width = data.dtype.itemsize
    for split in ("train", "val"):
        for shard in data.shards[split]:
            url = data.url(shard)
            if url not in found:
                raise DataError(
                    f"{url} is missing: the manifest lists it (fix: upload the prepared directory again, or prepare it again with --force)"
                )
            if found[url] != shard.tokens * width:
                raise DataError(
                    f"{url} is {found[url]} bytes, the manifest says {shard.tokens * width} "
                    "(fix: upload it again, or prepare again with --force)"
                )
    train = sorted((s.tokens * width for s in data.shards["train"]), reverse=True)
    window = cfg.data.shuffle_window if 0 < cfg.data.shuffle_window < len(train) else len(train)
    need = sum(train[: 2 * window]) + sum(s.tokens * width for s in data.shards["val"])
    if need > data.cache.max_bytes:
        shards_fit = max(1, int(data.cache.max_bytes / 2 / max(train[0], 1)) - 1)
        raise DataError(
            f"each node must hold {need / 2**30:.2f} GB of shards at once "
            f"({'all of them' if window == len(train) else f'2 windows of {window}'}) "
            f"and data.cache_gb is {cfg.data.cache_gb:g} (fix: --set data.cache_gb={need / 2**30 * 1.1:.1f}, or "
            f"for a new run --set data.shuffle_window={shards_fit} to shuffle fewer shards together: a run resumes in its own order)"
        )


def prompt_tokens(tokenizer_dir: Path, prompt: str) -> int:
    """How many tokens `prompt` is with the prepared tokenizer (the `tokenizers` library alone: fast to import)."""
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(prompt, add_special_tokens=False).ids)


def check_sample_prompt(cfg: RunConfig, tokenizer_dir: Path | None, estimate: bool = False) -> None:
    """The samples fit the model's context: refused before training, not after it (a crash at the
    final sample used to leave no summary, and every re-run then said 'nothing to do'). Without the
    tokenizer (a dry run before the data is prepared) and with `estimate`, from the prompt's bytes."""
    from aura_hpc.data.plan import BYTES_PER_TOKEN

    t, room = cfg.train, cfg.model.n_positions
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file():
        n, about = prompt_tokens(tokenizer_dir, t.sample_prompt), ""
    elif estimate:
        n, about = int(len(t.sample_prompt.encode()) / BYTES_PER_TOKEN), "~"
    else:
        return
    if n == 0 and not about:  # measured, not estimated from its bytes
        raise ConfigError(f"train.sample_prompt {shown(t.sample_prompt)} is no token of this tokenizer (fix: a prompt of words)")
    if n + t.sample_tokens > room:
        fix = f"--set train.sample_tokens={room - n}" if n < room else "a shorter train.sample_prompt"
        raise ConfigError(
            f"train.sample_prompt is {about}{n} tokens and train.sample_tokens {t.sample_tokens}: more than model.n_positions "
            f"({room}) (fix: {fix})"
        )


def check_writable(out: Path) -> None:
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise LaunchError(f"output_dir {out} cannot be created: {existing} is a file, not a directory (fix: --output-dir a folder path)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise LaunchError(f"output_dir {out} is not writable ({exc.strerror}) (fix: --output-dir a writable folder)") from None


RUN_DIR_MODE = 0o750


def _refuse_a_folder_not_ours(config_path: Path) -> None:
    """An existing folder whose config file aura_hpc did not write (`--output-dir ~ --run-name myproject` named a
    project of the user's own): its config.yaml was replaced without a word. Ours holds run_name, output_dir and
    the model, data and train sections (an older version's may hold sections this one no longer has)."""
    try:
        text = config_path.read_text(encoding="utf-8", errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        raise LaunchError(f"{config_path} cannot be read ({exc.strerror}) (fix: another --run-name or --output-dir)") from None
    try:
        data = yaml.safe_load(text[:1_000_000])
    except yaml.YAMLError:
        data = None
    if not (isinstance(data, dict) and {"run_name", "output_dir", "model", "data", "train"} <= set(data)):
        raise LaunchError(
            f"{config_path} was not written by aura_hpc, and a run there would replace it (fix: another --run-name or "
            "--output-dir; if it is this run's own, damaged, restore it or remove it)"
        )


def make_run_dir(path: Path) -> None:
    """A new run directory is readable by its owner and group only: on a shared cluster filesystem the
    weights, configs and logs are not every user's (an existing one keeps the mode its owner chose)."""
    if path.is_dir():
        return
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, RUN_DIR_MODE)


def export_webhook_secret(cfg: RunConfig) -> None:
    """A literal health.webhook_url is stored redacted; the workers (local children, or the Slurm job,
    which inherits the submitting environment) read it from this variable instead."""
    from aura_hpc.config.tree import WEBHOOK_SECRET_ENV, is_literal_url

    if is_literal_url(cfg.health.webhook_url) and not cfg.health.webhook_url_env:
        os.environ[WEBHOOK_SECRET_ENV] = cfg.health.webhook_url
    h = cfg.health
    named = h.webhook_url_env or (h.webhook_url[4:] if h.webhook_url.startswith("env:") and not h.webhook_url_file else "")
    if named and not os.environ.get(named, "").strip():  # every alert of the run was dropped in silence
        raise ConfigError(
            f"the webhook's URL is to come from the environment variable {named}, which is not set here: no GPU fault or hang "
            f"would be reported (fix: export {named}=https://... in this shell before starting, or leave the webhook out)"
        )
    if cfg.health.webhook_url_file and not os.access(cfg.health.webhook_url_file, os.R_OK):
        raise ConfigError(
            f"health.webhook_url_file {cfg.health.webhook_url_file} cannot be read (fix: a readable file holding the URL, "
            "on storage the compute nodes share)"
        )


def ensure_data(cfg: RunConfig, world_size: int) -> None:
    """The built-in corpus prepared when no data.path is given, then the data checks."""
    if not cfg.data.path and not cfg.data.stream:
        from aura_hpc.data.prepare import PrepareSpec, prepare
        from aura_hpc.data.storage import DamagedManifest

        target = builtin_data_dir(cfg)
        spec = PrepareSpec(out_dir=target, builtin=True, vocab_size=cfg.data.vocab_size, val_fraction=0.05)
        try:
            manifest = prepare(spec)
        except DamagedManifest:  # the package's own corpus, which no `prepare` command of the user's writes: made again
            spec.force = True
            manifest = prepare(spec)
        if not manifest.get("up_to_date"):
            logging.getLogger("aura_hpc").info("prepared the built-in Spanish corpus in %s", target)
        cfg.data.path = str(target)
    preflight_data(cfg, world_size)


def prepare_run_dir(
    cfg: RunConfig,
    world_size: int,
    lock: bool = False,
    check_lock: bool = True,
    config_name: str = "config.yaml",
    secret: bool = True,
    exact_world: bool = True,
) -> RunLock | None:
    """Side effects before launch: the built-in data if needed, the run directory, config.yaml.

    Shared by `local` and `submit`, so both refuse the same bad data before any worker starts.
    Nothing in an existing run directory changes until the new run is known to be valid and no
    other trainer holds it; with `lock`, the run lock is taken (and returned) before config.yaml
    is written. LAN nodes other than node 0 pass check_lock=False: node 0 holds the lock.
    """
    check_writable(Path(cfg.output_dir))
    if check_lock:
        check_free(cfg.run_dir)
    _refuse_a_folder_not_ours(cfg.run_dir / config_name)
    check_kept_copy(cfg, config_name)
    ensure_data(cfg, world_size)
    _check_resume_compatible(cfg, world_size, exact_world)
    export_webhook_secret(cfg)
    held: RunLock | None = None
    tmp = cfg.run_dir / f".{config_name}.tmp-{os.getpid()}"
    try:
        make_run_dir(cfg.run_dir)
        held = RunLock(cfg.run_dir).acquire() if lock else None
        if held is not None:
            _remove_partial_checkpoints(cfg.run_dir / "checkpoints")
        if secret:
            ensure_run_secret(cfg.run_dir)
        tmp.write_text(kept_in_run_dir(cfg, config_name).to_yaml(), encoding="utf-8")
        tmp.replace(cfg.run_dir / config_name)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)  # a run that did not start leaves no part, nor a lock another host waits out
        if held is not None:
            held.release()
        if not isinstance(exc, OSError) or exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise LaunchError(
            f"no space left on the disk of {cfg.run_dir} ({exc.strerror}) before training started "
            "(fix: free space there, lower train.keep_last, or use an output_dir on a larger disk)"
        ) from None
    return held


def ensure_run_secret(run_dir: Path) -> str:
    """The run's secret, which every rank proves before the first collective (comm/stores.py): kept in
    RUN_DIR/run.secret (mode 600), made once, so a resumed run or a requeued job keeps it; one the user
    chose (AURA_RUN_SECRET) replaces it."""
    from aura_hpc.comm.stores import SECRET_ENV, SECRET_FILE, new_secret, strong_enough

    path = run_dir / SECRET_FILE
    chosen = os.environ.get(SECRET_ENV, "").strip()
    if chosen:
        strong_enough(chosen)
    try:
        existing = path.read_text(encoding="utf-8").strip()
    except OSError:
        existing = ""
    if existing and (not chosen or chosen == existing):
        return existing
    value = chosen or new_secret()
    tmp = run_dir / f".{SECRET_FILE}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(value + "\n")
    tmp.replace(path)
    return value


def _remove_partial_checkpoints(root: Path) -> None:
    """Checkpoint folders a crash left half-written (the trainer writes `.tmp-step_*` and renames it
    when complete) or half-deleted (`.del-step_*`, a pruned one): removed first, so a disk they filled has
    room again. Only the lock holder is here.
    A committed one an interrupted re-save set aside is put back first: it was removed with them."""
    from aura_hpc.train.checkpoint.files import remove_partial

    if root.is_dir():
        remove_partial(root)

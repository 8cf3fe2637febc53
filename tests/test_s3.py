"""Data in S3-compatible object storage, against a real server process reached over HTTP (moto's
server mode, request signatures checked), through the same s3fs client users run: prepare from and
to a bucket, train 2 ranks from its shards through injected faults, a missing shard, refused
credentials, and storage that stops answering mid-run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from aura_hpc.data.corpus import generate
from aura_hpc.data.order import GlobalOrder
from aura_hpc.data.prepare import PrepareSpec, prepare
from tests.conftest import SMALL_MODEL, final_weights, run_cli

pytestmark = pytest.mark.slow

PREP = ["--vocab-size", "512", "--shard-mb", "0.04"]


def _texts() -> dict[str, str]:
    text = generate(1500, seed=11)
    cut = text.index("\n\n", len(text) // 2) + 2
    return {"a.txt": text[:cut], "b.txt": text[cut:]}


@pytest.fixture(scope="module")
def bucket_data(s3: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Raw text uploaded to s3://raw/es/, prepared by the CLI into s3://prep/es (2 workers)."""
    fs = s3.fs()
    for name, text in _texts().items():
        fs.pipe(f"raw/es/{name}", text.encode())
    r = run_cli(["prepare", "s3://raw/es", "--out", "s3://prep/es", *PREP, "--workers", "2"], timeout=300, **s3.env())
    assert r.returncode == 0, r.stdout + r.stderr
    manifest = json.loads(fs.cat("prep/es/manifest.json"))
    return {"manifest": manifest, "tmp": tmp_path_factory.mktemp("s3data")}


def _train_args(out: Path, name: str, cache: Path, extra: list[str], nproc: int = 2) -> list[str]:
    return [
        "local", "--nproc-per-node", str(nproc), "--output-dir", str(out), "--run-name", name,
        "--set", "data.path=s3://prep/es", "--set", f"data.cache_dir={cache}", "--set", "data.shuffle_window=2",
        "--set", "train.max_steps=14", "--set", "train.warmup_steps=2", "--set", "train.batch_size=4",
        *SMALL_MODEL, *extra,
    ]  # fmt: skip


def _no_secret_anywhere(s3: Any, run_dir: Path, *outputs: str) -> None:
    for text in outputs:
        assert s3.secret not in text and s3.key not in text
    for f in run_dir.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            assert s3.secret.encode() not in data and s3.key.encode() not in data, f"a credential is in {f}"


def test_prepare_from_a_bucket_gives_the_tokens_of_a_local_prepare(bucket_data: dict[str, Any], tmp_path: Path, s3: Any) -> None:
    local_in = tmp_path / "es"
    local_in.mkdir()
    for name, text in _texts().items():
        (local_in / name).write_text(text, encoding="utf-8")
    local = prepare(PrepareSpec(out_dir=tmp_path / "p", inputs=[str(local_in)], vocab_size=512, shard_mb=0.04))
    remote = bucket_data["manifest"]
    assert len(remote["shards"]) >= 6 and remote["pieces"] >= 3
    assert remote["data_sha256"] == local["data_sha256"] and remote["tokenizer"]["sha256"] == local["tokenizer"]["sha256"]
    # Nothing but the prepared directory under the prefix; a re-run is a no-op.
    names = sorted(p.split("/", 2)[2] for p in s3.fs().find("prep/es"))
    assert names == sorted(
        ["manifest.json", *(s["file"] for s in remote["shards"]), "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"]
    )
    again = run_cli(["prepare", "s3://raw/es", "--out", "s3://prep/es", *PREP], timeout=120, **s3.env())
    assert again.returncode == 0 and "already prepared" in again.stdout


def test_two_ranks_train_from_bucket_shards_through_failing_reads(bucket_data: dict[str, Any], tmp_path: Path, s3: Any) -> None:
    """The first two GETs of every training shard fail with 503 SlowDown: each is retried, downloaded
    once for the node (the two ranks share the cache), and the run ends normally."""
    endpoint, log = s3.proxy(tmp_path, fail=r"^/prep/es/shards/train-", times=2)
    cache = tmp_path / "cache"
    r = run_cli(_train_args(tmp_path, "s3run", cache, ["--set", "data.read_tries=4"]), timeout=300, **s3.env(endpoint=endpoint))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    gets: dict[str, list[str]] = {}
    for line in log.read_text().splitlines():
        method, path, status = line.split()
        if method == "GET" and path.startswith("/prep/es/shards/train-"):
            gets.setdefault(path, []).append(status)
    assert gets, "no training shard was read through the proxy"
    for path, statuses in gets.items():
        assert statuses == ["injected-503", "injected-503", "200"], (path, statuses)
    logs = (tmp_path / "s3run" / "logs" / "rank_0.log").read_text() + (tmp_path / "s3run" / "logs" / "rank_1.log").read_text()
    assert "503 SlowDown), try 1 of 4; retrying" in logs
    _no_secret_anywhere(s3, tmp_path / "s3run", r.stdout, r.stderr)
    # A warm cache: a second run reads no shard from the bucket.
    endpoint2, log2 = s3.proxy(tmp_path)
    r2 = run_cli(_train_args(tmp_path, "s3warm", cache, []), timeout=300, **s3.env(endpoint=endpoint2))
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    assert not [ln for ln in log2.read_text().splitlines() if ln.startswith("GET /prep/es/shards/")]
    a, b = final_weights(tmp_path / "s3run"), final_weights(tmp_path / "s3warm")
    assert all(torch.equal(a[k], b[k]) for k in a), "the same data read twice trained differently"


def test_a_missing_shard_is_refused_before_training(bucket_data: dict[str, Any], tmp_path: Path, s3: Any) -> None:
    fs = s3.fs()
    fs.copy("prep/es", "prep/holed", recursive=True)
    victim = bucket_data["manifest"]["shards"][2]["file"]
    fs.rm(f"prep/holed/{victim}")
    args = _train_args(tmp_path, "holed", tmp_path / "cache", ["--set", "data.path=s3://prep/holed"])
    r = run_cli(args, timeout=120, **s3.env())
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stdout[-2000:] + r.stderr
    assert f"s3://prep/holed/{victim} is missing" in lines[0] and "(fix: " in lines[0]
    assert not (tmp_path / "holed" / "logs").exists(), "no worker started"


@pytest.mark.parametrize("command", ["local", "prepare"])
def test_wrong_credentials_get_one_line_and_no_secret(bucket_data: dict[str, Any], tmp_path: Path, s3: Any, command: str) -> None:
    wrong = "WRONGsecretWRONGsecretWRONGsecret0123456"
    if command == "local":
        args = _train_args(tmp_path, "denied", tmp_path / "cache", [])
    else:
        args = ["prepare", "s3://raw/es", "--out", "s3://prep/denied", *PREP]
    r = run_cli(args, timeout=120, **s3.env(secret=wrong))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stdout[-2000:] + r.stderr
    assert "was refused (403" in lines[0] and "AWS_ACCESS_KEY_ID" in lines[0] and "Traceback" not in r.stderr
    for text in (r.stdout, r.stderr):
        assert wrong not in text and s3.secret not in text and s3.key not in text


def test_storage_that_stops_answering_mid_run_stops_every_rank_with_a_checkpoint(
    bucket_data: dict[str, Any], tmp_path: Path, s3: Any
) -> None:
    """The shards of the second shuffle window cannot be read: every rank stops together at the
    window's edge with a checkpoint (exit 74); the re-run, on one process instead of two (and an
    accumulation of 2), resumes where the global order stopped and ends like a run that was never
    interrupted: the same sample at every position, the same weights."""
    manifest = bucket_data["manifest"]
    counts = [max(0, (s["tokens"] - 1) // 64) for s in manifest["shards"] if s["split"] == "train"]
    order = GlobalOrder(counts, seed=1234, window=2)
    first, second = order.window_shards(0, 0), order.window_shards(0, 1)
    lost = [s for s in second if s not in first]
    train_files = [s["file"] for s in manifest["shards"] if s["split"] == "train"]
    pattern = "|".join(f"/prep/es/{train_files[i]}$" for i in lost)
    steps_in_first = sum(counts[i] for i in first) // 8  # 2 ranks x 4 sequences per step; the next one reads window 2
    endpoint, _ = s3.proxy(tmp_path, fail=pattern, times=1000)
    extra = ["--set", "data.read_tries=2", "--set", "data.read_timeout_s=5", "--set", "train.checkpoint_every=0"]
    extra += ["--set", f"train.max_steps={steps_in_first + 4}"]
    probe = {"AURA_PROBE_SAMPLES": str(tmp_path / "samples-cut")}
    cut = run_cli(_train_args(tmp_path, "cut", tmp_path / "cache-cut", extra), timeout=300, **s3.env(endpoint=endpoint), **probe)
    assert cut.returncode == 74, cut.stdout[-3000:] + cut.stderr[-3000:]
    assert "SlowDown" in cut.stderr and "re-run the same command to resume" in cut.stderr
    meta = json.loads(sorted((tmp_path / "cut" / "checkpoints").glob("step_*/meta.json"))[-1].read_text())
    assert meta["step"] == steps_in_first
    one = [*extra, "--set", "train.grad_accum=2"]
    again = run_cli(_train_args(tmp_path, "cut", tmp_path / "cache-cut", one, nproc=1), timeout=300, **s3.env(), **probe)
    assert again.returncode == 0 and f"resumed from checkpoint step_{steps_in_first:08d}" in again.stdout, again.stdout[-3000:]
    straight = run_cli(
        _train_args(tmp_path, "straight", tmp_path / "cache-straight", extra), timeout=300, **s3.env(),
        AURA_PROBE_SAMPLES=str(tmp_path / "samples-straight"),
    )  # fmt: skip
    assert straight.returncode == 0, straight.stdout[-3000:]

    def ids(folder: Path) -> dict[int, int]:
        out: dict[int, int] = {}
        for f in folder.glob("*.jsonl"):
            for row in map(json.loads, f.read_text().splitlines()):
                for k, i in enumerate(row["ids"]):
                    assert out.setdefault(row["start"] + k, i) == i, "a position read twice, differently"
        return out

    resumed, reference = ids(tmp_path / "samples-cut"), ids(tmp_path / "samples-straight")
    assert sorted(resumed) == list(range((steps_in_first + 4) * 8)) and resumed == reference
    a, b = final_weights(tmp_path / "cut"), final_weights(tmp_path / "straight")
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a), "the interrupted run differs from the uninterrupted one"


def test_validation_shards_unreadable_at_the_start_stop_the_run_before_its_first_step(
    bucket_data: dict[str, Any], tmp_path: Path, s3: Any
) -> None:
    """The data's first read (the validation set evaluation needs) fails after its retries: the run stops
    before its first step with status 74, saves nothing (there is nothing new) and says how to resume."""
    endpoint, _ = s3.proxy(tmp_path, fail=r"^/prep/es/shards/val-", times=1000)
    extra = ["--set", "data.read_tries=2", "--set", "data.read_timeout_s=5"]
    r = run_cli(_train_args(tmp_path, "novalid", tmp_path / "cache", extra, nproc=1), timeout=300, **s3.env(endpoint=endpoint))
    assert r.returncode == 74, r.stdout[-3000:] + r.stderr[-3000:]
    assert "nothing new to save at step 0" in r.stderr and "re-run the same command to resume" in r.stderr, r.stderr[-3000:]
    assert not list((tmp_path / "novalid" / "checkpoints").glob("step_*"))


def test_credentials_in_a_url_are_refused(tmp_path: Path) -> None:
    r = run_cli(["local", "--dry-run", "--set", "data.path=s3://AKIAXXXX:secretvalue@bucket/p"], timeout=60)
    assert r.returncode == 2 and "holds credentials" in r.stderr and "secretvalue" not in r.stderr + r.stdout


def test_the_cache_is_bounded_and_evicts_only_its_own_least_recently_used_shards(
    bucket_data: dict[str, Any], tmp_path: Path, s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aura_hpc.data import storage
    from aura_hpc.data.cache import ShardCache
    from aura_hpc.errors import DataError

    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    storage._FS.clear()
    train = [s for s in bucket_data["manifest"]["shards"] if s["split"] == "train"]
    sizes = [s["tokens"] * 2 for s in train]
    cache = ShardCache(tmp_path / "c", max_bytes=sizes[0] + sizes[1] + sizes[2] // 2, policy=storage.Policy(tries=2))
    (cache.objects / "notes.txt").write_text("mine")  # not the cache's naming: never removed
    # Part files of downloads killed with their process: one untouched for an hour goes, one being written stays.
    dead, live = (cache.objects / f".{'a' * 64}.{n}.part" for n in (111, 222))
    for part in (dead, live):
        part.write_bytes(b"x" * 1000)
    os.utime(dead, (time.time() - 3600, time.time() - 3600))
    paths = [cache.fetch(f"s3://prep/es/{s['file']}", s["sha256"], n) for s, n in zip(train[:2], sizes[:2], strict=True)]
    assert all(p.is_file() for p in paths)
    third = cache.fetch(f"s3://prep/es/{train[2]['file']}", train[2]["sha256"], sizes[2], keep={train[1]["sha256"]})
    assert third.is_file() and not paths[0].exists() and paths[1].exists(), "the oldest shard not kept went"
    assert (cache.objects / "notes.txt").read_text() == "mine" and not dead.exists() and live.exists()
    live.unlink()
    with pytest.raises(DataError, match=r"do not fit in data.cache_gb.*\(fix: a larger data.cache_gb"):
        cache.fetch(f"s3://prep/es/{train[3]['file']}", train[3]["sha256"], sizes[3], keep={train[1]["sha256"], train[2]["sha256"]})
    # A shard whose bytes do not match the manifest's hash is never kept.
    with pytest.raises(DataError, match="does not match the manifest"):
        cache.fetch(f"s3://prep/es/{train[1]['file']}", train[0]["sha256"], sizes[1])
    assert not list(cache.objects.glob(".*.part"))
    storage._FS.clear()


def test_raw_text_in_a_bucket_streams_into_training_without_a_prepare_step(
    bucket_data: dict[str, Any], tmp_path: Path, s3: Any, prepared: Path
) -> None:
    stream = ["--set", "data.stream=true", "--set", "data.path=s3://raw/es", "--set", f"data.tokenizer={prepared}"]
    stream += ["--set", "data.shard_mb=0.04", "--set", "train.eval_every=6"]
    r = run_cli(_train_args(tmp_path, "streamed", tmp_path / "cache", stream), timeout=300, **s3.env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "streaming s3://raw/es:" in r.stdout and "eval_loss" in r.stdout
    done = list((tmp_path / "cache" / "stream").glob("*/done/*.json"))
    assert done and all(json.loads(f.read_text())["piece"]["source"].startswith("s3://raw/es/") for f in done)
    _no_secret_anywhere(s3, tmp_path / "streamed", r.stdout, r.stderr)


def test_dry_runs_from_a_bucket_describe_the_work_and_a_missing_bucket_or_path_is_named(
    bucket_data: dict[str, Any], tmp_path: Path, s3: Any
) -> None:
    """docs/data.md says to dry-run first: from a bucket into a local folder and into another bucket it
    says what it would read (sizes from one listing, no object read); a bucket or path that does not
    exist is said to, not "not a prepared directory"."""
    for out in (str(tmp_path / "local-out"), "s3://prep/es-dry"):
        r = run_cli(["prepare", "s3://raw/es/", "--out", out, *PREP, "--dry-run"], timeout=120, **s3.env())
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        size = sum(len(t.encode()) for t in _texts().values())
        assert "2 file(s)" in r.stdout and f"{size / 1024:,.1f} KB" in r.stdout, r.stdout
        assert not (tmp_path / "local-out").exists() and not s3.fs().exists("prep/es-dry")
    for path, said in (
        ("s3://no-such-bucket/es", "bucket s3://no-such-bucket does not exist (fix: create it first"),
        ("s3://prep/nothing-here", "data.path 's3://prep/nothing-here' does not exist: nothing is stored there"),
    ):
        r = run_cli(_train_args(tmp_path, "missing", tmp_path / "cache", ["--set", f"data.path={path}"]), timeout=120, **s3.env())
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and said in lines[0], r.stderr[-2000:]


def test_no_credentials_or_a_forgotten_endpoint_fail_at_once_with_the_fix() -> None:
    """Before, 5 tries with backoff each (53 s and 12 retry lines for a forgotten AWS_ENDPOINT_URL)."""
    import os

    from botocore.exceptions import EndpointConnectionError, NoCredentialsError

    from aura_hpc.data import storage
    from aura_hpc.errors import DataError

    waited: list[float] = []
    for exc, said in (
        (NoCredentialsError(), "no credentials to read s3://corpus/es (fix: set AWS_ACCESS_KEY_ID"),
        (EndpointConnectionError(endpoint_url="https://corpus.s3.amazonaws.com"), "AWS_ENDPOINT_URL is not set (fix: for MinIO, R2"),
    ):

        def fail(exc: Exception = exc) -> None:
            raise exc

        before = os.environ.pop("AWS_ENDPOINT_URL", None)
        storage._REACHED[0] = False  # the first contact of a process
        try:
            with pytest.raises(DataError, match=None) as got:
                storage.retrying("s3://corpus/es", fail, storage.Policy(), sleep=waited.append)
        finally:
            if before is not None:
                os.environ["AWS_ENDPOINT_URL"] = before
        assert said in str(got.value), str(got.value)
    assert waited == [], "retried"


def test_a_damaged_or_hostile_manifest_in_a_bucket_is_refused_in_one_line(tmp_path: Path, s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each field a reader uses, wrong: a KeyError, ValueError, AttributeError or IndexError before; and a
    tokenizer hash of "/../../../escape" named a folder outside the cache, taken without a hash check."""
    import copy

    from aura_hpc.data import storage
    from aura_hpc.data.cache import ShardCache
    from aura_hpc.data.packed import PackedTokens
    from aura_hpc.errors import DataError

    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    storage._FS.clear()
    fs = s3.fs()
    good = {
        "dtype": "uint16",
        "tokenizer": {"vocab_size": 300, "eos_id": 0, "sha256": "a" * 64},
        "shards": [{"split": "train", "file": "shards/train-00000.bin", "tokens": 100, "sha256": "b" * 64}],
    }
    cases: list[tuple[str, Any]] = [
        ("dtype", lambda m: m.pop("dtype")),
        ("dtype", lambda m: m.update(dtype="object")),
        ("tokenizer", lambda m: m.pop("tokenizer")),
        ("tokenizer.vocab_size", lambda m: m["tokenizer"].update(vocab_size="300")),
        ("tokenizer.sha256", lambda m: m["tokenizer"].update(sha256="/../../../escape")),
        ("shards[0]", lambda m: m.update(shards=["a"])),
        ("shards[0].tokens", lambda m: m["shards"][0].update(tokens="x")),
        ("shards[0].tokens", lambda m: m["shards"][0].update(tokens=-5)),
        ("shards[0].file", lambda m: m["shards"][0].update(file="../x.bin")),
        ("shards[0].file", lambda m: m["shards"][0].update(split="val")),  # training tokens named validation
        ("shards[1].file", lambda m: m["shards"].append(dict(m["shards"][0]))),  # one file listed twice
        ("train_tokens", lambda m: m.update(shards=[], val_tokens=3)),
    ]
    cache = ShardCache(tmp_path / "a" / "b" / "cache", 2**30, storage.Policy(tries=1))
    (tmp_path / "a" / "escape").mkdir()
    (tmp_path / "a" / "escape" / "tokenizer.json").write_text("{}")  # what the escaping hash pointed at,
    (cache.root / "tokenizer-").mkdir()  # through the folder its first try made in the cache
    for i, (field, damage) in enumerate(cases):
        m = copy.deepcopy(good)
        damage(m)
        fs.pipe(f"prep/hostile/{i}/manifest.json", json.dumps(m).encode())
        with pytest.raises(DataError) as got:
            _ = PackedTokens(f"s3://prep/hostile/{i}", 16, cache).tokenizer_dir
        said = str(got.value)
        assert f"s3://prep/hostile/{i}/manifest.json: {field} is " in said and "(fix: prepare the data again with --force)" in said, said
    # An older release's one-file format, whole: set up, then exit 74 at the first window ("storage does not answer").
    old = {k: v for k, v in good.items() if k != "shards"} | {"train_tokens": 100, "val_tokens": 0}
    fs.pipe("prep/hostile/old/manifest.json", json.dumps(old).encode())
    with pytest.raises(
        DataError, match=r"is in an older release's format, read locally only \(fix: python -m aura_hpc prepare .* --force\)"
    ):
        PackedTokens("s3://prep/hostile/old", 16, cache)
    storage._FS.clear()


@pytest.mark.parametrize("marker", [b"not json", b"[1, 2]"])
def test_an_upload_marker_that_is_not_ours_is_refused_in_one_line(
    tmp_path: Path, s3: Any, monkeypatch: pytest.MonkeyPatch, marker: bytes
) -> None:
    from aura_hpc.data import storage
    from aura_hpc.errors import DataError

    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    storage._FS.clear()
    s3.fs().pipe("prep/marked/.aura-prepare", marker)
    (tmp_path / "a.txt").write_text(generate(40, seed=2), encoding="utf-8")
    spec = PrepareSpec(out_dir="s3://prep/marked", inputs=[str(tmp_path / "a.txt")], vocab_size=300, cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"s3://prep/marked/\.aura-prepare is not the marker prepare leaves during an upload .*\(fix: "):
        prepare(spec)
    storage._FS.clear()


def test_an_out_prefix_inside_the_input_prefix_is_refused(tmp_path: Path, s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """As for a folder: s3://raw/nine/ prepared into s3://raw/nine/prepared made its manifest and tokenizer
    JSON inputs of the next run (which then failed, or trained on them)."""
    from aura_hpc.data import storage
    from aura_hpc.errors import DataError

    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    storage._FS.clear()
    s3.fs().pipe("raw/nine/a.txt", generate(40, seed=2).encode())
    spec = PrepareSpec(out_dir="s3://raw/nine/prepared", inputs=["s3://raw/nine/"], vocab_size=300, cache_dir=str(tmp_path / "c"))
    with pytest.raises(
        DataError, match=r"--out s3://raw/nine/prepared is inside the input s3://raw/nine/: .*\(fix: .*--out s3://raw/nine-prepared\)"
    ):
        prepare(spec)
    assert not s3.fs().exists("raw/nine/prepared")
    storage._FS.clear()
    from aura_hpc.data.to_bucket import check_inputs

    a = ["s3://raw/nine/a.txt"]
    with pytest.raises(DataError, match=r"--out s3://raw/nine contains the input s3://raw/nine/a\.txt"):
        check_inputs("s3://raw/nine", ["s3://raw/nine/a.txt"], a)
    with pytest.raises(DataError, match=r"is inside the input s3://raw/\*\*/\*\.json"):
        check_inputs("s3://raw/nine/prepared", ["s3://raw/**/*.json"], [])
    check_inputs("s3://raw/nine/prepared", ["s3://raw/nine/*.txt"], a)  # what it matches stays the text


def test_a_full_or_unwritable_local_disk_is_said_at_once_and_not_blamed_on_the_bucket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every OSError counted as the storage's: a download onto a full disk was retried and ended in
    "could not read s3://... (fix: check AWS_ENDPOINT_URL and the network)"."""
    import errno

    from aura_hpc.data import storage
    from aura_hpc.errors import DataError

    part = str(tmp_path / "objects" / ".abc.part")  # objects/ missing: its open fails with the local name

    class Disk:
        def __init__(self, full: bool) -> None:
            self.full = full

        def get_file(self, rpath: str, lpath: str) -> None:
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")  # a write() names no file
            open(lpath, "wb").close()

    for full, said in ((True, "No space left on device"), (False, "No such file or directory")):
        monkeypatch.setattr(storage, "filesystem", lambda policy=None, full=full: Disk(full))
        with pytest.raises(DataError) as got:
            storage.download("s3://corpus/es/shards/train-00000.bin", part, storage.Policy(backoff_s=0.001))
        line = str(got.value)
        assert f"failed on this machine, not in the storage: {part}: {said} (fix: free space on that disk" in line, line
        assert "retrying" not in caplog.text


def test_the_default_cache_in_tmp_is_made_for_its_user_alone_and_one_another_could_have_planted_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards in the cache are trusted by their size (the hash is checked as they arrive): a folder another user
    made first in /tmp could hold planted shards, and was used as it was."""
    import os
    import tempfile

    from aura_hpc.data.cache import default_dir
    from aura_hpc.errors import DataError

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    made = default_dir()
    assert made.parent == tmp_path and oct(made.stat().st_mode & 0o777) == "0o700"
    assert default_dir() == made  # an own folder is taken as it is
    made.chmod(0o775)  # ours, made by an earlier version under umask 002: closed to others, not refused
    assert default_dir() == made and oct(made.stat().st_mode & 0o777) == "0o700"
    made.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    made.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DataError, match="is not a folder"):
        default_dir()
    made.unlink()
    if os.geteuid() == 0:  # a folder of another user (root can make one)
        made.mkdir(mode=0o700)
        os.chown(made, 12345, 12345)
        with pytest.raises(DataError, match="is not yours"):
            default_dir()


def test_a_parquet_object_is_downloaded_once_and_its_copy_goes_once_encoded(
    tmp_path: Path, s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer's sample and the encoding each downloaded a Parquet or JSON object whole, and every copy stayed
    on local disk until the end: twice the egress, and the whole corpus again on disk."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from aura_hpc.data import shards, storage

    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    storage._FS.clear()
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": [p for p in generate(400, seed=5).split("\n\n") if p.strip()]}), table)
    s3.fs().put(str(table), "raw/pq/t.parquet")
    fetched: list[str] = []
    real_download, real_encode = storage.download, shards.encode

    def download(url: str, dest: Any, *args: Any) -> None:
        fetched.append(url)
        real_download(url, dest, *args)

    left: list[list[Path]] = []

    def encode(job: Any) -> dict[str, Any]:
        record = real_encode(job)
        left.append(list((Path(job.build) / "inputs").glob("*")))
        return record

    monkeypatch.setattr(storage, "download", download)
    monkeypatch.setattr(shards, "encode", encode)
    m = prepare(PrepareSpec(out_dir=tmp_path / "p", inputs=["s3://raw/pq/t.parquet"], vocab_size=300))
    assert m["train_tokens"] > 0 and fetched == ["s3://raw/pq/t.parquet"], fetched
    assert left == [[]], left

    # Objects whose copies do not fit in a quarter of the room: those past it are let go once sampled (the whole corpus was on
    # local disk before the first was encoded), and downloaded again to be encoded.
    import shutil

    for name in ("a", "b", "c"):
        s3.fs().put(str(table), f"raw/many/{name}.parquet")
    real_usage, on_disk = shutil.disk_usage, []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_usage(path)._replace(free=6 * table.stat().st_size))
    fetched.clear()

    def counting(url: str, dest: Any, *args: Any) -> None:
        on_disk.append(len(list(Path(dest).parent.glob("*.parquet"))))
        download(url, dest, *args)

    monkeypatch.setattr(storage, "download", counting)
    prepare(PrepareSpec(out_dir=tmp_path / "q", inputs=["s3://raw/many/"], vocab_size=300))
    assert sorted(fetched) == sorted(f"s3://raw/many/{n}.parquet" for n in "abbcc") and max(on_disk) <= 1, (fetched, on_disk)


def test_data_replaced_in_a_bucket_leaves_no_file_of_the_old_tokenizer(tmp_path: Path, s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old shards went, the old tokenizer's vocab.json and merges.txt (an earlier --tokenizer) stayed beside the new
    tokenizer.json, and were fetched with it."""
    from aura_hpc.data import storage
    from aura_hpc.errors import DataError

    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    storage._FS.clear()
    (tmp_path / "a.txt").write_text(generate(40, seed=2), encoding="utf-8")
    spec = PrepareSpec(out_dir="s3://prep/replaced", inputs=[str(tmp_path / "a.txt")], vocab_size=300, cache_dir=str(tmp_path / "c"))
    prepare(spec)
    fs = s3.fs()
    fs.pipe("prep/replaced/tokenizer/merges.txt", b"#version: 0.2\n")  # an earlier tokenizer's
    spec.force, spec.vocab_size = True, 280
    prepare(spec)
    left = sorted(p.rsplit("/", 1)[1] for p in fs.ls("prep/replaced/tokenizer"))
    assert "merges.txt" not in left and "tokenizer.json" in left, left
    # A manifest cut short (an upload interrupted by hand, a full disk where it was copied from): the fix it names,
    # --force, was refused by the same reader before --force was looked at.
    fs.pipe("prep/replaced/manifest.json", b'{"format": 2, "dtyp')
    storage._FS.clear()
    spec.force, spec.vocab_size = False, 300
    with pytest.raises(DataError, match=r"manifest\.json is damaged: it is not JSON .*\(fix: prepare the data there again with --force"):
        prepare(spec)
    spec.force = True
    assert prepare(spec)["tokenizer"]["vocab_size"] <= 300 and json.loads(fs.cat("prep/replaced/manifest.json"))["format"] == 2
    storage._FS.clear()


def test_many_objects_are_listed_once_not_asked_for_one_by_one(tmp_path: Path, s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare (and each rank of a stream) asked for every input object's size and ETag one by one, three requests an
    object (a listing of its key, a HEAD, another HEAD for its size) after the listing that found them all: 100,000
    objects were hours of requests before the first token. What the listing said is taken."""
    from aura_hpc.data import shards, storage
    from aura_hpc.data.prepare import PrepareSpec, input_key
    from aura_hpc.data.sources import TEXT_SUFFIXES, resolve_inputs

    fs = s3.fs()
    for i in range(40):
        fs.pipe(f"raw/listed-once/part-{i:03d}.txt", f"Párrafo {i}.\n\n".encode())
    endpoint, log = s3.proxy(tmp_path)
    for k, v in s3.env(endpoint=endpoint).items():
        monkeypatch.setenv(k, v)
    storage._FS.clear()
    before = len(log.read_text().splitlines())  # the proxy's own check that it answers
    files = resolve_inputs(["s3://raw/listed-once"])
    key = input_key(PrepareSpec(out_dir=tmp_path / "p", inputs=["s3://raw/listed-once"]), files)
    pieces = shards.plan(files, TEXT_SUFFIXES, 1 << 20, None, False)
    asked = log.read_text().splitlines()[before:]
    assert len(files) == len(pieces) == 40 and len(key) == 64
    assert asked == ["GET /raw 200"], asked  # the listing: not one more request an object
    storage._FS.clear()

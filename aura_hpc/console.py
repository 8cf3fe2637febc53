"""The user-facing side: all `rich` output goes through here.

Workers write plain, rank-prefixed log lines (Slurm log files are not terminals); only rank 0
attached to a terminal gets a live progress bar, and its log lines are printed above the bar.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

_P = ParamSpec("_P")


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich exits 1 here: `local ... | tee run.log` stopped by Ctrl+C (tee dies with it) turned the run's 75 into 1.
        _gone(self)


def _gone(con: Console) -> None:
    """The reader went away (a closed ssh session's terminal: EIO; a pipe's reader: EPIPE): what is left to say goes
    nowhere, not into an error that ends the process, and the stream points at /dev/null so that Python's own flush
    at exit does not fail (status 120) on what was written."""
    con.quiet = True
    with contextlib.suppress(OSError, ValueError, AttributeError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, con.file.fileno())
        os.close(null)


# The reader went away: a pipe's (EPIPE), a hung-up terminal's (EIO, ENXIO). A full disk under `> file` is an error still.
_GONE = (errno.EPIPE, errno.EIO, errno.ENXIO)


@contextlib.contextmanager
def _written(con: Console) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno not in _GONE:
            raise
        _gone(con)


def _to(con: Console) -> Callable[[Callable[_P, None]], Callable[_P, None]]:
    def wrap(fn: Callable[_P, None]) -> Callable[_P, None]:
        @functools.wraps(fn)
        def written(*args: _P.args, **kwargs: _P.kwargs) -> None:
            with _written(con):
                fn(*args, **kwargs)

        return written

    return wrap


console = _Console(highlight=False)
err_console = _Console(stderr=True, highlight=False)
# Files and pipes (Slurm logs, `| tee`) get whole lines: no 80-column wrapping, no box tables.
_PLAIN = not console.is_terminal


@_to(err_console)
def error(message: str) -> None:
    from rich.markup import escape

    # The message is text (paths, gloo's "[file.cc:537]" prefixes), never markup.
    err_console.print(f"[bold red]error:[/] {escape(message)}", markup=True, soft_wrap=True)


@_to(console)
def info(message: str) -> None:
    console.print(message, markup=False, soft_wrap=True)


@_to(console)
def heading(message: str) -> None:
    from rich.markup import escape

    console.print(f"[bold]{escape(message)}[/]", soft_wrap=True)


@_to(console)
def _plain_lines(title: str, lines: list[str]) -> None:
    console.out("\n".join([title, *(f"  {line}" for line in lines)]), highlight=False)


@_to(console)
def table(title: str, rows: list[tuple[str, str]]) -> None:
    if _PLAIN:
        _plain_lines(title, [f"{k}: {' '.join(str(v).split())}" for k, v in rows])
        return
    from rich.table import Table
    from rich.text import Text

    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold cyan")
    t.add_column()
    for k, v in rows:
        t.add_row(Text(str(k)), Text(str(v)))  # text, never markup: values come from files, queues and peers
    console.print(t)


class TrainProgress:
    """A progress bar for rank 0 on a terminal; a no-op elsewhere."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self.enabled = enabled and sys.stdout.isatty()
        self._progress: Progress | None = None
        self._task: Any = None
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]training"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
                transient=False,
            )
            self._task = self._progress.add_task("train", total=total, completed=start, status="")
            self._progress.start()

    def update(self, step: int, status: str = "") -> None:
        if self._progress is not None:
            with _written(console):
                self._progress.update(self._task, completed=step, status=status)

    def print(self, line: str) -> None:
        # A closed ssh session's terminal (EIO) crashed rank 0 here, on its way to the checkpoint of the SIGHUP.
        with _written(console):
            console.print(line, markup=False, highlight=False, soft_wrap=True)

    def stop(self) -> None:
        if self._progress is not None:
            with _written(console):
                self._progress.stop()
            self._progress = None


class ProgressAwareHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Routes rank 0's stdout log lines through the live progress bar when there is one."""

    progress: TrainProgress | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.progress is not None and self.progress.enabled and not console.quiet:
            try:
                self.progress.print(self.format(record))
            except Exception:  # as StreamHandler does: a log line never ends the run
                self.handleError(record)
        else:
            super().emit(record)


@_to(console)
def grid(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """A table with a header row (job listings)."""
    if _PLAIN:

        def cell(c: str, v: str) -> str:
            v = " ".join(str(v).split()) or "-"
            return f"{c}={v}" if c else v

        _plain_lines(title, ["  ".join(cell(c, v) for c, v in zip(columns, r, strict=False)) for r in rows])
        return
    from rich.table import Table
    from rich.text import Text

    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*(Text(str(v)) for v in r))  # a job's name or a node's hostname is text, never markup
    console.print(t)


@_to(console)
def plain(text: str) -> None:
    """Exact text (scripts, logs): no markup, no wrapping, no highlighting."""
    console.out(text, highlight=False)


@_to(err_console)
def warn(message: str) -> None:
    from rich.markup import escape

    err_console.print(f"[bold yellow]warning:[/] {escape(message)}", markup=True, soft_wrap=True)


def resources_table(row: dict[str, Any]) -> Any:
    import time

    from rich.table import Table

    when = row.get("time")
    shown = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(when))) if isinstance(when, (int, float)) else when
    t = Table(title=f"{row.get('host')}  {shown}", title_justify="left")
    for c in ("cpu %", "ram GiB (%)", "disk free GiB", "net rx/tx Mbit/s"):  # the _gb fields are GiB (2**30)
        t.add_column(c)
    t.add_row(
        f"{row['cpu_pct']:.0f}",
        f"{row['ram_used_gb']} ({row['ram_pct']:.0f}%)",
        str(row["disk_free_gb"]),
        f"{row['net_rx_mbps']} / {row['net_tx_mbps']}",
    )
    gpus = row.get("gpus") or []
    if not gpus:
        return t
    from rich.console import Group

    g = Table()
    cols = ["index", "name", "util_pct", "mem_used_mb", "temp_c", "power_w", "sm_clock_mhz", "throttle_reasons", "ecc_uncorrected_volatile"]
    for c in cols:
        g.add_column(c.replace("_", " "))
    for gpu in gpus:
        g.add_row(*[str(gpu.get(c, "-")) for c in cols])
    return Group(t, g)


def live_table() -> Any:
    from rich.live import Live

    live = Live(console=console, auto_refresh=False)
    live.start()

    class _Updater:
        def update(self, renderable: Any) -> None:
            live.update(renderable, refresh=True)

        def stop(self) -> None:
            live.stop()

    return _Updater()

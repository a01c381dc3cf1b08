"""prometheus-client's multiprocess directory, kept small and read consistently.

Each process that observed a histogram or a counter has a file of its own there
(`histogram_<pid>.db`, `counter_<pid>.db`) and a scrape sums them all, the files of
processes that are gone included. django-q2 replaces a worker process every 500 tasks (its
`recycle`), so under load the directory would gain a file every few seconds and every
scrape would read them all. A scrape therefore first
folds the files of processes that are gone into one archive file, under an exclusive lock,
and reads under a shared one, so it never sees a fold half done.

A fold is exact across a crash at any point. A dead process's file is first renamed
`histogram_<pid>.db.g<N>` (out of the scrape's `*.db`), N being the generation of the
archive that will include it; that archive, `histogram_archive-g<N>.db` (one per kind:
counters sum the same way), is written whole
under a temporary name and renamed into place; only then are the renamed files and the
previous archive removed. A fold that finds leftovers tells from N whether the newest
archive already includes them.

"Gone" is judged by process id on this machine, so one directory serves the processes of
one host (one PID namespace, in containers), never several. Gauges' files are read as they
are: how they combine depends on their mode, and summing is not it.

A label whose values come from tenants' data (a tool's name) is bounded for the whole host
here too (`BoundedLabel`): a bound per process alone would let every process, and every
worker that replaces a recycled one, add its own values to the files a scrape sums.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

from prometheus_client.core import Metric
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

KINDS = ("counter", "histogram")  # what sums across processes, and so may be folded
_GAUGE = re.compile(r"gauge_\w+_\d+\.db")
LOCK = ".fold.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _live(kind: str) -> re.Pattern[str]:
    return re.compile(rf"{kind}_(\d+)\.db")


def _archives(kind: str, names: list[str]) -> list[tuple[int, str]]:
    archive = re.compile(rf"{kind}_archive-g(\d+)\.db")
    return sorted((int(m[1]), name) for name in names if (m := archive.fullmatch(name)))


def fold(path: Path) -> int:
    """Fold the files of processes that are gone into the archives (the caller holds the
    exclusive lock); returns how many files were folded."""
    return sum(_fold(path, kind) for kind in KINDS)


def _fold(path: Path, kind: str) -> int:
    names = os.listdir(path)
    archives = _archives(kind, names)
    generation, current = archives[-1] if archives else (0, None)
    for _, older in archives[:-1]:  # an interrupted fold's superseded archive
        os.remove(path / older)
    todo = []
    renamed_file = re.compile(rf"{kind}_\d+\.db\.g(\d+)")
    for name in names:
        renamed = renamed_file.fullmatch(name)
        if renamed and int(renamed[1]) <= generation:
            os.remove(path / name)  # the newest archive includes it already
        elif renamed:
            todo.append(name)
    following = generation + 1
    for name in names:
        live = _live(kind).fullmatch(name)
        if live and not _alive(int(live[1])):
            os.rename(path / name, path / f"{name}.g{following}")
            todo.append(f"{name}.g{following}")
    if not todo:
        return 0
    totals: dict[str, float] = {}
    for name in [current, *todo] if current else todo:
        for key, value, _timestamp, _pos in MmapedDict.read_all_values_from_file(path / name):
            totals[key] = totals.get(key, 0.0) + value
    temporary = path / f"{kind}_archive-g{following}.tmp"
    archive = MmapedDict(str(temporary))
    for key, value in totals.items():
        archive.write_value(key, value, 0.0)
    archive.close()
    with open(temporary, "rb+") as written:
        os.fsync(written.fileno())
    os.rename(temporary, path / f"{kind}_archive-g{following}.db")
    for name in todo:
        os.remove(path / name)
    if current:
        os.remove(path / current)
    return len(todo)


class BoundedLabel:
    """One label of one metric that takes at most `limit` values on a host: the first that
    come, each cut to `length` characters; any other is `other`. The values admitted are a
    file of the directory (one JSON string a line), appended under an exclusive lock, so
    that every process of the host admits the same ones, and a value once admitted keeps its
    series for good: moved into `other` later, its counts and `other`'s would go down, which
    Prometheus reads as counter resets. A process reads the file again only for a value it
    has not met while fewer than `limit` were admitted when it last read it."""

    def __init__(self, metric: str, label: str, *, other: str, length: int) -> None:
        self.metric, self.label, self.other, self.length = metric, label, other, length
        self._path: Path | None = None
        self._known: dict[str, int] = {}  # value -> its line in the file, as last read

    def file(self, path: Path) -> Path:
        return path / f".{self.metric}.{self.label}.values"

    def value(self, path: Path, raw: str, limit: int) -> str:
        """What to label an observation of `raw` with, admitting it if there is room."""
        value = raw[: self.length]
        if path != self._path:
            self._path, self._known = path, {}
        if self._known.get(value, limit) < limit:
            return value
        if len(self._known) >= limit:
            return self.other
        with open(self.file(path), "a+", encoding="utf-8") as values:
            fcntl.flock(values, fcntl.LOCK_EX)
            self._known = _lines(values)
            if value not in self._known and len(self._known) < limit:
                values.write(json.dumps(value) + "\n")
                self._known[value] = len(self._known)
        return value if self._known.get(value, limit) < limit else self.other

    def admitted(self, path: Path, limit: int) -> set[str]:
        try:
            with open(self.file(path), encoding="utf-8") as values:
                fcntl.flock(values, fcntl.LOCK_SH)
                return {value for value, line in _lines(values).items() if line < limit}
        except FileNotFoundError:
            return set()

    def bounded(self, metric: Metric, admitted: set[str]) -> Metric:
        """`metric` with every series whose value is not `admitted` summed into `other`'s:
        those a process wrote past the bound (one from a release without it, or admitted
        before `limit` was lowered)."""
        sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for sample in metric.samples:
            labels = dict(sample.labels)
            if labels.get(self.label) not in admitted:
                labels[self.label] = self.other
            key = (sample.name, tuple(labels.items()))
            sums[key] = sums.get(key, 0.0) + sample.value
        metric.samples = [Sample(name, dict(labels), n) for (name, labels), n in sums.items()]
        return metric


def _lines(values: IO[str]) -> dict[str, int]:
    """The values a BoundedLabel's file admits, each with its place among them."""
    values.seek(0)
    known: dict[str, int] = {}
    for line in values:
        with contextlib.suppress(ValueError):  # a line a crash cut short: no value
            known.setdefault(str(json.loads(line)), len(known))
    return known


class HostMetrics(Collector):
    """Every metric observed by a process of this host, read under the directory's lock
    after folding what the processes that are gone left; `bounds`: labels held to their
    limits (`BoundedLabel`)."""

    def __init__(self, path: str, bounds: Sequence[tuple[BoundedLabel, int]] = ()) -> None:
        self.path = Path(path)
        self.bounds = bounds

    def collect(self) -> Iterator[Metric]:
        with open(self.path / LOCK, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fold(self.path)
            except BlockingIOError:
                pass  # another scrape holds it: read as it leaves the directory
            fcntl.flock(lock, fcntl.LOCK_SH)
            names = os.listdir(self.path)
            files = [n for n in names if _GAUGE.fullmatch(n)]
            for kind in KINDS:
                files += [n for n in names if _live(kind).fullmatch(n)]
                files += [name for _, name in _archives(kind, names)[-1:]]
            merged = MultiProcessCollector.merge([str(self.path / n) for n in files])
        bounds = {bound.metric: (bound, bound.admitted(self.path, n)) for bound, n in self.bounds}
        for metric in merged:
            if metric.name in bounds:
                bound, admitted = bounds[metric.name]
                metric = bound.bounded(metric, admitted)
            yield metric

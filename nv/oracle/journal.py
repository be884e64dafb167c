"""Append-only journal of paid API responses: nothing paid is lost, nothing completed is paid twice.

JSON lines. The first line binds the file to one attack (endpoint, model and the parameters that
shape its requests); a journal written for another binding is refused, except where it differs only
in paths the caller declares unbound (how many requests an attack makes, not what they ask: a rerun
with a larger budget reuses every paid reply). Then one line per paid
response, keyed by the request's identity (the SHA-256 of its exact JSON body, which carries the
per-request seed, so the same key always means the same question), and one line per token column
the first time a token is seen (the stable column index of Y_hat, Alg. 1).

Each line goes out in one ``os.write`` on an ``O_APPEND`` descriptor as soon as its response
arrives, and the file is fsync'ed before a batch of responses leaves the oracle (with the token columns they
were given: ``HTTPOracle.sample``/``argmax`` sync after assigning them). A process killed mid-write leaves
at most a torn last line: it is dropped with a warning and the file truncated to its last whole
line; a bad line anywhere else makes the journal untrusted (an error, never silently accepted).
An exclusive lock keeps two processes from appending to one journal. No credential is written.

Memory: an index of 20 bytes per reply (``_Index``: where each reply's line lies in the file; ~35 while it merges
its runs, allocated; ~37 and ~50 resident, ``benchmarks/bench_journal_memory.py``); a reply itself is read back from
the file when it is asked for.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from nv.errors import NVError

log = logging.getLogger(__name__)

# what to do about a bad line: the lines above it are whole (each was fsync'ed before its reply left the oracle)
_RECOVER = "(keep the replies above it with `head -n {keep}` into a new file, or use a new --journal path)"
MAGIC = "nightvision-journal"


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999
        raise ValueError(f"{text} is not a finite number")
    return value


def _refuse(name: str):
    raise ValueError(f"{name} is not JSON")


def _strict_json(data: bytes):
    """``json.loads`` without its NaN and Infinity extension and with finite numbers only: ``canonical`` never writes
    others, so a line holding one was changed outside nv (a NaN log-prob would pass for a number and poison the
    matrix, an infinite token count stop the run with a traceback)."""
    return json.loads(data, parse_constant=_refuse, parse_float=_finite)

_DIGEST = re.compile("[0-9a-f]{64}")
VERSION = 1


def _prefix(key: str) -> int:
    """The index's 64 bits of a request key: the first 8 bytes of a ``request_key`` (a lowercase SHA-256 hex digest),
    of any other key's SHA-256. Two keys may share them; the line read back names its key."""
    if _DIGEST.fullmatch(key):
        return int(key[:16], 16)
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


def _merge(a: list[np.ndarray], b: list[np.ndarray]) -> list[np.ndarray]:
    """Two sorted runs [prefixes, offsets, lengths] as one, ``b``'s entries after ``a``'s where prefixes tie. Built a
    field at a time, each input field released once copied (the lists are emptied): the merge holds both runs, one
    output field and the positions, ~35 bytes an entry at its peak."""
    n = len(a[0]) + len(b[0])
    at_b = np.searchsorted(a[0], b[0], side="right") + np.arange(len(b[0]))
    from_a = np.ones(n, bool)
    from_a[at_b] = False
    out = []
    while a:
        x, y = a.pop(0), b.pop(0)
        z = np.empty(n, x.dtype)
        z[from_a], z[at_b] = x, y
        del x, y
        out.append(z)
    return out


class _Index:
    """Request key prefix -> (offset, length) of the reply's line: 20 bytes a reply in sorted numpy runs, merged like a
    binary counter (about log2(n / BATCH) runs, each found by bisection), behind a dict of the last BATCH added."""

    BATCH = 1 << 14

    def __init__(self) -> None:
        self._runs: list[list[np.ndarray]] = []  # [prefixes (sorted), offsets, lengths], the oldest first
        self._new: dict[int, list[tuple[int, int]]] = {}
        self._pending = 0
        self.size = 0

    def add(self, prefix: int, offset: int, length: int) -> None:
        self._new.setdefault(prefix, []).append((offset, length))
        self._pending += 1
        self.size += 1
        if self._pending == self.BATCH:
            self._flush()

    def _flush(self) -> None:
        """File the dict's entries as a run, merged with every run no longer than it."""
        rows = sorted((p, o, n) for p, places in self._new.items() for o, n in places)
        run = [np.array([r[0] for r in rows], np.uint64), np.array([r[1] for r in rows], np.int64),
               np.array([r[2] for r in rows], np.uint32)]
        self._new.clear()
        self._pending = 0
        while self._runs and len(self._runs[-1][0]) <= len(run[0]):
            run = _merge(self._runs.pop(), run)
        self._runs.append(run)

    def places(self, prefix: int) -> list[tuple[int, int]]:
        """Every (offset, length) filed under ``prefix``."""
        found = list(self._new.get(prefix, ()))
        p = np.uint64(prefix)
        for prefixes, offsets, lengths in self._runs:
            i = int(np.searchsorted(prefixes, p))
            while i < len(prefixes) and prefixes[i] == p:
                found.append((int(offsets[i]), int(lengths[i])))
                i += 1
        return found


def canonical(obj) -> str:
    """Compact, key-sorted JSON: the byte-exact form keys and bindings are compared in."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def request_key(body: dict) -> str:
    """Identity of one request: SHA-256 of its canonical JSON body."""
    return hashlib.sha256(canonical(body).encode()).hexdigest()


def _first_difference(old, new, unbound: tuple[str, ...] = (), path: str = "") -> str | None:
    """'key.sub was A, now B' for the first differing leaf of two JSON values outside the ``unbound`` paths
    (None when they agree there)."""
    if path in unbound or old == new:
        return None
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new)):
            diff = _first_difference(old.get(k, "<absent>"), new.get(k, "<absent>"), unbound, f"{path}.{k}" if path else k)
            if diff:
                return diff
        return None
    return f"{path or 'binding'} was {old!r}, now {new!r}"


def _number(v, minimum=None) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and (minimum is None or v >= minimum)


def _valid_record(d) -> bool:
    """A paid reply as ``HTTPOracle`` journals it: prompt and output tokens, and either the sampled tokens
    [[key or null, log-prob or null, [[key, log-prob], ...]], ...] or a timed call's seconds."""
    if not (isinstance(d, dict) and _number(d.get("p"), 0) and _number(d.get("o"), 0)):
        return False
    if "t" in d:
        return _number(d["t"], 0)
    return isinstance(d.get("c"), list) and all(
        isinstance(c, list) and len(c) == 3 and (c[0] is None or isinstance(c[0], str))
        and (c[1] is None or _number(c[1])) and isinstance(c[2], list) for c in d["c"])


class Journal:
    """Paid responses keyed by request identity, plus the token -> column map.

    ``path=None`` writes to an anonymous temporary file (nothing survives the process). ``get`` gives the stored
    record of a request key (a dict with ``p`` prompt tokens and ``o`` output tokens as the server's
    usage reported them); ``columns`` maps token keys to column indexes 0, 1, ...
    """

    def __init__(self, path: str | Path | None, binding: dict, unbound: tuple[str, ...] = (), readonly: bool = False) -> None:
        """``readonly``: read what a journal holds (a dry run's look at what is paid) without locking, repairing or
        writing it, so it works beside the attack that is appending to it; it takes no ``put``."""
        self._fd: int | None = None  # first: ``__del__`` closes it
        self.path = None if path is None else Path(path)
        self.readonly = readonly
        self.binding = json.loads(canonical(binding))
        self.unbound = unbound  # binding paths a resumed attack may change (how many requests, not what they ask)
        self._index = _Index()
        self.columns: dict[str, int] = {}
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.unidentified = 0  # sampled tokens the endpoint named no token for, over every reply
        self._end = 0  # bytes of whole lines in the file: where the next line goes
        if self.path is None:
            self._fd, name = tempfile.mkstemp(prefix="nv-journal-")
            os.unlink(name)
        else:
            self._open()

    # -- reading -----------------------------------------------------------------------------

    def _open(self) -> None:
        if self.readonly:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except OSError as exc:
                raise NVError(f"journal {self.path} cannot be read: {exc.strerror}") from None
            self._read()
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists() and not self.path.is_file():  # /dev/null would drop every paid reply, a FIFO hang
                raise NVError(f"journal {self.path} is not a regular file: give a file's path (--journal)")
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as exc:
            raise NVError(f"journal {self.path} cannot be opened for writing: {exc.strerror}") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self.close()
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise NVError(f"journal {self.path} is in use by another process") from None
            raise NVError(f"journal {self.path} cannot be locked ({exc.strerror}; a network file system?): give a "
                          "--journal on a local disk") from None
        self._read()

    def _read(self) -> None:
        """Index every paid reply, line by line: the header's binding is checked before the first reply is indexed."""
        header, loaded = None, 0
        for line, offset, length, entry in self._entries():
            if line == 1:
                header = entry
                continue
            if not loaded:
                self._check_binding(header)
            self._load(entry, line, offset, length)
            loaded += 1
        if not loaded and header is not None and header.get("binding") != self.binding:
            # a header and nothing paid under it (a first run that failed its set-up checks): nothing to lose, so the
            # corrected command reuses the file instead of being refused
            if self.readonly:
                return
            log.info("journal %s: no reply was paid under its binding; reused for this attack", self.path)
            os.ftruncate(self._fd, 0)
            self._end = 0
            header = None
        if header is None and not self.readonly:
            self._append({"journal": MAGIC, "version": VERSION, "binding": self.binding})
            self.sync()

    def _check_binding(self, header: dict) -> None:
        diff = _first_difference(header.get("binding"), self.binding, self.unbound)
        if diff:
            self.close()
            raise NVError(f"journal {self.path} belongs to another attack ({diff}): run the new attack with its own "
                          "--out folder (and --journal, if one was given), which keeps the earlier attack's results")
        if header.get("binding") != self.binding:
            log.info("journal %s: the same attack with %s: its paid replies are reused", self.path,
                     _first_difference(header.get("binding"), self.binding))

    def _entries(self) -> Iterator[tuple[int, int, int, dict]]:
        """Every whole line as (line number, its offset, its length, entry), read line by line (never in one read:
        Linux returns at most 2 GiB per read, and a journal cut short there would pass for a torn last line and be
        truncated, its paid replies lost). Once every line is read, a torn last line (bytes after the last newline) is
        dropped and the file truncated to the whole lines before it; a whole line that does not parse is corrupt, the
        last one too."""
        size = os.fstat(self._fd).st_size
        whole, tail = 0, b""  # tail: bytes after the last newline
        with open(self.path, "rb") as f:
            for i, line in enumerate(f):
                try:
                    entry = _strict_json(line) if line.endswith(b"\n") else None
                    if not isinstance(entry, dict):
                        raise ValueError
                except ValueError:
                    if line.endswith(b"\n"):  # written whole (canonical JSON holds no newline), so changed since:
                        self.close()  # corrupt, the last line too (dropping it as torn would lose a paid reply)
                        if i == 0:
                            raise NVError(f"{self.path} is not a NightVision journal (version {VERSION}): use a new "
                                          "--journal path") from None
                        raise NVError(f"journal {self.path}: line {i + 1} is corrupt, so the journal cannot be trusted "
                                      f"{_RECOVER.format(keep=i)}") from None
                    tail = line  # bytes after the last newline: a write cut short
                    continue
                if i == 0 and (entry.get("journal") != MAGIC or entry.get("version") != VERSION):
                    self.close()  # before anything is truncated: someone else's file stays as it was
                    raise NVError(f"{self.path} is not a NightVision journal (version {VERSION}): use a new --journal path")
                yield i + 1, whole, len(line), entry
                whole += len(line)
        if whole + len(tail) != size and not self.readonly:  # read-only: the attack beside it may be appending
            self.close()
            raise NVError(f"journal {self.path} changed size while it was read ({size} bytes, then {whole + len(tail)}): "
                          "is another program writing it?")
        start = b'{"binding":'  # how a header (canonical: sorted keys) begins
        if not whole and tail and not (tail.startswith(start) or start.startswith(tail)):  # no header, nor a torn one
            self.close()
            raise NVError(f"{self.path} is not a NightVision journal (version {VERSION}): use a new --journal path")
        self._end = whole
        if tail and not self.readonly:
            log.warning("journal %s: dropping a torn last line (%d bytes, an interrupted write)", self.path, len(tail))
            os.ftruncate(self._fd, whole)
            os.fsync(self._fd)

    def _load(self, entry: dict, line: int, offset: int, length: int) -> None:
        if isinstance(entry.get("r"), str) and _valid_record(entry.get("d")):
            self._remember(entry["r"], entry["d"], offset, length)
        elif isinstance(entry.get("v"), str) and entry.get("c") == len(self.columns):
            self.columns[entry["v"]] = entry["c"]
        else:
            self.close()
            raise NVError(f"journal {self.path}: line {line} is not a response or a column entry, so the journal cannot "
                          f"be trusted {_RECOVER.format(keep=line - 1)}")

    def _remember(self, key: str, record: dict, offset: int, length: int) -> None:
        """Index a reply's line and count its tokens."""
        self._index.add(_prefix(key), offset, length)
        self.prompt_tokens += int(record.get("p", 0))
        self.output_tokens += int(record.get("o", 0))
        self.unidentified += sum(c[0] is None for c in record.get("c", ()))

    # -- writing -----------------------------------------------------------------------------

    def _append(self, entry: dict) -> tuple[int, int]:
        """Write one line; its offset and length."""
        data = (canonical(entry) + "\n").encode()
        offset, length = self._end, len(data)
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError:  # a full disk: the part written is cut off, so a later line cannot land after a torn one
            os.ftruncate(self._fd, self._end)
            raise
        self._end += length
        return offset, length

    def _line(self, offset: int, length: int) -> dict:
        """The entry of the line at ``offset`` (reads may come back short)."""
        data = b""
        while len(data) < length:
            chunk = os.pread(self._fd, length - len(data), offset + len(data))
            if not chunk:
                break
            data += chunk
        try:
            entry = _strict_json(data)
            if not isinstance(entry, dict):
                raise ValueError
            return entry
        except ValueError:
            raise NVError(f"journal {self.path}: the line at byte {offset} is no longer what was read there: "
                          "was the file changed during the attack?") from None

    def get(self, key: str) -> dict | None:
        """The paid reply to request ``key``, or None."""
        for offset, length in sorted(self._index.places(_prefix(key)), reverse=True):  # a key paid twice: the last
            entry = self._line(offset, length)
            if entry.get("r") == key:
                return entry["d"]
        return None

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def put(self, key: str, record: dict) -> None:
        """Append one paid response (written at once; durable at the next ``sync``)."""
        self._remember(key, record, *self._append({"r": key, "d": record}))

    def column(self, token: str) -> int:
        """The stable column of a token key, assigned (and journaled) on first sight."""
        if token not in self.columns:
            self._append({"v": token, "c": len(self.columns)})
            self.columns[token] = len(self.columns)
        return self.columns[token]

    def sync(self) -> None:
        if self._fd is not None and self.path is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:  # an oracle's own journal (``path=None``) is dropped, not closed
        self.close()

    @property
    def requests(self) -> int:
        """Paid replies (a key paid twice, by two requests in flight at once, counts twice, as it was billed)."""
        return self._index.size

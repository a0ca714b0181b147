"""The persistent store of measured speeds that the autotune policy reads.

One SQLite file in WAL mode, shared by every process that tunes on the machine. The first
committed result for a key wins, so concurrent tuners converge on one answer. A file that
is not a readable store of this schema is moved aside and replaced by an empty one (a cache:
losing it costs a re-measurement). ``sqlite3`` is imported when a store is opened.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext, suppress
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any, TypeVar

from kernreg._fork import Lock
from kernreg._frozen import Frozen
from kernreg.errors import KernregError
from kernreg.measurement import Measurement, TuningDataError

if TYPE_CHECKING:
    import sqlite3

__all__ = [
    "SCHEMA_VERSION",
    "Demotion",
    "Measurement",
    "TuningDataError",
    "TuningKey",
    "TuningStore",
    "TuningStoreError",
    "TuningStoreWarning",
]

#: Version of the tables below, kept in the file's ``PRAGMA user_version``. A file of
#: another version is moved aside, never migrated: its contents are only measurements.
SCHEMA_VERSION = 1

#: ``PRAGMA application_id`` of a kernreg tuning store ("KRtn"): tells our files from
#: other SQLite databases that happen to sit at the same path.
APPLICATION_ID = 0x4B52746E

#: ``format`` of the JSON that :meth:`TuningStore.export_json` writes.
EXPORT_FORMAT = "kernreg-tuning"
EXPORT_VERSION = 1

#: The longest text :meth:`TuningStore.import_json` reads (about a million entries).
MAX_IMPORT_CHARS = 256 * 1024 * 1024

_FILENAME = "tuning.sqlite3"

# Name, then the columns in order: how the file is checked when it is opened.
_TABLES = (
    ("entries", ("id", "op", "platform", "implementations", "dtypes", "bucket", "created_at")),
    ("measurements", ("entry_id", "label", "median_ns", "spread_ns", "repeats")),
)

_SCHEMA = (
    """CREATE TABLE entries (
        id INTEGER PRIMARY KEY,
        op TEXT NOT NULL,
        platform TEXT NOT NULL,
        implementations TEXT NOT NULL,
        dtypes TEXT NOT NULL,  -- JSON array of dtype names, in the key's order
        bucket TEXT NOT NULL,
        created_at REAL NOT NULL,  -- Unix time of the put that stored the entry
        UNIQUE (op, platform, implementations, dtypes, bucket)
    )""",
    """CREATE TABLE measurements (
        entry_id INTEGER NOT NULL REFERENCES entries (id) ON DELETE CASCADE,
        label TEXT NOT NULL,
        median_ns REAL NOT NULL,
        spread_ns REAL NOT NULL,
        repeats INTEGER NOT NULL,
        PRIMARY KEY (entry_id, label)
    ) WITHOUT ROWID""",
)

# Demotions (docs/fallbacks.md) sit in a table created where missing, outside _TABLES:
# older kernreg releases, which check only their own tables, read a store that has it.
_DEMOTIONS = """CREATE TABLE IF NOT EXISTS demotions (
    op TEXT NOT NULL,
    platform TEXT NOT NULL,
    dtypes TEXT NOT NULL,  -- JSON array of dtype names, as in entries
    bucket TEXT NOT NULL,  -- the call's shape bucket, as in entries
    implementation TEXT NOT NULL,  -- label=target@distribution version
    error TEXT NOT NULL,  -- the exception's type and message
    created_at REAL NOT NULL,
    PRIMARY KEY (op, platform, dtypes, bucket, implementation)
) WITHOUT ROWID"""

_FIX = "set KERNREG_CACHE_DIR to a writable directory, or pass another path to TuningStore"
_RETRY = "retry, or raise TuningStore(timeout=...)"

# A forked child never closes the connections it inherited: closing one there could disturb
# the parent's locks and write-ahead log, so they are kept referenced and never used again.
_INHERITED: list[Any] = []

_T = TypeVar("_T")


class TuningStoreError(KernregError, OSError):
    """The tuning store cannot be used at ``path``: the message says why and what to do."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        super().__init__(message)


class TuningStoreWarning(UserWarning):
    """The tuning store was damaged or foreign, and was set aside and rebuilt empty."""


class _DamagedRowError(Exception):
    """A row SQLite reads fine but kernreg cannot have written (edited by hand or another tool)."""


class TuningKey(Frozen):
    """What a tuning result is valid for: an op, on a platform (a fingerprint such as
    ``"cuda:9.0|torch=2.13.0|cuda=12.4"``), among a candidate set with its versions, for the
    dtypes (in argument order) and shape bucket of a call."""

    __slots__ = ("op", "platform", "implementations", "dtypes", "bucket")
    op: str
    platform: str
    implementations: str
    dtypes: tuple[str, ...]
    bucket: str

    def __init__(
        self, op: str, platform: str, implementations: str, dtypes: Sequence[str], bucket: str
    ) -> None:
        values = (op, platform, implementations, dtypes, bucket)
        for name, value in zip(self._fields, values, strict=True):
            if name != "dtypes" and not isinstance(value, str):
                raise TypeError(f"TuningKey.{name} must be a str, not {type(value).__name__}")
        if not op:
            raise ValueError("TuningKey.op must not be empty")
        if not isinstance(dtypes, (tuple, list)):
            what = type(dtypes).__name__
            raise TypeError(f"TuningKey.dtypes must be a tuple of dtype names, not {what}")
        if not all(isinstance(d, str) for d in dtypes):
            raise TypeError(f"TuningKey.dtypes must hold only str, got {dtypes!r}")
        for name, value in zip(self._fields, values, strict=True):
            self._set(name, tuple(value) if name == "dtypes" else value)

    def describe(self) -> dict[str, Any]:
        """The key as JSON-ready data; :meth:`from_description` reads it back."""
        return {**{name: getattr(self, name) for name in self._fields}, "dtypes": list(self.dtypes)}

    @classmethod
    def from_description(cls, data: Mapping[str, Any]) -> TuningKey:
        """The key that :meth:`describe` described; ``TuningDataError`` if ``data`` is not one."""
        if not isinstance(data, Mapping):
            raise TuningDataError(f"a tuning key must be an object, not {type(data).__name__}")
        if set(data) != set(cls._fields):
            missing = sorted(set(cls._fields) - set(data))
            extra = sorted(set(data) - set(cls._fields))
            raise TuningDataError(
                f"a tuning key has exactly the fields {', '.join(cls._fields)}"
                + (f"; missing {', '.join(missing)}" if missing else "")
                + (f"; unknown {', '.join(extra)}" if extra else "")
            )
        try:
            return cls(**data)
        except (TypeError, ValueError) as exc:
            raise TuningDataError(str(exc)) from None

    def _row(self) -> tuple[str, str, str, str, str]:
        dtypes = _dump_dtypes(self.dtypes)
        return (self.op, self.platform, self.implementations, dtypes, self.bucket)


class Demotion(Frozen):
    """An implementation (``label=target@distribution version``: a new version is tried
    again) that raised ``error`` under the demotion policy, demoted for ``op`` on ``platform``
    for calls with ``dtypes`` in shape ``bucket`` (:func:`kernreg.autotune.shape_bucket`)."""

    __slots__ = ("op", "implementation", "platform", "dtypes", "bucket", "error")
    op: str
    implementation: str
    platform: str
    dtypes: tuple[str, ...]
    bucket: str
    error: str

    def __init__(
        self,
        op: str,
        implementation: str,
        platform: str,
        dtypes: Sequence[str],
        bucket: str,
        error: str,
    ) -> None:
        fields = (op, implementation, platform, bucket, error, *dtypes)
        if not all(isinstance(v, str) for v in fields):
            raise TypeError(f"the fields of a Demotion are strings: {op!r}, {implementation!r}")
        values = (op, implementation, platform, tuple(dtypes), bucket, error)
        for name, value in zip(self._fields, values, strict=True):
            self._set(name, value)

    @property
    def label(self) -> str:
        """The implementation's label (``triton``, ``aot/sm90``)."""
        return self.implementation.partition("=")[0]

    @property
    def where(self) -> tuple[str, str, tuple[str, ...]]:
        """What a decision looks it up by: ``(op, platform, dtypes)``."""
        return (self.op, self.platform, self.dtypes)

    def describe(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "implementation": self.label,
            "target": self.implementation.partition("=")[2],
            "platform": self.platform,
            "dtypes": list(self.dtypes),
            "bucket": self.bucket,
            "error": self.error,
        }

    def __str__(self) -> str:
        device, dtypes = self.platform.partition("|")[0], ", ".join(self.dtypes) or "any dtype"
        where = f"{device}, {dtypes}, shape bucket {self.bucket}"
        return f"op '{self.op}': {self.label} is demoted on {where} after it raised {self.error}"

    def _row(self) -> tuple[str, ...]:
        dtypes = _dump_dtypes(self.dtypes)
        return (self.op, self.platform, dtypes, self.bucket, self.implementation, self.error)


def _dump_dtypes(dtypes: tuple[str, ...]) -> str:
    return json.dumps(list(dtypes), separators=(",", ":"))


def _load_dtypes(text: object) -> tuple[str, ...]:
    """The dtypes column read back; ``ValueError`` for anything but a JSON array of names."""
    try:
        dtypes = json.loads(text) if isinstance(text, str) else None
    except RecursionError:
        raise ValueError("dtypes are nested too deeply") from None
    if not isinstance(dtypes, list) or not all(isinstance(d, str) for d in dtypes):
        raise ValueError(f"dtypes {text!r:.80} is not an array of dtype names")
    return tuple(dtypes)


def _check_results(results: Mapping[str, Measurement]) -> list[tuple[str, Measurement]]:
    if not isinstance(results, Mapping):
        raise TypeError(f"results must be a mapping of label to Measurement, not {results!r}")
    if not results:
        raise ValueError("results must hold at least one measurement")
    for label, value in results.items():
        if not isinstance(label, str) or not label:
            raise TypeError(f"result labels must be non-empty str, got {label!r}")
        if not isinstance(value, Measurement):
            raise TypeError(f"result {label!r} must be a Measurement, not {type(value).__name__}")
        # Measurement checks its fields, but Measurement.replace does not re-check them.
        if not (math.isfinite(value.median_ns) and math.isfinite(value.spread_ns)):
            raise ValueError(f"result {label!r} is not finite: {value!r}")
    return sorted(results.items())


def _is_corruption(exc: BaseException) -> bool:
    import sqlite3

    if not isinstance(exc, sqlite3.DatabaseError) or isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)  # Python >= 3.11
    if code is not None:
        return code & 0xFF in (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB
    text = str(exc)
    return "malformed" in text or "not a database" in text


class TuningStore:
    """The persistent tuning results of this machine: ``TuningKey`` -> label -> ``Measurement``
    in the SQLite file ``path`` (default :meth:`default_path`); threads may share a store.
    ``timeout`` is how long a write waits for other processes before :class:`TuningStoreError`."""

    def __init__(
        self, path: str | os.PathLike[str] | None = None, *, timeout: float = 30.0
    ) -> None:
        self.path: str = os.path.abspath(self.default_path() if path is None else os.fspath(path))
        self.timeout = float(timeout)
        self._lock = Lock()
        self._identity: tuple[int, int] | None = None
        self._closed = False
        # Keyed by process: a connection must not cross fork() (see _INHERITED).
        self._connections: dict[int, sqlite3.Connection] = {os.getpid(): self._open()}

    @staticmethod
    def default_path() -> str:
        """``$KERNREG_CACHE_DIR/tuning.sqlite3``, else ``tuning.sqlite3`` in kernreg's user
        cache directory (``platformdirs``, else ``$XDG_CACHE_HOME`` or ``~/.cache``)."""
        configured = os.environ.get("KERNREG_CACHE_DIR", "").strip()
        if configured:
            return os.path.join(os.path.abspath(os.path.expanduser(configured)), _FILENAME)
        try:
            platformdirs = importlib.import_module("platformdirs")
        except ImportError:
            base = os.environ.get("XDG_CACHE_HOME", "").strip()
            if not base or not os.path.isabs(base):  # the XDG spec ignores relative paths
                base = os.path.join(os.path.expanduser("~"), ".cache")
            return os.path.join(base, "kernreg", _FILENAME)
        return os.path.join(str(platformdirs.user_cache_dir("kernreg")), _FILENAME)

    def get(self, key: TuningKey) -> dict[str, Measurement] | None:
        """The measurements stored for ``key`` (label -> Measurement), or ``None``."""
        _check_key(key)
        found = self._run(lambda conn: _select(conn, key))
        return found[0][1] if found else None

    def put(self, key: TuningKey, results: Mapping[str, Measurement]) -> dict[str, Measurement]:
        """Store ``results`` for ``key`` unless it has results already; return what is stored
        (the first process to commit a key wins; the write is durable on return)."""
        _check_key(key)
        rows = _check_results(results)

        def insert(conn: sqlite3.Connection) -> dict[str, Measurement]:
            _insert(conn, key, rows, time.time())
            ((_, stored),) = _select(conn, key)  # inserted, or found, in this transaction
            return stored

        return self._run(insert, write=True)

    def entries(self) -> list[tuple[TuningKey, dict[str, Measurement]]]:
        """Every stored entry, sorted by key (op, platform, implementations, dtypes, bucket)."""
        return self._run(_select)

    def export_json(self) -> str:
        """All entries as JSON text, sorted and indented so equal stores export equal text."""
        entries = [
            {"key": key.describe(), "results": {label: m.describe() for label, m in found.items()}}
            for key, found in self.entries()
        ]
        document = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "entries": entries}
        return json.dumps(document, indent=2, sort_keys=True, allow_nan=False) + "\n"

    def import_json(self, text: str) -> int:
        """Merge JSON written by :meth:`export_json`, all checked before any is written;
        return how many keys were added (stored keys keep their results)."""
        items = _parse_export(text)
        now = time.time()
        return self._run(lambda conn: sum(_insert(conn, *item, now) for item in items), write=True)

    def demote(self, demotion: Demotion) -> bool:
        """Record ``demotion`` until it is cleared; ``False`` when it was recorded already."""
        insert = "INSERT OR IGNORE INTO demotions VALUES (?, ?, ?, ?, ?, ?, ?)"
        row = (*demotion._row(), time.time())
        return self._run(lambda conn: conn.execute(insert, row).rowcount == 1, write=True)

    def demotions(self) -> list[Demotion]:
        """Every recorded demotion, sorted by op, platform, dtypes, bucket and implementation."""
        return self._run(_read_demotions)

    def clear_demotions(self, pattern: str = "*") -> list[Demotion]:
        """Forget the demotions of the ops ``pattern`` (an op id or glob) matches; return them."""

        def wipe(conn: sqlite3.Connection) -> list[Demotion]:
            gone = [d for d in _read_demotions(conn) if fnmatchcase(d.op, pattern)]
            conn.executemany(
                "DELETE FROM demotions WHERE op = ? AND platform = ? AND dtypes = ?"
                " AND bucket = ? AND implementation = ?",
                [d._row()[:5] for d in gone],
            )
            return gone

        return self._run(wipe, write=True)

    def clear(self) -> None:
        """Forget every stored result (measurements go with their entries: ON DELETE CASCADE)."""
        self._run(lambda conn: conn.execute("DELETE FROM entries"), write=True)

    def close(self) -> None:
        """Close the connection; the store cannot be used afterwards."""
        with self._lock:
            self._closed = True
            self._drop_connection()

    def __del__(self) -> None:
        # A store dropped in a forked child leaves what it inherited open (see _INHERITED).
        connections = getattr(self, "_connections", {})
        if os.getpid() not in connections:
            _INHERITED.extend(connections.values())

    def __enter__(self) -> TuningStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TuningStore({self.path!r})"

    def _run(self, operation: Callable[[sqlite3.Connection], _T], *, write: bool = False) -> _T:
        """Run ``operation`` (``write``: in one transaction); retry once on a rebuilt store."""
        import sqlite3

        with self._lock:
            for retry in (True, False):
                try:
                    conn = self._connection()
                    with _transaction(conn) if write else nullcontext():
                        return operation(conn)
                except sqlite3.Error as exc:
                    if not (retry and _is_corruption(exc)):
                        raise self._error(exc) from exc
                    self._drop_connection()
                except _DamagedRowError as exc:
                    # SQLite finds nothing wrong, so opening again would not set it aside.
                    self._drop_connection()
                    if not retry:
                        raise self._error(exc) from exc
                    with self._exclusive():
                        self._set_aside("corrupt", f"is damaged ({exc})")
            raise AssertionError("unreachable")  # pragma: no cover

    def _connection(self) -> sqlite3.Connection:
        if self._closed:
            raise TuningStoreError(self.path, f"tuning store {self.path} is closed")
        if os.getpid() in self._connections and self._identity != _identity(self.path):
            # The file was replaced (set aside by another process, or deleted): follow the path.
            self._drop_connection()
        if os.getpid() not in self._connections:
            _INHERITED.extend(self._connections.values())
            self._connections = {os.getpid(): self._open()}
        return self._connections[os.getpid()]

    def _drop_connection(self) -> None:
        conn = self._connections.pop(os.getpid(), None)
        if conn is not None:
            conn.close()

    def _open(self) -> sqlite3.Connection:
        """Connect, check the file, and rebuild it if it is damaged or foreign."""
        import sqlite3

        directory = os.path.dirname(self.path)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            why = f"cannot create the tuning store directory {directory} ({exc.strerror or exc})"
            raise self._unusable(why) from None
        if os.path.isdir(self.path):
            raise self._unusable(f"tuning store path {self.path} is a directory")
        if not os.access(directory, os.W_OK | os.X_OK) or (
            os.path.exists(self.path) and not os.access(self.path, os.R_OK | os.W_OK)
        ):
            why = f"the store needs to create and write files in {directory}"
            raise self._unusable(f"tuning store {self.path} is not writable ({why})")
        with self._exclusive():
            for _ in range(4):  # at worst: set aside, create, check
                try:
                    conn = sqlite3.connect(
                        self.path,
                        timeout=self.timeout,
                        isolation_level=None,
                        check_same_thread=False,
                    )
                except sqlite3.Error as exc:
                    raise self._error(exc) from exc
                try:
                    problem = _inspect(conn)
                    if problem is None:
                        _configure(conn)
                        self._identity = _identity(self.path)
                        return conn
                    if problem == ("empty", ""):
                        _create_schema(conn)
                except sqlite3.Error as exc:
                    conn.close()
                    if not _is_corruption(exc):
                        raise self._error(exc) from exc
                    problem = ("corrupt", f"is damaged ({exc})")
                conn.close()
                if problem != ("empty", ""):  # a new store is checked on the next round
                    self._set_aside(*problem)
        raise self._unusable(f"cannot rebuild the tuning store {self.path}")

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the store's lock file, so that two processes never both replace a damaged file."""
        if sys.platform == "win32":  # pragma: no cover - no fcntl; SQLite's own locks remain
            yield
            return
        import fcntl

        lock_path = self.path + ".lock"
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            why = f"cannot create the lock file {lock_path} ({exc.strerror})"
            raise self._unusable(why) from None
        try:
            deadline = time.monotonic() + self.timeout
            while True:
                # A POSIX record lock, not flock(): a child forked while a thread here held
                # (or waited for) a flock() kept it for its whole life, and every process
                # opening the store waited out its timeout.
                with suppress(BlockingIOError, PermissionError):  # EAGAIN or EACCES: held
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                if time.monotonic() > deadline:
                    held = f"another process held {lock_path} for more than {self.timeout:g} s"
                    raise TuningStoreError(self.path, f"{held}; {_RETRY}")
                time.sleep(0.002)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _set_aside(self, kind: str, reason: str) -> None:
        """Move the store's files aside, warning the first caller outside this module."""
        base = f"{self.path}.{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
        aside, n = base, 1
        while os.path.lexists(aside) or os.path.lexists(aside + "-wal"):
            aside, n = f"{base}-{n}", n + 1
        try:
            for suffix in ("", "-wal", "-shm", "-journal"):
                if os.path.lexists(self.path + suffix):
                    os.replace(self.path + suffix, aside + suffix)
        except OSError as exc:
            why = f"cannot be moved aside ({exc.strerror or exc}); delete it, or {_FIX}"
            unusable = f"tuning store {self.path} is unusable ({reason})"
            raise TuningStoreError(self.path, f"{unusable} and {why}") from None
        frame, level = sys._getframe(), 1
        while frame.f_back is not None and frame.f_code.co_filename == __file__:
            frame, level = frame.f_back, level + 1
        warnings.warn(
            f"kernreg tuning store {self.path} {reason}; moved it to {aside} and started an "
            "empty store (tuned kernels will be measured again)",
            TuningStoreWarning,
            stacklevel=level,
        )

    def _unusable(self, why: str) -> TuningStoreError:
        return TuningStoreError(self.path, f"{why}; {_FIX}")

    def _error(self, exc: BaseException) -> TuningStoreError:
        text = str(exc)
        if "readonly" in text or "read-only" in text:
            hint = "the file or its directory is read-only; " + _FIX
        elif "locked" in text or "busy" in text:
            hint = f"other processes held the store for more than {self.timeout:g} s; " + _RETRY
        elif "unable to open" in text:
            hint = "check that the directory exists and is writable, or " + _FIX
        else:
            hint = "delete the file to start afresh, or " + _FIX
        return TuningStoreError(self.path, f"tuning store {self.path}: {text}; {hint}")


def _check_key(key: object) -> None:
    if not isinstance(key, TuningKey):
        raise TypeError(f"expected a TuningKey, got {type(key).__name__}")


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _select(
    conn: sqlite3.Connection, key: TuningKey | None = None
) -> list[tuple[TuningKey, dict[str, Measurement]]]:
    """The stored entries (all, or ``key``'s), sorted by key."""
    where = " WHERE op = ? AND platform = ? AND implementations = ? AND dtypes = ? AND bucket = ?"
    rows = conn.execute(
        "SELECT e.id, e.op, e.platform, e.implementations, e.dtypes, e.bucket,"
        " m.label, m.median_ns, m.spread_ns, m.repeats"
        " FROM entries e JOIN measurements m ON m.entry_id = e.id"
        f"{where if key is not None else ''} ORDER BY e.id, m.label",
        () if key is None else key._row(),
    )
    found: dict[int, tuple[TuningKey, dict[str, Measurement]]] = {}
    for entry_id, op, plat, impls, dtypes, bucket, label, *measured in rows:
        try:
            if not isinstance(label, str) or not label:
                raise ValueError(f"label {label!r:.80} is not an implementation label")
            if entry_id not in found:
                found[entry_id] = (TuningKey(op, plat, impls, _load_dtypes(dtypes), bucket), {})
            found[entry_id][1][label] = Measurement(*measured)
        except (ValueError, TypeError) as exc:
            raise _DamagedRowError(f"entry {entry_id} does not decode: {exc}") from exc
    return sorted(found.values(), key=lambda item: [getattr(item[0], f) for f in item[0]._fields])


def _insert(
    conn: sqlite3.Connection, key: TuningKey, rows: list[tuple[str, Measurement]], now: float
) -> int:
    """Insert ``key`` with ``rows`` if it is new (inside the caller's transaction)."""
    cursor = conn.execute(
        "INSERT OR IGNORE INTO entries (op, platform, implementations, dtypes, bucket,"
        " created_at) VALUES (?, ?, ?, ?, ?, ?)",
        (*key._row(), now),
    )
    if cursor.rowcount != 1:
        return 0
    conn.executemany(
        "INSERT INTO measurements (entry_id, label, median_ns, spread_ns, repeats)"
        " VALUES (?, ?, ?, ?, ?)",
        [(cursor.lastrowid, label, m.median_ns, m.spread_ns, m.repeats) for label, m in rows],
    )
    return 1


def _inspect(conn: sqlite3.Connection) -> tuple[str, str] | None:
    """``None`` for a good store, ``("empty", "")`` for a new file, else ``(kind, reason)``
    (kind: ``corrupt`` or ``foreign-v<N>``)."""
    application_id = conn.execute("PRAGMA application_id").fetchone()[0]
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    tables: dict[str, tuple[str, ...]] = {}
    for name, column in conn.execute(
        "SELECT m.name, c.name FROM sqlite_master m, pragma_table_info(m.name) c"
        " WHERE m.type = 'table' AND m.name NOT LIKE 'sqlite_%' ORDER BY m.name, c.cid"
    ).fetchall():
        tables[name] = (*tables.get(name, ()), column)
    if not tables and application_id == 0 and version == 0:
        return ("empty", "")
    if application_id != APPLICATION_ID:
        return (f"foreign-v{version}", "is not a kernreg tuning store")
    if version != SCHEMA_VERSION:
        newer = "a newer" if version > SCHEMA_VERSION else "an older"
        why = f"has schema version {version}, written by {newer} kernreg"
        return (f"foreign-v{version}", f"{why} (this one reads version {SCHEMA_VERSION})")
    for name, columns in _TABLES:
        if name not in tables:
            return ("corrupt", f"is damaged (table {name!r} is missing)")
        if tables[name] != columns:
            return ("corrupt", f"is damaged (table {name!r} has columns {tables[name]})")
    check = conn.execute("PRAGMA quick_check").fetchall()
    if check != [("ok",)]:
        return ("corrupt", f"is damaged ({'; '.join(str(row[0]) for row in check[:3])})")
    return None


def _read_demotions(conn: sqlite3.Connection) -> list[Demotion]:
    rows = conn.execute(
        "SELECT op, implementation, platform, dtypes, bucket, error FROM demotions"
        " ORDER BY op, platform, dtypes, bucket, implementation"
    ).fetchall()
    try:
        return [Demotion(o, i, p, _load_dtypes(d), b, e) for o, i, p, d, b, e in rows]
    except (ValueError, TypeError) as exc:
        raise _DamagedRowError(f"a demotion does not decode: {exc}") from exc


def _configure(conn: sqlite3.Connection) -> None:
    # WAL: readers never block the writer. synchronous=FULL: a put that returned
    # survives a crash of the machine, not only of the process.
    conn.execute("PRAGMA journal_mode = WAL").fetchone()
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("PRAGMA foreign_keys = ON")
    columns = [row[1] for row in conn.execute("PRAGMA table_info(demotions)")]
    if "bucket" not in columns:  # missing (an older release), or a layout never released
        conn.execute("DROP TABLE IF EXISTS demotions")
        conn.execute(_DEMOTIONS)


def _create_schema(conn: sqlite3.Connection) -> None:
    conn.execute("PRAGMA journal_mode = WAL").fetchone()
    with _transaction(conn):
        if conn.execute("PRAGMA user_version").fetchone()[0] != 0:
            return  # created meanwhile by a process that did not take the lock file
        for statement in (*_SCHEMA, _DEMOTIONS):
            conn.execute(statement)
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


@contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    # IMMEDIATE takes the write lock up front, so a writer waits (busy timeout) instead
    # of failing when it would upgrade a read lock another writer got first.
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            with suppress(Exception):  # the first error is the one to report
                conn.execute("ROLLBACK")
        raise


def _parse_export(text: str) -> list[tuple[TuningKey, list[tuple[str, Measurement]]]]:
    if not isinstance(text, str):
        raise TypeError(f"import_json takes JSON text, not {type(text).__name__}")

    def reject_constant(name: str) -> Any:
        raise TuningDataError(f"invalid tuning JSON: {name} is not a valid measurement")

    if len(text) > MAX_IMPORT_CHARS:
        why = f"{len(text)} characters, more than the {MAX_IMPORT_CHARS} a tuning export may have"
        raise TuningDataError(f"invalid tuning JSON: {why}")
    try:
        document = json.loads(text, parse_constant=reject_constant)
        json.dumps(document, ensure_ascii=False).encode()  # a lone surrogate: SQLite refuses it
    except TuningDataError:
        raise
    except RecursionError:  # arrays or objects nested thousands deep
        raise TuningDataError("invalid tuning JSON: nested too deeply") from None
    except ValueError as exc:  # not JSON or not UTF-8, or an integer over the digit limit
        why = "a number has too many digits" if "integer string" in str(exc) else str(exc)
        raise TuningDataError(f"invalid tuning JSON: {why}") from None
    if not isinstance(document, dict) or document.get("format") != EXPORT_FORMAT:
        why = f'expected an object with "format": "{EXPORT_FORMAT}"'
        raise TuningDataError(f"invalid tuning JSON: {why} (as written by TuningStore.export_json)")
    if (version := document.get("version")) != EXPORT_VERSION:
        why = f"version {version!r} is not supported (this kernreg reads version {EXPORT_VERSION})"
        raise TuningDataError(f"invalid tuning JSON: {why}")
    entries = document.get("entries")
    if not isinstance(entries, list):
        raise TuningDataError('invalid tuning JSON: "entries" must be a list')
    items = []
    seen: dict[TuningKey, int] = {}
    for index, entry in enumerate(entries):
        where = f"invalid tuning JSON: entries[{index}]"
        if not isinstance(entry, dict) or set(entry) != {"key", "results"}:
            raise TuningDataError(f"{where} must be {{key, results}}")
        try:
            key = TuningKey.from_description(entry["key"])
        except TuningDataError as exc:
            raise TuningDataError(f"{where}.key: {exc}") from None
        if key in seen:
            raise TuningDataError(f"{where}.key repeats entries[{seen[key]}].key")
        seen[key] = index
        results = entry["results"]
        if not isinstance(results, dict) or not results:
            raise TuningDataError(f"{where}.results must be a non-empty object")
        rows = []
        for label, value in results.items():
            at = f"{where}.results[{label!r}]"
            if not label:
                raise TuningDataError(f"{where}.results has an empty label")
            if not isinstance(value, dict) or set(value) != {"median_ns", "spread_ns", "repeats"}:
                expected = "expected an object with median_ns, spread_ns and repeats"
                raise TuningDataError(f"{at}: {expected}, got {value!r:.200}")
            try:
                rows.append((label, Measurement(**value)))
            except TuningDataError as exc:
                raise TuningDataError(f"{at}: {exc}") from None
        items.append((key, sorted(rows)))
    return items

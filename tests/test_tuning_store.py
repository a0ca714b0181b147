"""The persistent tuning store: round trips, first-wins, export/import, damaged files, and
many processes writing one file at once."""

from __future__ import annotations

import itertools
import json
import os
import pickle
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from _support import BAD_INPUT_OP, BAD_INPUT_TARGET, DEEP, LONG_INT, norm_registry
from kernreg import KernelRegistry, KernelSpec, Platform
from kernreg.config import Config
from kernreg.tuning import (
    APPLICATION_ID,
    SCHEMA_VERSION,
    Demotion,
    Measurement,
    TuningDataError,
    TuningKey,
    TuningStore,
    TuningStoreError,
    TuningStoreWarning,
)

PLATFORM = "cuda:9.0|torch=2.13.0|cuda=12.4"
IMPLS = "aten=kernreg_ops._aten:rmsnorm@kernreg-ops 0.1.0;torch=kernreg_ops._torch:rmsnorm@0.1.0"


def key(bucket: str = "x=1x4096", op: str = "layernorm.rmsnorm", **fields: Any) -> TuningKey:
    values: dict[str, Any] = {
        "op": op,
        "platform": PLATFORM,
        "implementations": IMPLS,
        "dtypes": ("bfloat16",),
        "bucket": bucket,
    }
    values.update(fields)
    return TuningKey(**values)


def results(median: float = 1000.0) -> dict[str, Measurement]:
    return {"aten": Measurement(median, 12.5, 20), "torch": Measurement(median * 2, 30.0, 20)}


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "tuning.sqlite3"


@pytest.fixture
def store(store_path: Path) -> Iterator[TuningStore]:
    with TuningStore(store_path) as opened:
        yield opened


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH", "")]))
    return env


# -- keys ------------------------------------------------------------------------------


def test_key_compares_and_hashes_by_value() -> None:
    a = key(dtypes=["bfloat16", "float32"])
    b = key(dtypes=("bfloat16", "float32"))
    assert a == b
    assert hash(a) == hash(b)
    assert a.dtypes == ("bfloat16", "float32")
    assert a != key(dtypes=("float32", "bfloat16"))  # dtypes follow argument order
    assert len({a, b, key()}) == 2


def test_key_describe_round_trips() -> None:
    k = key(dtypes=("bfloat16", "float32"))
    assert k.describe() == {
        "op": "layernorm.rmsnorm",
        "platform": PLATFORM,
        "implementations": IMPLS,
        "dtypes": ["bfloat16", "float32"],
        "bucket": "x=1x4096",
    }
    assert TuningKey.from_description(json.loads(json.dumps(k.describe()))) == k


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"dtypes": "bfloat16"}, TypeError),
        ({"dtypes": ("bfloat16", 3)}, TypeError),
        ({"bucket": 4096}, TypeError),
        ({"platform": None}, TypeError),
        ({"op": ""}, ValueError),
    ],
)
def test_key_rejects_malformed_fields(fields: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        key(**fields)


# -- round trips -----------------------------------------------------------------------


def test_put_then_get_round_trips(store: TuningStore) -> None:
    assert store.get(key()) is None
    stored = store.put(key(), results())
    assert stored == results()
    assert store.get(key()) == results()
    assert store.get(key("x=2x4096")) is None


def test_results_survive_reopening(store_path: Path) -> None:
    with TuningStore(store_path) as first:
        first.put(key(), results(123.25))
    with TuningStore(store_path) as second:
        assert second.get(key()) == results(123.25)


def test_first_result_wins(store: TuningStore) -> None:
    assert store.put(key(), results(1000.0)) == results(1000.0)
    assert store.put(key(), {"triton": Measurement(1.0, 0.0, 3)}) == results(1000.0)
    assert store.get(key()) == results(1000.0)


def test_two_store_objects_share_one_file(store_path: Path) -> None:
    with TuningStore(store_path) as a, TuningStore(store_path) as b:
        a.put(key(), results(5.0))
        assert b.get(key()) == results(5.0)
        assert b.put(key(), results(6.0)) == results(5.0)


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ({}, ValueError),
        ({"aten": 12.0}, TypeError),
        ({"": Measurement(1, 0, 1)}, TypeError),
    ],
)
def test_put_rejects_malformed_results(
    store: TuningStore, bad: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        store.put(key(), bad)  # type: ignore[arg-type]
    assert store.get(key()) is None


def test_get_and_put_take_only_keys(store: TuningStore) -> None:
    with pytest.raises(TypeError, match="TuningKey"):
        store.get(("layernorm.rmsnorm",))  # type: ignore[arg-type]


def test_entries_are_sorted_whatever_the_insertion_order(tmp_path: Path) -> None:
    keys = [
        key("x=2x4096"),
        key("x=1x4096", op="activation.silu_and_mul"),
        key("x=1x4096", dtypes=("float16",)),
        key("x=1x4096", dtypes=("bfloat16", "float32")),
        key("x=1x4096"),
        key("x=1x4096", platform="cpu"),
    ]
    listings = []
    for n, order in enumerate([keys, keys[::-1], keys[2:] + keys[:2]]):
        with TuningStore(tmp_path / f"s{n}.sqlite3") as store:
            for i, k in enumerate(order):
                store.put(k, {"torch": Measurement(10.0, 1.0, 5), "aten": Measurement(i, 1, 5)})
            listings.append([(k, list(r)) for k, r in store.entries()])
    assert [k for k, _ in listings[0]] == sorted(
        keys, key=lambda k: (k.op, k.platform, k.implementations, k.dtypes, k.bucket)
    )
    assert all(labels == ["aten", "torch"] for _, labels in listings[0])
    assert listings[0] == listings[1] == listings[2]


def test_clear_forgets_everything(store: TuningStore) -> None:
    store.put(key(), results())
    store.clear()
    assert store.entries() == []
    assert store.put(key(), results(7.0)) == results(7.0)


def test_closed_store_refuses_work(store_path: Path) -> None:
    with TuningStore(store_path) as store:
        pass
    with pytest.raises(TuningStoreError, match="closed"):
        store.get(key())
    store.close()  # closing twice is harmless


def test_threads_share_one_store(store: TuningStore) -> None:
    returned: dict[int, dict[str, Measurement]] = {}

    def work(n: int) -> None:
        for i in range(25):
            store.put(key(f"t{n}-{i}"), results(n * 100 + i))
        returned[n] = store.put(key("shared"), results(n))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.entries()) == 6 * 25 + 1
    assert (
        len({json.dumps({k: m.describe() for k, m in r.items()}) for r in returned.values()}) == 1
    )
    assert store.get(key("shared")) == returned[0]


def test_writer_waits_then_reports_a_busy_store(store_path: Path) -> None:
    with TuningStore(store_path, timeout=0.2) as store:
        other = sqlite3.connect(store_path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            assert store.get(key()) is None  # readers are not blocked (WAL)
            with pytest.raises(TuningStoreError, match=r"held the store for more than 0.2 s"):
                store.put(key(), results())
            other.execute("ROLLBACK")
        finally:
            other.close()
        assert store.put(key(), results()) == results()


def test_write_refused_by_sqlite_is_a_clear_error(store: TuningStore) -> None:
    store._connection().execute("PRAGMA query_only = ON")  # what a read-only file does
    with pytest.raises(TuningStoreError, match=r"read-only; set KERNREG_CACHE_DIR"):
        store.put(key(), results())


# -- file format -----------------------------------------------------------------------


def test_file_format(store: TuningStore, store_path: Path) -> None:
    store.put(key(dtypes=("bfloat16", "float32")), results(1500.5))
    conn = sqlite3.connect(store_path)
    try:
        assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        rows = conn.execute(
            "SELECT e.op, e.dtypes, m.label, m.median_ns, m.spread_ns, m.repeats"
            " FROM entries e JOIN measurements m ON m.entry_id = e.id ORDER BY m.label"
        ).fetchall()
    finally:
        conn.close()
    # Plain columns and JSON text: readable by any SQLite client, nothing pickled.
    assert rows == [
        ("layernorm.rmsnorm", '["bfloat16","float32"]', "aten", 1500.5, 12.5, 20),
        ("layernorm.rmsnorm", '["bfloat16","float32"]', "torch", 3001.0, 30.0, 20),
    ]


def test_demotions_keep_their_shape_bucket(store: TuningStore, store_path: Path) -> None:
    small = Demotion("layernorm.rmsnorm", "fast=m:f", PLATFORM, ("float16",), "x=8", "E: a")
    large = Demotion("layernorm.rmsnorm", "fast=m:f", PLATFORM, ("float16",), "x=4096", "E: b")
    assert store.demote(large)
    assert store.demote(small)
    assert not store.demote(large)  # recorded already
    assert store.demotions() == [large, small]  # sorted by bucket as text
    conn = sqlite3.connect(store_path)
    try:
        rows = conn.execute("SELECT bucket, error FROM demotions ORDER BY bucket").fetchall()
    finally:
        conn.close()
    assert rows == [("x=4096", "E: b"), ("x=8", "E: a")]
    assert store.clear_demotions("layer*") == [large, small]
    assert store.demotions() == []


UNRELEASED_DEMOTIONS = """CREATE TABLE demotions (
    op TEXT NOT NULL, platform TEXT NOT NULL, dtypes TEXT NOT NULL,
    implementation TEXT NOT NULL, error TEXT NOT NULL, created_at REAL NOT NULL,
    PRIMARY KEY (op, platform, dtypes, implementation)) WITHOUT ROWID"""


@pytest.mark.parametrize("before", ["previous release", "unreleased layout"])
def test_a_store_without_the_demotions_table_is_read_and_gains_it(
    store_path: Path, before: str
) -> None:
    with TuningStore(store_path) as old:  # a store as the previous kernreg wrote it
        old.put(key(), results())
    _sqlite_edit(store_path, "DROP TABLE demotions")
    if before == "unreleased layout":  # a development build's table, without the bucket
        _sqlite_edit(store_path, UNRELEASED_DEMOTIONS)
    with TuningStore(store_path) as store:
        assert store.get(key()) == results()
        assert store.demotions() == []
        demotion = Demotion("layernorm.rmsnorm", "fast=m:f", PLATFORM, (), "-", "E: c")
        assert store.demote(demotion)
    with TuningStore(store_path) as again:
        assert again.demotions() == [demotion]
        assert again.get(key()) == results()


# -- export / import -------------------------------------------------------------------


def test_export_import_round_trip(tmp_path: Path) -> None:
    with TuningStore(tmp_path / "a.sqlite3") as a, TuningStore(tmp_path / "b.sqlite3") as b:
        for i in range(5):
            a.put(key(f"x={i}x4096", dtypes=("float16", "float32")), results(i + 0.5))
        text = a.export_json()
        assert text == a.export_json()
        document = json.loads(text)
        assert document["format"] == "kernreg-tuning"
        assert document["version"] == 1
        assert document["entries"][0]["results"]["aten"] == {
            "median_ns": 0.5,
            "repeats": 20,
            "spread_ns": 12.5,
        }
        assert b.import_json(text) == 5
        assert b.entries() == a.entries()
        assert b.export_json() == text
        assert b.import_json(text) == 0


def test_import_merges_first_wins(tmp_path: Path) -> None:
    with TuningStore(tmp_path / "a.sqlite3") as a, TuningStore(tmp_path / "b.sqlite3") as b:
        a.put(key("one"), results(1.0))
        a.put(key("two"), results(2.0))
        b.put(key("two"), results(99.0))
        assert b.import_json(a.export_json()) == 1
        assert b.get(key("one")) == results(1.0)
        assert b.get(key("two")) == results(99.0)


def test_empty_store_exports_an_empty_document(store: TuningStore) -> None:
    assert json.loads(store.export_json()) == {
        "entries": [],
        "format": "kernreg-tuning",
        "version": 1,
    }


def _document(*entries: object, **top: object) -> str:
    document: dict[str, object] = {"format": "kernreg-tuning", "version": 1}
    document["entries"] = list(entries)
    document.update(top)
    return json.dumps(document)


GOOD_ENTRY = {
    "key": key("good").describe(),
    "results": {"aten": {"median_ns": 1.0, "spread_ns": 0.5, "repeats": 3}},
}


def _entry(key_changes: dict[str, object] | None = None, **result: object) -> dict[str, object]:
    described = key("bad").describe()
    described.update(key_changes or {})
    measurement = {"median_ns": 1.0, "spread_ns": 0.5, "repeats": 3, **result}
    return {"key": described, "results": {"aten": measurement}}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "invalid tuning JSON"),
        ("[]", "format"),
        (json.dumps({"format": "other", "version": 1, "entries": []}), "format"),
        (_document(version=2), "version 2"),
        (_document(entries={}), "entries"),
        (_document(GOOD_ENTRY, "x"), r"entries\[1\]"),
        (_document({"key": {"op": "a.b"}, "results": {}}), "missing"),
        (_document(_entry({"dtypes": "bfloat16"})), "dtypes"),
        (_document(_entry({"colour": "red"})), "unknown colour"),
        (_document(_entry(repeats=True)), "repeats"),
        (_document(_entry(repeats=-1)), "repeats"),
        (_document(_entry(median_ns="fast")), "median_ns"),
        (_document(_entry(spread_ns=None)), "spread_ns"),
        (_document(_entry(extra=1)), "median_ns, spread_ns and repeats"),
        (_document({"key": key("e").describe(), "results": {}}), "non-empty"),
        (_document(GOOD_ENTRY, GOOD_ENTRY), "repeats entries"),
        ('{"format": "kernreg-tuning", "version": 1, "entries": [NaN]}', "NaN"),
    ],
)
def test_import_rejects_malformed_input_and_writes_nothing(
    store: TuningStore, text: str, match: str
) -> None:
    with pytest.raises(TuningDataError, match=match):
        store.import_json(text)
    assert store.entries() == []


def test_import_rejects_non_finite_numbers(store: TuningStore) -> None:
    text = _document(GOOD_ENTRY).replace('"median_ns": 1.0', '"median_ns": Infinity')
    with pytest.raises(TuningDataError, match="Infinity"):
        store.import_json(text)


# -- where the store lives -------------------------------------------------------------


def test_default_path_honours_kernreg_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNREG_CACHE_DIR", str(tmp_path / "kr-cache"))
    assert TuningStore.default_path() == str(tmp_path / "kr-cache" / "tuning.sqlite3")
    with TuningStore() as store:
        assert store.path == str(tmp_path / "kr-cache" / "tuning.sqlite3")
        store.put(key(), results())
    assert (tmp_path / "kr-cache" / "tuning.sqlite3").is_file()


def test_default_path_without_platformdirs_follows_xdg(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KERNREG_CACHE_DIR", raising=False)
    monkeypatch.setitem(sys.modules, "platformdirs", None)  # makes the import fail
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert TuningStore.default_path() == str(tmp_path / "xdg" / "kernreg" / "tuning.sqlite3")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = tmp_path / "home" / ".cache" / "kernreg" / "tuning.sqlite3"
    assert TuningStore.default_path() == str(expected)


def test_default_path_uses_platformdirs_when_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KERNREG_CACHE_DIR", raising=False)
    fake = types.ModuleType("platformdirs")
    fake.user_cache_dir = lambda appname: str(tmp_path / "pd" / appname)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "platformdirs", fake)
    assert TuningStore.default_path() == str(tmp_path / "pd" / "kernreg" / "tuning.sqlite3")
    monkeypatch.setenv("KERNREG_CACHE_DIR", str(tmp_path / "env"))
    assert TuningStore.default_path() == str(tmp_path / "env" / "tuning.sqlite3")


def test_unusable_location_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    path = blocker / "cache" / "tuning.sqlite3"
    with pytest.raises(TuningStoreError, match="KERNREG_CACHE_DIR") as info:
        TuningStore(path)
    assert str(path.parent) in str(info.value)
    assert info.value.path == str(path)


def test_directory_in_place_of_the_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "tuning.sqlite3").mkdir()
    with pytest.raises(TuningStoreError, match="is a directory"):
        TuningStore(tmp_path / "tuning.sqlite3")


@pytest.mark.skipif(
    sys.platform == "win32" or os.geteuid() == 0, reason="root ignores permission bits"
)
def test_read_only_directory_is_a_clear_error(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(TuningStoreError, match=r"not writable.*KERNREG_CACHE_DIR"):
            TuningStore(locked / "tuning.sqlite3")
    finally:
        locked.chmod(0o755)


def test_read_only_location_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Permission bits do not stop root, so the check is fed a read-only answer.
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: real_access(p, mode) and not str(p).startswith(str(locked))
    )
    with pytest.raises(TuningStoreError, match=r"not writable.*KERNREG_CACHE_DIR") as info:
        TuningStore(locked / "tuning.sqlite3")
    assert str(locked / "tuning.sqlite3") in str(info.value)
    assert pickle.loads(pickle.dumps(info.value)).path == info.value.path


# -- damaged and foreign files ---------------------------------------------------------


def _filled_store(path: Path, n: int = 300) -> None:
    with TuningStore(path) as store:
        for i in range(n):
            store.put(key(f"x={i}x4096"), results(i))


def _random_bytes(path: Path) -> None:
    path.write_bytes(os.urandom(8192))
    Path(f"{path}-wal").write_bytes(os.urandom(512))


def _short_garbage(path: Path) -> None:
    path.write_bytes(b"definitely not SQLite")


def _truncated(path: Path) -> None:
    _filled_store(path)
    data = path.read_bytes()
    assert len(data) > 8 * 4096
    path.write_bytes(data[: len(data) // 2])


def _truncated_header(path: Path) -> None:
    _filled_store(path, 3)
    path.write_bytes(path.read_bytes()[:60])


def _sqlite_edit(path: Path, *statements: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for statement in statements:
            conn.execute(statement)
    finally:
        conn.close()


def _future_version(path: Path) -> None:
    _filled_store(path, 3)
    _sqlite_edit(path, "PRAGMA user_version = 99")


def _foreign_database(path: Path) -> None:
    _sqlite_edit(path, "CREATE TABLE photos (id INTEGER, name TEXT)")


def _table_missing(path: Path) -> None:
    _filled_store(path, 3)
    _sqlite_edit(path, "DROP TABLE measurements")


def _column_changed(path: Path) -> None:
    _filled_store(path, 3)
    _sqlite_edit(path, "ALTER TABLE entries RENAME COLUMN bucket TO shape")


@pytest.mark.parametrize(
    ("damage", "kind", "match"),
    [
        (_random_bytes, "corrupt", "not a database"),
        (_short_garbage, "corrupt", "not a database"),
        (_truncated, "corrupt", "malformed|damaged"),
        (_truncated_header, "corrupt", "malformed|damaged"),
        (_future_version, "foreign-v99", "schema version 99, written by a newer kernreg"),
        (_foreign_database, "foreign-v0", "not a kernreg tuning store"),
        (_table_missing, "corrupt", "table 'measurements' is missing"),
        (_column_changed, "corrupt", "table 'entries' has columns"),
    ],
)
def test_damaged_file_is_set_aside_and_rebuilt(
    store_path: Path, damage: object, kind: str, match: str
) -> None:
    store_path.parent.mkdir(parents=True)
    damage(store_path)  # type: ignore[operator]
    before = store_path.read_bytes()
    with pytest.warns(TuningStoreWarning, match=match) as caught:
        store = TuningStore(store_path)
    assert caught[0].filename == __file__  # the warning points at the caller
    with store:
        assert store.entries() == []
        assert store.put(key(), results(3.0)) == results(3.0)
    asides = sorted(store_path.parent.glob(f"tuning.sqlite3.{kind}-*"))
    main = [p for p in asides if not p.name.endswith(("-wal", "-shm"))]
    assert len(main) == 1, asides
    assert main[0].read_bytes() == before
    with TuningStore(store_path) as reopened:  # the rebuilt file is sound: no warning
        assert reopened.get(key()) == results(3.0)


def test_file_replaced_while_open_is_followed(store: TuningStore, store_path: Path) -> None:
    store.put(key(), results())
    garbage = store_path.with_name("garbage")
    garbage.write_bytes(os.urandom(4096))
    os.replace(garbage, store_path)
    with pytest.warns(TuningStoreWarning, match="not a database"):
        assert store.get(key()) is None
    assert store.put(key(), results(2.0)) == results(2.0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_store_opened_before_fork_works_in_both_processes(store: TuningStore) -> None:
    store.put(key("parent"), results(1.0))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child process
        code = 1
        try:
            seen = store.get(key("parent")) == results(1.0)
            store.put(key("child"), results(2.0))
            code = 0 if seen else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.get(key("child")) == results(2.0)
    assert store.put(key("parent-again"), results(3.0)) == results(3.0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_a_thread_opens_the_store_leaves_it_openable(tmp_path: Path) -> None:
    # The thread is inside the store's lock file (setting a damaged file aside, its warning
    # held up) when the process forks a long-lived worker.
    path = tmp_path / "tuning.sqlite3"
    path.write_bytes(b"not a database" * 100)
    code = f"""
import os, threading, time, warnings
from kernreg.tuning import TuningStore, TuningStoreError
inside, release = threading.Event(), threading.Event()
warnings.showwarning = lambda *args, **kwargs: (inside.set(), release.wait(10))
opening = threading.Thread(target=lambda: TuningStore({str(path)!r}).close())
opening.start()
inside.wait(10)
pid = os.fork()
if pid == 0:
    time.sleep(20)
    os._exit(0)
release.set()
opening.join()
try:
    TuningStore({str(path)!r}, timeout=2).close()
    print("opened")
except TuningStoreError as exc:
    print(exc)
os.kill(pid, 9)
os.waitpid(pid, 0)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_child_env(), timeout=60
    )
    assert proc.stdout.strip() == "opened", proc.stdout + proc.stderr


# -- import cost -----------------------------------------------------------------------


def test_importing_the_module_does_not_import_sqlite3() -> None:
    subprocess.run(
        [sys.executable, "-c", "import kernreg.tuning, sys; assert 'sqlite3' not in sys.modules"],
        env=_child_env(),
        check=True,
    )


# -- many processes --------------------------------------------------------------------

WRITER = r"""
import json, os, sys, time
from kernreg.tuning import Measurement, TuningKey, TuningStore

path, writer, distinct, shared, go = sys.argv[1:6]
writer, distinct, shared = int(writer), int(distinct), int(shared)

def key(bucket):
    return TuningKey("layernorm.rmsnorm", "cuda:9.0", "aten=a;torch=t", ("bfloat16",), bucket)

open(f"{go}.ready-{writer}", "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
with TuningStore(path) as store:
    for i in range(distinct):
        if i % 5 == 0 and i // 5 < shared:
            name = f"shared-{i // 5}"
            got = store.put(key(name), {"aten": Measurement(writer, 0.0, 1), "torch": Measurement(i, 1.0, 2)})
            print(json.dumps({"shared": name, "stored": {k: m.describe() for k, m in got.items()}}), flush=True)
        got = store.put(key(f"w{writer}-{i}"), {"aten": Measurement(writer * 1000 + i, 0.5, 3)})
        assert got["aten"].median_ns == writer * 1000 + i
        print(json.dumps({"own": i, "t": time.time()}), flush=True)
        time.sleep(0.002)  # let the others in: on a busy machine a writer may not be preempted
"""


def test_many_processes_write_one_file(tmp_path: Path) -> None:
    path = tmp_path / "shared" / "tuning.sqlite3"
    go = tmp_path / "go"
    writers, distinct, shared = 8, 50, 6
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-W",
                "error",
                "-c",
                WRITER,
                *map(str, (path, w, distinct, shared, go)),
            ],
            env=_child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(writers)
    ]
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("go.ready-*"))) < writers and time.monotonic() < deadline:
        time.sleep(0.005)
    go.touch()  # all start at once, racing to create the file
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        outputs.append([json.loads(line) for line in out.splitlines()])

    # The writers really ran at the same time: some put windows overlap.
    times = [[line["t"] for line in lines if "own" in line] for lines in outputs]
    spans = sorted((t[0], t[-1]) for t in times)
    assert any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans)), spans

    with TuningStore(path) as store:
        for w, lines in enumerate(outputs):
            assert [line["own"] for line in lines if "own" in line] == list(range(distinct))
            for i in range(distinct):
                got = store.get(
                    TuningKey(
                        "layernorm.rmsnorm",
                        "cuda:9.0",
                        "aten=a;torch=t",
                        ("bfloat16",),
                        f"w{w}-{i}",
                    )
                )
                assert got == {"aten": Measurement(w * 1000 + i, 0.5, 3)}
        for s in range(shared):
            answers = {
                json.dumps(line["stored"], sort_keys=True)
                for lines in outputs
                for line in lines
                if line.get("shared") == f"shared-{s}"
            }
            assert len(answers) == 1, answers  # every writer went on with the same winner
            stored = store.get(
                TuningKey(
                    "layernorm.rmsnorm", "cuda:9.0", "aten=a;torch=t", ("bfloat16",), f"shared-{s}"
                )
            )
            assert stored is not None
            assert (
                json.dumps({k: m.describe() for k, m in stored.items()}, sort_keys=True) in answers
            )
        assert len(store.entries()) == writers * distinct + shared
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        conn.close()


KILLED_WRITER = r"""
import sys
from kernreg.tuning import Measurement, TuningKey, TuningStore

store = TuningStore(sys.argv[1])
for i in range(1_000_000):
    store.put(
        TuningKey("layernorm.rmsnorm", "cuda:9.0", "aten=a", ("bfloat16",), f"{sys.argv[2]}-{i}"),
        {"aten": Measurement(i, 0.0, 1), "torch": Measurement(2 * i, 0.0, 1)},
    )
    print(i, flush=True)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
def test_killed_writer_loses_no_returned_put(tmp_path: Path) -> None:
    path = tmp_path / "tuning.sqlite3"
    confirmed: dict[str, list[int]] = {}
    for round_, wait_for in enumerate((1, 5, 20, 60, 150)):
        proc = subprocess.Popen(
            [sys.executable, "-W", "error", "-c", KILLED_WRITER, str(path), f"r{round_}"],
            env=_child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if len(lines) >= wait_for:
                break
        proc.send_signal(signal.SIGKILL)  # in the middle of the next put
        rest, err = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL, err
        lines.extend(rest.splitlines(keepends=True))
        confirmed[f"r{round_}"] = [int(line) for line in lines if line.endswith("\n")]
        assert len(confirmed[f"r{round_}"]) >= wait_for

    with TuningStore(path) as store:  # no warning: the file is sound
        stored = {k.bucket for k, _ in store.entries()}
        for prefix, numbers in confirmed.items():
            for i in numbers:
                k = TuningKey(
                    "layernorm.rmsnorm", "cuda:9.0", "aten=a", ("bfloat16",), f"{prefix}-{i}"
                )
                assert store.get(k) == {
                    "aten": Measurement(i, 0.0, 1),
                    "torch": Measurement(2 * i, 0.0, 1),
                }
        # Nothing half-written: an entry is there with all its measurements or not at all.
        assert all(len(r) == 2 for _, r in store.entries())
        assert len(stored) >= sum(len(n) for n in confirmed.values())
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        conn.close()


# --- measurements that cannot be stored ---------------------------------------------------


def test_huge_numbers_in_measurements_are_a_named_error(tmp_path: Path) -> None:
    from kernreg.tuning import Measurement, TuningDataError, TuningKey, TuningStore

    store = TuningStore(tmp_path / "t.sqlite3")
    key = TuningKey("layernorm.rmsnorm", "cuda:9.0", "aten=a;torch=t", ("bfloat16",), "x=1")
    with pytest.raises(TuningDataError):
        store.put(key, {"aten": Measurement(10**400, 1, 3)})
    exported = (
        '{"format": "kernreg-tuning", "version": 1, "entries": [{"key": {"op": "a.b",'
        ' "platform": "cpu", "implementations": "x", "dtypes": [], "bucket": "b"},'
        ' "results": {"aten": {"median_ns": 1' + "0" * 400 + ', "spread_ns": 1, "repeats": 1}}}]}'
    )
    with pytest.raises(TuningDataError):
        store.import_json(exported)


def test_a_stored_nan_measurement_is_set_aside_not_decided_on(tmp_path: Path) -> None:
    import sqlite3

    from kernreg.tuning import Measurement, TuningKey, TuningStore

    path = tmp_path / "t.sqlite3"
    store = TuningStore(path)
    key = TuningKey("layernorm.rmsnorm", "cuda:9.0", "aten=a;torch=t", ("bfloat16",), "x=1")
    store.put(key, {"aten": Measurement(100, 1, 3), "torch": Measurement(200, 1, 3)})
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE measurements SET median_ns = 'nan'")
    with pytest.warns(TuningStoreWarning, match="damaged"):
        assert store.get(key) is None
    assert store.entries() == []


# --- a damaged store is set aside and rebuilt, never a crash ------------------------------


KEY = TuningKey(BAD_INPUT_OP, "cuda:9.0|torch=-|runtime=-", "torch=a:b", ("bfloat16",), "x=1024")
RESULT = {"torch": Measurement(100.0, 1.0, 5), "triton": Measurement(50.0, 1.0, 5)}


def _sql(path: Path, *statements: str) -> None:
    conn = sqlite3.connect(path)
    try:
        for statement in statements:
            conn.execute(statement)
        conn.commit()
    finally:
        conn.close()


def _truncate(fraction: float) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * fraction)])

    return damage


STORE_DAMAGE: list[tuple[str, Callable[[Path], None], str]] = [
    ("truncated-to-header", _truncate(0.02), "corrupt"),
    ("truncated-half", _truncate(0.5), "corrupt"),
    ("garbage", lambda p: p.write_bytes(b"not a database at all" * 100), "corrupt"),
    ("future-schema", lambda p: _sql(p, "PRAGMA user_version = 2"), "foreign-v2"),
    ("foreign-application", lambda p: _sql(p, "PRAGMA application_id = 7"), "foreign-v1"),
    ("table-dropped", lambda p: _sql(p, "DROP TABLE measurements"), "corrupt"),
    (
        "column-renamed",
        lambda p: _sql(p, "ALTER TABLE entries RENAME COLUMN bucket TO shape"),
        "corrupt",
    ),
    (
        "median-edited-to-text",
        lambda p: _sql(p, "UPDATE measurements SET median_ns = 'fast'"),
        "corrupt",
    ),
    (
        "repeats-edited-to-text",
        lambda p: _sql(p, "UPDATE measurements SET repeats = 'many'"),
        "corrupt",
    ),
    ("dtypes-edited-not-json", lambda p: _sql(p, "UPDATE entries SET dtypes = 'bf16'"), "corrupt"),
    ("dtypes-edited-to-number", lambda p: _sql(p, "UPDATE entries SET dtypes = '3'"), "corrupt"),
]


@pytest.fixture
def built_store_path(tmp_path: Path) -> Path:
    path = tmp_path / "cache" / "tuning.sqlite3"
    with TuningStore(path) as store:
        store.put(KEY, RESULT)
        store.put(TuningKey(BAD_INPUT_OP, "cpu|torch=-|runtime=-", "torch=a:b", (), "-"), RESULT)
    return path


@pytest.mark.parametrize(
    ("damage", "aside"), [pytest.param(d, a, id=name) for name, d, a in STORE_DAMAGE]
)
@pytest.mark.parametrize("read", ["get", "entries", "put"])
def test_a_damaged_tuning_store_is_set_aside_and_rebuilt_never_a_crash(
    built_store_path: Path, damage: Callable[[Path], None], aside: str, read: str
) -> None:
    damage(built_store_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = TuningStore(built_store_path)
        try:
            other = TuningKey(BAD_INPUT_OP, "cpu|torch=-|runtime=-", "torch=a:b", ("float32",), "-")
            if read == "get":
                found = store.get(KEY)
                assert found in (None, RESULT)
            elif read == "entries":
                assert all(results == RESULT for _, results in store.entries())
            else:
                assert store.put(other, RESULT) == RESULT
            # Whatever happened, the store works afterwards, to the last row.
            assert store.put(other, RESULT) == RESULT
            assert store.get(other) == RESULT
            assert all(results == RESULT for _, results in store.entries())
        finally:
            store.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, TuningStoreWarning)]
    assert [w for w in caught if not issubclass(w.category, TuningStoreWarning)] == []
    assert len(messages) == 1, messages
    assert str(built_store_path) in messages[0]
    assert any(
        name.startswith(f"tuning.sqlite3.{aside}-") for name in os.listdir(built_store_path.parent)
    )


def test_a_registry_whose_store_was_hand_edited_decides_instead_of_crashing(
    tmp_path: Path, targets: None
) -> None:
    reg = KernelRegistry(config=Config(policy=("*",)), platform=Platform.parse("cpu"))
    reg.register(KernelSpec(BAD_INPUT_OP, "torch", "hard_targets:ref", reference=True))
    reg.register(KernelSpec(BAD_INPUT_OP, "fast", BAD_INPUT_TARGET, priority=1))
    reg.register(KernelSpec(BAD_INPUT_OP, "faster", BAD_INPUT_TARGET, priority=1, variant="v2"))
    store = TuningStore(tmp_path / "tuning.sqlite3")
    reg.use_tuning_store(store)
    plat = reg.platform
    reg.record_measurements(
        BAD_INPUT_OP,
        plat,
        None,
        "x=8",
        {"fast": Measurement(10, 0, 3), "faster/v2": Measurement(5, 0, 3)},
    )
    _sql(tmp_path / "tuning.sqlite3", "UPDATE measurements SET median_ns = 'quick'")
    fresh = KernelRegistry(config=Config(policy=("*",)), platform=Platform.parse("cpu"))
    for spec in reg.all_specs():
        fresh.register(spec)
    fresh.use_tuning_store(TuningStore(tmp_path / "tuning.sqlite3"))
    with pytest.warns(TuningStoreWarning, match="is damaged"):
        decision = fresh.explain(BAD_INPUT_OP, bucket="x=8", autotune=True)
    assert decision.tuning  # nothing recorded any more: measure again
    store.close()


# --- hostile exports and rows edited by hand ----------------------------------------------


def _export(median: str = "1.0", spread: str = "0.5", repeats: str = "3") -> str:
    key = {"op": "a.b", "platform": "cpu", "implementations": "x", "dtypes": [], "bucket": "b"}
    return (
        '{"format": "kernreg-tuning", "version": 1, "entries": [{"key": '
        + json.dumps(key)
        + f', "results": {{"aten": {{"median_ns": {median}, "spread_ns": {spread},'
        f' "repeats": {repeats}}}}}}}]}}'
    )


HOSTILE_EXPORTS = {
    "nested arrays": "[" * DEEP + "]" * DEEP,
    "nested key": _export().replace('"dtypes": []', '"dtypes": ' + "[" * DEEP + "]" * DEEP),
    "median of 5,000 digits": _export(median=LONG_INT),
    "median of 4,000 digits": _export(median=LONG_INT[:4000]),
    "huge median": _export(median="1e999"),
    "NaN median": _export(median="NaN"),
    "Infinity spread": _export(spread="Infinity"),
    "negative median": _export(median="-5"),
    "huge repeats": _export(repeats=LONG_INT[:4000]),
    "fractional repeats": _export(repeats="2.5"),
    "boolean median": _export(median="true"),
    # A lone surrogate is valid JSON but no text SQLite can store.
    "surrogate in a key": _export().replace('"a.b"', '"a.\\ud800"'),
    "surrogate in a label": _export().replace('"aten"', '"\\udc00"'),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_EXPORTS))
def test_hostile_tuning_export_is_a_tuning_data_error(name: str, tmp_path: Path) -> None:
    with TuningStore(tmp_path / "t.sqlite3") as store:
        with pytest.raises(TuningDataError, match="invalid tuning JSON"):
            store.import_json(HOSTILE_EXPORTS[name])
        assert store.entries() == []


@pytest.mark.parametrize(
    ("median", "spread", "repeats"),
    [
        (float("nan"), 0.0, 1),
        (1.0, float("nan"), 1),
        (float("inf"), 0.0, 1),
        (-1.0, 0.0, 1),
        (10**400, 0.0, 1),
        pytest.param(10**5000, 0.0, 1, id="median-of-5000-digits"),
        (1.0, 0.0, float("nan")),
        (1.0, 0.0, float("inf")),
        (1.0, 0.0, 10**400),
        (1.0, 0.0, -1),
        (1.0, 0.0, 1.5),
        ("1", 0.0, 1),
        (True, 0.0, 1),
        (1.0, 0.0, None),
    ],
)
def test_a_measurement_that_cannot_be_measured_is_a_tuning_data_error(
    median: object, spread: object, repeats: object
) -> None:
    with pytest.raises(TuningDataError, match="Measurement"):
        Measurement(median, spread, repeats)  # type: ignore[arg-type]


HAND_EDITS = {
    "median nan as text": "UPDATE measurements SET median_ns = 'nan' WHERE label = 'fast'",
    "spread nan as text": "UPDATE measurements SET spread_ns = 'NaN' WHERE label = 'fast'",
    "median inf": "UPDATE measurements SET median_ns = 9e999 WHERE label = 'fast'",
    "median negative": "UPDATE measurements SET median_ns = -5 WHERE label = 'fast'",
    "median as words": "UPDATE measurements SET median_ns = 'fast' WHERE label = 'fast'",
    "repeats as words": "UPDATE measurements SET repeats = 'many' WHERE label = 'fast'",
    "label empty": "UPDATE measurements SET label = '' WHERE label = 'fast'",
}


@pytest.mark.parametrize("edit", sorted(HAND_EDITS))
def test_a_hand_edited_row_is_set_aside_and_the_decision_goes_on(edit: str, tmp_path: Path) -> None:
    path = tmp_path / "tuning.sqlite3"
    registry = norm_registry("cpu")
    registry.configure(Config(policy="autotune"), platform=Platform.parse("cpu"))
    registry.use_tuning_store(TuningStore(path))
    measured = {
        "fast": Measurement(900, 10, 20),
        "slow": Measurement(100, 10, 20),
        "torch": Measurement(500, 10, 20),
    }
    plat = registry.platform
    registry.record_measurements("norm.rms", plat, None, "x=8", measured)
    assert registry.explain("norm.rms", bucket="x=8").chosen.backend == "slow"  # type: ignore[union-attr]
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(HAND_EDITS[edit])
    conn.close()
    fresh = norm_registry("cpu")  # another process: reads the store, not the memory
    fresh.configure(Config(policy="autotune"), platform=Platform.parse("cpu"))
    fresh.use_tuning_store(TuningStore(path))
    with pytest.warns(TuningStoreWarning, match="damaged"):
        decision = fresh.explain("norm.rms", bucket="x=8")
    assert decision.ok
    assert decision.chosen.backend == "fast"  # type: ignore[union-attr]  # measurements gone: priority
    assert list(tmp_path.glob("tuning.sqlite3.corrupt-*"))  # set aside, not deleted


def test_a_hand_edited_dtypes_column_is_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "tuning.sqlite3"
    with TuningStore(path) as store:
        store.put(TuningKey("a.b", "cpu", "x", ("float16",), "b"), {"x": Measurement(1, 0, 1)})
    for dtypes in ('"float16"', '{"float16": 1}', "[" * 5_000 + "]" * 5_000, "[1]"):
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("UPDATE entries SET dtypes = ?", (dtypes,))
        conn.close()
        with TuningStore(path) as store, pytest.warns(TuningStoreWarning, match="damaged"):
            assert store.entries() == []
        with TuningStore(path) as store:
            store.put(TuningKey("a.b", "cpu", "x", ("float16",), "b"), {"x": Measurement(1, 0, 1)})


def test_the_tuning_store_follows_a_configured_cache_dir(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    registry = norm_registry("cpu")
    registry.configure(Config(policy="autotune", cache_dir=str(a)), platform=Platform.parse("cpu"))
    measured = {
        "fast": Measurement(900, 10, 20),
        "slow": Measurement(100, 10, 20),
        "torch": Measurement(500, 10, 20),
    }
    registry.record_measurements("norm.rms", registry.platform, None, "x=8", measured)
    assert registry.explain("norm.rms", bucket="x=8").rule == "autotune"
    registry.configure(Config(policy="autotune", cache_dir=str(b)), platform=Platform.parse("cpu"))
    assert registry.tuning_store is not None
    assert registry.tuning_store.path == registry.tuning_store_path == str(b / "tuning.sqlite3")
    assert registry.explain("norm.rms", bucket="x=8").rule == "priority"  # b has no measurements
    with registry.scoped():
        registry.configure(Config(policy="autotune", cache_dir=str(a)), platform=registry.platform)
        assert registry.explain("norm.rms", bucket="x=8").rule == "autotune"
    assert registry.tuning_store.path == str(b / "tuning.sqlite3")
    assert registry.explain("norm.rms", bucket="x=8").rule == "priority"
    with TuningStore(a / "tuning.sqlite3") as given:
        registry.use_tuning_store(given)  # a store given stays, whatever is configured
        registry.configure(Config(policy="autotune", cache_dir=str(b)), platform=registry.platform)
        assert registry.tuning_store is given
        assert registry.explain("norm.rms", bucket="x=8").rule == "autotune"


# --- eight processes tune into one store at once through the registry ---------------------
# (record_measurements), and one of them is killed mid-write: the killed process must
# cost nothing that any process confirmed


PROCESSES = 8
PUTS = 40
SHARED = 5
VICTIM = 3
WORKER = r"""
import json, os, sys, time
from kernreg import KernelRegistry, KernelSpec, Platform
from kernreg.config import Config
from kernreg.tuning import Measurement

cache, writer, puts, shared, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
stop = go + ".stop"  # the others keep writing until the victim is dead (bounded below)
reg = KernelRegistry(config=Config(cache_dir=cache, policy=("*",)), platform=Platform.parse("cpu"))
reg.register(KernelSpec("hmp.op", "torch", "math:fabs", reference=True))
reg.register(KernelSpec("hmp.op", "fast", "math:floor", priority=1))
plat = reg.platform
open(f"{go}.ready-{writer}", "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
i = 0
deadline = time.monotonic() + 90  # bounded in time, not count: a starved victim still gets killed mid-write
while i < puts or (not os.path.exists(stop) and time.monotonic() < deadline):
    if i % 4 == 0:
        bucket = f"shared-{(i // 4) % shared}"
        kept = reg.record_measurements("hmp.op", plat, ("float32",), bucket, {
            "torch": Measurement(1000 + writer, 1.0, 3), "fast": Measurement(500 + writer, 1.0, 3),
        })
        print(json.dumps({"shared": bucket, "kept": {k: m.describe() for k, m in kept.items()}}), flush=True)
    kept = reg.record_measurements("hmp.op", plat, ("float32",), f"w{writer}-{i}", {
        "torch": Measurement(writer * 1000 + i, 0.5, 3), "fast": Measurement(i, 0.5, 3),
    })
    assert kept["torch"].median_ns == writer * 1000 + i
    print(json.dumps({"own": i}), flush=True)
    i += 1
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNREG_")}
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH", "")]))
    return env


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
def test_eight_tuning_processes_one_killed_mid_write(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-W",
                "error",
                "-c",
                WORKER,
                str(cache),
                str(w),
                str(10**9 if w == VICTIM else PUTS),
                str(SHARED),
                str(go),
            ],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(PROCESSES)
    ]
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("go.ready-*"))) < PROCESSES:
            assert time.monotonic() < deadline, "workers did not start"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.005)
        go.touch()  # all start at once
        victim = procs[VICTIM]
        assert victim.stdout is not None
        victim_lines = []
        for line in victim.stdout:
            victim_lines.append(line)
            if len(victim_lines) >= 15:
                break
        others_running = sum(p.poll() is None for i, p in enumerate(procs) if i != VICTIM)
        victim.send_signal(signal.SIGKILL)  # in the middle of its next write
        rest, _ = victim.communicate(timeout=30)
        Path(f"{go}.stop").touch()
        assert victim.returncode == -signal.SIGKILL
        victim_lines.extend(rest.splitlines(keepends=True))
        outputs: dict[int, list[dict[str, object]]] = {
            VICTIM: [json.loads(line) for line in victim_lines if line.endswith("\n")]
        }
        for w, proc in enumerate(procs):
            if w == VICTIM:
                continue
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            outputs[w] = [json.loads(line) for line in out.splitlines()]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    # The kill happened while others were still writing.
    assert others_running >= 1
    confirmed = {
        w: [line["own"] for line in lines if "own" in line] for w, lines in outputs.items()
    }
    for w in range(PROCESSES):
        if w != VICTIM:
            assert confirmed[w] == list(range(len(confirmed[w])))
            assert len(confirmed[w]) >= PUTS
    assert len(confirmed[VICTIM]) >= 10

    # The store opens without being set aside, and holds every confirmed measurement.
    path = cache / "tuning.sqlite3"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reg = KernelRegistry(
            config=Config(cache_dir=str(cache), policy=("*",)), platform=Platform.parse("cpu")
        )
        reg.register(KernelSpec("hmp.op", "torch", "math:fabs", reference=True))
        reg.register(KernelSpec("hmp.op", "fast", "math:floor", priority=1))
        for w, numbers in confirmed.items():
            for i in numbers:
                got = reg.measurements("hmp.op", reg.platform, ("float32",), f"w{w}-{i}")
                assert got == {
                    "torch": Measurement(w * 1000 + i, 0.5, 3),
                    "fast": Measurement(i, 0.5, 3),
                }, (w, i)
        # Shared keys: one winner, and every process went on with it.
        for s in range(SHARED):
            answers = {
                json.dumps(line["kept"], sort_keys=True)
                for lines in outputs.values()
                for line in lines
                if line.get("shared") == f"shared-{s}"
            }
            assert len(answers) == 1, answers
            stored = reg.measurements("hmp.op", reg.platform, ("float32",), f"shared-{s}")
            assert stored is not None
            assert (
                json.dumps({k: m.describe() for k, m in stored.items()}, sort_keys=True) in answers
            )
            # The decision under the autotune policy reads the winner: no measuring again.
            decision = reg.explain(
                "hmp.op", dtypes=["float32"], bucket=f"shared-{s}", autotune=True
            )
            assert decision.ok
            assert not decision.tuning
        assert reg.tuning_store is not None
        entries = reg.tuning_store.entries()
        # Nothing half-written: every entry has both of its measurements.
        assert all(len(results) == 2 for _, results in entries)
        total_confirmed = sum(len(n) for n in confirmed.values())
        assert len(entries) >= total_confirmed + SHARED
    assert not [p for p in cache.iterdir() if ".corrupt-" in p.name or ".foreign-" in p.name]
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        conn.close()
    TuningStore(path).close()


@pytest.mark.parametrize("table", ['a"b', 'entries"; DROP TABLE x; --', "sel ect", "[x]", "ü"])
def test_a_foreign_file_is_set_aside_whatever_its_tables_are_called(
    tmp_path: Path, table: str
) -> None:
    import sqlite3

    path = tmp_path / "tuning.sqlite3"
    conn = sqlite3.connect(path)
    quoted = '"' + table.replace('"', '""') + '"'
    conn.execute(f"CREATE TABLE {quoted} (x)")
    conn.commit()
    conn.close()
    with pytest.warns(TuningStoreWarning, match="is not a kernreg tuning store"):
        store = TuningStore(str(path))
    assert store.entries() == []
    (aside,) = [p for p in tmp_path.iterdir() if ".foreign-" in p.name]
    kept = sqlite3.connect(aside)
    assert kept.execute("SELECT name FROM sqlite_master").fetchall() == [(table,)]
    kept.close()

"""Selection plans (lock files): the decisions of a process, written out and replayed.

Workers follow a plan (``KERNREG_LOCK=path``), CI diffs it (``kernreg lock --check``), and
:meth:`SelectionPlan.fingerprint` lets the ranks of a job prove they run the same kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import stat
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import NoneType
from typing import Any

from kernreg._devices import driver_version, torch_build
from kernreg._names import OP_ID_RE, check_name, check_op_id, check_variant, label
from kernreg.dtypes import normalize_dtype
from kernreg.errors import ConfigError, InvalidSpecError, KernregError
from kernreg.pins import parse_pins
from kernreg.platform import Platform
from kernreg.spec import KernelSpec

__all__ = [
    "ENVIRONMENT_KEYS",
    "MAX_PLAN_BYTES",
    "MAX_PLAN_ENTRIES",
    "PLAN_FORMAT",
    "PlanEntry",
    "PlanError",
    "PlanWarning",
    "SelectionPlan",
    "capture_environment",
    "dtype_sets",
    "plan_mismatch",
    "plan_of",
]

#: The version of the plan file format this kernreg reads and writes.
PLAN_FORMAT = 1

#: The most entries a plan file may hold (500 ops x 4 platforms x 5 dtype sets x 10 buckets).
MAX_PLAN_ENTRIES = 100_000

#: The largest plan file read, in characters (``MAX_PLAN_ENTRIES`` long entries take half).
MAX_PLAN_BYTES = 32 * 1024 * 1024

#: The normalised dtypes of a call, in argument order (``None``: not given).
Dtypes = tuple[str, ...] | None
PlanKey = tuple[str, str, Dtypes, str | None]


class PlanError(KernregError, ValueError):
    """A plan file is missing, unreadable, of another format version, or malformed."""

    def __init__(self, source: str, why: str) -> None:
        self.source = source
        super().__init__(f"invalid selection plan {source}: {why}")


class PlanWarning(UserWarning):
    """A planned implementation is not available here; normal selection was used instead."""


@dataclasses.dataclass(frozen=True, slots=True)
class PlanEntry:
    """One planned decision; ``backend`` is ``""`` where there was no choice (``rule``
    ``"ambiguous"`` or ``"none"``)."""

    op: str
    platform: str
    dtypes: tuple[str, ...] | None
    backend: str
    variant: str
    rule: str
    target: str
    distribution: str | None = None
    version: str | None = None
    bucket: str | None = None

    def replace(self, **changes: Any) -> PlanEntry:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    @property
    def key(self) -> PlanKey:
        return (self.op, self.platform, self.dtypes, self.bucket)

    @property
    def label(self) -> str:
        return label(self.backend, self.variant) if self.backend else f"<{self.rule}>"

    def describe(self) -> dict[str, Any]:
        fields = {name: getattr(self, name) for name in self.__slots__}
        return {**fields, "dtypes": None if self.dtypes is None else list(self.dtypes)}

    def row(self) -> tuple[Any, ...]:
        """The entry as one row of the plan file, in field order."""
        return tuple(self.describe().values())

    def identity(self) -> tuple[Any, ...]:
        """What the fingerprint covers: which code runs, not why it was chosen."""
        return tuple(getattr(self, name) for name in self.__slots__ if name != "rule")

    def __str__(self) -> str:
        dtypes = "any dtype" if self.dtypes is None else ",".join(self.dtypes)
        if self.bucket is not None:
            dtypes += f", shapes {self.bucket}"
        return f"{self.op} on {self.platform}, {dtypes}: {self._choice()}"

    def _choice(self) -> str:
        dist = f" [{self.distribution} {self.version}]" if self.distribution else ""
        return f"{self.label} ({self.rule}){dist}"


def dtype_set(dtypes: Dtypes) -> Dtypes:
    """The dtypes a decision depends on: each dtype once, sorted."""
    return None if dtypes is None else tuple(sorted(set(dtypes)))


def entry_order(key: PlanKey) -> tuple[str, str, tuple[str, ...], str]:
    op, platform, dtypes, bucket = key
    return (op, platform, ("",) if dtypes is None else ("~", *dtypes), bucket or "")


#: What the environment record of a plan holds, in this order. ``assumed_packages`` lists
#: the ``name==version`` assumptions the package gates saw (``KERNREG_ASSUME_PACKAGES``).
ENVIRONMENT_KEYS = (
    "kernreg",
    "python",
    "torch",
    "triton",
    "cuda",
    "rocm",
    "driver",
    "assumed_packages",
)

#: A plan's environment record: version strings (``None``: not installed or not known),
#: and ``assumed_packages`` as a list of ``name==version`` strings.
Environment = Mapping[str, "str | list[str] | None"]


class SelectionPlan:
    """An immutable set of planned decisions, looked up by op, platform and dtypes. ``environment``
    records the versions they were made with (not compared, not in the fingerprint);
    ``site_pins`` (``op@module.glob=backend``) are part of both."""

    def __init__(
        self,
        entries: Iterable[PlanEntry] = (),
        *,
        source: str = "",
        environment: Environment | None = None,
        site_pins: Iterable[str] = (),
    ) -> None:
        where = source or "<plan>"
        self._entries: dict[PlanKey, PlanEntry] = {}
        #: Entries by the set of dtypes they decide for, and those sets per op, platform, bucket.
        self._lookups: dict[PlanKey, PlanEntry] = {}
        self._dtype_sets: dict[tuple[Any, ...], set[tuple[str, ...] | None]] = {}
        for entry in entries:
            same_key = self._entries.setdefault(entry.key, entry)
            dtypes = dtype_set(entry.dtypes)
            key = (entry.op, entry.platform, dtypes, entry.bucket)
            found = self._lookups.setdefault(key, entry)
            if (same_key is not entry and same_key != entry) or (
                found is not entry and found.identity()[3:] != entry.identity()[3:]
            ):
                clash = f"two entries for {entry.op} on {entry.platform}, {entry.dtypes}"
                if same_key == entry:
                    clash += ": dtypes in another order or repeated name the same decision"
                raise PlanError(where, clash)
            self._lookups[key] = entry
            self._dtype_sets.setdefault((entry.op, entry.platform, entry.bucket), set()).add(dtypes)
        self.site_pins: tuple[str, ...] = _site_pins(site_pins, where)
        self.source = source
        self.environment = None if environment is None else dict(environment)

    def lookup(
        self, op: str, platform: Platform | str, dtypes: Dtypes, bucket: str | None = None
    ) -> PlanEntry | None:
        """The planned decision for a call's ``dtypes`` (and shape ``bucket``): a mix finds
        the smallest planned set holding all of them."""
        where = str(platform)
        wanted = dtype_set(dtypes)
        found = self._lookups.get((op, where, wanted, bucket))
        if found is None and wanted:  # no dtypes are in every set, decided for none
            # What accepts all of the call's dtypes is what accepts the smallest such set.
            planned = self._dtype_sets.get((op, where, bucket), ())
            covering = [d for d in planned if d is not None and set(wanted) <= set(d)]
            best = min(covering, key=lambda d: (len(d), d), default=None)
            found = self._lookups.get((op, where, best, bucket))
        return found

    def entries(self) -> tuple[PlanEntry, ...]:
        return tuple(self._entries[key] for key in sorted(self._entries, key=entry_order))

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SelectionPlan):
            return NotImplemented
        return self._entries == other._entries and self.site_pins == other.site_pins

    __hash__ = None  # type: ignore[assignment]

    def fingerprint(self) -> str:
        """A hash of which implementation runs for every planned decision (not why)."""
        import hashlib

        digest = hashlib.sha256()
        for entry in self.entries():
            digest.update(json.dumps(entry.identity(), separators=(",", ":")).encode() + b"\n")
        for pin in self.site_pins:  # none: the fingerprint of a plan without site pins
            digest.update(json.dumps(["site_pin", pin]).encode() + b"\n")
        return digest.hexdigest()

    def to_json(self) -> str:
        """The lock file text: a header, then one sorted line per decision (diffs well)."""
        where = self.source or "<plan>"
        if len(self._entries) > MAX_PLAN_ENTRIES:  # what KERNREG_LOCK would refuse to read
            raise _too_large(where, len(self._entries), "entries", MAX_PLAN_ENTRIES, _NOT_WRITTEN)
        rows = [json.dumps(list(entry.row())) for entry in self.entries()]
        entries = "[\n    " + ",\n    ".join(rows) + "\n  ]" if rows else "[]"
        fields = json.dumps(list(PlanEntry.__slots__))
        # The record shares the header's line: one line per decision stays the file's shape.
        env = ""
        if self.environment is not None:
            env = f', "environment": {json.dumps(self.environment, sort_keys=True)}'
        pins = f',\n  "site_pins": {json.dumps(list(self.site_pins))}' if self.site_pins else ""
        text = (
            f'{{\n  "kernreg_plan": {PLAN_FORMAT}{env}{pins},\n  "fields": {fields},\n'
            f'  "entries": {entries}\n}}\n'
        )
        if len(text) > MAX_PLAN_BYTES:
            raise _too_large(where, len(text), "characters", MAX_PLAN_BYTES, _NOT_WRITTEN)
        return text

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan atomically; one that :meth:`load` would refuse raises
        :class:`PlanError` and writes nothing."""
        target = os.fspath(path)
        try:
            text = self.to_json()
            # Read back as KERNREG_LOCK will: what is written is what a worker can load.
            SelectionPlan.from_json(text, source=target)
        except PlanError as exc:
            why = str(exc).partition(": ")[2]
            raise PlanError(
                target, why if "not written" in why else f"not written: {why}"
            ) from None
        write_atomically(target, text)

    @classmethod
    def from_json(cls, text: str, *, source: str = "<text>") -> SelectionPlan:
        """Read a plan from lock-file text (anything else raises :class:`PlanError`),
        platforms and dtypes in their canonical spelling."""
        if not isinstance(text, str):
            raise PlanError(source, f"expected the text of a plan, not {type(text).__name__}")
        if len(text) > MAX_PLAN_BYTES:
            raise _too_large(source, len(text), "characters", MAX_PLAN_BYTES)
        try:
            document = json.loads(text.removeprefix("\ufeff"), object_pairs_hook=_unique_keys)
        except KeyError as exc:
            raise PlanError(source, f"key {exc.args[0]!r} appears twice in one object") from None
        except RecursionError:
            raise PlanError(source, "not a plan: arrays or objects nested too deeply") from None
        except ValueError as exc:  # JSONDecodeError, or an integer over the digit limit
            why = "a number has too many digits" if "integer string" in str(exc) else str(exc)
            raise PlanError(source, f"not JSON ({why})") from None
        if not isinstance(document, dict) or "kernreg_plan" not in document:
            why = "not a kernreg plan (no 'kernreg_plan' key); write one with `kernreg lock`"
            raise PlanError(source, why)
        version = document["kernreg_plan"]
        if type(version) is not int or version != PLAN_FORMAT:
            why = f"format {version!r}, this kernreg reads format {PLAN_FORMAT}"
            raise PlanError(source, f"{why}; regenerate it with `kernreg lock`")
        if document.get("fields") != list(PlanEntry.__slots__):
            raise PlanError(source, f"'fields' must be {list(PlanEntry.__slots__)}")
        raw = document.get("entries")
        if not isinstance(raw, list):
            raise PlanError(source, "'entries' must be a list")
        if len(raw) > MAX_PLAN_ENTRIES:
            raise _too_large(source, len(raw), "entries", MAX_PLAN_ENTRIES)
        environment = document.get("environment")
        if environment is not None and not _is_environment(environment):
            why = "'environment' must map names to version strings, null or lists of strings"
            raise PlanError(source, why)
        site_pins = document.get("site_pins", [])
        if not isinstance(site_pins, list) or not all(isinstance(p, str) for p in site_pins):
            raise PlanError(source, "'site_pins' must be a list of 'op@module.glob=backend'")
        checked: dict[Any, Any] = {}
        platforms: dict[str, str] = {}
        entries = (_entry(row, source, i, checked, platforms) for i, row in enumerate(raw))
        return cls(entries, source=source, environment=environment, site_pins=site_pins)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SelectionPlan:
        source = os.fspath(path)
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below).
            flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
            with open(os.open(source, flags), encoding="utf-8-sig") as handle:
                if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                    raise PlanError(source, "not a regular file")
                text = handle.read(MAX_PLAN_BYTES + 1)  # from_json refuses a longer text
        except (OSError, ValueError) as exc:  # ValueError: not UTF-8, or a NUL in the path
            why = getattr(exc, "strerror", None) or exc
            raise PlanError(source, f"cannot read it ({why})") from None
        return cls.from_json(text, source=source)

    def environment_drift(self, current: SelectionPlan) -> list[str]:
        """Lines naming each version that differs in ``current``'s environment record
        (``torch: 2.12.0 -> 2.13.0``); empty when either has no record."""
        if self.environment is None or current.environment is None:
            return []
        old, new = self.environment, current.environment
        keys = [k for k in ENVIRONMENT_KEYS if k in old or k in new]
        keys += sorted((set(old) | set(new)) - set(ENVIRONMENT_KEYS))
        changed = [key for key in keys if old.get(key) != new.get(key)]
        return [f"{k}: {_version_text(old.get(k))} -> {_version_text(new.get(k))}" for k in changed]

    def diff(self, current: SelectionPlan) -> list[str]:
        """Lines saying how ``current`` differs from this plan (empty: no drift)."""
        lines = [f"- site pin {p}" for p in self.site_pins if p not in current.site_pins]
        lines += [f"+ site pin {p}" for p in current.site_pins if p not in self.site_pins]
        for key in sorted(set(self._entries) | set(current._entries), key=entry_order):
            old, new = self._entries.get(key), current._entries.get(key)
            if old is None:
                lines.append(f"+ {new}")
            elif new is None:
                lines.append(f"- {old}")
            elif old.identity() != new.identity():
                lines.append(f"~ {old} -> {new._choice()}")
        return lines


#: Why :meth:`SelectionPlan.save` writes nothing: ``KERNREG_LOCK`` would refuse to read it.
_NOT_WRITTEN = ": not written; lock fewer platforms or ops"


def _too_large(source: str, size: int, unit: str, limit: int, why: str = "") -> PlanError:
    return PlanError(source, f"{size} {unit}, more than the {limit} a plan may have{why}")


def _site_pins(pins: Iterable[str], source: str) -> tuple[str, ...]:
    """Site pins in their canonical spelling, sorted."""
    texts = [pins] if isinstance(pins, str) else list(pins)
    try:
        parsed = parse_pins("pin", texts)
    except ConfigError as exc:
        raise PlanError(source, f"site pins: {exc}") from None
    if any(pin.site is None for pin in parsed):
        raise PlanError(source, f"site pins must name a site (op@module.glob=backend): {texts}")
    return tuple(sorted(str(pin) for pin in parsed))


def write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader (or a crash) sees the old file or the new,
    never a part: a temporary file beside it, then ``os.replace``."""
    import secrets

    # A fresh, unpredictable name beside the target, created exclusively (never through
    # a symlink waiting there) and removed again if anything fails; the umask applies.
    name = f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp"
    tmp = os.path.join(os.path.dirname(path), name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _version_text(value: str | list[str] | None) -> str:
    if isinstance(value, list):
        return ",".join(value) or "none"
    return "none" if value is None else value


def _is_environment(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(key, str)
        and (
            item is None
            or isinstance(item, str)
            or (isinstance(item, list) and all(isinstance(v, str) for v in item))
        )
        for key, item in value.items()
    )


def _installed_version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except Exception:  # not installed, or broken metadata: a lock file is written all the same
        return None


def capture_environment(
    assume_packages: Iterable[object] = (),
) -> dict[str, str | list[str] | None]:
    """The versions decisions are made with here (:data:`ENVIRONMENT_KEYS`), read without
    importing anything."""
    from kernreg.version import __version__

    torch_version = getattr(sys.modules.get("torch"), "__version__", None)
    build = torch_build()
    cuda, rocm = (None, None) if build is None else (build.cuda, build.hip)
    return {
        "kernreg": __version__,
        "python": "{}.{}.{}".format(*sys.version_info[:3]),
        "torch": _installed_version("torch") if torch_version is None else str(torch_version),
        "triton": _installed_version("triton"),
        "cuda": cuda or None,
        "rocm": rocm or None,
        "driver": driver_version(),
        "assumed_packages": [str(a) for a in assume_packages],
    }


#: The types of a plan row's fields, in PlanEntry's field order (dtypes' items checked apart).
_ROW_TYPES = (*[(str,)] * 2, (list, NoneType), *[(str,)] * 4, *[(str, NoneType)] * 3)
#: The field types of every well-formed row as ``json.loads`` gives them: one lookup a row.
_ROW_SHAPES = frozenset(itertools.product(*_ROW_TYPES))


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (JSON keeps the last one silently)."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise KeyError(key)  # json.loads raises no KeyError of its own
        seen.add(key)
    return dict(pairs)


def _entry(
    row: Any, source: str, index: int, checked: dict[Any, Any], platforms: dict[str, str]
) -> PlanEntry:
    """Plan row ``index`` as an entry. ``checked`` maps each (platform, backend, variant,
    dtypes) seen to its canonical platform and dtypes: rows repeat a few, and checking them
    took 2.5 µs a row (25 of the 70 ms of loading 10,000, benchmarks/bench_plan.py)."""
    key = None
    if type(row) is list and tuple(map(type, row)) in _ROW_SHAPES:
        key = (row[1], row[3], row[4], None if row[2] is None else tuple(row[2]))
        try:
            if OP_ID_RE.fullmatch(row[0]):  # else _checked_fields says why
                return PlanEntry(row[0], *checked[key], *row[3:])
        except (KeyError, TypeError):  # not seen yet, or a dtype that is a list
            pass
    checked[key] = found = _checked_fields(row, source, index, platforms)
    return PlanEntry(row[0], *found, *row[3:])


def _checked_fields(
    row: Any, source: str, index: int, platforms: dict[str, str]
) -> tuple[str, Dtypes]:
    """The canonical platform and dtypes of a plan row, every field checked."""
    if not isinstance(row, list) or len(row) != len(_ROW_TYPES):
        raise PlanError(source, f"entry {index} is not a row of {len(_ROW_TYPES)} fields: {row!r}")
    for name, value, types in zip(PlanEntry.__slots__, row, _ROW_TYPES, strict=True):
        if not isinstance(value, types):
            raise PlanError(source, f"entry {index}: field {name!r} is {value!r}")
    op, platform, dtypes, backend, variant = row[:5]
    if dtypes is not None and not all(isinstance(d, str) for d in dtypes):
        raise PlanError(source, f"entry {index}: field 'dtypes' is {dtypes!r}")
    # A hand-edited name that no registration can have would silently never match.
    try:
        check_op_id(op, "op")
        if backend:
            check_name(backend, "backend")
        check_variant(variant)
        if dtypes is not None:
            dtypes = tuple(normalize_dtype(d, "dtypes") for d in dtypes)
    except InvalidSpecError as exc:
        raise PlanError(source, f"entry {index}: {exc}") from None
    if platform not in platforms:  # a plan names a few platforms: 33 µs a parse
        try:
            platforms[platform] = str(Platform.parse(platform))
        except ValueError as exc:  # InvalidSpecError, or an architecture of 5,000 digits
            why = "the architecture has too many digits" if "integer string" in str(exc) else exc
            raise PlanError(source, f"entry {index}: {why}") from None
    return platforms[platform], dtypes


def plan_mismatch(plan: SelectionPlan, platform: Platform | str, ops: Iterable[str]) -> str | None:
    """Why ``plan`` decides nothing for a process on ``platform`` with ``ops`` registered
    (another machine or inventory), or ``None`` if it decides something."""
    here, name = str(platform), plan.source or "<plan>"
    entries = plan.entries()
    if not entries:
        return f"the plan {name} has no entries"
    planned = sorted({entry.platform for entry in entries})
    if here not in planned:
        return (
            f"the plan {name} decides for {', '.join(planned)}, "
            f"not for {here} (this process): no decision follows it; "
            f"lock on this platform, or with `kernreg lock --platform {here}`"
        )
    registered = set(ops)
    if not any(entry.op in registered for entry in entries if entry.platform == here):
        return (
            f"the plan {name} names none of the {len(registered)} ops "
            "registered here: no decision follows it"
        )
    return None


def dtype_sets(specs: Sequence[KernelSpec]) -> list[Dtypes]:
    """The dtype sets a plan covers for an op with ``specs``: unknown dtypes, each dtype a spec
    names, and each common part of two or more dtypes of some specs (where a call mixing dtypes
    finds its decision: the smallest such set holding them has exactly the specs accepting it)."""
    gated = {frozenset(spec.dtypes) for spec in specs if len(spec.dtypes) > 1}
    closed, fresh = set(gated), gated
    while fresh:  # every intersection of two or more specs' dtype sets
        found = {a & b for a in fresh for b in gated} - closed
        fresh = {common for common in found if len(common) > 1}
        closed |= fresh
    named = sorted({d for spec in specs for d in spec.dtypes})
    mixes = sorted(tuple(sorted(common)) for common in closed)
    return [None, *((d,) for d in named), *mixes]


def plan_of(
    registry: Any,
    platforms: Iterable[Platform],
    *,
    follow_plan: bool,
    platform_key: Callable[[Platform], str],
) -> SelectionPlan:
    """The decisions of ``registry`` (a :class:`kernreg.registry.KernelRegistry`) for every op
    on ``platforms``, each dtype set and each measured or demoted shape bucket;
    ``platform_key`` names a platform as the tuning store does."""
    # Each platform and each device of a mixed host that decides differently (``cuda:1`` at
    # SM 9.0 beside ``cuda:0`` at SM 8.0), once each, so a worker on any device finds its
    # decisions.
    plats = list({str(d): d for p in platforms for d in (*p.devices, p)}.values())
    config, ops = registry.config, registry.ops()
    # Under the autotune policy, every shape bucket measured so far is a decision of its own;
    # so is a demoted one (ranks that demoted differently differ, a lock records its choice).
    todo: list[tuple[str, Platform, Dtypes, str | None, bool | None]] = [
        (op, plat, dtypes, None, None)
        for op in ops
        for plat in plats
        for dtypes in dtype_sets(registry.get(op))
    ]
    todo += [
        (op, plat, dtypes, bucket, True)
        for op in ops
        if config.autotuned(op)
        for plat in plats
        for dtypes, bucket in registry.tuned_buckets(op, plat)
    ]
    todo += [
        (d.op, plat, d.dtypes or None, d.bucket, config.autotuned(d.op))
        for d in registry.demotions()
        if config.demotes(d.op) and d.op in ops
        for plat in plats
        if platform_key(plat) == d.platform
    ]
    entries = []
    for op, plat, dtypes, bucket, tuned in todo:
        decision = registry.explain(
            op, platform=plat, dtypes=dtypes, bucket=bucket, autotune=tuned, follow_plan=follow_plan
        )
        chosen = decision.chosen if decision.ok else None
        if chosen is None:
            rule = "strict" if decision.strict_error else decision.rule
            choice: tuple[str, str, str, str] = ("", "", rule, "")
        else:
            choice = (chosen.backend, chosen.variant, decision.rule, chosen.target_name)
        origin = chosen.origin if chosen is not None else None
        dist: tuple[str | None, str | None] = (None, None)
        if origin is not None:
            dist = (origin.distribution, origin.version)
        where = (op, str(decision.platform), decision.dtypes)
        entries.append(PlanEntry(*where, *choice, *dist, bucket))
    site_pins = [pin for pin in config.pins if pin.site is not None]
    followed = registry.plan if follow_plan else None
    if followed is not None:  # kernelize binds the site pins of the plan it follows too
        pinned = {(pin.pattern, pin.site) for pin in site_pins}
        site_pins += [
            p
            for p in parse_pins("pin", list(followed.site_pins))
            if (p.pattern, p.site) not in pinned
        ]
    environment = capture_environment(config.assume_packages)
    return SelectionPlan(entries, environment=environment, site_pins=map(str, site_pins))

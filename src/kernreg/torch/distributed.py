"""Cross-rank consistency: prove that the ranks of a distributed job run the same kernels.

* :func:`verify` compares the effective decisions of every rank of a process group, and
  what their kernelized models run (their selection fingerprints), and raises
  :class:`RankMismatchError` on every rank when they differ, naming each decision (and
  kernelized site) that differs and the ranks on each side.
* :func:`share_plan` makes every rank follow one rank's decisions: the source's selection
  plan (and its tuning results) is broadcast and loaded with
  :meth:`~kernreg.registry.KernelRegistry.use_plan`.

Both are collectives: every rank of the group must call them, in the same order as its
other collectives. Data travels as UTF-8 JSON in ``uint8`` tensors (lengths first, then
the payloads), never pickled, so a rank only ever parses plan and tuning JSON from its
peers. Tensors live on the device the group's backend communicates through (CPU for
gloo, the current CUDA device for NCCL).

It imports torch, like everything under :mod:`kernreg.torch`; ``import kernreg`` never does.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
from collections.abc import Callable, Hashable, Mapping, Sequence
from types import MappingProxyType

import torch
import torch.distributed as dist

from kernreg.errors import KernregError
from kernreg.plan import PlanEntry, SelectionPlan, entry_order
from kernreg.platform import Platform
from kernreg.registry import KernelRegistry, build_plan, default_registry
from kernreg.tuning import TuningStore

__all__ = [
    "MAX_COMPARED",
    "MAX_LISTED",
    "DistributedError",
    "RankMismatchError",
    "share_plan",
    "verify",
]

#: How many differing decisions the message of a :class:`RankMismatchError` lists; the
#: rest are counted (all of them are in its ``differences``).
MAX_LISTED = 10

#: How many distinct fingerprints are compared decision by decision: each costs one
#: broadcast of a plan, so a job where every rank differs does not flood the network.
MAX_COMPARED = 8

_FINGERPRINT_BYTES = 64  # a SHA-256 hex digest
#: Sent in place of a fingerprint by a rank that failed, so its peers raise instead of hanging.
_FAILED = "!" * _FINGERPRINT_BYTES

#: The device each backend moves tensors through; gloo (and mixed backends with gloo
#: for CPU, the default of ``init_process_group()`` without a backend) take CPU tensors.
_BACKEND_DEVICES = MappingProxyType({"nccl": "cuda", "xccl": "xpu", "hccl": "npu"})

_ADVICE = (
    "Give every rank the same plugins, package versions and KERNREG_* settings, or call "
    "kernreg.torch.distributed.share_plan() so that every rank follows one rank's decisions."
)


class DistributedError(KernregError, RuntimeError):
    """A kernreg collective cannot run (no process group) or a peer rank failed in it."""


class RankMismatchError(DistributedError):
    """Ranks of one process group would run different kernels.

    ``fingerprints`` maps each (global) rank to its selection fingerprint;
    ``differences`` holds one line per differing decision (the message lists the first
    :data:`MAX_LISTED`).
    """

    def __init__(
        self, message: str, fingerprints: Mapping[int, str], differences: Sequence[str]
    ) -> None:
        self.fingerprints = dict(fingerprints)
        self.differences = tuple(differences)
        super().__init__(message)


def verify(
    group: dist.ProcessGroup | None = None,
    *,
    registry: KernelRegistry | None = None,
    platforms: Sequence[Platform | str] | None = None,
) -> str:
    """Check that every rank of ``group`` makes the same decisions; return their fingerprint.

    Each rank builds its effective plan (a loaded plan included, as
    :func:`kernreg.registry.fingerprint`) for ``platforms`` (default: each rank's own platform);
    its fingerprint covers that plan and what the models kernelized with ``registry`` run
    at each site (:func:`kernreg.torch.kernelize.routing_of`; the plan's fingerprint alone
    where none is). The 64-character fingerprints are gathered first; only when they differ
    are the plans exchanged (one per distinct fingerprint) to name the decisions and
    kernelized sites that differ.

    ``group``: a process group (``None``: the default one). ``registry``: default the
    process-wide one. Raises :class:`RankMismatchError` on every rank when the ranks
    differ, and :class:`DistributedError` when torch.distributed is not initialised or
    a peer failed to compute its decisions (the failing rank raises its own error).
    """
    return _verify(group, default_registry() if registry is None else registry, platforms, None)


def share_plan(
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    *,
    registry: KernelRegistry | None = None,
    platforms: Sequence[Platform | str] | None = None,
    store: TuningStore | None = None,
    tuning: bool = True,
    check: bool = True,
) -> SelectionPlan:
    """Make every rank of ``group`` follow the decisions of rank ``src``; return the plan.

    Rank ``src`` (a global rank, as in ``torch.distributed.broadcast``) builds its
    *effective* plan for ``platforms`` (default: its own platform), so a plan it follows
    itself is passed on, and broadcasts it; every rank, ``src`` included, then loads it
    with ``registry.use_plan(plan)``. A plan only covers the platforms it was built for:
    when ranks run on different platforms, name all of them in ``platforms``.

    With ``tuning`` (the default) the source's tuning results travel too, so autotuned
    decisions agree and later measurements are not repeated: ``store.export_json()`` on
    the source, ``store.import_json()`` on the others. ``store`` defaults to the
    registry's own store (``registry.tuning_store``). Results a rank already holds are
    kept (first wins).

    With ``check`` (the default) :func:`verify` runs afterwards, so a rank that cannot
    follow the plan (a planned implementation is not available there) raises
    :class:`RankMismatchError` on every rank now rather than diverging silently.
    """
    _require_group()
    ranks = _group_ranks(group)
    if src not in ranks:
        raise ValueError(f"share_plan: src={src} is not a rank of the group (ranks {_span(ranks)})")
    reg = default_registry() if registry is None else registry
    device = _device(group)
    me = dist.get_rank()
    source = f"shared by rank {src}"

    payloads = [b"", b""]
    error: Exception | None = None
    if me == src:
        try:
            built = build_plan(reg, platforms=platforms or (), follow_plan=True)
            payloads[0] = built.to_json().encode()
            if tuning:
                payloads[1] = _export_tuning(store or reg.tuning_store).encode()
        except Exception as exc:  # peers must learn of it, not wait for a broadcast
            error = exc
    header = torch.tensor([int(error is not None), *map(len, payloads)], dtype=torch.int64)
    header = header.to(device)
    dist.broadcast(header, src=src, group=group)
    failed, plan_size, tuning_size = (int(v) for v in header.cpu().tolist())
    if failed:
        if error is not None:
            raise error
        raise DistributedError(
            f"share_plan: rank {src} could not build its selection plan; see the error raised there"
        )
    plan_text, tuning_text = [
        _broadcast_bytes(payload, size, src, group, device).decode()
        for payload, size in zip(payloads, (plan_size, tuning_size), strict=True)
    ]

    try:
        plan = SelectionPlan.from_json(plan_text, source=source)
        if tuning_text and me != src:
            _import_tuning(store or reg.tuning_store, tuning_text)
        reg.use_plan(plan)
    except Exception as exc:
        if not check:
            raise
        error = exc
    if check:
        _verify(group, reg, platforms, error)
    return plan


# --- the collective check ---------------------------------------------------------------


def _verify(
    group: dist.ProcessGroup | None,
    reg: KernelRegistry,
    platforms: Sequence[Platform | str] | None,
    error: Exception | None,
) -> str:
    """:func:`verify`; a rank arriving with ``error`` takes part, then raises it."""
    _require_group()
    ranks = _group_ranks(group)
    device = _device(group)
    me = ranks.index(dist.get_rank())
    plan = SelectionPlan()
    routing: list[tuple[str, ...]] = []
    mine = _FAILED
    if error is None:
        try:
            plan = build_plan(reg, platforms=platforms or (), follow_plan=True)
            routing = _routing_of(reg)
            mine = _fingerprint(plan, routing)
        except Exception as exc:  # peers must learn of it, not wait in the gather
            error = exc
    fingerprints = [
        raw.decode("ascii", "replace")
        for raw in _all_gather_fixed(mine.encode("ascii"), group, device)
    ]
    failed = [rank for rank, fp in zip(ranks, fingerprints, strict=True) if fp == _FAILED]
    if error is not None:
        raise error
    if failed:
        raise DistributedError(
            f"{_ranks(failed)} failed in a kernreg collective (computing or loading "
            f"kernel decisions); see the error raised on {'it' if len(failed) == 1 else 'them'}"
        )
    if len(set(fingerprints)) == 1:
        return fingerprints[0]

    # Only the plans of one rank per distinct fingerprint travel, largest groups first.
    members: dict[str, list[int]] = {}
    for index, fp in enumerate(fingerprints):
        members.setdefault(fp, []).append(index)
    compared = sorted(members.values(), key=lambda m: (-len(m), m[0]))[:MAX_COMPARED]
    senders = {m[0] for m in compared}
    text = b""
    if me in senders:
        text = json.dumps({"plan": plan.to_json(), "kernelized": routing}).encode()
    sizes = _all_gather_int(len(text), group, device)
    plans: dict[str, SelectionPlan] = {}
    routings: dict[str, list[tuple[str, ...]]] = {}
    for indices in compared:
        sender = indices[0]
        raw = _broadcast_bytes(text, sizes[sender], ranks[sender], group, device)
        where = f"<plan of rank {ranks[sender]}>"
        document = json.loads(raw.decode())
        plans[fingerprints[sender]] = SelectionPlan.from_json(document["plan"], source=where)
        routings[fingerprints[sender]] = _routing(document.get("kernelized"), where)
    raise _mismatch_error(dict(zip(ranks, fingerprints, strict=True)), plans, routings)


def _routing_of(reg: KernelRegistry) -> list[tuple[str, ...]]:
    """What the process's kernelized models run (none while kernelize was never imported;
    importing it here would hide the function ``kernreg.torch.kernelize`` behind its
    module)."""
    module = sys.modules.get("kernreg.torch.kernelize")
    return [] if module is None else list(module.routing_of(reg))


def _fingerprint(plan: SelectionPlan, routing: Sequence[tuple[str, ...]]) -> str:
    """The plan's fingerprint, and what the process's kernelized models run at each site
    (:func:`kernreg.torch.kernelize.routing_of`): the plan's own where none is kernelized."""
    if not routing:
        return plan.fingerprint()
    digest = hashlib.sha256(plan.fingerprint().encode() + b"\n")
    for entry in routing:
        digest.update(json.dumps(["kernelized", *entry], separators=(",", ":")).encode() + b"\n")
    return digest.hexdigest()


def _routing(value: object, where: str) -> list[tuple[str, ...]]:
    """The kernelized sites a peer sent, checked: lists of seven strings."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(
        isinstance(e, list) and len(e) == 7 and all(isinstance(f, str) for f in e) for e in value
    ):
        raise DistributedError(f"{where}: 'kernelized' must be a list of 7-string lists")
    return [tuple(e) for e in value]


def _mismatch_error(
    fingerprints: Mapping[int, str],
    plans: Mapping[str, SelectionPlan],
    routings: Mapping[str, Sequence[tuple[str, ...]]] | None = None,
) -> RankMismatchError:
    """The error for ranks (``rank -> fingerprint``) that differ; ``plans`` holds the plan
    behind each fingerprint that was compared (the rest are only counted), ``routings``
    what its kernelized models run at each site."""
    holders: dict[str, list[int]] = {}
    for rank in sorted(fingerprints):
        holders.setdefault(fingerprints[rank], []).append(rank)
    compared = sorted(holders, key=lambda fp: (-len(holders[fp]), holders[fp][0]))
    uncompared = [fp for fp in compared if fp not in plans]
    compared = [fp for fp in compared if fp in plans]

    summary = "; ".join(f"{_ranks(holders[fp])}: {fp[:12]}" for fp in compared)
    if uncompared:
        others = sorted(r for fp in uncompared for r in holders[fp])
        summary += f"; {len(uncompared)} more on {_ranks(others)}, not compared"
    lines = [
        f"ranks run different kernels: {len(holders)} selection fingerprints among "
        f"{len(fingerprints)} ranks ({summary})"
    ]

    platforms = {fp: sorted({e.platform for e in plans[fp].entries()}) for fp in compared}
    if len({tuple(p) for p in platforms.values()}) > 1:
        by_platform = _group_by(compared, lambda fp: ",".join(platforms[fp]) or "no platform")
        lines.append(
            "  the ranks decide for different platforms: "
            + "; ".join(
                f"{_ranks(_ranks_of(fps, holders))} {_verb(fps, holders, 'decides', 'decide')} "
                f"for {name}"
                for name, fps in by_platform
            )
        )

    site_pins = {fp: plans[fp].site_pins for fp in compared}
    if len(set(site_pins.values())) > 1:
        by_pins = _group_by(compared, lambda fp: ", ".join(site_pins[fp]) or "no site")
        lines.append(
            "  the ranks pin model sites differently (KERNREG_PIN op@module=backend): "
            + "; ".join(
                f"{_ranks(_ranks_of(fps, holders))} {_verb(fps, holders, 'pins', 'pin')} {name}"
                for name, fps in by_pins
            )
        )

    tables = {fp: {e.key: e for e in plans[fp].entries()} for fp in compared}
    keys = sorted({key for table in tables.values() for key in table}, key=entry_order)
    differences = [
        _difference([(fp, tables[fp].get(key)) for fp in compared], holders)
        for key in keys
        if len({_identity(tables[fp].get(key)) for fp in compared}) > 1
    ]
    sites: dict[str, dict[tuple[str, ...], tuple[tuple[str, ...], ...]]] = {}
    for fp in compared:
        table: dict[tuple[str, ...], list[tuple[str, ...]]] = {}
        for entry in (routings or {}).get(fp, ()):
            table.setdefault(tuple(entry[:3]), []).append(tuple(entry[3:]))
        sites[fp] = {key: tuple(sorted(found)) for key, found in table.items()}
    for key in sorted({key for table in sites.values() for key in table}):
        if len({sites[fp].get(key, ()) for fp in compared}) > 1:
            sides = [(fp, sites[fp].get(key, ())) for fp in compared]
            differences.append(_site_difference(key, sides, holders))
    lines.extend(f"  {line}" for line in differences[:MAX_LISTED])
    if len(differences) > MAX_LISTED:
        lines.append(f"  ... and {len(differences) - MAX_LISTED} more differing decisions")
    lines.append(_ADVICE)
    return RankMismatchError("\n".join(lines), fingerprints, differences)


def _difference(sides: list[tuple[str, PlanEntry | None]], holders: Mapping[str, list[int]]) -> str:
    """``op X on P, D: ranks 0,2 run aten (priority) [dist 1.0]; rank 1 runs torch (pin)``
    for one decision, given each compared fingerprint's entry for it (``None``: none)."""
    where = _where(next(entry for _, entry in sides if entry is not None))
    entries = dict(sides)
    shown = [
        (fps, entries[fps[0]])
        for _, fps in _group_by(list(entries), lambda fp: _identity(entries[fp]))
    ]
    texts = [_choice(entry, with_target=False) for _, entry in shown]
    if len(set(texts)) < len(texts):  # same label, different code: name the targets
        texts = [_choice(entry, with_target=True) for _, entry in shown]
    parts = []
    for (fps, entry), text in zip(shown, texts, strict=True):
        verb = (
            _verb(fps, holders, "has", "have")
            if entry is None
            else _verb(fps, holders, "runs", "run")
        )
        parts.append(f"{_ranks(_ranks_of(fps, holders))} {verb} {text}")
    return f"{where}: " + "; ".join(parts)


def _site_difference(
    key: tuple[str, ...],
    sides: list[tuple[str, tuple[tuple[str, ...], ...]]],
    holders: Mapping[str, list[int]],
) -> str:
    """``kernelized site model.norm of pkg:Model (op X): ranks 0,2 run aten; rank 1 runs
    torch (kernelize pin)`` for one site of a kernelized model."""
    model, path, op = key
    found = dict(sides)
    parts = []
    for value, fps in _group_by(list(found), lambda fp: found[fp]):
        assert isinstance(value, tuple)
        if not value:
            text = f"{_verb(fps, holders, 'has', 'have')} not kernelized it"
        else:
            text = _verb(fps, holders, "runs", "run") + " " + " and ".join(map(_runs, value))
        parts.append(f"{_ranks(_ranks_of(fps, holders))} {text}")
    return f"kernelized site {path or '<root>'} of {model} (op {op}): " + "; ".join(parts)


def _runs(outcome: tuple[str, ...]) -> str:
    """What one kernelized site runs: ``(status, implementation, pin, mode)``."""
    status, implementation, pin, mode = outcome
    if status == "routed":
        text = implementation + (f" (kernelize pin {pin})" if pin else "")
    elif status == "rejected" and implementation:
        text = f"its own forward ({implementation} rejected by verification)"
    else:
        text = f"its own forward ({status})"
    return text + (f" in mode {mode}" if mode != "inference" else "")


def _where(entry: PlanEntry) -> str:
    """``op X on cpu, bfloat16`` (and the shape bucket of an autotuned decision)."""
    text = f"op {entry.op} on {entry.platform}, "
    text += "any dtype" if entry.dtypes is None else ",".join(entry.dtypes)
    return text + (f", shapes {entry.bucket}" if entry.bucket is not None else "")


def _choice(entry: PlanEntry | None, *, with_target: bool) -> str:
    if entry is None:
        return "no such decision"
    if not entry.backend:
        return f"nothing ({entry.rule})"
    text = f"{entry.label} ({entry.rule})"
    if entry.distribution:
        text += f" [{entry.distribution}{f' {entry.version}' if entry.version else ''}]"
    if with_target:
        text += f" = {entry.target}"
    return text


def _identity(entry: PlanEntry | None) -> tuple[object, ...] | None:
    return None if entry is None else entry.identity()


def _group_by(
    fingerprints: list[str], key: Callable[[str], Hashable]
) -> list[tuple[Hashable, list[str]]]:
    """``fingerprints`` grouped by ``key(fp)``, groups in order of first appearance."""
    groups: dict[Hashable, list[str]] = {}
    for fp in fingerprints:
        groups.setdefault(key(fp), []).append(fp)
    return list(groups.items())


def _ranks_of(fps: Sequence[str], holders: Mapping[str, list[int]]) -> list[int]:
    return sorted(rank for fp in fps for rank in holders[fp])


def _verb(fps: Sequence[str], holders: Mapping[str, list[int]], one: str, many: str) -> str:
    return one if len(_ranks_of(fps, holders)) == 1 else many


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0,2``, ``ranks 0-7,9``: runs of three or more as ranges."""
    return ("rank " if len(ranks) == 1 else "ranks ") + _span(ranks)


def _span(ranks: Sequence[int]) -> str:
    ordered = sorted(ranks)
    parts: list[str] = []
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            run = ordered[start:i]
            if len(run) >= 3:
                parts.append(f"{run[0]}-{run[-1]}")
            else:
                parts.extend(str(r) for r in run)
            start = i
    return ",".join(parts)


# --- tuning results -----------------------------------------------------------------------


def _export_tuning(store: TuningStore | None) -> str:
    if store is None or not store.entries():
        return ""  # nothing measured: receivers need not open a store for it
    return store.export_json()


def _import_tuning(store: TuningStore | None, text: str) -> None:
    if store is None:
        raise DistributedError(
            "share_plan: tuning results arrived but this rank has no tuning store "
            "(see the earlier warning); pass store=, or share_plan(tuning=False)"
        )
    store.import_json(text)


# --- transport: JSON bytes in uint8 tensors, never pickle ---------------------------------


def _require_group() -> None:
    if not dist.is_available():
        raise DistributedError(
            "this torch build has no torch.distributed; kernreg.torch.distributed needs it"
        )
    if not dist.is_initialized():
        raise DistributedError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group() "
            "on every rank before kernreg.torch.distributed.verify() or share_plan()"
        )


def _group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` in group-rank order; this process must be one of them."""
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    if ranks is None:
        ranks = list(range(dist.get_world_size()))
    if dist.get_rank() not in ranks:
        raise DistributedError(
            f"rank {dist.get_rank()} is not a member of the process group "
            f"(ranks {_span(ranks)}); call this only on the group's ranks"
        )
    return ranks


def _device(group: dist.ProcessGroup | None) -> torch.device:
    backend = str(dist.get_backend(group))
    if "gloo" in backend:
        return torch.device("cpu")
    for name, device_type in _BACKEND_DEVICES.items():
        if name in backend:
            module = getattr(torch, device_type)
            return torch.device(device_type, module.current_device())
    return torch.device("cpu")


def _to_tensor(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    """``data`` zero-padded to ``size`` bytes, as a ``uint8`` tensor on ``device``."""
    tensor = torch.zeros(size, dtype=torch.uint8)
    if data:
        tensor[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return tensor.to(device)


def _to_bytes(tensor: torch.Tensor) -> bytes:
    host = tensor.cpu().contiguous()
    return ctypes.string_at(host.data_ptr(), host.numel()) if host.numel() else b""


def _all_gather_fixed(
    data: bytes, group: dist.ProcessGroup | None, device: torch.device
) -> list[bytes]:
    """Every rank's ``data``, in group-rank order (all ranks send the same length)."""
    mine = _to_tensor(data, len(data), device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [_to_bytes(t) for t in gathered]


def _all_gather_int(value: int, group: dist.ProcessGroup | None, device: torch.device) -> list[int]:
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [int(t.item()) for t in gathered]


def _broadcast_bytes(
    data: bytes, size: int, src: int, group: dist.ProcessGroup | None, device: torch.device
) -> bytes:
    """``data`` of global rank ``src`` (``size`` bytes, known to every rank) on every rank."""
    if size == 0:
        return b""
    tensor = _to_tensor(data if dist.get_rank() == src else b"", size, device)
    dist.broadcast(tensor, src=src, group=group)
    return _to_bytes(tensor)

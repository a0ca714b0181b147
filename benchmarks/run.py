"""Run every benchmark module and report each figure against its budget.

Usage::

    python benchmarks/run.py [--quick] [--json out.json] [--markdown] [--strict]

Every ``benchmarks/bench_*.py`` is imported in sorted order and its ``run()`` is called
(``run(quick)`` when it takes a parameter). ``run`` returns a list of records::

    {"name": str, "value": float, "unit": str, "budget": str | None,
     "baseline": str | None, "ratio": float | None, "ok": bool | None}

``ratio`` is the measured figure divided by the baseline's (``None`` without a
baseline), ``ok`` says whether the figure is within its budget (``None`` without one).
A record may carry an optional ``"note"`` (printed under the table).

A module that cannot be imported (it needs torch, say, and torch is not installed) is
reported as skipped with the reason. A module whose ``run`` raises is reported as an
error and makes the exit status 1. Budget misses are reported, and change the exit
status only with ``--strict``.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent

#: Keys every record carries, with the types they may hold.
RECORD_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "value": (float, int),
    "unit": (str,),
    "budget": (str, type(None)),
    "baseline": (str, type(None)),
    "ratio": (float, int, type(None)),
    "ok": (bool, type(None)),
}


def discover(directory: Path = HERE) -> list[Path]:
    """The benchmark modules of ``directory``, sorted by file name."""
    return sorted(directory.glob("bench_*.py"))


def load_module(path: Path) -> ModuleType:
    """Import ``path`` as a module named after its file (the benchmarks folder is importable)."""
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(path.stem, None)
        raise
    return module


def call_run(run: Callable[..., Any], quick: bool) -> Any:
    """Call ``run()`` or ``run(quick)``, whichever the module defined."""
    params = list(inspect.signature(run).parameters.values())
    if not params:
        return run()
    first = params[0]
    if first.kind is inspect.Parameter.KEYWORD_ONLY:
        return run(**{first.name: quick})
    if first.kind is inspect.Parameter.VAR_KEYWORD:
        return run(quick=quick)
    return run(quick)


def check_record(record: object) -> dict[str, Any]:
    """``record`` normalised (floats, optional keys filled in); ``ValueError`` when malformed."""
    if not isinstance(record, dict):
        raise ValueError(f"a record must be a dict, not {type(record).__name__}")
    out: dict[str, Any] = {}
    for key, types in RECORD_TYPES.items():
        value = record.get(key)
        if key in ("name", "value", "unit") and key not in record:
            raise ValueError(f"record {record!r} has no {key!r}")
        if not isinstance(value, types) or (isinstance(value, bool) and key in ("value", "ratio")):
            raise ValueError(f"record {record.get('name')!r}: {key}={value!r} has the wrong type")
        if key in ("value", "ratio") and value is not None:
            value = float(value)
        out[key] = value
    note = record.get("note")
    if note is not None:
        out["note"] = str(note)
    return out


def run_all(paths: Sequence[Path], quick: bool) -> dict[str, Any]:
    """Run every module in ``paths``; the report ``--json`` writes."""
    results: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    errors: list[dict[str, str]] = []
    for path in paths:
        name = path.stem
        try:
            module = load_module(path)
        except Exception as exc:
            skipped.append({"module": name, "reason": f"{type(exc).__name__}: {exc}"})
            continue
        run = getattr(module, "run", None)
        if not callable(run):
            skipped.append({"module": name, "reason": "defines no run()"})
            continue
        started = time.perf_counter()
        try:
            records = [check_record(r) for r in call_run(run, quick)]
        except Exception as exc:
            errors.append(
                {
                    "module": name,
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(),
                }
            )
            continue
        elapsed = time.perf_counter() - started
        print(f"# {name}: {len(records)} figures in {elapsed:.1f} s", file=sys.stderr)
        results.extend({"module": name, **record} for record in records)
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "machine": platform.machine(),
        "system": platform.system(),
        "quick": quick,
        "results": results,
        "skipped": skipped,
        "errors": errors,
    }


def format_value(value: float | None) -> str:
    """Three significant figures, without exponent notation for everyday magnitudes."""
    if value is None:
        return "—"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    magnitude = abs(value)
    if magnitude == 0:
        return "0"
    if magnitude >= 100:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    if magnitude >= 0.001:
        return f"{value:.3f}"
    return f"{value:.2e}"


def _verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("yes" if ok else "NO")


HEADER = ("benchmark", "value", "unit", "budget", "baseline", "ratio", "within budget")


def _rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = []
    for r in report["results"]:
        ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        rows.append(
            (
                r["name"],
                format_value(r["value"]),
                r["unit"],
                r["budget"] or "—",
                r["baseline"] or "—",
                ratio,
                _verdict(r["ok"]),
            )
        )
    return rows


def _footer(report: dict[str, Any]) -> list[str]:
    lines = [f"{r['name']}: {r['note']}" for r in report["results"] if r.get("note")]
    lines += [f"skipped {s['module']}: {s['reason']}" for s in report["skipped"]]
    lines += [f"ERROR in {e['module']}: {e['error']}" for e in report["errors"]]
    return lines


def render_text(report: dict[str, Any]) -> str:
    rows = [HEADER, *_rows(report)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    numeric = {1, 5}
    lines = []
    for index, row in enumerate(rows):
        cells = [
            cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    title = f"Python {report['python']} ({report['implementation']}, {report['machine']})"
    if report["quick"]:
        title += ", --quick"
    return "\n".join([title, "", *lines, "", *_footer(report)]).rstrip() + "\n"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "| " + " | ".join(HEADER) + " |",
        "|---|---:|---|---|---|---:|---|",
    ]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in _rows(report)]
    title = f"Measured with CPython {report['python']} on {report['system']} {report['machine']}"
    if report["quick"]:
        title += " (`--quick`)"
    footer = _footer(report)
    notes = ["", *(f"* {_md_cell(line)}" for line in footer)] if footer else []
    return "\n".join([title + ".", "", *lines, *notes]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke runs)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a budget is missed")
    args = parser.parse_args(argv)

    report = run_all(discover(), args.quick)
    print(render_markdown(report) if args.markdown else render_text(report), end="")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if report["errors"]:
        for error in report["errors"]:
            print(error["traceback"], file=sys.stderr)
        return 1
    if args.strict and any(r["ok"] is False for r in report["results"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Build the fixture projects beside this file as real wheels, and install them with pip.

Each fixture is a directory with a PEP 621 ``pyproject.toml`` (name, version and
``[project.entry-points."kernreg.kernels"]``) and its package sources. The wheel is
written directly (METADATA, WHEEL, entry_points.txt, RECORD with hashes), which takes
milliseconds where a build backend takes a second, and installed by pip, so
``importlib.metadata`` reads ordinary ``.dist-info`` directories.
"""

from __future__ import annotations

import base64
import hashlib
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = ["FIXTURES_DIR", "build_project", "install", "projects", "write_wheel"]

FIXTURES_DIR = Path(__file__).resolve().parent
ENTRY_POINT_GROUP = "kernreg.kernels"


def _escape(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def write_wheel(
    out_dir: Path,
    name: str,
    version: str,
    files: Mapping[str, str],
    entry_points: Mapping[str, str],
) -> Path:
    """Write ``{name}-{version}-py3-none-any.whl`` holding ``files`` (relative path: text)."""
    escaped = _escape(name)
    dist_info = f"{escaped}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    wheel = "Wheel-Version: 1.0\nGenerator: kernreg-test-fixtures\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    eps = "".join(f"{key} = {value}\n" for key, value in entry_points.items())
    contents = {path: text.encode() for path, text in sorted(files.items())}
    contents[f"{dist_info}/METADATA"] = metadata.encode()
    contents[f"{dist_info}/WHEEL"] = wheel.encode()
    contents[f"{dist_info}/entry_points.txt"] = f"[{ENTRY_POINT_GROUP}]\n{eps}".encode()
    record = [_record_line(path, data) for path, data in contents.items()]
    record.append(f"{dist_info}/RECORD,,")
    contents[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{escaped}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for member, data in contents.items():
            archive.writestr(member, data)
    return path


def build_project(project: str | Path, out_dir: Path) -> Path:
    """Build the wheel of one fixture project (a directory name beside this file, or a path)."""
    root = FIXTURES_DIR / project if isinstance(project, str) else project
    meta = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    files = {
        path.relative_to(root).as_posix(): path.read_text()
        for path in sorted(root.rglob("*.py"))
        if "__pycache__" not in path.parts
    }
    entry_points = meta.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
    return write_wheel(out_dir, meta["name"], meta["version"], files, entry_points)


def install(wheels: Iterable[Path], target: Path) -> subprocess.Popen[bytes]:
    """Start ``pip install --no-deps --target target wheels``; the caller waits on the process."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--no-compile",
            "--disable-pip-version-check",
            "--no-warn-script-location",
            "--quiet",
            "--target",
            str(target),
            *(str(wheel) for wheel in wheels),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def projects() -> list[str]:
    """The fixture project directories beside this file."""
    return sorted(p.parent.name for p in FIXTURES_DIR.glob("*/pyproject.toml"))

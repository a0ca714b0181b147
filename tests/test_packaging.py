"""What the package index and a fresh install see: licence, metadata, links, the sdist."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PROJECTS = {"kernreg": ROOT, "kernreg_ops": ROOT / "ops"}


def pyproject(root: Path) -> dict[str, object]:
    return tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_licence_is_the_full_apache_2_text_in_both_distributions() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.lstrip().startswith("Apache License")
    assert "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert len(text.splitlines()) > 150
    assert (ROOT / "ops" / "LICENSE").read_text(encoding="utf-8") == text


@pytest.mark.parametrize("root", PROJECTS.values(), ids=PROJECTS.keys())
def test_the_metadata_names_licence_urls_and_a_home_page(root: Path) -> None:
    data = pyproject(root)
    build = data["build-system"]
    assert isinstance(build, dict)
    # license = "<SPDX expression>" needs setuptools 77 or later.
    assert "setuptools>=77" in build["requires"]
    project = data["project"]
    assert isinstance(project, dict)
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    urls = project["urls"]
    assert {"Homepage", "Source", "Issues", "Changelog"} <= set(urls)
    assert all(url.startswith("https://") for url in urls.values())
    setup_cfg = configparser.ConfigParser()
    setup_cfg.read(root / "setup.cfg")
    assert setup_cfg["metadata"]["url"] == urls["Homepage"]  # pip show's Home-page


@pytest.mark.parametrize("readme", [ROOT / "README.md", ROOT / "ops" / "README.md"])
def test_readme_links_work_on_the_package_index(readme: Path) -> None:
    # The README is the project page on the index, where relative links lead nowhere.
    text = readme.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, re.M)
    assert targets, "no links to check"
    # Only targets that name a file or page ("box[0](x)" in a benchmark name is no link).
    paths = [t for t in targets if re.search(r"[./:]", t)]
    relative = [t for t in paths if not t.startswith(("https://", "http://", "#"))]
    assert not relative, f"{readme.name}: relative links {relative}"


def test_no_file_points_to_a_design_document_the_project_lacks() -> None:
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "ops" / "README.md"]
    for folder in ("src", "ops/src", "benchmarks"):
        files.extend((ROOT / folder).rglob("*.py"))
    mentions = [str(f) for f in files if "DESIGN.md" in f.read_text(encoding="utf-8")]
    assert mentions == []
    assert (ROOT / "docs" / "design.md").is_file()


@pytest.mark.parametrize("name", PROJECTS.keys())
def test_the_sdist_has_the_licence_and_metadata_and_no_partial_test_tree(
    name: str, tmp_path: Path
) -> None:
    pytest.importorskip("build")
    root = PROJECTS[name]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--sdist",
            "--no-isolation",
            "-o",
            str(tmp_path),
            str(root),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (archive,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
        top = archive.name[: -len(".tar.gz")]
        pkg_info = tar.extractfile(f"{top}/PKG-INFO")
        assert pkg_info is not None
        metadata = pkg_info.read().decode()
    assert "LICENSE" in names
    assert [n for n in names if n.startswith("tests")] == []  # none rather than a partial tree
    assert "License-Expression: Apache-2.0" in metadata
    home = re.search(r"^Home-page: (\S+)$", metadata, re.M)
    assert home is not None
    assert home.group(1).startswith("https://")
    assert "Project-URL: Source, https://" in metadata

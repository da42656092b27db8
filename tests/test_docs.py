"""The repo stands on its own: its documents link only to files it holds, nothing cites a design
document it does not contain, and the README stays a guide a user reads in a few minutes."""

from __future__ import annotations

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Markdown links and images: [text](target) where target is not a URL or an in-page anchor.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_ABSENT_DOCUMENTS = ("DESIGN.md", "STYLE.md")
README_MAX_LINES = 320


def _tracked_files() -> list[pathlib.Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines() if (ROOT / line).is_file()]


def _markdown_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_relative_link_in_the_docs_points_to_a_file_in_the_repo() -> None:
    broken = []
    for doc in _markdown_files():
        for target in _LINK.findall(doc.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken
    assert any(_LINK.findall(doc.read_text()) for doc in _markdown_files())  # the pattern finds links at all


def test_no_file_cites_a_design_document_the_repo_does_not_hold() -> None:
    citing = [
        str(path.relative_to(ROOT))
        for path in _tracked_files()
        if path.suffix in {".py", ".md", ".toml", ".sh", ".yml", ".yaml", ".cfg", ""}
        and path.name != pathlib.Path(__file__).name
        and any(name in path.read_text(errors="replace") for name in _ABSENT_DOCUMENTS)
        and not any((ROOT / name).exists() for name in _ABSENT_DOCUMENTS)
    ]
    assert not citing, citing


def test_the_readme_is_a_short_guide() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    for command in ("make demo", "make test", "kvservice launch", "kvservice bench peers"):
        assert command in readme, command

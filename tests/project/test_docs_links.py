"""The documentation's relative links lead somewhere: every linked file exists, and every `#anchor` is a heading
of the page it points into (GitHub's heading slugs). The README and the results pages link into each other's
sections; a renamed heading would otherwise leave a dead link on the landing page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "measurements" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_slugs(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to dashes, '-1', '-2', ...
    after a repeated heading. Headings inside fenced code do not count."""
    slugs: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"#{1,6} (.*)", line)
        if heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


def test_heading_slugs_follow_githubs_rules(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# 1.2 Theorem 3.1, and what it *does not* keep\n```\n# not a heading\n```\n## Notes\n## Notes\n")
    assert heading_slugs(page) == {"12-theorem-31-and-what-it-does-not-keep", "notes", "notes-1"}


def _links() -> list[tuple[str, Path, str]]:
    return [
        (f"{page.relative_to(ROOT)} -> {target}", page, target)
        for page in PAGES
        for target in LINK.findall(page.read_text(encoding="utf-8"))
        if not target.startswith(("http://", "https://", "mailto:"))
    ]


@pytest.mark.parametrize(("name", "page", "target"), _links(), ids=[link[0] for link in _links()])
def test_every_relative_link_leads_to_a_file_and_heading(name, page, target):
    path, _, anchor = target.partition("#")
    destination = (page.parent / path).resolve() if path else page
    assert destination.exists(), f"{name}: no such file"
    if anchor and destination.suffix == ".md":
        assert anchor in heading_slugs(destination), f"{name}: no heading with that anchor in {destination.name}"

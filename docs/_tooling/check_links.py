"""Check every internal link of a built site: the page (or file) it points to exists, and so does its anchor.

``python docs/_tooling/check_links.py SITE_DIR`` exits 1 and lists the broken links. mkdocs --strict already
checks the Markdown links between pages; this also covers what is generated while building (the API pages'
cross-references, the CLI reference, the theme's navigation) and anchors on every page.
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("id", "name") and value:
                self.ids.add(value)
            if value and ((tag == "a" and name == "href") or (tag in ("link", "script", "img") and name in ("href", "src"))):
                self.links.append(value)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def _target(site: Path, page: Path, path: str) -> Path:
    base = site if path.startswith("/") else page.parent
    target = (base / unquote(path.lstrip("/"))).resolve()
    return target / "index.html" if target.is_dir() or path.endswith("/") else target


def check(site: Path) -> tuple[list[str], int, int]:
    """(the broken links, how many internal links were checked, how many pages)."""
    site = site.resolve()
    pages = {path.resolve(): _parse(path) for path in site.rglob("*.html")}
    broken, checked = [], 0
    for path, page in sorted(pages.items()):
        if path.name == "404.html":  # its links are written for whatever URL failed
            continue
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:")):
                continue
            checked += 1
            target = _target(site, path, parts.path) if parts.path else path
            where = f"{path.relative_to(site)}: {link}"
            if not str(target).startswith(str(site)) or not target.exists():
                broken.append(f"{where} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{where} (no anchor #{parts.fragment})")
    return broken, checked, len(pages)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} SITE_DIR", file=sys.stderr)
        return 2
    broken, checked, pages = check(Path(argv[1]))
    for line in broken:
        print(f"broken link: {line}", file=sys.stderr)
    print(f"internal links: {checked} checked in {pages} pages, {len(broken)} broken")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

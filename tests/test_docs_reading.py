"""The user's documents: the results guide is reachable (site navigation, README), the catalogue spells out its
acronyms where it first uses them, and a link to a repository file leads somewhere in the built site."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: acronym -> its words, as the catalogue must give them at first use
ACRONYMS = {
    "SNIS": "self-normalized importance sampling",
    "MIS": "multiple importance sampling",
    "OPRF": "optimal positive random features",
    "SDERF": "symmetric dense-exponential random features",
}


def test_the_results_guide_is_in_the_navigation_and_the_readme():
    assert "How to read the results: guide/reading-results.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "[How to read the results](docs/guide/reading-results.md)" in readme
    assert (ROOT / "docs/guide/reading-results.md").is_file()


@pytest.mark.parametrize("page", ["README.md", "docs/guide/estimators.md"])
@pytest.mark.parametrize("acronym", sorted(ACRONYMS))
def test_the_catalogue_defines_each_acronym_at_first_use(page, acronym):
    text = (ROOT / page).read_text(encoding="utf-8")
    first = re.search(rf"\b{acronym}\b", text)
    assert first is not None, f"{page} does not use {acronym}"
    # the words stand beside the first use: "words (ACRONYM)" or "ACRONYM (words)"
    before = " ".join(text[max(0, first.start() - 120):first.start()].split())
    after = " ".join(text[first.end():first.end() + 120].split())
    assert before.endswith(f"{ACRONYMS[acronym]} (") or after.startswith(f" ({ACRONYMS[acronym]})") \
        or after.startswith(f"({ACRONYMS[acronym]})"), (page, before, after)


class _Config(dict):
    """The keys of mkdocs' config that the hooks read, by key and by attribute as mkdocs offers them."""

    __getattr__ = dict.__getitem__


def _config(tmp_path: Path, repo_url: str = "") -> _Config:
    return _Config(docs_dir=str(ROOT / "docs"), config_file_path=str(ROOT / "mkdocs.yml"), repo_url=repo_url,
                   site_dir=str(tmp_path / "site"), use_directory_urls=True,
                   plugins=SimpleNamespace(_current_plugin=None))


def test_a_link_to_a_repository_folder_leads_to_a_copy_in_the_site(tmp_path):
    pytest.importorskip("mkdocs_click")
    import importlib.util

    from mkdocs.structure.files import Files

    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs/_tooling/hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)

    files = hooks.on_files(Files([]), _config(tmp_path))
    uris = {f.src_uri for f in files}
    assert "repo/examples/randattn-nystrom/index.md" in uris
    assert "repo/examples/randattn-nystrom/randattn_nystrom/reference.py" in uris
    page = next(f for f in files if f.src_uri == "repo/examples/randattn-nystrom/index.md")
    assert page.content_string.startswith("# randattn-nystrom: Nyströmformer attention as a randattn plugin")
    assert "- [`randattn_nystrom/reference.py`](randattn_nystrom/reference.py)" in page.content_string

    source = SimpleNamespace(file=SimpleNamespace(src_uri="write-your-own-estimator.md"))
    line = "The worked example is [`examples/randattn-nystrom/`](../examples/randattn-nystrom/): Nyströmformer"
    assert hooks.on_page_markdown(line, source, _config(tmp_path), files) == (
        "The worked example is [`examples/randattn-nystrom/`](repo/examples/randattn-nystrom/index.md): Nyströmformer")
    with_url = _config(tmp_path, "https://example.org/randattn")
    assert hooks.on_page_markdown(line, source, with_url, files) == (
        "The worked example is [`examples/randattn-nystrom/`](https://example.org/randattn/tree/HEAD/"
        "examples/randattn-nystrom): Nyströmformer")


def test_the_masks_guide_lists_every_estimator_with_the_masks_its_spec_declares():
    """docs/guide/masks.md's table has a row per registered built-in, and its causal and sliding-window columns say
    "yes" (or a qualified "yes, ...") exactly where the spec's defaults declare the mask."""
    from randattn.estimators.registry import get_spec, list_estimators

    text = (ROOT / "docs/guide/masks.md").read_text(encoding="utf-8")
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"`[a-z]+`", cells[0]):
            rows[cells[0].strip("`")] = cells[1:3]
    names = [name for name in list_estimators() if get_spec(name).draw.__module__.startswith("randattn.")]
    assert sorted(rows) == sorted(names)
    for name, (causal, sliding) in rows.items():
        masks = get_spec(name).masks_of(get_spec(name).resolve_params({}))
        assert causal.lower().lstrip("*").startswith("yes") == ("causal" in masks), name
        assert sliding.startswith("yes") == ("sliding" in masks), name

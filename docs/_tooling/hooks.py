"""MkDocs hooks of randattn's documentation site (mkdocs.yml, ``hooks:``).

1. Links from a page to files of the repository outside ``docs/`` (``../examples/randattn-nystrom/``,
   ``../benchmarks/mutation.sh``) work when the Markdown is read on the repository, but mkdocs only builds
   ``docs/``. Each such link is checked (a target that does not exist is a warning, an error under
   ``--strict``) and then pointed at the repository (``repo_url``, when mkdocs.yml sets one) or, without a
   ``repo_url``, at a copy built into the site under ``repo/``: a linked file is copied as it is; a linked
   folder gets a page (its README, then a list of its files, each copied), so the link works offline too.
2. mkdocs-click 0.9.0 (pinned in docs/requirements.txt) renders click 8.3+'s unset defaults as
   ``Sentinel.UNSET``, marks required options ``_required``, lists no arguments, and runs a command's help
   through Markdown as it is: click's ``\\b`` (do not rewrap) paragraphs merge into one line and ``<kind>``
   vanishes as an HTML tag. Its table style is replaced here with one that shows each option's default as
   ``--help`` would with ``show_default``, the arguments, and help text as text.
"""

from __future__ import annotations

import html
import inspect
import logging
import posixpath
import re
import textwrap
from pathlib import Path
from typing import Any, Iterator

import click
import mkdocs_click._docs as click_docs

log = logging.getLogger("mkdocs.hooks.randattn")

# ------------------------------------------------------------------------------------------ links out of docs/
_LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\((?P<target>[^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def _repository_link(target: str, page_src: str, docs_dir: Path, root: Path) -> str | None:
    """The repository path of a relative link that leaves docs/, or None for any other link."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None
    path = target.split("#", 1)[0]
    if not path:
        return None
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(page_src), path))
    if not resolved.startswith("../"):
        return None
    in_repo = posixpath.normpath(posixpath.join(docs_dir.relative_to(root).as_posix(), resolved))
    return None if in_repo.startswith("../") else in_repo


#: where the site keeps its copies of linked repository files (without a repo_url)
_COPIES = "repo"


def _links_out(config: Any) -> set[str]:
    """The repository paths (files or folders, existing) that the documentation's pages link to."""
    docs_dir = Path(config["docs_dir"]).resolve()
    root = Path(config["config_file_path"]).resolve().parent
    found = set()
    for source in docs_dir.rglob("*.md"):
        src_uri = source.relative_to(docs_dir).as_posix()
        if src_uri.startswith("_tooling/"):
            continue
        fenced = False
        for line in source.read_text(encoding="utf-8").split("\n"):
            if _FENCE.match(line.lstrip()):
                fenced = not fenced
            if fenced:
                continue
            for match in _LINK.finditer(line):
                path = _repository_link(match.group("target"), src_uri, docs_dir, root)
                if path is not None and (root / path).exists():
                    found.add(path)
    return found


def _folder_files(folder: Path) -> list[Path]:
    """The files of a linked folder worth showing: no hidden files, caches or build outputs."""
    skip = {"__pycache__", "build", "dist", ".pytest_cache"}
    return sorted(p for p in folder.rglob("*") if p.is_file()
                  and not any(part.startswith(".") or part in skip or part.endswith(".egg-info")
                              for part in p.relative_to(folder).parts))


def on_files(files: Any, config: Any) -> Any:
    """Without a repo_url, build a copy of every linked repository file or folder into the site (``repo/``)."""
    from mkdocs.structure.files import File, InclusionLevel

    if config.get("repo_url"):
        return files
    root = Path(config["config_file_path"]).resolve().parent
    for path in sorted(_links_out(config)):
        target = root / path
        copies = _folder_files(target) if target.is_dir() else [target]
        for file in copies:
            if file.suffix == ".md":
                continue  # a folder's README is its page, below; Markdown is not served raw
            uri = f"{_COPIES}/{file.relative_to(root).as_posix()}"
            files.append(File.generated(config, uri, abs_src_path=str(file), inclusion=InclusionLevel.NOT_IN_NAV))
        if target.is_dir():
            listed = "\n".join(f"- [`{f.relative_to(target).as_posix()}`]({f.relative_to(target).as_posix()})"
                                for f in copies if f.suffix != ".md")
            readme = target / "README.md"
            intro = readme.read_text(encoding="utf-8") if readme.is_file() else f"# `{path}/`\n"
            page = (f"{intro.rstrip()}\n\n## Files\n\nThe folder `{path}/` of the repository, as this site was "
                    f"built:\n\n{listed}\n")
            files.append(File.generated(config, f"{_COPIES}/{path}/index.md", content=page,
                                        inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs_dir = Path(config["docs_dir"]).resolve()
    root = Path(config["config_file_path"]).resolve().parent
    repo_url = (config.get("repo_url") or "").rstrip("/")
    lines, fenced = [], False
    for line in markdown.split("\n"):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
        if not fenced:
            line = _LINK.sub(lambda m: _rewrite(m, page, docs_dir, root, repo_url), line)
        lines.append(line)
    return "\n".join(lines)


def _rewrite(match: re.Match[str], page: Any, docs_dir: Path, root: Path, repo_url: str) -> str:
    target = match.group("target")
    path = _repository_link(target, page.file.src_uri, docs_dir, root)
    if path is None:
        return match.group(0)
    if not (root / path).exists():
        log.warning("Doc file '%s' links to '%s', which is not in the repository (%s)", page.file.src_uri, target, path)
        return match.group(0)
    if not repo_url:  # the copy on_files built into the site
        copy = f"{_COPIES}/{path}/index.md" if (root / path).is_dir() else f"{_COPIES}/{path}"
        anchor = "#" + target.split("#", 1)[1] if "#" in target else ""
        relative = posixpath.relpath(copy, posixpath.dirname(page.file.src_uri) or ".")
        return f"[{match.group('text')}]({relative}{anchor})"
    kind = "tree" if (root / path).is_dir() else "blob"
    anchor = "#" + target.split("#", 1)[1] if "#" in target else ""
    return f"[{match.group('text')}]({repo_url}/{kind}/HEAD/{path}{anchor})"


# ------------------------------------------------------------------------------------------ mkdocs-click
_UNSET = getattr(click.core, "UNSET", None)


def _text(value: str) -> str:
    """Help text as one line of Markdown table text: no HTML, no cell breaks."""
    return html.escape(" ".join(value.split()), quote=False).replace("|", "&#x7C;")


def _help_blocks(help_string: str) -> Iterator[tuple[bool, list[str]]]:
    """Paragraphs of click help as (kept as written, lines): a ``\\b`` line starts a kept block, as in click."""
    for paragraph in re.split(r"\n\s*\n", inspect.cleandoc(help_string)):
        kept, lines = False, []
        for line in paragraph.split("\n"):
            if line.strip() == "\b":
                if lines:
                    yield kept, lines
                kept, lines = True, []
            else:
                lines.append(line)
        if lines:
            yield kept, lines


def _make_description(ctx: click.Context, remove_ascii_art: bool = False) -> Iterator[str]:
    """A command's help: paragraphs as text, click's ``\\b`` blocks with indented lines as text blocks."""
    help_string = ctx.command.help or ctx.command.short_help
    if not help_string:
        return
    for kept, lines in _help_blocks(help_string):
        if kept and any(line.startswith((" ", "\t")) for line in lines[1:]):
            if not lines[0].startswith((" ", "\t")) and lines[0].rstrip().endswith(":"):
                yield html.escape(lines[0], quote=False)  # "Examples:" above its lines
                yield ""
                lines = lines[1:]
            yield "```text"
            yield from textwrap.dedent("\n".join(lines)).split("\n")
            yield "```"
        else:
            yield html.escape(" ".join(line.strip() for line in lines), quote=False)
        yield ""


def _default(option: click.Option, ctx: click.Context) -> str:
    """The default as ``--help`` shows it with ``show_default`` (click's own rules), or ''."""
    if option.required:
        return "required"
    if isinstance(option.show_default, str):
        return option.show_default
    value = option.get_default(ctx, call=False)
    if value is None or (_UNSET is not None and value is _UNSET):
        return ""
    if callable(value):
        return "(dynamic)"
    if option.is_bool_flag and option.secondary_opts:
        return re.sub(r"^(--|-|/|\+)", "", (option.opts if value else option.secondary_opts)[0])
    if option.is_bool_flag or option.count:
        return ""
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value)
    return '""' if value == "" else str(value)


def _option_row(option: click.Option, ctx: click.Context) -> str:
    names = ", ".join(f"`{opt}`" for opt in option.opts)
    if option.secondary_opts:
        names += " / " + ", ".join(f"`{opt}`" for opt in option.secondary_opts)
    value_type = click_docs._format_table_option_type(option)
    default = _default(option, ctx)
    default = "required" if default == "required" else (f"`{_text(default)}`" if default else "")
    return f"| {names} | {value_type} | {_text(option.help or '')} | {default} |"


def _metavar(argument: click.Argument, ctx: click.Context) -> str:
    try:
        return argument.make_metavar(ctx)
    except TypeError:  # click < 8.2 takes no context
        return argument.make_metavar()  # type: ignore[call-arg]


def _make_table_options(ctx: click.Context, show_hidden: bool = False) -> Iterator[str]:
    params = ctx.command.get_params(ctx)
    arguments = [p for p in params if isinstance(p, click.Argument)]
    if arguments:
        yield "**Arguments:**"
        yield ""
        yield "| Name | Type | Required |"
        yield "| ---- | ---- | -------- |"
        for argument in arguments:
            many = " (one or more)" if argument.nargs == -1 else ""
            yield f"| `{_metavar(argument, ctx)}` | {argument.type.name}{many} | {'yes' if argument.required else 'no'} |"
        yield ""
    options = [p for p in params if isinstance(p, click.Option) and (show_hidden or not p.hidden)]
    if options:
        yield "**Options:**"
        yield ""
        yield "| Name | Type | Description | Default |"
        yield "| ---- | ---- | ----------- | ------- |"
        yield from (_option_row(option, ctx) for option in options)
        yield ""


for _name in ("_make_description", "_make_table_options", "_format_table_option_type"):
    if not hasattr(click_docs, _name):  # a mkdocs-click other than the pinned 0.9.0
        raise RuntimeError(f"mkdocs_click._docs.{_name} is gone: update docs/_tooling/hooks.py for this mkdocs-click")
click_docs._make_description = _make_description
click_docs._make_table_options = _make_table_options

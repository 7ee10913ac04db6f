"""A griffe extension: the reStructuredText of randattn's numpydoc docstrings, as Markdown for mkdocstrings.

randattn's docstrings are numpydoc in the scipy manner: ``:math:`...``` roles, ``.. math::`` directives,
cross-reference roles (``:func:`x```, ``:class:`~a.B```) and ``::`` literal blocks. mkdocstrings renders
docstrings as Markdown, where none of these means anything (a role shows as ``:math:`` before a code span, a
directive as a paragraph). This extension rewrites each docstring's text when griffe loads it, before
mkdocstrings parses its sections; the source files are not touched:

- ``:math:`x``` becomes ``$x$`` and each equation of a ``.. math::`` block (blank-line separated, as in Sphinx)
  a ``$$ ... $$`` block, which ``pymdownx.arithmatex`` (generic mode) hands to MathJax;
- ``:func:`x```, ``:class:`~a.b.C``` and the other Python roles become code spans (``x``, ``C``); a role with
  an explicit title (``:func:`title <target>```) keeps the title;
- a paragraph ending in ``::`` followed by an indented block becomes the paragraph (ending in ``:``) and a
  fenced code block;
- a doctest block (``>>>`` lines) outside an Examples section, which Markdown would read as nested quotes,
  becomes a fenced ``pycon`` block;
- the type of a section item (``name : type``), which mkdocstrings shows as code, loses its double backquotes;
- a prose paragraph after the items of a Parameters (Other Parameters, Attributes) section, which numpydoc
  parsers read as more parameters, moves before the docstring's first section.

It also reads the Sphinx-style ``#:`` comments above a module or class attribute (``#: k-hat above which ...``)
as that attribute's docstring, which griffe alone does not; and it gives an estimator entry point written on its
options (decorated with ``randattn.estimators.base.keyword_entry``, whose keyword signature is made when the module
is imported) the signature a caller sees, read from the imported function, where griffe reads the source alone.

Used from mkdocs.yml (``handlers.python.options.extensions``); ``python docs/_tooling/rst_docstrings.py``
runs its self-test.
"""

from __future__ import annotations

import importlib
import inspect
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

try:  # griffe is there when mkdocstrings runs the extension; the self-test below needs only this module
    from griffe import Docstring, Extension, Parameter, ParameterKind, Parameters
except ImportError:  # pragma: no cover
    Docstring = Parameter = ParameterKind = Parameters = None
    Extension = object  # type: ignore[assignment,misc]

_MATH_ROLE = re.compile(r":math:`([^`]+)`")
_PY_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|data|mod|obj|exc|const|term):`([^`]+)`")
_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)\.\. math::[ \t]*(?P<rest>.*)$")
_LITERAL = re.compile(r"^(?P<indent>[ \t]*)(?P<text>.*?)[ \t]*::[ \t]*$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _inline_math(match: re.Match[str]) -> str:
    # a role may run over lines (a docstring's own line breaks): one line of TeX, whitespace collapsed
    return "$" + " ".join(match.group(1).split()) + "$"


def _py_role(match: re.Match[str]) -> str:
    target = " ".join(match.group(1).split())
    titled = re.fullmatch(r"(.+?)\s*<[^<>]+>", target)
    if titled:
        text = titled.group(1)
    elif target.startswith("~"):
        text = target[1:].rsplit(".", 1)[-1]
    else:
        text = target.lstrip(".!")
    return f"`{text}`"


def _display(indent: str, equation: list[str]) -> list[str]:
    """One ``$$`` block from the lines of one equation, dedented to ``indent``."""
    body = [line.strip() for line in equation if line.strip()]
    tex = "\n".join(body)
    if "\\\\" in tex and "\\begin" not in tex:  # Sphinx's convention: a multi-line equation is aligned
        body = ["\\begin{aligned}", *body, "\\end{aligned}"]
    return ["", indent + "$$", *(indent + line for line in body), indent + "$$", ""]


def _block(lines: list[str], start: int, base: int) -> int:
    """The index after the block indented deeper than ``base`` that starts at ``start`` (blank lines included)."""
    end = start
    i = start
    while i < len(lines):
        if lines[i].strip():
            if _indent(lines[i]) <= base:
                break
            end = i + 1
        i += 1
    return end


def _math_blocks(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _DIRECTIVE.match(lines[i])
        if not match:
            out.append(lines[i])
            i += 1
            continue
        indent, base = match.group("indent"), _indent(lines[i])
        end = _block(lines, i + 1, base)
        content = ([match.group("rest")] if match.group("rest").strip() else []) + lines[i + 1:end]
        # options (":label: x", ":nowrap:") carry no TeX
        content = [line for line in content if not re.match(r"^\s*:[a-z]+:(\s|$)", line)]
        equation: list[str] = []
        for line in content + [""]:
            if line.strip():
                equation.append(line)
            elif equation:
                out.extend(_display(indent, equation))
                equation = []
        i = end
    return out


def _literal_blocks(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        match = _LITERAL.match(line)
        nxt = i + 1
        while nxt < len(lines) and not lines[nxt].strip():
            nxt += 1
        if (not match or line.lstrip().startswith("..") or nxt == i + 1 or nxt >= len(lines)
                or _indent(lines[nxt]) <= _indent(line)):
            out.append(line)
            i += 1
            continue
        indent, text = match.group("indent"), match.group("text")
        if text:
            out.append(indent + text + ("" if text.endswith(":") else ":"))
        end = _block(lines, nxt, _indent(line))
        body = lines[nxt:end]
        depth = min(_indent(b) for b in body if b.strip())
        out.extend(["", indent + "```text", *(indent + b[depth:] if b.strip() else "" for b in body),
                    indent + "```", ""])
        i = end
    return out


_ITEM_SECTIONS = ("Parameters", "Other Parameters", "Attributes")
_TYPED_SECTIONS = _ITEM_SECTIONS + ("Returns", "Yields", "Receives", "Raises", "Warns")
_ITEM = re.compile(r"^[\w*.]+(\s*,\s*[\w*.]+)*\s*(:.*)?$")


def _is_heading(lines: list[str], i: int) -> bool:
    return (i + 1 < len(lines) and bool(lines[i].strip()) and not lines[i].startswith((" ", "\t"))
            and re.fullmatch(r"-{3,}", lines[i + 1].strip()) is not None)


def _prose_out_of_sections(lines: list[str]) -> list[str]:
    first = next((i for i in range(len(lines)) if _is_heading(lines, i)), None)
    if first is None:
        return lines
    kept, moved, section, i = [], [], None, 0
    while i < len(lines):
        if _is_heading(lines, i):
            section = lines[i].strip()
            kept += lines[i:i + 2]
            i += 2
            continue
        line = lines[i]
        if section in _TYPED_SECTIONS and line.strip() and not line.startswith((" ", "\t")):
            line = line.replace("``", "")  # an item's header: its type is shown as code
        if (section in _ITEM_SECTIONS and line.strip() and not line.startswith((" ", "\t"))
                and i > 0 and not lines[i - 1].strip() and not _ITEM.match(line.strip())):
            end = i
            while end < len(lines) and lines[end].strip() and not _is_heading(lines, end):
                end += 1
            moved += lines[i:end] + [""]
            i = end
            continue
        kept.append(line)
        i += 1
    if not moved:
        return kept
    return kept[:first] + moved + kept[first:]


def _doctest_blocks(lines: list[str]) -> list[str]:
    out: list[str] = []
    section, i = None, 0
    while i < len(lines):
        if _is_heading(lines, i):
            section = lines[i].strip()
        line = lines[i]
        if (section not in ("Examples", "Example") and line.lstrip().startswith(">>>")
                and (i == 0 or not lines[i - 1].strip())):
            end = i
            while end < len(lines) and lines[end].strip():
                end += 1
            indent = line[:_indent(line)]
            out += [indent + "```pycon", *lines[i:end], indent + "```"]
            i = end
            continue
        out.append(line)
        i += 1
    return out


def rst_to_markdown(text: str) -> str:
    """The Markdown form of one docstring's reStructuredText constructs (see the module docstring)."""
    ending = "\n" if text.endswith("\n") else ""
    lines = _doctest_blocks(_literal_blocks(_math_blocks(_prose_out_of_sections(text.split("\n")))))
    text = "\n".join(lines).rstrip("\n") + ending
    text = _MATH_ROLE.sub(_inline_math, text)
    text = _PY_ROLE.sub(_py_role, text)
    return re.sub(r"\n{3,}", "\n\n", text)


@lru_cache(maxsize=None)
def _source_lines(path: str) -> tuple[str, ...]:
    return tuple(Path(path).read_text(encoding="utf-8").splitlines())


def comment_docstring(lines: tuple[str, ...] | list[str], lineno: int) -> str | None:
    """The ``#:`` comment lines right above line ``lineno`` (1-based), or a trailing ``#:`` on it; None if none."""
    above = []
    i = lineno - 2
    while i >= 0 and lines[i].lstrip().startswith("#:"):
        above.insert(0, lines[i].lstrip()[2:].strip())
        i -= 1
    if above:
        return "\n".join(above)
    match = re.search(r"#:\s*(.+)$", lines[lineno - 1]) if 0 < lineno <= len(lines) else None
    return match.group(1).strip() if match else None


def _is_keyword_entry(obj: Any) -> bool:
    return getattr(obj, "is_function", False) and any(
        "keyword_entry" in str(decorator.value) for decorator in getattr(obj, "decorators", ()))


def runtime_parameters(module: str, qualname: str) -> list[Any]:
    """The griffe parameters of the imported ``module.qualname``'s ``inspect.signature`` (defaults as their repr)."""
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return [
        Parameter(p.name, kind=ParameterKind(p.kind.description),
                  annotation=None if p.annotation is p.empty else str(p.annotation),
                  default=None if p.default is p.empty else repr(p.default))
        for p in inspect.signature(target).parameters.values()
    ]


class RstDocstrings(Extension):  # type: ignore[misc,valid-type]
    """Rewrite every docstring that griffe loads; give ``#:``-commented attributes their docstring."""

    def on_instance(self, *, obj: Any, agent: Any = None, **kwargs: Any) -> None:
        if _is_keyword_entry(obj):
            qualname = obj.path[len(obj.module.path) + 1:]
            obj.parameters = Parameters(*runtime_parameters(obj.module.path, qualname))
        if getattr(obj, "is_attribute", False) and obj.docstring is None and obj.lineno and obj.filepath:
            try:
                text = comment_docstring(_source_lines(str(obj.filepath)), obj.lineno)
            except (OSError, TypeError):
                text = None
            if text:
                obj.docstring = Docstring(text, lineno=obj.lineno, parent=obj,
                                          parser=getattr(agent, "docstring_parser", None),
                                          parser_options=getattr(agent, "docstring_options", None))
        docstring = getattr(obj, "docstring", None)
        if docstring is not None and docstring.value:
            docstring.value = rst_to_markdown(docstring.value)


if __name__ == "__main__":
    sample = (
        "With :math:`y_r` and :math:`L\n    \\epsilon`:\n\n.. math::\n    a = b,\n\n    c = d \\\\\n    e = f\n\n"
        "See :func:`~randattn.api.estimate`, :func:`title <x.y>` and :class:`Param`.\n\n"
        "Layout::\n\n    layer{L}.q   (B, H, N, D)\n\nAfter.\n\n.. math:: x = 1\n          + 2\n"
    )
    got = rst_to_markdown(sample)
    expected = (
        "With $y_r$ and $L \\epsilon$:\n\n$$\na = b,\n$$\n\n$$\n\\begin{aligned}\nc = d \\\\\ne = f\n"
        "\\end{aligned}\n$$\n\nSee `estimate`, `title` and `Param`.\n\n"
        "Layout:\n\n```text\nlayer{L}.q   (B, H, N, D)\n```\n\nAfter.\n\n$$\nx = 1\n+ 2\n$$\n"
    )
    assert got == expected, got
    params = "Summary.\n\nParameters\n----------\nx : int, ``x > 0``\n    An x.\n\nThe test takes ``x``.\n\nReturns\n-------\nint"
    got = rst_to_markdown(params)
    expected = ("Summary.\n\nThe test takes ``x``.\n\nParameters\n----------\nx : int, x > 0\n    An x.\n\n"
                "Returns\n-------\nint")
    assert got == expected, got
    doctest = "Kit.\n\n>>> import x\n>>> x.y\nTrue\n\nExamples\n--------\n>>> 1 + 1\n2"
    got = rst_to_markdown(doctest)
    expected = "Kit.\n\n```pycon\n>>> import x\n>>> x.y\nTrue\n```\n\nExamples\n--------\n>>> 1 + 1\n2"
    assert got == expected, got
    source = ["#: the threshold", "#: of k-hat", "KHAT = 0.7", "X = 1  #: one", "Y = 2"]
    assert comment_docstring(source, 3) == "the threshold\nof k-hat"
    assert comment_docstring(source, 4) == "one"
    assert comment_docstring(source, 5) is None
    if Parameter is not None:  # griffe installed: a keyword entry point's signature is the caller's
        got = [(p.name, p.kind.value, p.default) for p in runtime_parameters("randattn.estimators.lara.reference",
                                                                             "estimate")]
        assert got[:6] == [("q", "positional or keyword", None), ("k", "positional or keyword", None),
                           ("v", "positional or keyword", None), ("draws", "positional or keyword", None),
                           ("scale", "keyword-only", "None"), ("proposal", "keyword-only", "'eq34'")], got
    print("rst_docstrings: ok")

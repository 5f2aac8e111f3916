"""Every config key with its type, default and meaning, as Markdown, read from the typed config.

    python -m bebop.configdoc > docs/configuration.md

The keys, types and defaults come from the frozen dataclasses of `bebop/config.py` (starting at
`RunConfig`, one section per nested dataclass); the meaning of a key is its field's comment in the
source: the comment lines directly above the field, then the comment at the end of its line (a
field with neither, right below a commented one, points to the comment they share). A section's
text is its class docstring. The output depends only on the source, so it is the same on every
machine; `tests/test_docs.py` fails when `docs/configuration.md` differs from it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize

from bebop import config

HEADER = """# Configuration

Every key of the run config, its type, its default (the schema's, `config.defaults()`; each
config file changes some) and what it means. Set a key in a config file (`configs/*.py`,
`get_config(arg)`) or on the command line, e.g.
`python launch.py --config configs/demo.py --config.rl.kl_coef=0.01`. An unknown key or an
invalid value stops the run before any compute with an error naming the key.

This file is generated from `bebop/config.py` (its dataclasses and their field comments):
`python -m bebop.configdoc > docs/configuration.md`. Edit the comments there, not this file.
"""


def _comments(source: str) -> dict[int, str]:
    """Line number (1-based, in `source`) -> the text of the comment on that line."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def field_comments(cls) -> dict[str, str]:
    """Field name -> its comment: the comment lines right above it, then its trailing comment."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments = _comments(source)
    (node,) = ast.parse(source).body
    out = {}
    group = None  # the first field under a comment block that several fields share
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            group = None
            continue
        name = stmt.target.id
        above = []
        n = stmt.lineno - 1
        while n >= 1 and lines[n - 1].strip().startswith("#"):
            above.insert(0, comments[n])
            n -= 1
        if above or (n >= 1 and not lines[n - 1].strip()):
            group = name if above else None
        parts = above + ([comments[stmt.end_lineno]] if stmt.end_lineno in comments else [])
        text = " ".join(p for p in parts if p)
        if not text and group and group != name:
            text = f"See `{group}`."
        out[name] = text
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section(obj, prefix: str) -> tuple[list[str], list[tuple[object, str]]]:
    """The Markdown of one config section's own keys (`obj`: the section at its default, so a
    nested section shows the defaults its parent gives it), and its nested sections."""
    cls = type(obj)
    comments = field_comments(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            nested.append((value, prefix + f.name + "."))
            continue
        default = f"`{value!r}`"
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        meaning = re.sub(r"^See `(\w+)`", lambda m: f"See `{prefix}{m[1]}`", comments[f.name])
        rows.append(
            f"| `{prefix}{f.name}` | `{_cell(kind)}` | {_cell(default)} | {_cell(meaning)} |"
        )
    title = prefix.rstrip(".") or "top level"
    doc = inspect.getdoc(cls) if cls.__doc__ else ""
    out = [f"## `{title}`" if prefix else "## Top level", ""]
    if doc and not doc.startswith(cls.__name__ + "("):
        out += [" ".join(doc.split()), ""]
    if rows:
        out += ["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    return out, nested


def render(root=None) -> str:
    """The whole document for `root` (default: `config.RunConfig()`), sections depth first."""
    root = root if root is not None else config.RunConfig()
    out = [HEADER]
    todo = [(root, "")]
    while todo:
        obj, prefix = todo.pop(0)
        text, nested = _section(obj, prefix)
        out += text
        todo = nested + todo
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()

"""Spec text with positions: a safe YAML loader that keeps file:line:col for every string."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["Located", "SpecError", "load_yaml", "relpath"]


def relpath(path: Path) -> str:
    """A path as written in messages and generated code: relative to the repo."""
    root = Path(__file__).resolve().parent.parent
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


class SpecError(Exception):
    """A mistake in an opdefs/*.yaml spec; the message starts with file:line:col."""


class Located(str):
    """A string from a spec, remembering where its text starts."""

    file: str
    line: int  # 1-based
    col: int  # 1-based column of the first character of the value's text
    source_line: str
    # (line, col) of each character and of the end, for values whose text is not
    # simply their characters in one line: escapes, '' in single quotes, folded lines.
    positions: tuple[tuple[int, int], ...] | None = None
    lines: list[str] | None = None

    def __new__(cls, value: str, file: str, line: int, col: int, source_line: str = "") -> Located:
        self = super().__new__(cls, value)
        self.file, self.line, self.col, self.source_line = file, line, col, source_line
        return self

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def position(self, offset: int) -> tuple[int, int, str]:
        """(line, col, source line) of the character `offset` characters into this string."""
        if self.positions is None or self.lines is None:
            return self.line, self.col + offset, self.source_line
        line, col = self.positions[max(0, min(offset, len(self.positions) - 1))]
        return line, col, self.lines[line - 1]

    def sub(self, start: int, end: int) -> Located:
        """The slice [start:end] as a Located string."""
        line, col, src = self.position(start)
        out = Located(str(self)[start:end], self.file, line, col, src)
        if self.positions is not None:
            out.positions, out.lines = self.positions[start:end + 1], self.lines
        return out

    def error(self, message: str, offset: int = 0) -> SpecError:
        """A SpecError pointing at `offset` characters into this string."""
        line, col, src = self.position(offset)
        text = f"{self.file}:{line}:{col}: {message}"
        if src:
            text += f"\n    {src}\n    {' ' * (col - 1)}^"
        return SpecError(text)


class _Loader(yaml.SafeLoader):
    """SafeLoader whose strings are Located and whose mappings reject duplicate keys."""


def _construct_str(loader: _Loader, node: yaml.ScalarNode) -> Located:
    value = loader.construct_scalar(node)
    mark = node.start_mark
    quoted = node.style in ("'", '"')
    lines = loader.source_lines
    src = lines[mark.line] if mark.line < len(lines) else ""
    out = Located(value, loader.file, mark.line + 1, mark.column + 1 + quoted, src)
    start, end = mark.index + quoted, node.end_mark.index - quoted
    if loader.text[start:end] != value:  # escapes, '' or folded lines: map each character
        out.positions, out.lines = _positions(loader.text, start, end, value), lines
    return out


def _positions(text: str, start: int, end: int, value: str) -> tuple[tuple[int, int], ...]:
    """(line, col) in `text` of each character of `value` (then of its end), parsed from text[start:end].

    Characters only in the source (line breaks and indentation folded into a space,
    escape backslashes, doubled quotes, block indicators) are skipped.
    """
    out, i = [], start
    for ch in value:
        while i < end and text[i] != ch and text[i] in " \t\r\n\\'|>+-0123456789":
            if ch == " " and text[i] == "\n":
                break  # a folded line break reads as a space
            i += 1
        out.append(i)
        i = min(i + 1, end)
    out.append(i)

    result, scanned = [], start
    line, line_start = text.count("\n", 0, start) + 1, text.rfind("\n", 0, start) + 1
    for index in out:
        for k in range(scanned, index):
            if text[k] == "\n":
                line, line_start = line + 1, k + 1
        scanned = max(scanned, index)
        result.append((line, index - line_start + 1))
    return tuple(result)


def _construct_map(loader: _Loader, node: yaml.MappingNode) -> dict:
    out: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in out:
            first = next(k for k in out if k == key)
            at = f" (first at line {first.line})" if isinstance(first, Located) else ""
            raise _mark_error(loader.file, key_node.start_mark, f"duplicate key {key!r}{at}; give each key once",
                              loader.source_lines)
        out[key] = loader.construct_object(value_node, deep=True)
    return out


_Loader.add_constructor("tag:yaml.org,2002:str", _construct_str)
_Loader.add_constructor("tag:yaml.org,2002:map", _construct_map)


def _mark_error(file: str, mark: Any, message: str, lines: list[str]) -> SpecError:
    src = lines[mark.line] if mark.line < len(lines) else ""
    return SpecError(f"{file}:{mark.line + 1}:{mark.column + 1}: {message}\n    {src}\n    {' ' * mark.column}^")


_YAML_HINTS = {
    "mapping values are not allowed": "; quote a value that contains ': ' (or fix the indentation)",
    "expected ','": " (quote a value that holds commas)",
    "'\\t'": "; indent with spaces",
    "undefined alias": "; quote a value that starts with '*'",
    "expected <block end>": "; check the indentation, and quote the whole value if it starts with a quote",
}


def load_yaml(path: Path) -> Any:
    """Load one spec file safely; YAML errors become SpecErrors with file:line:col."""
    text = path.read_text()
    loader = _Loader(text)
    loader.file = relpath(path)
    loader.text = text
    loader.source_lines = text.splitlines()
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        opened = err.context_mark
        if opened is not None and (mark is None or mark.line >= len(loader.source_lines)):
            mark = opened  # the error is at the end of the file: point at what was never closed
        problem = err.problem or err.context or "?"
        hint = next((h for key, h in _YAML_HINTS.items() if key in problem), "")
        if opened is not None and ("expected ','" in problem or "end of stream" in problem):
            what = {"sequence": "'['", "mapping": "'{'"}.get(str(err.context).split()[-1], "quote")
            hint = f"; the {what} at line {opened.line + 1} is never closed" + hint
        raise _mark_error(loader.file, mark, f"invalid YAML: {problem}{hint}", loader.source_lines) from None
    finally:
        loader.dispose()

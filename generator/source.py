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

    def __new__(cls, value: str, file: str, line: int, col: int, source_line: str = "") -> Located:
        self = super().__new__(cls, value)
        self.file, self.line, self.col, self.source_line = file, line, col, source_line
        return self

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def sub(self, start: int, end: int) -> Located:
        """The slice [start:end] as a Located string (for single-line values)."""
        return Located(str(self)[start:end], self.file, self.line, self.col + start, self.source_line)

    def error(self, message: str, offset: int = 0) -> SpecError:
        """A SpecError pointing at `offset` characters into this string."""
        col = self.col + offset
        text = f"{self.file}:{self.line}:{col}: {message}"
        if self.source_line:
            text += f"\n    {self.source_line}\n    {' ' * (col - 1)}^"
        return SpecError(text)


class _Loader(yaml.SafeLoader):
    """SafeLoader whose strings are Located and whose mappings reject duplicate keys."""


def _construct_str(loader: _Loader, node: yaml.ScalarNode) -> Located:
    value = loader.construct_scalar(node)
    mark = node.start_mark
    quoted = node.style in ("'", '"')
    lines = loader.source_lines
    src = lines[mark.line] if mark.line < len(lines) else ""
    return Located(value, loader.file, mark.line + 1, mark.column + 1 + quoted, src)


def _construct_map(loader: _Loader, node: yaml.MappingNode) -> dict:
    out: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in out:
            raise _mark_error(loader.file, key_node.start_mark, f"duplicate key {key!r}", loader.source_lines)
        out[key] = loader.construct_object(value_node, deep=True)
    return out


_Loader.add_constructor("tag:yaml.org,2002:str", _construct_str)
_Loader.add_constructor("tag:yaml.org,2002:map", _construct_map)


def _mark_error(file: str, mark: Any, message: str, lines: list[str]) -> SpecError:
    src = lines[mark.line] if mark.line < len(lines) else ""
    return SpecError(f"{file}:{mark.line + 1}:{mark.column + 1}: {message}\n    {src}\n    {' ' * mark.column}^")


def load_yaml(path: Path) -> Any:
    """Load one spec file safely; YAML errors become SpecErrors with file:line:col."""
    text = path.read_text()
    loader = _Loader(text)
    loader.file = relpath(path)
    loader.source_lines = text.splitlines()
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        raise _mark_error(loader.file, mark, f"invalid YAML: {err.problem or err.context}",
                          loader.source_lines) from None
    finally:
        loader.dispose()

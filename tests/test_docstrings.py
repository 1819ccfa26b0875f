"""Every docstring parses as the documentation site reads it (issue 23): mkdocstrings reads the sources with
griffe, Google style, and ``mkdocs build --strict`` (CI) fails on any warning, such as two parameters on one
``Args:`` line or a parameter the signature does not have. This test finds the same warnings in a second,
without building the site; it runs where griffe is installed (the ``docs`` extra)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parents[1]


def _parse_all(obj: object) -> None:
    if obj.is_alias:  # type: ignore[attr-defined]
        return
    if obj.docstring is not None:  # type: ignore[attr-defined]
        _ = obj.docstring.parsed  # type: ignore[attr-defined]
    for member in obj.members.values():  # type: ignore[attr-defined]
        _parse_all(member)


def test_every_docstring_parses_without_a_warning() -> None:
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    handler, logger = Collect(), logging.getLogger("griffe")
    logger.addHandler(handler)
    try:
        package = griffe.load("kvpool", search_paths=[str(ROOT)], docstring_parser="google",
                              resolve_aliases=False)
        _parse_all(package)
    finally:
        logger.removeHandler(handler)
    assert not warnings, "docstrings the docs build refuses:\n" + "\n".join(warnings)

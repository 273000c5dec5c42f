"""Cells of the Prefect summary table artifact read as their literal text in the UI, which renders them as Markdown."""

from __future__ import annotations

import html

import pytest
from markdown_it import MarkdownIt

from flows.artifacts import table_cell


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (None, "none"),
        ("-", "-"),
        ("- x", "- x"),
        ("+", "+"),
        ("* y", "* y"),
        ("# heading", "# heading"),
        ("> quote", "> quote"),
        ("1. first", "1. first"),
        ("3)", "3)"),
        ("  - indented", "- indented"),
        ("-5", "-5"),
        ("a - b", "a - b"),
        ("sqlite:////tmp/mlflow.db", "sqlite:////tmp/mlflow.db"),
        (4.0, "4"),
        (0.52401, "0.5240"),
    ],
)
def test_summary_cells_render_as_their_text_not_as_markdown_blocks(value, shown):
    # CommonMark (the reference parser's port) is the independent judge: one paragraph holding the text.
    rendered = MarkdownIt("commonmark").render(table_cell(value)).strip()
    assert rendered == f"<p>{html.escape(shown, quote=False)}</p>"

"""README.md's Environment table is llmx.settings.SETTINGS' user settings, so the two cannot drift."""

from __future__ import annotations

from pathlib import Path

from llmx.settings import SETTINGS

README = Path(__file__).resolve().parent.parent / "README.md"
HEADER = ["variable", "values", "default", "what it does"]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def environment_table() -> tuple[list[str], list[list[str]]]:
    """The header and the rows of the first table under README.md's "## Environment"."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index("## Environment") + 1
    section = []
    for line in lines[start:]:
        if line.startswith("## "):
            break
        section.append(line)
    table = [line for line in section if line.startswith("|")]
    assert len(table) >= 2, "README.md's Environment section has no table"
    header, rule, *rows = table
    assert set(rule.replace("|", "").split()) <= {"---", ":---", "---:", ":---:"}, rule
    return _cells(header), [_cells(row) for row in rows]


def test_environment_table_lists_the_user_settings():
    header, rows = environment_table()
    assert header == HEADER
    expected = [[f"`{s.name}`", s.values, s.default, s.doc] for s in SETTINGS if s.user]
    assert [row[0] for row in rows] == [row[0] for row in expected], (
        "README.md's Environment table must list exactly the settings with user=True in llmx/settings.py, "
        "in its order"
    )
    for row, want in zip(rows, expected, strict=True):
        assert row == want, f"README.md's row for {want[0]} differs from llmx/settings.py"


def test_no_setting_text_breaks_the_table():
    for setting in SETTINGS:
        for text in (setting.name, setting.values, setting.default, setting.doc):
            assert "|" not in text and "\n" not in text, f"{setting.name}: '|' or a newline breaks the table"

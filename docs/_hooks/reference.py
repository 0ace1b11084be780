"""mkdocs hook: the reference page's table of `loragate serve` flags, made from the settings
(gateway/cli/serve_flags.py) at every build, so that it can never fall behind the command."""

from __future__ import annotations

from typing import Any

MARKER = "<!-- serve-flags -->"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    from gateway.cli.serve_flags import reference_rows

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| flag and variable | default | what it does |", "| --- | --- | --- |"]
    for flag, variable, default, help in reference_rows():
        shown = {"True": "on", "False": "off"}.get(default, default)
        shown = f"`{shown}`" if shown else "(in the text)"
        names = "<br>".join(f"`{name}`" for name in (*flag.split(" / "), variable))
        lines.append(f"| {names} | {shown} | {cell(help)} |")
    return markdown.replace(MARKER, "\n".join(lines))

"""The docs site's reference page is made from the settings: one row per `loragate serve`
flag, each a flag the command really takes, with its variable."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from gateway.cli.serve_flags import HELP, add_serve_command, reference_rows


def test_every_serve_flag_has_one_row_and_the_command_takes_it() -> None:
    cli = typer.Typer()
    add_serve_command(cli, lambda settings: None)
    cli.command("other")(lambda: None)  # two commands: `serve` is then named on the line
    runner = CliRunner(env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    help_text = runner.invoke(cli, ["serve", "--help"]).output
    rows = reference_rows()
    assert len(rows) == len(HELP)
    for flag, variable, _, _ in rows:
        name = flag.split(" / ")[0]
        assert name in help_text, flag
        assert variable == "LORAGATE_" + name[2:].replace("-", "_").upper()
    kernels = next(row for row in rows if row[0] == "--kernels")
    assert kernels[1:3] == ("LORAGATE_KERNELS", "auto")

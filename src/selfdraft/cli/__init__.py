"""`selfdraft` command line. Each subcommand builds a config and calls one library function; one
module per command group, errors mapped to exit codes in one place (common.command)."""

from __future__ import annotations

import typer

from selfdraft.cli import bench, calibrate, data, export, generate, serve, train

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="`selfdraft` command line. Each subcommand builds a config and calls one library function.")
for group in (generate, data, train, bench, calibrate, export, serve):
    group.register(app)

__all__ = ["app"]

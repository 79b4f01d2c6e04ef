"""What both typer CLIs share: the error-to-exit-code mapping of PROTOCOL §9,
in one place, and the `--version` option.

Usage errors exit 64 (typer's default 2 means "timeout" in §9); an
`EnvFileError` prints `ERROR: <path>: cannot read (<ExceptionType>)` and
exits 1; every other `MamError` prints `ERROR: <message>` on stderr and
exits with `errors.exit_code_for`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import typer

from mam.shared import __version__
from mam.shared.cli import helptext
from mam.shared.cli.render import cli_jobs, cli_show
from mam.shared.protocol.errors import EnvFileError, ExitCode, MamError, exit_code_for

try:  # typer >= 0.2x vendors click; older versions depend on it
    from typer._click.exceptions import ClickException as ClickException  # re-exported: typer's click
except ImportError:  # pragma: no cover - typer < 0.2x only (click itself may be installed, for uvicorn)
    from click.exceptions import ClickException  # type: ignore[import-not-found, no-redef, assignment, unused-ignore]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LOG_LEVEL = "INFO"
HUMAN_LOG_LEVEL = "WARNING"  # a person reads stdout on a terminal: no INFO lines mixed into the view


def new_app(name: str, help_text: str, order: Sequence[str] = (),
            examples: Mapping[str, str] | None = None, *, no_args_is_help: bool = True) -> typer.Typer:
    """A typer app with our conventions: no rich tracebacks, `-h` as `--help`, commands
    listed in workflow `order` with whole summaries and an example each (`clihelp`)."""
    return typer.Typer(
        name=name,
        help=help_text,
        cls=helptext.workflow_group(order, examples or {}),
        no_args_is_help=no_args_is_help,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
        context_settings={"help_option_names": ["-h", "--help"]},
    )


def version_option(prog: str) -> Any:
    """An eager `--version` option that prints `<prog> <version>` and exits 0.

    Returns:
        a typer OptionInfo, typed Any as `typer.Option` is so it can default a `bool` parameter.
    """

    def _callback(value: bool) -> None:
        if value:
            typer.echo(f"{prog} {__version__}")
            raise typer.Exit(0)

    return typer.Option(False, "--version", callback=_callback, is_eager=True,
                        help="Print the version and exit.")


def add_registry_commands(app: typer.Typer) -> None:
    """Add `jobs` and `show`, the same on the hub and on a runner (PROTOCOL §8)."""

    @app.command("jobs")
    def jobs_cmd(
        status: str = typer.Option(None, "--status", metavar="S",
                                   help="Only jobs in this status: blocked, queued, pending, running, completed, "
                                        "error, cancelled."),
        as_json: bool = typer.Option(False, "--json", help="One JSON object per line (default on a pipe)."),
        workspace: str = workspace_option(),
    ) -> int:
        """List this host's job records (PROTOCOL §8); tokens are shown only as set."""
        return cli_jobs(workspace=workspace, status=status, as_json=as_json)

    @app.command("show")
    def show_cmd(
        job_id: str = typer.Argument(..., metavar="JOB_ID", help="The job id (8 hex characters)."),
        as_json: bool = typer.Option(False, "--json", help="One JSON object (default on a pipe)."),
        workspace: str = workspace_option(),
    ) -> int:
        """Show one job record and its audit trail (PROTOCOL §8); tokens are shown only as set."""
        return cli_show(workspace=workspace, job_id=job_id, as_json=as_json)


def workspace_option() -> Any:
    """The `--workspace DIR` option every command takes (registry root, PROTOCOL §8).

    Returns:
        a typer OptionInfo, typed Any as `typer.Option` is so it can default a `str` parameter.
    """
    return typer.Option(None, "--workspace", metavar="DIR",
                        help="Workspace root (default: MAM_REAL_ROOT, WORKSPACE_ROOT, the nearest "
                             "parent with .agents or .git, else the current directory; PROTOCOL §8).")


def setup_logging(human: bool | None = None) -> None:
    """Send logs to stderr (stdout carries JSON lines only, PROTOCOL §9).

    MAM_LOG_LEVEL (DEBUG, INFO, WARNING, ERROR) sets the level; default INFO,
    WARNING when a person reads the human view (`human`, default: stdout is a TTY).
    """
    if human is None:
        human = sys.stdout.isatty()
    default = HUMAN_LOG_LEVEL if human else DEFAULT_LOG_LEVEL
    level = os.environ.get("MAM_LOG_LEVEL", default).upper()
    logging.basicConfig(level=level if level in LOG_LEVELS else default,
                        stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def human_view(as_json: bool) -> bool:
    """A person reads stdout (a TTY) and did not ask for `--json`."""
    return not as_json and sys.stdout.isatty()


def key_value_lines(info: Mapping[str, Any]) -> list[str]:
    """`key: value` lines of a flat result (lists joined with ", ", dicts as k=v)."""
    width = max((len(str(k)) for k in info), default=0) + 1
    lines = []
    for key, value in info.items():
        if isinstance(value, Mapping):
            value = " ".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            value = ", ".join(str(v) for v in value) or "-"
        lines.append(f"{(str(key) + ':').ljust(width)} {'-' if value is None else value}")
    return lines


def print_view(info: Mapping[str, Any], as_json: bool, lines: Sequence[str] | None = None) -> None:
    """One JSON line (a pipe, or `--json`), else the human `lines` (default `key_value_lines`)."""
    if human_view(as_json):
        typer.echo("\n".join(key_value_lines(info) if lines is None else lines))
    else:
        typer.echo(json.dumps(info, sort_keys=True))


def json_option() -> Any:
    """`--json`: JSON lines on stdout even on a TTY (a pipe always gets them).

    Returns:
        a typer OptionInfo, typed Any as `typer.Option` is so it can default a `bool` parameter.
    """
    return typer.Option(False, "--json", help="JSON lines on stdout even on a terminal (the default on a pipe).")


def fail(message: str, code: int = ExitCode.ERROR) -> NoReturn:
    """Print `ERROR: <message>` on stderr and exit with `code`."""
    print(f"ERROR: {message}", file=sys.stderr)
    raise SystemExit(code)


def run(app: typer.Typer, prog: str, argv: list[str] | None = None) -> NoReturn:
    """Run `app` and exit with the code of PROTOCOL §9.

    Args:
        app: the typer application.
        prog: program name shown in usage lines.
        argv: arguments (default: sys.argv[1:]).
    """
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name=prog, standalone_mode=False)
    except ClickException as exc:  # usage errors: bad option, missing argument
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare command: show its help
            exc.show()
            raise SystemExit(ExitCode.USAGE) from None
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        message = " ".join(exc.format_message().split())
        print(f"ERROR: {message}{hint}", file=sys.stderr)
        raise SystemExit(ExitCode.USAGE) from None
    except typer.Abort:
        print("Aborted.", file=sys.stderr)
        raise SystemExit(ExitCode.INTERRUPTED) from None
    except KeyboardInterrupt:
        raise SystemExit(ExitCode.INTERRUPTED) from None
    except EnvFileError as exc:
        fail(str(exc), ExitCode.ERROR)
    except MamError as exc:
        fail(str(exc), exit_code_for(exc))
    raise SystemExit(result if isinstance(result, int) else 0)

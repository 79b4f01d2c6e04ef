"""`mam-runner`: the worker host's command line. Each command parses, calls
one function, and lets `clikit.run` map errors to the exit codes of
PROTOCOL §9. `publish` is called often by agents: its imports stay lazy."""

from __future__ import annotations

import typer

from mam.shared import clikit

app = clikit.new_app(
    "mam-runner",
    "The worker side of mam-fleet: take dispatched jobs for a session, run the "
    "agent under a heartbeat, and publish its events.",
)


@app.callback()
def _root(version: bool = clikit.version_option("mam-runner")) -> None:
    """The worker side of mam-fleet."""


@app.command("jobs")
def jobs_cmd(
    status: str = typer.Option(None, "--status", metavar="S",
                               help="Only jobs in this status: pending, running, completed, error, cancelled."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line (default on a pipe)."),
    workspace: str = typer.Option(None, "--workspace", help="Workspace root (default: see PROTOCOL §8)."),
) -> int:
    """List this host's job records (PROTOCOL §8); tokens are shown only as set."""
    from mam.shared.registry import cli_jobs

    return cli_jobs(workspace=workspace, status=status, as_json=as_json)


@app.command("show")
def show_cmd(
    job_id: str = typer.Argument(..., metavar="JOB_ID", help="The job id (8 hex characters)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object (default on a pipe)."),
    workspace: str = typer.Option(None, "--workspace", help="Workspace root (default: see PROTOCOL §8)."),
) -> int:
    """Show one job record and its audit trail (PROTOCOL §8); tokens are shown only as set."""
    from mam.shared.registry import cli_show

    return cli_show(workspace=workspace, job_id=job_id, as_json=as_json)


def main() -> None:
    """Console-script entry point."""
    clikit.run(app, "mam-runner")


if __name__ == "__main__":
    main()

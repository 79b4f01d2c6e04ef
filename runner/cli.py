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


def main() -> None:
    """Console-script entry point."""
    clikit.run(app, "mam-runner")


if __name__ == "__main__":
    main()

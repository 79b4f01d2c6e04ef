"""`mam-orch`: the hub's command line. Each command parses, calls one
function, and lets `clikit.run` map errors to the exit codes of PROTOCOL §9.
Imports of the modules doing the work stay inside the commands (lazy)."""

from __future__ import annotations

import typer

from mam.shared import clikit

app = clikit.new_app(
    "mam-orch",
    "The hub of mam-fleet: dispatch jobs to runners over MQTT, watch them, "
    "cancel and redispatch them, run an embedded broker.",
)


@app.callback()
def _root(version: bool = clikit.version_option("mam-orch")) -> None:
    """The hub of mam-fleet: dispatch jobs to runners over MQTT and watch them."""


def main() -> None:
    """Console-script entry point."""
    clikit.run(app, "mam-orch")


if __name__ == "__main__":
    main()

"""`mam-runner` and `python -m mam.runner`: an agent's `publish` goes through the
runner daemon's local socket (`fastpath`, §17) before typer is even imported;
every other command, and a publish the fast path does not take, is `cli`."""

from __future__ import annotations

import sys

from mam.runner import fastpath


def main() -> None:
    """Console-script entry point: the socket fast path, else the typer CLI."""
    code = fastpath.try_publish(sys.argv[1:])
    if code is not None:
        raise SystemExit(code)
    from mam.runner import cli  # lazy: typer loads only when the fast path does not apply

    cli.main()


if __name__ == "__main__":
    main()

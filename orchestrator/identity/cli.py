"""`mam-orch runner ...`: enrolment, listing, revocation and hub key rotation
(PROTOCOL §16), and draining a runner from the hub (§7). `mam-orch runners` (plural) lists
presence; this group (singular) manages the roster of `orchestrator.roster` and the hub key of `shared.keys`.

`add` prints what the runner host needs and nothing secret: the command that
stores the hub's public key there, and the broker settings (its password is
handed over separately, as before).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import typer

from mam.orchestrator.identity import invites, notice, roster, runneruser
from mam.orchestrator.identity.roster import RosterEntry
from mam.shared import cli, config
from mam.shared.protocol import names
from mam.shared.protocol.crypto import invite, keys
from mam.shared.protocol.crypto.keys import EnrolRequest
from mam.shared.protocol.errors import UsageError
from mam.shared.store import keyfiles
from mam.shared.store.root import resolve_root

KEY_SHOWN_CHARS = 12
"""How much of a public key `runner list` shows in its table (the full key is in --json)."""

runner_app = cli.new_app(
    "runner", "Enrol, list, drain and revoke runners; rotate the hub key (PROTOCOL §16, §7).",
    ("invite", "add", "list", "drain", "undrain", "revoke", "rotate-hub-key"),
    {"invite": "mam-orch runner invite --session gpu-box --labels gpu --ttl 15m",
     "add": "mam-orch runner add 'THE_LINE_MAM_RUNNER_ENROLL_PRINTED'", "list": "mam-orch runner list",
     "drain": "mam-orch runner drain gpu-box --reason 'disk full'", "undrain": "mam-orch runner undrain gpu-box",
     "revoke": "mam-orch runner revoke gpu-box", "rotate-hub-key": "mam-orch runner rotate-hub-key"})

__all__ = ["runner_app"]


def _root(workspace: str | None) -> Path:
    return resolve_root(workspace)


def _hub_publics(root: Path) -> list[str]:
    """The hub keys a runner should trust: current (made on first use), then previous if any."""
    current = keys.public_text(keyfiles.hub_key(root))
    previous = keyfiles.hub_previous_public(root)
    return [current] + ([previous] if previous and previous != current else [])


def _broker_lines(root: Path) -> list[str]:
    """The runner's broker settings as `.mam.env` lines, without the password (§13)."""
    cfg = config.broker_config(workspace=root, warn=False)
    lines = [f"MQTT_BROKER={','.join(cfg.hosts)}", f"MQTT_PORT={cfg.port}",
             f"MQTT_TLS={'true' if cfg.tls else 'false'}", f"MAM_TOPIC_ROOT={cfg.topic_root}"]
    if cfg.username:
        lines.append(f"MQTT_USERNAME={cfg.username}")
    if cfg.ca_certs:
        lines.append("MQTT_CA_CERTS=<path of the CA certificate on the runner host>")
    return lines


def _request(request: str | None, session: str | None, ed25519: str | None, x25519: str | None,
             labels: str | None) -> EnrolRequest:
    if request is not None:
        if any(v is not None for v in (session, ed25519, x25519, labels)):
            raise UsageError("give either the enrolment REQUEST or --session/--ed25519/--x25519/--labels, not both")
        return EnrolRequest.parse(request)
    if session is None or ed25519 is None or x25519 is None:
        raise UsageError("give the enrolment REQUEST printed by `mam-runner enroll`, or --session, --ed25519 "
                         "and --x25519")
    return EnrolRequest.build(session, labels or "", ed25519, x25519)


@runner_app.command("invite")
def invite_cmd(
    session: str = typer.Option(..., "--session", metavar="NAME", help="The session the runner will serve (§1)."),
    labels: str = typer.Option(None, "--labels", metavar="L1,L2", help="Its labels, comma-separated (§14)."),
    ttl: str = typer.Option("15m", "--ttl", metavar="DURATION", help="How long the code is valid: 90s, 15m, 2h."),
    replace_keys: bool = typer.Option(False, "--replace", help="Let the invite replace an enrolled session's keys."),
    broker_host: str = typer.Option(None, "--broker-host", metavar="HOST[,HOST]",
                                    help="The broker as runner hosts reach it, written into the code "
                                         "(default MQTT_BROKER)."),
    workspace: str = cli.workspace_option(),
) -> int:
    """Print a single-use enrolment code, then wait (until --ttl) for the runner host to run
    `mam-runner enroll --invite CODE` and enrol it: the code authenticates the runner's public
    keys to the hub and the hub's key to the runner, over the broker, and carries where the
    broker is (hosts, port, TLS and its CA, topic root), so a fresh host needs nothing else
    configured for it (PROTOCOL §16). Only this command answers invites (not `mam-orch serve`).
    Exit 0 enrolled; 1 the TTL passed unused; 3 broker unreachable; 64 bad arguments."""
    root = _root(workspace)
    names.validate_session(session)
    wanted = keys.labels_of(labels or "")
    ttl_s = invite.parse_ttl(ttl)
    cfg = config.broker_config(workspace=root, warn=False)
    hint = invites.broker_hint(cfg, broker_host)
    code, stored = invites.create(root, session, wanted, ttl_s)
    # a fresh host needs a way in: the code's one-time user, allowed only this session's enrol topics
    enrol_user = runneruser.add_enrol_user(root, code, invites.finished_enrol_users(root))
    code = code.with_broker(dataclasses.replace(hint, enrol_user=enrol_user))

    def ready() -> None:
        typer.echo(code.text)  # the only time the code is shown
        sys.stdout.flush()
        typer.echo(f"on the runner host, within {ttl}: mam-runner enroll --invite <the code above> "
                   f"(it names broker {','.join(hint.hosts)}:{hint.port}); waiting until {stored.expires_at} ...",
                   err=True)
        if all(invites.is_loopback(host) for host in hint.hosts):
            typer.echo(f"WARNING: broker {','.join(hint.hosts)} is this host's loopback: a runner on another host "
                       "cannot reach it there; give --broker-host with the address runner hosts use", err=True)

    try:
        if enrol_user:
            invites.await_enrol_login(cfg, code)
        return invites.wait_for_enrolment(root, code, stored, replace_keys=replace_keys, on_ready=ready)
    finally:
        if enrol_user:  # used or expired: the way in closes, and the broker has applied it when this ends
            runneruser.remove_enrol_user(root, code)
            if not invites.await_enrol_logout(cfg, code):
                typer.echo(f"WARNING: the broker still accepts the invite's one-time user {code.enrol_username}: "
                           "reload it (it was removed from the config)", err=True)


@runner_app.command("add")
def add_cmd(
    request: str = typer.Argument(None, metavar="REQUEST",
                                  help="The one-line request `mam-runner enroll` printed (quote it)."),
    session: str = typer.Option(None, "--session", metavar="NAME", help="Instead of REQUEST: the session."),
    ed25519: str = typer.Option(None, "--ed25519", metavar="PUB", help="Its Ed25519 public key (base64url)."),
    x25519: str = typer.Option(None, "--x25519", metavar="PUB", help="Its X25519 public key (base64url)."),
    labels: str = typer.Option(None, "--labels", metavar="L1,L2", help="Its labels, comma-separated (§14)."),
    replace_keys: bool = typer.Option(False, "--replace", help="Replace the keys of an enrolled session."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of text."),
    workspace: str = cli.workspace_option(),
) -> int:
    """Enrol a runner's public keys in the roster (.mam/runners/<session>.json) and print what
    its host needs: the hub's public key (as a `mam-runner trust-hub` command) and the broker
    settings, without secrets; its own broker user's password goes once into a 0600 file
    (.mam/runner-credentials/<session>.env) and the user into the managed broker config
    (PROTOCOL §16). Exit 64: a bad request or key."""
    root = _root(workspace)
    enrol = _request(request, session, ed25519, x25519, labels)
    runneruser.check_session(enrol.session)  # a session that cannot be a broker user: nothing written
    entry, what = roster.add(root, enrol, replace_keys=replace_keys)
    hub = _hub_publics(root)
    broker = [line for line in _broker_lines(root) if not line.startswith("MQTT_USERNAME=")]
    granted = runneruser.grant(root, entry.session)  # its own broker user (§16), password in a 0600 file
    if as_json:
        typer.echo(json.dumps({"session": entry.session, "result": what, "labels": list(entry.labels),
                               "hub_ed25519_public": hub, "broker": broker, "broker_user": granted.user,
                               "credentials_file": str(granted.credentials), "notes": list(granted.lines)},
                              sort_keys=True))
        return 0
    shown = ",".join(entry.labels) or "none"
    typer.echo(f"{what} runner {entry.session} (labels: {shown}) in .mam/runners/{entry.session}.json")
    typer.echo("on the runner host, run:")
    typer.echo(f"  mam-runner trust-hub -- {' '.join(hub)}")
    typer.echo("and give its .mam.env these settings:")
    for line in broker:
        typer.echo(f"  {line}")
    for line in granted.lines:
        typer.echo(line)
    return 0


def _row(entry: RosterEntry) -> dict[str, object]:
    return {**entry.to_dict(), "status": "enrolled" if entry.active else "revoked"}


@runner_app.command("list")
def list_cmd(
    as_json: bool = typer.Option(False, "--json", help="JSON lines (default on a pipe)."),
    workspace: str = cli.workspace_option(),
) -> int:
    """List the enrolled and revoked runners of the roster (PROTOCOL §16)."""
    found = roster.entries(_root(workspace))
    if as_json or not sys.stdout.isatty():
        for entry in found:
            typer.echo(json.dumps(_row(entry), sort_keys=True))
        return 0
    if not found:
        typer.echo("no runner enrolled (mam-orch runner add REQUEST)")
        return 0
    typer.echo(f"{'SESSION':<24} {'STATUS':<9} {'ENROLLED':<21} {'REVOKED':<21} {'ED25519':<13} LABELS")
    for entry in found:
        typer.echo(f"{entry.session:<24} {_row(entry)['status']:<9} {entry.enrolled_at:<21} "
                   f"{entry.revoked_at or '-':<21} {entry.ed25519_public[:KEY_SHOWN_CHARS]:<13} "
                   f"{','.join(entry.labels) or '-'}")
    return 0


REASON_HELP = "Why, for the runner's log (at most 256 characters)."


def _drain(session: str, workspace: str | None, *, draining: bool, reason: str) -> int:
    from mam.orchestrator.hub import open_hub
    from mam.orchestrator.identity.drain import order_drain  # the hub and the broker client: only these two commands

    typer.echo(order_drain(open_hub(workspace), session, draining=draining, reason=reason))
    return 0


@runner_app.command("drain")
def drain_cmd(
    session: str = typer.Argument(..., metavar="NAME", help="The runner session to drain."),
    reason: str = typer.Option("", "--reason", metavar="TEXT", help=REASON_HELP),
    workspace: str = cli.workspace_option(),
) -> int:
    """Drain a runner from the hub: it takes no new job and shows `draining`, its running jobs
    go on; the order is signed and retained, so it holds across the runner's restarts until
    `undrain` (PROTOCOL §7). Exit 64: a bad name, or a revoked runner; 3: no broker."""
    return _drain(session, workspace, draining=True, reason=reason)


@runner_app.command("undrain")
def undrain_cmd(
    session: str = typer.Argument(..., metavar="NAME", help="The runner session to take back."),
    reason: str = typer.Option("", "--reason", metavar="TEXT", help=REASON_HELP),
    workspace: str = cli.workspace_option(),
) -> int:
    """Undo `drain`: the runner takes jobs again, the dispatches that waited for it first
    (PROTOCOL §7). Exit 64: a bad name, or a revoked runner; 3: no broker."""
    return _drain(session, workspace, draining=False, reason=reason)


@runner_app.command("revoke")
def revoke_cmd(
    session: str = typer.Argument(..., metavar="NAME", help="The runner session to revoke."),
    workspace: str = cli.workspace_option(),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of text."),
) -> int:
    """Revoke a runner: from the hub's next message on its presence is refused and nothing is
    dispatched to it; the runner is told (a signed, retained notice), stops its jobs and
    exits 77; its broker user, if the hub made one, is removed (PROTOCOL §16.7).
    Revoking again tells it again. Exit 1: not enrolled."""
    root = _root(workspace)
    entry = roster.revoke(root, session)
    notes = notice.tell_revoked(root, entry)  # before its broker user goes, so it can still hear
    notes += runneruser.withdraw(root, entry.session)  # its broker user too (§16)
    if as_json:
        typer.echo(json.dumps({"session": entry.session, "result": "revoked", "revoked_at": entry.revoked_at,
                               "notes": list(notes)}, sort_keys=True))
        return 0
    typer.echo(f"revoked runner {entry.session} at {entry.revoked_at}")
    for line in notes:
        typer.echo(line)
    return 0


@runner_app.command("rotate-hub-key")
def rotate_cmd(
    stage: bool = typer.Option(False, "--stage", help="Only make the next key, to be trusted by runners first."),
    workspace: str = cli.workspace_option(),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of text."),
) -> int:
    """Rotate the hub key without downtime (PROTOCOL §16): `--stage` makes the next key and
    prints the `mam-runner trust-hub CURRENT NEXT` line for every runner; then, without
    --stage, the hub signs with the next key and keeps the old public key as `previous`.
    Exit 64: no hub key yet (it is made by `mam-orch init` or the first `runner add`)."""
    root = _root(workspace)
    if stage:
        current = keys.public_text(keyfiles.hub_key(root, create=False))
        staged = keyfiles.stage_hub_key(root)
        if as_json:
            typer.echo(json.dumps({"result": "staged", "current": current, "next": staged}, sort_keys=True))
            return 0
        typer.echo(f"staged next hub public key: {staged}")
        typer.echo(f"on every runner host: mam-runner trust-hub -- {current} {staged}")
        typer.echo("then: mam-orch runner rotate-hub-key")
        return 0
    new, previous = keyfiles.rotate_hub_key(root)
    current = keys.public_text(new)
    if as_json:
        typer.echo(json.dumps({"result": "rotated", "current": current, "previous": previous}, sort_keys=True))
        return 0
    typer.echo(f"hub now signs with: {current} (previous: {previous})")
    typer.echo(f"runners that trust both keep working; on runners not yet told: "
               f"mam-runner trust-hub -- {current} {previous}")
    typer.echo(f"once every runner trusts the new key: mam-runner trust-hub -- {current}")
    return 0

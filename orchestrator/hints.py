"""The one-line hints hub commands print (§10, §14): how to re-attach to a job or
cancel it, naming `--workspace` when one was given."""

from __future__ import annotations

import os
import shlex

from mam.orchestrator.hub import Workspace
from mam.shared.protocol.codes import TERMINAL_STATUSES
from mam.shared.store.registry import Registry


def _where(workspace: Workspace) -> str:
    return f" --workspace {shlex.quote(os.fspath(workspace))}" if workspace is not None else ""


def command(text: str, workspace: Workspace = None) -> str:
    """`mam-orch TEXT`, with `--workspace DIR` when one was given: a command a person can paste."""
    return f"mam-orch {text}{_where(workspace)}"


def detach_hint(job_id: str, workspace: Workspace = None) -> str:
    """What Ctrl-C prints (§10): how to re-attach or cancel."""
    return (f"detached from job {job_id}; it keeps running. Re-attach: mam-orch watch {job_id}{_where(workspace)}  "
            f"Cancel: mam-orch cancel {job_id}{_where(workspace)}")


def reattach_hint(registry: Registry, job_id: str, workspace: Workspace = None) -> str | None:
    """What a watch that gave up on the broker (exit 3) prints when the job is
    still open (§14): its status and how to re-attach; None when it is closed."""
    status = registry.get(job_id)["status"]
    if status in TERMINAL_STATUSES:
        return None
    return (f"job {job_id} is still {status} (the broker is unreachable; nothing was decided). "
            f"Re-attach: mam-orch watch {job_id}{_where(workspace)}")


def unserved_hint(job_id: str, workspace: Workspace = None) -> str:
    """What `dispatch --detach` prints for a job left in the queue with no hub service running (§14)."""
    return (f"job {job_id} stays queued; nothing publishes it until `{command('serve', workspace)}` runs. "
            f"Cancel: {command(f'cancel {job_id}', workspace)}")


def queued_hint(job_id: str, workspace: Workspace = None) -> str:
    """What Ctrl-C prints while a job waits in the queue (§14)."""
    return (f"detached from job {job_id}; it stays queued, published by `mam-orch serve` once one runs. "
            f"Cancel: mam-orch cancel {job_id}{_where(workspace)}")

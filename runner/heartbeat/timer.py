"""The detached heartbeat timer process of PROTOCOL §12:
`python -m mam.runner.heartbeat.timer ...`, started by `heartbeat.start_timer`.

It publishes a `progress` beat (`detail: "heartbeat"`, `data.heartbeat: true`)
every N seconds over one persistent connection, with the attempt identity it
was started with, and stops for the reasons of `heartbeat` (terminal record
or barrier, newer attempt, `timeout_sec`, watched process gone).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from mam.runner import barrier
from mam.runner import publish as pub
from mam.runner.barrier import HEARTBEAT_DETAIL, WatchedProcess, barrier_attempt, read_json, record_stop_reason
from mam.shared.config import BrokerConfig
from mam.shared.protocol import names
from mam.shared.protocol.codes import TERMINAL_STATUSES, EventName
from mam.shared.protocol.errors import BrokerError, RegistryError, TransitionRefused
from mam.shared.store.registry import Registry
from mam.shared.transport import mqtt

TIMER_MODULE = "mam.runner.heartbeat.timer"
"""The module the detached timer process runs (`python -m`): this one."""

log = logging.getLogger("mam.heartbeat")

class _Timer:
    """The loop of one timer process. Publishes over one persistent connection."""

    def __init__(self, registry: Registry, job_id: str, attempt_id: int, dispatch_token: str,
                 interval_s: float, timeout_s: float, watch: WatchedProcess) -> None:
        self.registry = registry
        self.job_id = job_id
        self.attempt_id = attempt_id
        self.dispatch_token = dispatch_token
        self.interval_s = interval_s
        self.deadline = time.monotonic() + timeout_s
        self.watch = watch
        self.stop = threading.Event()
        self.client: mqtt.MqttClient | None = None

    def stop_reason(self) -> str | None:
        if not self.watch.alive():
            return f"watched process {self.watch.pid} is gone"
        if time.monotonic() >= self.deadline:
            return "timeout_sec reached"
        reason = record_stop_reason(self.registry, self.job_id, self.attempt_id, self.dispatch_token)
        if reason is not None:
            return reason
        if barrier_attempt(self.registry.root, self.job_id) >= self.attempt_id:
            return "terminal barrier raised"
        return None

    def run(self) -> int:
        cfg = pub.broker_for(self.registry, self.job_id)
        while True:
            if self.stop.wait(self.interval_s):
                return 0
            reason = self.stop_reason()
            if reason:
                log.info("heartbeat for job %s stops: %s", self.job_id, reason)
                return 0
            try:
                with self.registry.lock():
                    # checked under the seq lock: a beat takes its seq before a terminal or not at all
                    if barrier_attempt(self.registry.root, self.job_id) >= self.attempt_id:
                        log.info("heartbeat for job %s stops: terminal barrier raised", self.job_id)
                        return 0
                    result = pub.record(self.registry, pub.PublishRequest(
                        job_id=self.job_id, event=EventName.PROGRESS, detail=HEARTBEAT_DETAIL,
                        attempt_id=self.attempt_id, dispatch_token=self.dispatch_token),
                        extra_data={"heartbeat": True}, stop_heartbeat=False)
            except TransitionRefused as exc:
                log.info("heartbeat for job %s stops: %s", self.job_id, exc)
                return 0
            self._send(result, cfg)

    def _send(self, result: pub.Published, cfg: BrokerConfig) -> None:
        """Publish a beat on the timer's persistent connection; a broker failure
        costs only this beat on the wire (it is on disk) and the next one retries."""
        try:
            if self.client is None:
                client = mqtt.MqttClient(cfg, "heartbeat")
                try:
                    client.connect()
                except BrokerError:
                    client.close()
                    raise
                self.client = client
            pub.send_on(self.client, result)
        except BrokerError as exc:
            log.warning("job %s: beat seq %d not published: %s", self.job_id, result.seq, exc)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the detached timer of §12: `python -m mam.runner.heartbeat.timer ...`.

    Returns:
        the exit code (0 whenever the timer stops for a §12 reason).
    """
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s heartbeat[%(process)d] %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="mam.runner.heartbeat.timer", description=__doc__)
    parser.add_argument("--workspace", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--attempt-id", type=int, required=True)
    parser.add_argument("--dispatch-token", required=True)
    parser.add_argument("--interval-s", type=float, required=True)
    parser.add_argument("--timeout-s", type=float, required=True)
    parser.add_argument("--watch-pid", type=int, required=True)
    parser.add_argument("--watch-create-time", type=float, required=True)
    args = parser.parse_args(argv)
    timer = _Timer(Registry(args.workspace), names.validate_job_id(args.job), args.attempt_id,
                   names.validate_token(args.dispatch_token), args.interval_s, args.timeout_s,
                   WatchedProcess(args.watch_pid, args.watch_create_time))
    # SIGTERM = drain: finish the beat in flight, then exit (§12)
    signal.signal(signal.SIGTERM, lambda *_: timer.stop.set())
    try:
        return timer.run()
    finally:
        if timer.client is not None:
            timer.client.close()
        pid_path = names.heartbeat_path(timer.registry.root, timer.job_id, "pid")
        info = read_json(pid_path)
        if info and info.get("pid") == os.getpid():
            pid_path.unlink(missing_ok=True)


def start_timer(registry: Registry, job_id: str, *, attempt_id: int, dispatch_token: str,
                interval_s: float, watch: WatchedProcess, timeout_s: float,
                env: dict[str, str] | None = None, drain_s: float | None = None) -> int | None:
    """Start (or replace) the job's detached timer (§12).

    A start that finds the attempt ended (terminal record, a barrier for this
    attempt, or a newer attempt) arms nothing. A previous timer is drained or
    killed first. A timer whose pid could not be recorded is killed at once.

    Args:
        interval_s: seconds between beats (> 0).
        watch: the process whose death stops the timer.
        timeout_s: the job's wall-clock budget; the timer stops after it.
        env: environment for the timer process (default os.environ).
    Returns:
        the timer's pid, or None when nothing was armed.
    Raises:
        RegistryError: the pid file cannot be written (the timer is killed).
    """
    import psutil  # lazy: psutil only where a process is looked at (publish fast path)

    root = registry.root
    drain = barrier.drain_s_setting() if drain_s is None else drain_s
    with barrier.lifecycle_lock(root, job_id):
        record = registry.get(job_id)
        if (record["status"] in TERMINAL_STATUSES or record["attempt_id"] != attempt_id
                or record["dispatch_token"] != dispatch_token
                or barrier.barrier_attempt(root, job_id) >= attempt_id):
            log.info("job %s attempt %s has ended: no heartbeat timer armed", job_id, attempt_id)
            return None
        barrier.stop_timer_locked(root, job_id, drain)
        log_dir = names.job_logs_dir(root, job_id)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_fd = os.open(log_dir / "heartbeat.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        argv = [sys.executable, "-m", TIMER_MODULE, "--workspace", str(root), "--job", job_id,
                "--attempt-id", str(attempt_id), "--dispatch-token", dispatch_token,
                "--interval-s", repr(float(interval_s)), "--timeout-s", repr(float(timeout_s)),
                "--watch-pid", str(watch.pid), "--watch-create-time", repr(watch.create_time)]
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                                    env=env, start_new_session=True, close_fds=True)
        finally:
            os.close(log_fd)
        try:
            created = psutil.Process(proc.pid).create_time()
            barrier.write_json_0600(names.heartbeat_path(root, job_id, "pid"),
                             {"pid": proc.pid, "create_time": created, "attempt_id": attempt_id})
        except (psutil.Error, RegistryError, OSError) as exc:
            proc.kill()
            proc.wait()
            raise RegistryError(f"job {job_id}: heartbeat timer not armed: cannot record its pid ({exc})") from exc
        # The timer is detached (own session); reap it in the background if we outlive it.
        threading.Thread(target=proc.wait, name=f"reap-heartbeat-{job_id}", daemon=True).start()
        return proc.pid


if __name__ == "__main__":
    sys.exit(main())

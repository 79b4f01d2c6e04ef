"""Simulated runners for bench/bench_serve.py: one process publishes, for its
share of the hub's jobs, a signed `started` (+ state), a heartbeat every
BEAT_S (+ state) for BEAT_WINDOW_S, then `completed` (+ state), signed with
each job's auth_token (§3.1) as a real runner does, and writes the wall time of
each terminal publish to a JSON file. Each job beats at its own phase of BEAT_S
(a fleet's jobs started at different times) and the jobs end one after another
over END_SPREAD_S; the others beat on meanwhile, so every terminal is mirrored
under the full load.

Usage: python serve_sim.py HUB_ROOT SHARD SHARDS OUT_JSON BEAT_S BEAT_WINDOW_S END_SPREAD_S
"""

from __future__ import annotations

import heapq
import json
import sys
import time
from pathlib import Path
from typing import Any

from mam.shared import config
from mam.shared.protocol import crypto, names, wire
from mam.shared.store.registry import Registry
from mam.shared.transport import mqtt

DRAIN_S = 2.0  # after the last publish, time for the PUBACKs before closing
END, BEAT = 0, 1  # what is due for a job (a job's end comes before a beat due at the same moment)


def signed(kind: str, rec: dict[str, Any], seq: int, event: str, status: str,
           data: dict[str, Any] | None = None) -> bytes:
    """One signed event or state of `rec`'s current attempt, encoded (§3, §4)."""
    if kind == "event":
        body: Any = wire.Event.build(rec["job_id"], seq, event, "", attempt_id=rec["attempt_id"],
                                     dispatch_token=rec["dispatch_token"], session=rec["session"], data=data)
    else:
        body = wire.State.build(rec["job_id"], seq, status, event, attempt_id=rec["attempt_id"],
                                dispatch_token=rec["dispatch_token"])
    return wire.encode(crypto.sign_event(body.to_dict(), rec["auth_token"]))


def main(hub_root: str, shard: int, shards: int, out_path: str, beat_s: float, window_s: float,
         spread_s: float) -> None:
    records, _ = Registry(Path(hub_root)).list()
    mine = [r for i, r in enumerate(records) if i % shards == shard]
    cfg = config.broker_config(workspace=hub_root)
    root = cfg.topic_root
    sent_at: dict[str, float] = {}
    with mqtt.MqttClient(cfg, f"sim{shard}") as client:
        client.connect()

        def send(rec: dict[str, Any], seq: int, event: str, status: str, data: dict[str, Any] | None = None) -> None:
            client.publish_async(names.events_topic(rec["job_id"], root), signed("event", rec, seq, event, status,
                                                                                  data))
            client.publish_async(names.state_topic(rec["job_id"], root), signed("state", rec, seq, event, status),
                                 retain=True)

        seqs = {rec["job_id"]: 1 for rec in mine}
        for rec in mine:
            send(rec, 1, "started", "running")
        start = time.monotonic()
        # each job beats at its own phase of BEAT_S and ends at its own moment over END_SPREAD_S,
        # as jobs that started at different times do: not all at one tick, in one burst
        share = max(1, len(mine))
        due = [(start + beat_s * (1 + k / share), BEAT, k) for k in range(len(mine))]
        due += [(start + window_s + spread_s * k / share, END, k) for k in range(len(mine))]
        heapq.heapify(due)
        ended: set[int] = set()
        while len(ended) < len(mine):
            at, what, k = heapq.heappop(due)
            time.sleep(max(0.0, at - time.monotonic()))
            if k in ended:
                continue
            rec = mine[k]
            seqs[rec["job_id"]] += 1
            if what == END:
                ended.add(k)
                sent_at[rec["job_id"]] = time.time()
                send(rec, seqs[rec["job_id"]], "completed", "completed", {"exit_code": 0})
            else:
                send(rec, seqs[rec["job_id"]], "progress", "running", {"heartbeat": True})
                heapq.heappush(due, (at + beat_s, BEAT, k))
        time.sleep(DRAIN_S)
    Path(out_path).write_text(json.dumps(sent_at))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5]), float(sys.argv[6]),
         float(sys.argv[7]))

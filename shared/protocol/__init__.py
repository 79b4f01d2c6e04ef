"""The wire contract of docs/protocol.md: names, codes, errors, the messages
(`wire`) and their signatures and seals (`crypto`).

Imports nothing of store, transport or config (`make lint` checks it)."""

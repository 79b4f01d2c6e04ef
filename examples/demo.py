"""Placeholder for `make demo`; issue 5 (the remote transport end to end) fills it."""

print("make demo: not built yet; issue 5 (remote transport end to end) fills it in.")

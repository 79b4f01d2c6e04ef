"""mam.shared: code used by both the hub (mam-orch) and the runners (mam-runner)."""

__version__ = "0.1.0"

"""mam.orchestrator: the hub side (mam-orch)."""

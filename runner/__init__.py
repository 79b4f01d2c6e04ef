"""mam.runner: the worker side (mam-runner)."""

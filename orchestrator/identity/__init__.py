"""Who may talk to the hub (§16): the roster of enrolled runners, invites, revocations and per-runner broker users."""

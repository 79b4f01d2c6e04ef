"""One host's registry folder `.mam/` (§8): records, audit logs, their files,
locks and crash-safe writes."""

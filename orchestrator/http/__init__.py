"""`mam-orch serve --http`: the Starlette app, its JSON API, the dashboard's views and static files, and /metrics."""

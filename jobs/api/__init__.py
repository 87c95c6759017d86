"""The REST API of the jobs app under /api/ (jobs, nodes, reservations, events)."""

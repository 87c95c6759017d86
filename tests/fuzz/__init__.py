"""Standing API fuzzing with schemathesis over /api/schema/ (docs/api.md, "Fuzzing")."""

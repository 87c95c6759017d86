"""The telemetry HTTP API: batch ingestion endpoints for node agents (docs/telemetry.md)."""

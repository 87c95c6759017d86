"""Telemetry: GPU samples and step records, their ingestion, rollups and queries."""

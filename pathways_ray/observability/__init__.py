"""Observability: the fleet status table, profiles and their merged traces."""

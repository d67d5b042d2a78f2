"""Fault tests and the soak test: real site processes, a real gateway, real PostgreSQL."""

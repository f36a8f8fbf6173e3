"""Wiring: the pieces assembled into running services (serve, demo)."""

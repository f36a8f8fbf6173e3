"""The REST API under /v1/, its errors and its access rules."""

"""The healthgate command."""

"""healthgate: composite health and automatic cross-region failover."""

__version__ = "0.1.0"

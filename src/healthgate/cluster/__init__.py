"""Cluster mode (SPEC §4): many ``healthgate serve`` nodes over one etcd."""

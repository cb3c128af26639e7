"""Helpers for tests that start real processes and sockets (Envoy, HTTP backends)."""

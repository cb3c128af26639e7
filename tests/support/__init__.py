"""Helpers shared by the test folders: real processes and sockets (Envoy, HTTP backends),
fakes (a Kubernetes API server, a clock moved by hand), and checks several folders make."""

# The endpoint picker's image: `docker build -t kv-epp .` then `docker run kv-epp serve --help`.
#
# Two stages: the first installs the package and its runtime dependencies (no test extras) into
# a virtualenv, the second copies only that virtualenv onto a clean base, so compilers, pip's
# cache and the sources stay out of the image.  The process runs as an unprivileged user.
#
# BASE_IMAGE must provide `python` (3.11+) with the venv module; tests/deploy/test_image.py
# builds with a locally assembled Debian base because no registry is reachable there.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/epp
WORKDIR /src
COPY pyproject.toml README.md ./
COPY epp ./epp
COPY indexer ./indexer
COPY kvcache ./kvcache
COPY scorers ./scorers
RUN /opt/epp/bin/pip install . \
 && /opt/epp/bin/pip uninstall --yes pip \
 && /opt/epp/bin/epp serve --help > /dev/null

FROM ${BASE_IMAGE}
# A fixed numeric uid, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
RUN groupadd --system --gid 10001 epp \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin epp
COPY --from=build /opt/epp /opt/epp
# HF_HOME: transformers writes its cache there; /tmp is writable (an emptyDir in the Helm chart,
# whose pods run with a read-only root filesystem).
ENV PATH=/opt/epp/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/tmp/huggingface
USER 10001:10001
# ext_proc (gRPC), gRPC health, Prometheus /metrics
EXPOSE 9002 9003 9090
ENTRYPOINT ["epp"]
CMD ["serve"]

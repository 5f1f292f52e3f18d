# One image for the operator and the node agent: `proxyshift operator` / `proxyshift agent`.
# The Debian packages are exactly the tools the agent runs (tests/unit/test_dockerfile.py checks
# the list against every argument list written in the agent's code). Entrypoint in exec form:
# nothing runs through a shell.
FROM python:3.11-slim-bookworm AS base

RUN apt-get update \
 && apt-get install -y --no-install-recommends iptables nftables ipset ipvsadm kmod iproute2 conntrack \
 && rm -rf /var/lib/apt/lists/*

COPY requirements.lock /tmp/requirements.lock
RUN pip install --no-cache-dir --require-hashes -r /tmp/requirements.lock

COPY pyproject.toml README.md /src/
COPY operator /src/operator
RUN pip install --no-cache-dir --no-deps /src && rm -rf /src /tmp/requirements.lock

USER 65532:65532
ENTRYPOINT ["proxyshift"]
CMD ["--help"]

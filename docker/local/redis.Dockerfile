# Redis for the compose scale profile where Docker Hub's redis image cannot be pulled:
# Debian's redis-server on the local base (docker/local/setup.sh). docker/compose.local.yaml
# builds it; elsewhere compose.yaml runs redis:7.4-alpine.
ARG BASE_IMAGE=localhost/megacache-base:bookworm
FROM ${BASE_IMAGE}
# The redis user's ids are fixed (999) before the package would pick some, for USER below.
# DL3008: the version is the suite's (bookworm) redis-server, as the base pins the suite.
# hadolint ignore=DL3008
RUN groupadd --system --gid 999 redis \
    && useradd --system --uid 999 --gid 999 --home-dir /data --shell /usr/sbin/nologin redis \
    && apt-get update \
    && apt-get install -y --no-install-recommends redis-server redis-tools \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && mkdir -p /data && chown 999:999 /data
WORKDIR /data
USER 999:999
VOLUME ["/data"]
EXPOSE 6379
CMD ["redis-server", "--appendonly", "yes"]

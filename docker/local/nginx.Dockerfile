# nginx for the compose scale profile where Docker Hub's nginx image cannot be pulled:
# Debian's nginx-light on the local base (docker/local/setup.sh). Its entrypoint applies
# MEGACACHE_NGINX_REWRITE to the mounted docker/nginx.conf (docker/compose.local.yaml runs
# everything on the host's loopback, so the upstreams' and the listener's addresses change).
ARG BASE_IMAGE=localhost/megacache-base:bookworm
FROM ${BASE_IMAGE}
# DL3008: the version is the suite's (bookworm) nginx, as the base pins the suite.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends nginx-light \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /etc/nginx/sites-enabled/* \
    && ln -sf /dev/stdout /var/log/nginx/access.log \
    && ln -sf /dev/stderr /var/log/nginx/error.log
COPY nginx-entrypoint.sh /usr/local/bin/nginx-entrypoint
EXPOSE 8080
STOPSIGNAL SIGQUIT
ENTRYPOINT ["nginx-entrypoint"]
CMD ["nginx", "-g", "daemon off;"]

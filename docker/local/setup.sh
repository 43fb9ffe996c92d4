#!/usr/bin/env bash
# Make a Debian machine without Docker or Docker Hub able to build and run the megacache
# images (the container tests, `docker/smoke.sh --local`):
#   - rootful podman + runc + debootstrap from the Debian archive (only if missing);
#   - a containers.conf for this host: runc, and ulimits no higher than this host's hard
#     limits (podman's defaults exceed them and runc then cannot start a container);
#   - the base image localhost/megacache-base:bookworm, built here with debootstrap as the
#     stand-in for python:3.12-slim (only if the tag is absent or was built by another
#     version of this script or with other local CA certificates).
#
#   eval "$(docker/local/setup.sh)"    # stdout: the exports the podman commands need
#
# Idempotent: a second run changes nothing and takes about a second. Needs root to install
# packages and to build the base (debootstrap, chroot). Progress goes to stderr.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"
base="${MEGACACHE_BASE_IMAGE:-localhost/megacache-base:bookworm}"
suite="${MEGACACHE_DEBIAN_SUITE:-bookworm}"
state="${MEGACACHE_LOCAL_STATE:-/var/tmp/megacache-local}"
log() { echo "setup: $*" >&2; }
die() { echo "setup: error: $*" >&2; exit 1; }
mkdir -p "$state"
exec 9>"$state/setup.lock"
flock 9  # one setup at a time (pytest -n 2 runs one per worker)

# 1. Packages. --no-install-recommends: rootful podman needs none of them (crun would even
#    be picked over runc), and it keeps the install to ~10 s.
missing=()
for tool in podman runc debootstrap; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ "${#missing[@]}" -gt 0 ]; then
  [ "$(id -u)" = 0 ] || die "${missing[*]} missing; run as root, or: apt-get install podman runc debootstrap"
  command -v apt-get >/dev/null || die "${missing[*]} missing and no apt-get: install them with your package manager"
  log "installing ${missing[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

# 2. containers.conf: runc (crun fails on some hosts' cgroups), and ulimits a container may
#    have here: podman asks for ~1M files and ~4M processes, which runc cannot set on a host
#    with lower hard limits. nproc above 32768 failed even below the hard limit on a VM this
#    was tried on; a cache server needs far fewer.
conf="$state/containers.conf"
cap() { if [ "$1" = unlimited ] || [ "$1" -gt "$2" ]; then echo "$2"; else echo "$1"; fi; }
nofile="$(cap "$(ulimit -Hn)" 65536)"
nproc="$(cap "$(ulimit -Hu)" 32768)"
{
  echo "# written by docker/local/setup.sh"
  echo "[engine]"
  echo 'runtime = "runc"'
  echo "[containers]"
  echo "default_ulimits = [\"nofile=$nofile:$nofile\", \"nproc=$nproc:$nproc\"]"
} > "$conf.new"
mv "$conf.new" "$conf"
export CONTAINERS_CONF="$conf"

# 3. The base image. Its labels record what it was built from; a change rebuilds it.
recipe="$(sha256sum "$0" | cut -c1-16)"
local_cas=(/usr/local/share/ca-certificates/*.crt)
[ -e "${local_cas[0]}" ] || local_cas=()
cas="$( (cat "${local_cas[@]}" </dev/null 2>/dev/null || true) | sha256sum | cut -c1-16)"
current="$(podman image inspect --format '{{index .Labels "megacache.recipe"}}/{{index .Labels "megacache.cas"}}' "$base" 2>/dev/null || true)"
if [ "$current" != "$recipe/$cas" ]; then
  [ "$(id -u)" = 0 ] || die "building $base needs root (debootstrap, chroot)"
  # The Debian mirror this machine's apt uses (the first .../debian URI), for the same suite.
  mirror="${MEGACACHE_DEBIAN_MIRROR:-}"
  if [ -z "$mirror" ]; then
    mirror="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
        /etc/apt/sources.list.d/*.sources 2>/dev/null \
      | awk '/^deb / {for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) print $i}
             /^URIs:/ {for (i = 2; i <= NF; i++) print $i}' \
      | grep -E '/debian/?$' | head -n1 || true)"
  fi
  mirror="${mirror:-http://deb.debian.org/debian}"
  log "building $base: debootstrap $suite from $mirror (about a minute)"
  rootfs="$(mktemp -d "$state/rootfs.XXXXXX")"
  trap 'rm -rf "$rootfs"' EXIT
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
    "$suite" "$rootfs" "$mirror" >"$state/debootstrap.log" 2>&1 \
    || { tail -n 20 "$state/debootstrap.log" >&2; die "debootstrap failed (log: $state/debootstrap.log)"; }
  # apt inside image builds (docker/local/*.Dockerfile): the suite, its updates and security
  security="${mirror%/debian}/debian-security"
  printf 'deb %s %s main\ndeb %s %s-updates main\ndeb %s %s-security main\n' \
    "$mirror" "$suite" "$mirror" "$suite" "$security" "$suite" > "$rootfs/etc/apt/sources.list"
  # Trust what this host trusts (a TLS-inspecting proxy's CA, say), so pip in a build reaches
  # PyPI as it does here; pip reads the system store instead of its own certifi bundle.
  if [ "${#local_cas[@]}" -gt 0 ]; then
    cp "${local_cas[@]}" "$rootfs/usr/local/share/ca-certificates/"
    # the chroot has none of the host's temp dirs: a TMPDIR of the caller's (the test
    # suite gives each process its own) made its mktemp fail
    TMPDIR=/tmp chroot "$rootfs" update-ca-certificates >"$state/ca.log" 2>&1 \
      || { tail -n 20 "$state/ca.log" >&2; die "update-ca-certificates failed in the base (log: $state/ca.log)"; }
  fi
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$rootfs/etc/pip.conf"
  # Debian's python3 is "externally managed" (PEP 668): the image's pip installs into a venv,
  # which is first on PATH and reachable as python/pip, as in python:3.12-slim.
  TMPDIR=/tmp chroot "$rootfs" python3 -m venv /opt/venv
  ln -sf /opt/venv/bin/python "$rootfs/usr/local/bin/python"
  ln -sf /opt/venv/bin/pip "$rootfs/usr/local/bin/pip"
  # what an image never reads: package lists and archives, docs, man pages, translations
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin \
    "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* \
    "$rootfs"/usr/share/locale/* "$rootfs"/usr/share/info/* "$rootfs"/etc/resolv.conf
  old="$(podman image inspect --format '{{.Id}}' "$base" 2>/dev/null || true)"
  tar -C "$rootfs" -c . | podman import \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change "LABEL megacache.recipe=$recipe" --change "LABEL megacache.cas=$cas" \
    --change 'CMD ["python3"]' --quiet - "$base" >/dev/null
  # the image it replaces, unless something still uses it
  [ -z "$old" ] || podman rmi "$old" >/dev/null 2>&1 || true
  log "built $base ($(podman image inspect --format '{{.Size}}' "$base") bytes)"
fi

echo "export CONTAINERS_CONF=$(printf %q "$conf")"
echo "export MEGACACHE_BASE_IMAGE=$(printf %q "$base")"

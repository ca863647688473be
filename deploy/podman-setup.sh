#!/bin/bash
# Make podman able to start containers on this machine, then check that it can.
#
# Two defaults of podman fail on some machines (containers, CI sandboxes):
#  - crun refuses cgroups in hybrid mode ("cgroups in hybrid mode not supported"): runc copes.
#  - podman raises a container's RLIMIT_NOFILE and RLIMIT_NPROC above the machine's hard limits
#    ("setrlimit RLIMIT_NOFILE: Operation not permitted" without CAP_SYS_RESOURCE): the limits
#    are set to the hard limits this shell has.
# When a probe container fails, this writes those settings to /etc/containers/containers.conf
# (as root; $HOME/.config/containers/containers.conf otherwise) unless the file exists, and says
# so. It never edits an existing file. Exit 0: podman runs containers; 3: it cannot.
set -eu
say() { echo "podman-setup: $*" >&2; }
probe_image() {
    for img in ${KVPOOL_BASE_IMAGE:-localhost/kvpool-base:bookworm} localhost/debian-base:bookworm; do
        podman image exists "$img" && { echo "$img"; return; }
    done
}
IMG=$(probe_image || true)  # none on a fresh machine: not an error (set -e)
if [ -z "$IMG" ]; then
    # No image yet: nothing can be probed, and settings written unprobed can be wrong (rlimits a
    # container may not get), so none are written; build-image.sh calls this again once the base
    # image exists.
    say "no base image yet: nothing to probe, no settings written"
    exit 0
fi
probe() { [ -n "$IMG" ] && podman run --rm --network none "$IMG" true >/tmp/podman-probe.$$ 2>&1; }
if [ -n "$IMG" ] && probe; then rm -f /tmp/podman-probe.$$; exit 0; fi
[ -n "$IMG" ] && say "a probe container failed: $(tail -1 /tmp/podman-probe.$$)"
rm -f /tmp/podman-probe.$$

if [ "$(id -u)" = 0 ]; then CONF=/etc/containers/containers.conf; else CONF=$HOME/.config/containers/containers.conf; fi
if [ -e "$CONF" ]; then
    [ -n "$IMG" ] || exit 0
    say "$CONF exists: not touching it. Set in it: [containers] default_ulimits = [\"nofile=$(ulimit -Hn):$(ulimit -Hn)\", \"nproc=$(ulimit -Hu):$(ulimit -Hu)\"] and [engine] runtime = \"runc\""
    exit 3
fi
nofile=$(ulimit -Hn); nproc=$(ulimit -Hu)
[ "$nofile" = unlimited ] && nofile=1048576
[ "$nproc" = unlimited ] && nproc=4194304
runtime=""
command -v runc >/dev/null && runtime='runtime = "runc"'
# The limits a container may get can be lower than this shell's hard limits (the runtime's own
# process may have less): halve until a probe starts.
if [ -n "$IMG" ]; then
    rt=(); [ -n "$runtime" ] && rt=(--runtime runc)
    while [ "$nproc" -ge 1024 ]; do
        podman "${rt[@]}" run --rm --network none --ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc" \
            "$IMG" true >/dev/null 2>&1 && break
        nproc=$((nproc / 2))
    done
fi
mkdir -p "$(dirname "$CONF")"
cat >"$CONF" <<EOF
# Written by kvpool's deploy/podman-setup.sh: podman's defaults failed on this machine.
[containers]
# podman's default rlimits are above this machine's hard limits (no CAP_SYS_RESOURCE).
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
# crun refuses cgroups in hybrid mode; runc copes.
$runtime
EOF
say "wrote $CONF (runc, nofile=$nofile, nproc=$nproc)"
if [ -n "$IMG" ] && ! probe; then
    say "podman still cannot start a container: $(tail -1 /tmp/podman-probe.$$)"
    rm -f /tmp/podman-probe.$$
    exit 3
fi
rm -f /tmp/podman-probe.$$
exit 0

#!/usr/bin/env bash
# The one-node cluster's base images (crates/cluster), from Debian's busybox-static, with umoci
# and no container engine or registry:
#
#   images/node-images.sh [--busybox PATH] [--out DIR]
#
#   OUT/pause.oci.tar     the pod sandbox ("pause") image: /bin/sleep for 68 years as PID 1
#                         (containerd stops a sandbox with SIGKILL); tagged 3.10, so that
#                         `ctr images import --base-name registry.k8s.io/pause` gives the
#                         sandbox image the cluster's containerd names
#   OUT/busybox.oci.tar   the workload image: busybox with every applet linked in /bin, /bin/sh
#                         the default command; tagged with busybox's version
#
#   --busybox PATH   a static busybox (default: what images/setup.sh extracts,
#                    ${PLUGREG_DEPLOY_TOOLS:-$HOME/.cache/plugreg-deploy}/busybox-static/busybox)
#   --out DIR        where the archives go (default: target/images)
#
# Both carry busybox's copyright file. File times are SOURCE_DATE_EPOCH (default 0), so the
# same busybox gives the same bytes.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
die() { echo "images/node-images.sh: $*" >&2; exit 1; }

tools=${PLUGREG_DEPLOY_TOOLS:-$HOME/.cache/plugreg-deploy}
busybox=$tools/busybox-static/busybox
out=$repo/target/images
while [ $# -gt 0 ]; do
    case $1 in
    --busybox) busybox=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h | --help) sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1" ;;
    esac
done
command -v umoci >/dev/null || die "umoci is not installed (run images/setup.sh as root)"
[ -x "$busybox" ] || die "no static busybox at $busybox (run images/setup.sh as root)"
"$busybox" true 2>/dev/null || die "$busybox does not run"

epoch=${SOURCE_DATE_EPOCH:-0}
created=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)
version=$("$busybox" 2>&1 | sed -n '1s/^BusyBox v\([0-9.]*\).*/\1/p')
[ -n "$version" ] || die "cannot read the version of $busybox"
rootless=()
[ "$(id -u)" -eq 0 ] || rootless=(--rootless)

mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# One root file system for both: busybox, its applets, its licence, root and nobody.
root=$work/rootfs
mkdir -p "$root/bin" "$root/etc" "$root/tmp" "$root/usr/share/doc/busybox-static"
install -m 0755 "$busybox" "$root/bin/busybox"
for applet in $("$busybox" --list); do
    [ "$applet" = busybox ] || ln -s busybox "$root/bin/$applet"
done
copyright=$(dirname "$busybox")/copyright
[ -f "$copyright" ] || copyright=/usr/share/doc/busybox-static/copyright
[ -f "$copyright" ] && install -m 0644 "$copyright" "$root/usr/share/doc/busybox-static/copyright"
chmod 1777 "$root/tmp"
printf '%s\n' 'root:x:0:0:root:/root:/bin/sh' 'nobody:x:65534:65534:nobody:/:/bin/false' >"$root/etc/passwd"
printf '%s\n' 'root:x:0:' 'nogroup:x:65534:' >"$root/etc/group"
find "$root" -exec touch -h -d "@$epoch" {} +

# image NAME TAG CONFIG_ARGS...: OUT/NAME.oci.tar
image() {
    local name=$1 tag=$2
    shift 2
    local layout=$work/$name
    umoci init --layout "$layout"
    umoci new --image "$layout:$tag"
    umoci insert "${rootless[@]}" --image "$layout:$tag" \
        --history.created "$created" --history.created_by "images/node-images.sh ($name)" "$root" /
    umoci config --image "$layout:$tag" --no-history --created "$created" --author plugreg \
        --architecture amd64 --os linux --config.workingdir / \
        --config.env PATH=/bin \
        --config.label "org.opencontainers.image.title=$name" \
        --config.label "org.opencontainers.image.version=$tag" \
        --config.label "org.opencontainers.image.created=$created" "$@"
    umoci gc --layout "$layout"
    tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$epoch" \
        -C "$layout" -cf "$out/$name.oci.tar.tmp" .
    mv "$out/$name.oci.tar.tmp" "$out/$name.oci.tar"
    printf '%s\t%s bytes\t(%s)\n' "$out/$name.oci.tar" "$(stat -c %s "$out/$name.oci.tar")" "$tag"
}

image pause 3.10 --config.entrypoint /bin/sleep --config.cmd 2147483647 \
    --config.label "org.opencontainers.image.description=Pod sandbox for plugreg's one-node test cluster (busybox sleep)"
image busybox "$version" --config.cmd /bin/sh \
    --config.label "org.opencontainers.image.description=Workload image for plugreg's one-node test cluster (busybox-static)"

#!/usr/bin/env bash
# Build the container images as OCI archives, without a container engine (umoci only).
#
#   images/build.sh [--bin-dir DIR] [--out DIR] [--conf FILE] [IMAGE...]
#
# For each image of images/images.conf (or only the IMAGEs named): the root file system from
# images/rootfs.sh (the binary DIR/<image> and the libraries it needs), one layer, entrypoint
# /<image>, the user from images.conf, OCI labels with version and source revision. Writes
# OUT/<image>.oci.tar (an `oci-archive`, tag = version) and prints each archive's size.
#
#   --bin-dir DIR   where the binaries are (default: target/release)
#   --out DIR       where the archives go (default: target/images)
#   --conf FILE     the list of images (default: images/images.conf, the shipped images;
#                   images/test-images.conf lists the images only the tests use)
#
# Environment: VERSION (default v + the workspace version), REVISION (default: git HEAD,
# "-dirty" when tracked files changed), SOURCE_DATE_EPOCH (default: HEAD's commit time), so
# one commit gives byte-identical archives.
#
# Load or push: `podman load -i OUT/<image>.oci.tar`, or
# `skopeo copy oci-archive:OUT/<image>.oci.tar docker://REGISTRY/plugreg/<image>:VERSION`.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
die() { echo "images/build.sh: $*" >&2; exit 1; }

bin_dir=$repo/target/release
out=$repo/target/images
conf=$here/images.conf
wanted=()
while [ $# -gt 0 ]; do
    case $1 in
    --bin-dir) bin_dir=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --conf) conf=$2; shift 2 ;;
    -h | --help) sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1" ;;
    *) wanted+=("$1"); shift ;;
    esac
done

command -v umoci >/dev/null || die "umoci is not installed (Debian: apt-get install umoci; see images/setup.sh)"

workspace_version() {
    sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$repo/Cargo.toml" | head -n1
}
VERSION=${VERSION:-v$(workspace_version)}
if [ -z "${REVISION:-}" ]; then
    REVISION=$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)
    if [ "$REVISION" != unknown ] && [ -n "$(git -C "$repo" status --porcelain --untracked-files=no)" ]; then
        REVISION=$REVISION-dirty
    fi
fi
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git -C "$repo" log -1 --format=%ct 2>/dev/null || echo 0)}
export SOURCE_DATE_EPOCH
created=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
source_url=$(sed -n '/^\[workspace.package\]/,/^\[/s/^repository *= *"\(.*\)"/\1/p' "$repo/Cargo.toml" | head -n1)

# As root, file owners are recorded as they are (root); otherwise umoci maps us to root.
rootless=()
[ "$(id -u)" -eq 0 ] || rootless=(--rootless)

# images.conf: "image package user description...", '#' comments.
declare -A user_of desc_of
images=()
while read -r image _package user description; do
    case $image in '' | '#'*) continue ;; esac
    images+=("$image")
    user_of[$image]=$user
    desc_of[$image]=$description
done <"$conf"
[ ${#wanted[@]} -gt 0 ] || wanted=("${images[@]}")

mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for image in "${wanted[@]}"; do
    [ -n "${user_of[$image]+set}" ] || die "unknown image $image (not in $conf)"
    bin=$bin_dir/$image
    [ -x "$bin" ] || die "missing binary $bin (build it first: scripts/release.sh builds all)"

    root=$work/$image/rootfs
    layout=$work/$image/oci
    mkdir -p "$work/$image"
    "$here/rootfs.sh" "$bin" "$root"

    umoci init --layout "$layout"
    umoci new --image "$layout:$VERSION"
    umoci insert "${rootless[@]}" --image "$layout:$VERSION" \
        --history.created "$created" --history.created_by "images/build.sh ($image)" \
        "$root" /
    umoci config --image "$layout:$VERSION" --no-history \
        --created "$created" --author plugreg --architecture amd64 --os linux \
        --config.entrypoint "/$image" \
        --config.user "${user_of[$image]}" \
        --config.workingdir / \
        --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --config.label "org.opencontainers.image.title=$image" \
        --config.label "org.opencontainers.image.description=${desc_of[$image]}" \
        --config.label "org.opencontainers.image.version=$VERSION" \
        --config.label "org.opencontainers.image.revision=$REVISION" \
        --config.label "org.opencontainers.image.source=$source_url" \
        --config.label "org.opencontainers.image.licenses=Apache-2.0" \
        --config.label "org.opencontainers.image.created=$created"
    umoci gc --layout "$layout"

    # An oci-archive is the layout as a tar; sorted, fixed owners and times: reproducible.
    archive=$out/$image.oci.tar
    tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$SOURCE_DATE_EPOCH" \
        -C "$layout" -cf "$archive.tmp" .
    mv "$archive.tmp" "$archive"
    printf '%s\t%s bytes\t(%s %s, user %s)\n' "$archive" "$(stat -c %s "$archive")" \
        "$image" "$VERSION" "${user_of[$image]}"
done

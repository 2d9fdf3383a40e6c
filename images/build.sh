#!/usr/bin/env bash
# Build the container images as OCI archives, without a container engine (umoci only).
#
#   images/build.sh [--platform P] [--bin-dir DIR] [--out DIR] [--conf FILE] [IMAGE...]
#
# For each image of images/images.conf (or only the IMAGEs named): the root file system from
# images/rootfs.sh (the binary DIR/<image> and the libraries it needs), one layer, entrypoint
# /<image>, the user from images.conf, OCI labels with version and source revision. Writes
# OUT/<image>.oci.tar (an `oci-archive`, tag = version) and prints each archive's size.
#
#   --platform P    the OCI platform of the binaries (default linux/amd64): linux/arm64,
#                   linux/arm/v7, linux/ppc64le, linux/s390x, linux/riscv64 are cross builds
#                   (scripts/cross.sh), whose glibc comes from Debian's cross sysroot; each
#                   binary's ELF machine must be the platform's. images/index.sh joins one
#                   archive per platform into one multi-platform image (scripts/release.sh).
#   --bin-dir DIR   where the binaries are (default: each image's profile directory,
#                   target/<profile>: target/release, target/sidecar)
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
# Directories and files are created with the modes the images should have, whatever the
# caller's umask: part of the same bytes from the same commit.
umask 022

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
die() { echo "images/build.sh: $*" >&2; exit 1; }

bin_dir=
out=$repo/target/images
conf=$here/images.conf
platform=linux/amd64
wanted=()
while [ $# -gt 0 ]; do
    case $1 in
    --bin-dir) bin_dir=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --conf) conf=$2; shift 2 ;;
    --platform) platform=$2; shift 2 ;;
    -h | --help) sed -n '2,27p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1" ;;
    *) wanted+=("$1"); shift ;;
    esac
done

# The platform: OCI architecture, the ELF machine its binaries must have (readelf -h), and
# the cross sysroot whose glibc goes into the image (none for amd64: the build machine's).
os=${platform%%/*}
arch=${platform#*/}
arch=${arch%%/*}
machine=$("$repo/scripts/cross.sh" machine "$platform") || die "unknown platform $platform"
sysroot=()
if [ "$platform" != linux/amd64 ]; then
    sysroot=(--sysroot "$("$repo/scripts/cross.sh" sysroot "$platform")")
fi

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

# images.conf: "image package profile user description...", '#' comments.
declare -A profile_of user_of desc_of
images=()
while read -r image _package profile user description; do
    case $image in '' | '#'*) continue ;; esac
    images+=("$image")
    profile_of[$image]=$profile
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
    bin=${bin_dir:-$repo/target/${profile_of[$image]}}/$image
    [ -x "$bin" ] || die "missing binary $bin (build it first: cargo build --profile ${profile_of[$image]}; scripts/release.sh builds all)"
    got=$(readelf -h "$bin" | sed -n 's/^ *Machine: *//p')
    [ "$got" = "$machine" ] || die "$bin is built for $got, not for $platform ($machine)"

    root=$work/$image/rootfs
    layout=$work/$image/oci
    mkdir -p "$work/$image"
    "$here/rootfs.sh" "${sysroot[@]}" "$bin" "$root"

    # The layer: the root as a tar of our own (sorted, owners 0:0, the files' times already
    # SOURCE_DATE_EPOCH), which umoci only compresses. `umoci insert` (0.4.7) writes a layer
    # whose tar stream ends early: the last file lost its tail and the archive its end
    # blocks; engines took it, GNU tar does not.
    # Member names as engines write them (etc/passwd, not ./etc/passwd).
    (cd "$root" && LC_ALL=C ls -A) >"$work/$image/top"
    tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$SOURCE_DATE_EPOCH" \
        -C "$root" -cf "$work/$image/layer.tar" -T "$work/$image/top"
    umoci init --layout "$layout"
    umoci new --image "$layout:$VERSION"
    umoci raw add-layer --image "$layout:$VERSION" \
        --history.created "$created" --history.created_by "images/build.sh ($image)" \
        "$work/$image/layer.tar"
    umoci config --image "$layout:$VERSION" --no-history \
        --created "$created" --author plugreg --architecture "$arch" --os "$os" \
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
    # umoci's own gzip is 7% larger than GNU gzip -9 (images/regzip.py).
    "$here/regzip.py" "$layout"
    umoci gc --layout "$layout"

    # An oci-archive is the layout as a tar; sorted, fixed owners, modes and times (umoci
    # writes some files 0600, others follow the umask): reproducible.
    archive=$out/$image.oci.tar
    tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$SOURCE_DATE_EPOCH" \
        --mode=u=rwX,go=rX -C "$layout" -cf "$archive.tmp" .
    mv "$archive.tmp" "$archive"
    printf '%s\t%s bytes\t(%s %s %s, user %s)\n' "$archive" "$(stat -c %s "$archive")" \
        "$image" "$VERSION" "$platform" "${user_of[$image]}"
done

#!/usr/bin/env bash
# One command for a release: the release binaries of every image in images/images.conf for
# every platform, one multi-platform image per binary, and SHA256SUMS over all of them.
#
#   scripts/release.sh [--out DIR] [--platforms LIST]
#
#   --out DIR          default target/dist
#   --platforms LIST   comma-separated OCI platforms; default all six: linux/amd64,
#                      linux/arm64, linux/arm/v7, linux/ppc64le, linux/s390x, linux/riscv64
#
# DIR gets <os>-<arch>[-<variant>]/<binary> for each platform and image (linux-amd64/plugreg,
# linux-arm-v7/csi-provisioner, ...), <image>.oci.tar (an OCI image index with one manifest per
# platform: images/index.py), and SHA256SUMS over every binary and archive (check with
# `cd DIR && sha256sum -c SHA256SUMS`). VERSION, REVISION and SOURCE_DATE_EPOCH are as in
# images/build.sh, so one commit gives the same bytes; the binaries report VERSION in
# --version (PLUGREG_VERSION at build time).
#
# Every platform, linux/amd64 included, is built by scripts/cross.sh build into
# target/cross/<triple>/<profile> (each image's profile in images/images.conf): linux/amd64
# with the workspace's toolchain, the others with Debian's rustc-web and cross gcc
# (`scripts/cross.sh setup`, as root). cross.sh writes cargo home's paths as /cargo, so the
# bytes do not depend on where the checkout or cargo's home are.
# They do depend on the tools: DIR/BUILDINFO names every one (compilers, Debian packages,
# umoci, tar), for a rebuild that should match. Needs umoci (images/setup.sh installs it) and
# python3.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$repo/target/dist
platforms=$("$repo/scripts/cross.sh" platforms | awk '{ print $1 }' | paste -sd, -)
while [ $# -gt 0 ]; do
    case $1 in
    --out) out=$2; shift 2 ;;
    --platforms) platforms=$2; shift 2 ;;
    -h | --help) sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "scripts/release.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
IFS=, read -r -a platforms <<<"$platforms"

workspace_version() {
    sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$repo/Cargo.toml" | head -n1
}
export VERSION=${VERSION:-v$(workspace_version)}
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git -C "$repo" log -1 --format=%ct 2>/dev/null || echo 0)}

# Every image's binary, in one cargo invocation per platform and profile (images.conf's
# third column: `sidecar` for the controller sidecars, `release` for the others).
images=()
declare -A profile_of cargo_args
while read -r image package profile _rest; do
    case $image in '' | '#'*) continue ;; esac
    images+=("$image")
    profile_of[$image]=$profile
    cargo_args[$profile]+=" -p $package --bin $image"
done <"$repo/images/images.conf"

if [ -n "$(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    echo "scripts/release.sh: warning: tracked files have changed; the images' revision is" \
        "$(git -C "$repo" rev-parse HEAD)-dirty and no commit gives these bytes" >&2
fi

mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
files=()
for platform in "${platforms[@]}"; do
    dir=${platform//\//-}
    triple=$("$repo/scripts/cross.sh" platforms | awk -v p="$platform" '$1 == p { print $2 }')
    [ -n "$triple" ] || { echo "scripts/release.sh: unknown platform $platform" >&2; exit 2; }
    for profile in "${!cargo_args[@]}"; do
        echo "== $platform: scripts/cross.sh build --profile $profile (PLUGREG_VERSION=$VERSION)"
        # shellcheck disable=SC2086 # the packages and binaries, one word each
        PLUGREG_VERSION=$VERSION "$repo/scripts/cross.sh" build "$platform" --profile "$profile" ${cargo_args[$profile]}
    done
    mkdir -p "$out/$dir"
    for image in "${images[@]}"; do
        install -m 0755 "$repo/target/cross/$triple/${profile_of[$image]}/$image" "$out/$dir/$image"
        touch -d "@$SOURCE_DATE_EPOCH" "$out/$dir/$image"
        files+=("$dir/$image")
    done
    echo "== $platform: images"
    "$repo/images/build.sh" --platform "$platform" --bin-dir "$out/$dir" --out "$work/$dir" "${images[@]}"
done

echo "== multi-platform images"
for image in "${images[@]}"; do
    inputs=()
    for platform in "${platforms[@]}"; do
        inputs+=("$platform=$work/${platform//\//-}/$image.oci.tar")
    done
    "$repo/images/index.py" "$out/$image.oci.tar" "${inputs[@]}"
    files+=("$image.oci.tar")
done

(cd "$out" && sha256sum "${files[@]}" >SHA256SUMS)

# What made these bytes: a rebuild with the same commit and these tools gives the same
# SHA256SUMS (BUILDINFO itself is not in it).
{
    echo "commit: $(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "version: $VERSION"
    echo "source_date_epoch: $SOURCE_DATE_EPOCH"
    echo "platforms: ${platforms[*]}"
    echo "== rustc (linux/amd64)"
    (cd "$repo" && rustc -vV && cargo -V)
    if [ -x /usr/bin/rustc ]; then
        echo "== rustc (other platforms, RUSTC_BOOTSTRAP=1 -Zbuild-std)"
        /usr/bin/rustc -vV
    fi
    echo "== Debian packages"
    dpkg-query -W -f '${Package} ${Version} ${Architecture}\n' libc6 rustc-web rust-web-src \
        'gcc-*-linux-gnu*' 'libc6-*-cross' binutils 2>/dev/null | grep -v ' $' | sort || true
    echo "== image tools"
    umoci --version
    tar --version | head -n1
    python3 --version
} >"$out/BUILDINFO"
echo "== $out"
(cd "$out" && ls -l "${files[@]}" SHA256SUMS BUILDINFO && cat SHA256SUMS)

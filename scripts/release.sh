#!/usr/bin/env bash
# One command for a release: the release binaries of every image in images/images.conf, their
# images (images/build.sh), and SHA256SUMS over all of them.
#
#   scripts/release.sh [--out DIR]        (default DIR: target/dist)
#
# DIR gets <binary> for each image, <image>.oci.tar, and SHA256SUMS (check with
# `cd DIR && sha256sum -c SHA256SUMS`). VERSION, REVISION and SOURCE_DATE_EPOCH are as in
# images/build.sh; the binaries report VERSION in --version (PLUGREG_VERSION at build time).
# Needs cargo and umoci (images/setup.sh installs umoci).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$repo/target/dist
while [ $# -gt 0 ]; do
    case $1 in
    --out) out=$2; shift 2 ;;
    -h | --help) sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "scripts/release.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

workspace_version() {
    sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$repo/Cargo.toml" | head -n1
}
export VERSION=${VERSION:-v$(workspace_version)}

# Every image's binary, in one cargo invocation.
images=()
cargo_args=()
while read -r image package _rest; do
    case $image in '' | '#'*) continue ;; esac
    images+=("$image")
    cargo_args+=(-p "$package" --bin "$image")
done <"$repo/images/images.conf"

echo "== cargo build --release ${cargo_args[*]} (PLUGREG_VERSION=$VERSION)"
(cd "$repo" && PLUGREG_VERSION=$VERSION cargo build --release --locked "${cargo_args[@]}")

mkdir -p "$out"
out=$(cd "$out" && pwd)
for image in "${images[@]}"; do
    install -m 0755 "$repo/target/release/$image" "$out/$image"
done

echo "== images"
"$repo/images/build.sh" --bin-dir "$out" --out "$out" "${images[@]}"

files=()
for image in "${images[@]}"; do
    files+=("$image" "$image.oci.tar")
done
(cd "$out" && sha256sum "${files[@]}" >SHA256SUMS)
echo "== $out"
(cd "$out" && ls -l "${files[@]}" SHA256SUMS && cat SHA256SUMS)

#!/usr/bin/env bash
# Assemble the root file system of one image: the binary, the shared libraries it loads
# (found with ldd, so the same script serves glibc and static builds), their copyright
# files, and a minimal /etc and /tmp. No shell, no package manager.
#
#   images/rootfs.sh BINARY OUT_DIR
#
# OUT_DIR must not exist. The binary lands at /<name of BINARY> (the image's entrypoint).
# Every file's mtime is SOURCE_DATE_EPOCH (default 0), so the same inputs give the same
# layer bytes.
set -euo pipefail

die() { echo "rootfs.sh: $*" >&2; exit 1; }

[ $# -eq 2 ] || die "usage: rootfs.sh BINARY OUT_DIR"
bin=$1
out=$2
[ -f "$bin" ] && [ -x "$bin" ] || die "not an executable file: $bin"
[ ! -e "$out" ] || die "already exists: $out"
name=$(basename "$bin")
epoch=${SOURCE_DATE_EPOCH:-0}

mkdir -p "$out"
install -m 0755 "$bin" "$out/$name"

# Shared libraries, at the paths the dynamic loader looks for them (the interpreter's path is
# compiled into the binary). A static binary has none: ldd says "not a dynamic executable".
libs=()
if ldd_out=$(ldd "$bin" 2>&1); then
    while read -r lib; do
        libs+=("$lib")
    done < <(printf '%s\n' "$ldd_out" | grep -o '/[^ ]*' | sort -u)
elif ! grep -q 'not a dynamic executable\|statically linked' <<<"$ldd_out"; then
    die "ldd $bin failed: $ldd_out"
fi
for lib in "${libs[@]}"; do
    mkdir -p "$out$(dirname "$lib")"
    install -m 0755 "$(readlink -f "$lib")" "$out$lib"
    # The licence of each library's Debian package travels with it.
    # (dpkg knows a file by the path its package ships, /lib or /usr/lib: try both.)
    pkg=$( (dpkg -S "$lib" || dpkg -S "$(readlink -f "$lib")") 2>/dev/null | head -n1 | cut -d: -f1) || true
    if [ -n "${pkg:-}" ] && [ -f "/usr/share/doc/$pkg/copyright" ]; then
        mkdir -p "$out/usr/share/doc/$pkg"
        install -m 0644 "/usr/share/doc/$pkg/copyright" "$out/usr/share/doc/$pkg/copyright"
    fi
done

# Users for `USER 0` and `USER 65532` (the distroless "nonroot" id), without login shells.
mkdir -p "$out/etc" "$out/tmp"
chmod 1777 "$out/tmp"
printf '%s\n' 'root:x:0:0:root:/root:/sbin/nologin' \
    'nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin' >"$out/etc/passwd"
printf '%s\n' 'root:x:0:' 'nonroot:x:65532:' >"$out/etc/group"
chmod 0644 "$out/etc/passwd" "$out/etc/group"

find "$out" -exec touch -h -d "@$epoch" {} +

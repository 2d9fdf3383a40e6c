#!/usr/bin/env bash
# Assemble the root file system of one image: the binary, the shared libraries it loads
# (found with ldd, so the same script serves glibc and static builds), their copyright
# files, and a minimal /etc and /tmp. No shell, no package manager.
#
#   images/rootfs.sh [--sysroot DIR] BINARY OUT_DIR
#
# OUT_DIR must not exist. The binary lands at /<name of BINARY> (the image's entrypoint).
# Every file's mtime is SOURCE_DATE_EPOCH (default 0), so the same inputs give the same
# layer bytes.
#
# --sysroot DIR: BINARY is another architecture's (scripts/cross.sh), linked against the
# glibc of Debian's cross sysroot DIR (/usr/<multiarch>, from libc6-<arch>-cross). ldd cannot
# run it, so the libraries come from its ELF headers instead (readelf: the interpreter and
# every NEEDED library, transitively), taken from DIR/lib and laid out as that architecture's
# own Debian system has them: /lib/<multiarch>/<library>, the loader at the interpreter path.
set -euo pipefail

die() { echo "rootfs.sh: $*" >&2; exit 1; }

sysroot=
if [ "${1:-}" = --sysroot ]; then
    sysroot=${2:?--sysroot DIR}
    shift 2
fi
[ $# -eq 2 ] || die "usage: rootfs.sh [--sysroot DIR] BINARY OUT_DIR"
bin=$1
out=$2
[ -f "$bin" ] && [ -x "$bin" ] || die "not an executable file: $bin"
[ ! -e "$out" ] || die "already exists: $out"
name=$(basename "$bin")
epoch=${SOURCE_DATE_EPOCH:-0}

mkdir -p "$out"
install -m 0755 "$bin" "$out/$name"

# Shared libraries, at the paths the dynamic loader looks for them (the interpreter's path is
# compiled into the binary): "path in the image" and "file on this machine" pairs.
libs=()
if [ -z "$sysroot" ]; then
    # A static binary has none: ldd says "not a dynamic executable".
    if ldd_out=$(ldd "$bin" 2>&1); then
        while read -r lib; do
            libs+=("$lib" "$lib")
        done < <(printf '%s\n' "$ldd_out" | grep -o '/[^ ]*' | sort -u)
    elif ! grep -q 'not a dynamic executable\|statically linked' <<<"$ldd_out"; then
        die "ldd $bin failed: $ldd_out"
    fi
else
    [ -d "$sysroot/lib" ] || die "no cross sysroot at $sysroot (scripts/cross.sh setup installs it)"
    multiarch=$(basename "$sysroot")
    needed() { readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
    interp=$(readelf -l "$bin" | sed -n 's/.*Requesting program interpreter: \(.*\)\]/\1/p')
    if [ -n "$interp" ]; then
        [ -e "$sysroot/lib/$(basename "$interp")" ] || die "$sysroot has no loader $(basename "$interp")"
        libs+=("$interp" "$sysroot/lib/$(basename "$interp")")
        todo=$(needed "$bin")
        seen=" "
        while [ -n "$todo" ]; do
            set -- $todo
            lib=$1
            shift
            todo=$*
            case $seen in *" $lib "*) continue ;; esac
            seen="$seen$lib "
            [ "$lib" = "$(basename "$interp")" ] && continue
            [ -e "$sysroot/lib/$lib" ] || die "$bin needs $lib, which $sysroot/lib does not have"
            libs+=("/lib/$multiarch/$lib" "$sysroot/lib/$lib")
            todo="$todo $(needed "$(readlink -f "$sysroot/lib/$lib")")"
        done
    elif readelf -d "$bin" | grep -q NEEDED; then
        die "$bin needs shared libraries but names no interpreter"
    fi
fi
for ((i = 0; i < ${#libs[@]}; i += 2)); do
    lib=${libs[i]}
    file=${libs[i + 1]}
    mkdir -p "$out$(dirname "$lib")"
    install -m 0755 "$(readlink -f "$file")" "$out$lib"
    # The licence of each library's Debian package travels with it.
    # (dpkg knows a file by the path its package ships, /lib or /usr/lib: try both.)
    pkg=$( (dpkg -S "$file" || dpkg -S "$(readlink -f "$file")") 2>/dev/null | head -n1 | cut -d: -f1) || true
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

#!/usr/bin/env bash
# Cross builds for the platforms upstream's sidecar images ship, and riscv64 (issue 32):
# scripts/release.sh builds every platform with it, crates/interop/tests/qemu.rs the suite's
# arm64 and s390x proofs.
#
#   scripts/cross.sh setup [PLATFORM...]           as root: the toolchain below (Debian packages),
#                                                  for every platform or the ones named
#   scripts/cross.sh build PLATFORM [CARGO ARGS]   release binaries for PLATFORM into
#                                                  target/cross/<triple>/release (another
#                                                  profile with --profile NAME: .../<NAME>)
#   scripts/cross.sh run PLATFORM BINARY [ARGS]    BINARY of PLATFORM under qemu-user-static
#   scripts/cross.sh platforms                     PLATFORM -> Rust target triple
#   scripts/cross.sh sysroot PLATFORM              the cross glibc's root (images/rootfs.sh)
#   scripts/cross.sh machine PLATFORM              the ELF machine of its binaries (readelf -h)
#
# PLATFORM is an OCI platform: linux/amd64, linux/arm64, linux/arm/v7, linux/ppc64le,
# linux/s390x, linux/riscv64. Example:
#   scripts/cross.sh build linux/s390x -p plugreg-livenessprobe
#   scripts/cross.sh run linux/s390x target/cross/s390x-unknown-linux-gnu/release/livenessprobe --version
#
# Why this toolchain: rustup cannot download other targets' standard libraries here (no network
# but the package registries). Debian bookworm's `rustc-web` (rustc 1.96, kept current for the
# browsers' builds) and `rust-web-src` (the same release's standard library source) are in the
# registry, so the standard library is compiled for the target with cargo's `-Zbuild-std`
# (`RUSTC_BOOTSTRAP=1`: the same compiler and source, one release newer than the workspace's
# rustup toolchain). Linking is Debian's cross gcc and the target's glibc
# (`gcc-<triple>`, `libc6-dev-<arch>-cross`); the binaries are glibc binaries, as the amd64
# images' are (images/README.md). Debian's prebuilt `libstd-rust-web-dev:<arch>` is 1.96 only
# for arm64 in the registry (1.85 elsewhere), so every foreign platform builds its std the same
# way instead.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# The one list of release platforms (release.sh and images/build.sh read it from here):
# platform triple gcc-prefix debian-arch qemu elf-machine (readelf's name, _ for a space)
PLATFORMS="
linux/amd64 x86_64-unknown-linux-gnu - amd64 - Advanced_Micro_Devices_X86-64
linux/arm64 aarch64-unknown-linux-gnu aarch64-linux-gnu arm64 aarch64 AArch64
linux/arm/v7 armv7-unknown-linux-gnueabihf arm-linux-gnueabihf armhf arm ARM
linux/ppc64le powerpc64le-unknown-linux-gnu powerpc64le-linux-gnu ppc64el ppc64le PowerPC64
linux/s390x s390x-unknown-linux-gnu s390x-linux-gnu s390x s390x IBM_S/390
linux/riscv64 riscv64gc-unknown-linux-gnu riscv64-linux-gnu riscv64 riscv64 RISC-V
"

field() { # field PLATFORM N
    awk -v p="$1" -v n="$2" '$1 == p { print $n }' <<<"$PLATFORMS"
}

platform_or_die() {
    if [ -z "$(field "$1" 2)" ]; then
        echo "scripts/cross.sh: unknown platform $1 (see: scripts/cross.sh platforms)" >&2
        exit 2
    fi
}

case ${1:-} in
setup)
    # Every platform's linker and C library, or only those of the PLATFORMs named.
    shift
    for platform in "$@"; do platform_or_die "$platform"; done
    pkgs=(rustc-web rust-web-src qemu-user-static binutils)
    while read -r platform _triple gcc arch _qemu _machine; do
        [ -z "$platform" ] || [ "$gcc" = - ] && continue
        if [ $# -gt 0 ] && ! printf '%s\n' "$@" | grep -qxF "$platform"; then
            continue
        fi
        pkgs+=("gcc-$gcc" "libc6-dev-$arch-cross")
    done <<<"$PLATFORMS"
    missing=()
    for pkg in "${pkgs[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get -o DPkg::Lock::Timeout=300 update -q
        apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends "${missing[@]}"
    fi
    echo "scripts/cross.sh: ${pkgs[*]} installed"
    ;;
sysroot)
    # The cross C library's root (/usr/<multiarch>) of PLATFORM; nothing for linux/amd64.
    platform=${2:?PLATFORM}
    platform_or_die "$platform"
    gcc=$(field "$platform" 3)
    [ "$gcc" = - ] || echo "/usr/$gcc"
    ;;
build)
    platform=${2:?PLATFORM}
    shift 2
    platform_or_die "$platform"
    triple=$(field "$platform" 2)
    gcc=$(field "$platform" 3)
    # The release profile unless the arguments name another (`--profile qemu`).
    profile=(--release)
    for arg in "$@"; do
        case $arg in --profile | --profile=*) profile=() ;; esac
    done
    # The same bytes wherever the checkout and cargo's home are: the only machine paths a
    # release binary holds are cargo home's (the registry crates' sources, in panic locations),
    # so they are written as /cargo. Build scripts and proc macros are host code, which
    # RUSTFLAGS does not reach with --target.
    cargo_home=${CARGO_HOME:-$HOME/.cargo}
    remap="--remap-path-prefix=$cargo_home=/cargo"$'\x1f'"--remap-path-prefix=$repo=/plugreg"
    if [ -z "${CARGO_ENCODED_RUSTFLAGS:-}" ] && [ -n "${RUSTFLAGS:-}" ]; then
        CARGO_ENCODED_RUSTFLAGS=$(tr -s ' ' '\037' <<<"$RUSTFLAGS")
    fi
    export CARGO_ENCODED_RUSTFLAGS=${CARGO_ENCODED_RUSTFLAGS:+$CARGO_ENCODED_RUSTFLAGS$'\x1f'}$remap
    cd "$repo"
    if [ "$gcc" = - ]; then
        # .cargo/config.toml's packed relocations (x86 only), which these RUSTFLAGS replace.
        CARGO_ENCODED_RUSTFLAGS+=$'\x1f'-Clink-arg=-Wl,-z,pack-relative-relocs
        exec cargo build "${profile[@]}" --locked --target "$triple" --target-dir "$repo/target/cross" "$@"
    fi
    linker_var="CARGO_TARGET_$(tr 'a-z-' 'A-Z_' <<<"$triple")_LINKER"
    export "$linker_var=$gcc-gcc"
    RUSTC_BOOTSTRAP=1 RUSTC=/usr/bin/rustc exec cargo build "${profile[@]}" --locked \
        -Zbuild-std=std,panic_abort --target "$triple" --target-dir "$repo/target/cross" "$@"
    ;;
run)
    platform=${2:?PLATFORM}
    binary=${3:?BINARY}
    shift 3
    platform_or_die "$platform"
    qemu=$(field "$platform" 5)
    gcc=$(field "$platform" 3)
    if [ "$qemu" = - ]; then
        exec "$binary" "$@"
    fi
    # LD_LIBRARY_PATH: the sysroot's glibc before the host's /lib/<multiarch>, which holds
    # another glibc build when the machine has that architecture's libc6 installed.
    LD_LIBRARY_PATH=/usr/$gcc/lib exec "qemu-$qemu-static" -L "/usr/$gcc" "$binary" "$@"
    ;;
platforms)
    awk 'NF { print $1, $2 }' <<<"$PLATFORMS"
    ;;
machine)
    # The ELF machine `readelf -h` names for PLATFORM's binaries (images/build.sh checks it).
    platform=${2:?PLATFORM}
    platform_or_die "$platform"
    field "$platform" 6 | tr _ ' '
    ;;
*)
    sed -n '2,30p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    [ "${1:-}" = -h ] || [ "${1:-}" = --help ] || exit 2
    ;;
esac

#!/usr/bin/env bash
# Install what images/build.sh, scripts/release.sh and crates/deploy-tests need, on Debian
# bookworm, as root. Idempotent.
#
#   umoci           builds the OCI archives (no container engine)
#   podman, runc    run the images in the tests (runc: crun 1.8 refuses cgroup hybrid mode)
#   kubectl v1.20.2 from Debian's kubernetes-client, extracted (not installed, so it cannot
#                   clash with another kubectl package) to
#                   ${PLUGREG_DEPLOY_TOOLS:-$HOME/.cache/plugreg-deploy}/kubectl-v1.20.2
#   busybox-static  Debian's, extracted the same way (the package conflicts with `busybox`) to
#                   ${PLUGREG_DEPLOY_TOOLS:-$HOME/.cache/plugreg-deploy}/busybox-static/busybox:
#                   the one-node cluster's pause and workload images (images/node-images.sh)
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

tools=${PLUGREG_DEPLOY_TOOLS:-$HOME/.cache/plugreg-deploy}
kubectl=$tools/kubectl-v1.20.2
busybox=$tools/busybox-static/busybox
need=()
for cmd in umoci podman runc; do
    command -v "$cmd" >/dev/null || need+=("$cmd")
done

if [ ${#need[@]} -gt 0 ] || [ ! -x "$kubectl" ] || [ ! -x "$busybox" ]; then
    apt-get -o DPkg::Lock::Timeout=300 update -q
fi
if [ ${#need[@]} -gt 0 ]; then
    apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends "${need[@]}"
fi

# unpack PACKAGE: Debian's PACKAGE downloaded and unpacked (not installed) into the temporary
# directory $work/PACKAGE, whose path is printed; $work is removed on exit.
work=$(mktemp -d)
chmod 0755 "$work" # apt-get download runs as _apt
trap 'rm -rf "$work"' EXIT
unpack() {
    mkdir -p "$work/$1"
    (cd "$work/$1" && apt-get download -q "$1") >&2
    dpkg-deb -x "$work/$1/$1"_*.deb "$work/$1/root"
    echo "$work/$1/root"
}

if [ ! -x "$kubectl" ]; then
    mkdir -p "$tools"
    root=$(unpack kubernetes-client)
    version=$("$root/usr/bin/kubectl" version --client -o json | grep -o '"gitVersion": *"[^"]*"')
    case $version in
    *'"v1.20.2"') ;;
    *) echo "images/setup.sh: Debian's kubernetes-client is not v1.20.2: $version" >&2; exit 1 ;;
    esac
    install -m 0755 "$root/usr/bin/kubectl" "$kubectl.tmp"
    mv "$kubectl.tmp" "$kubectl"
fi
if [ ! -x "$busybox" ]; then
    mkdir -p "$tools/busybox-static"
    root=$(unpack busybox-static)
    "$root/bin/busybox" true || { echo "images/setup.sh: busybox-static does not run" >&2; exit 1; }
    # Its licence travels into the images with it.
    install -m 0644 "$root/usr/share/doc/busybox-static/copyright" "$tools/busybox-static/copyright"
    install -m 0755 "$root/bin/busybox" "$busybox.tmp"
    mv "$busybox.tmp" "$busybox"
fi
echo "images/setup.sh: umoci, podman, runc, $kubectl and $busybox ready"

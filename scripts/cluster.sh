#!/usr/bin/env bash
# A real one-node Kubernetes cluster with your CSI driver, for driver authors (and the cluster
# benchmark). Builds the workspace's binaries (plugreg's sidecars, the test driver,
# plugreg-cluster) as `cargo build --release --workspace` does, so a workspace built that way
# is reused as it is (cargo checks it in a second or two); with no release build there, `up`
# builds the faster `cluster` profile instead (see below). Then:
#
#   scripts/cluster.sh up [--kube-version v1.36.2|v1.20.2] [--overlay DIR]... [--image [NAME=]FILE]...
#       brings the cluster up (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
#       containerd, runc, the kubelet; all on 127.0.0.1, as root), imports plugreg's images and
#       yours, applies each overlay (an overlay of deploy/; default deploy/test), prints
#       `export KUBECONFIG=...` and waits; Ctrl-C tears everything down.
#
#   scripts/cluster.sh bench [--starts N] [--runs N] [--lives N] [--trace] [--out BENCHMARKS.md]
#       the cluster benchmark (crates/cluster/src/bench.rs); --trace adds, from the API
#       server's audit log, who made which request when in each step of the last claim life.
#
# Needs root and the project's set-up: `bash interop/build-peers.sh` (Kubernetes v1.20.2 and
# v1.36.2, containerd, runc, CNI plugins) and `bash images/setup.sh` (umoci, kubectl v1.20.2,
# busybox-static). No container engine, registry or other cluster tool.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The whole workspace, not a -p selection: cargo unifies features over the packages selected,
# so a selection compiles tokio, tonic, kube and every sidecar a second time beside the
# workspace build (issue 32: 23 minutes of a 2-core machine before the cluster started).
# `up` reuses a release build when there is one (target/release/plugreg-cluster, which
# `cargo build --release --workspace` makes); without one it builds the `cluster` profile
# (release without link-time optimisation: much less compile time). `bench` always measures
# release binaries.
target=${CARGO_TARGET_DIR:-target}
profile=(--release)
dir=$target/release
if [ "${1:-}" = up ] && [ ! -x "$target/release/plugreg-cluster" ]; then
    profile=(--profile cluster)
    dir=$target/cluster
fi
case ${1:-} in
up | bench)
    echo "scripts/cluster.sh: cargo build ${profile[*]} --workspace --bins (into $dir; what is built already is reused, a fresh clone compiles everything once)" >&2
    start=$(date +%s)
    cargo build "${profile[@]}" --locked --workspace --bins
    echo "scripts/cluster.sh: binaries ready in $(($(date +%s) - start)) s; starting the cluster" >&2
    ;;
*) cargo build "${profile[@]}" --locked --workspace --bins -q ;;
esac
exec "$dir/plugreg-cluster" "$@"

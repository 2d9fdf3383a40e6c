#!/usr/bin/env bash
# A real one-node Kubernetes cluster with your CSI driver, for driver authors (and the cluster
# benchmark). Builds the workspace's binaries in release (plugreg's sidecars, the test driver,
# plugreg-cluster) exactly as `cargo build --release --workspace` does, so a workspace built
# that way is reused as it is (cargo checks it in a second or two), then:
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
case ${1:-} in
up | bench)
    echo "scripts/cluster.sh: cargo build --release --workspace --bins (a built workspace is reused; from a fresh clone this compiles everything once)" >&2
    start=$(date +%s)
    cargo build --release --locked --workspace --bins
    echo "scripts/cluster.sh: binaries ready in $(($(date +%s) - start)) s; starting the cluster" >&2
    ;;
*) cargo build --release --locked --workspace --bins -q ;;
esac
exec target/release/plugreg-cluster "$@"

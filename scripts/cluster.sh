#!/usr/bin/env bash
# A real one-node Kubernetes cluster with your CSI driver, for driver authors (and the cluster
# benchmark). Builds plugreg's sidecars, the test driver and plugreg-cluster (release), then:
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
cargo build --release --locked \
    -p plugreg-cluster -p plugreg-node-driver-registrar -p plugreg-livenessprobe \
    -p plugreg-csi-provisioner -p plugreg-csi-attacher -p plugreg-csi-resizer -p plugreg-csi-snapshotter \
    -p plugreg-csi-health-monitor -p plugreg-csi-sidecars \
    -p plugreg-csi-test-driver --bins
exec target/release/plugreg-cluster "$@"

//! `csi-provisioner`: a drop-in replacement of the Kubernetes CSI external-provisioner (to be written).

fn main() {}

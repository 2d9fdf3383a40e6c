//! Real Kubernetes peers for plugreg's interop tests.
//!
//! `interop/build-peers.sh` builds the peers once per machine into a cache
//! folder outside the checkout (see [`peers_dir`]). This crate finds them and
//! runs them:
//!
//! * [`peer`] resolves a built peer binary, or fails with [`MissingPeer`],
//!   whose message says to run `interop/build-peers.sh`. Tests that need a
//!   peer fail with that message; they never skip.
//! * [`PeerProcess`] spawns a peer whose stdout carries one JSON object per
//!   line (the Go `plugin-manager-harness` and `example-plugin`), and
//!   [`JsonLines`] waits for the line that matches a predicate, with a
//!   deadline.
//! * [`goplugin::bind_only`] makes a plugin socket the way Go and C plugins do: bound before it
//!   listens, so a dial right after IN_CREATE is refused.
//! * [`ApiServer`] runs etcd and kube-apiserver (v1.20.2 by default, or the
//!   [`KubeVersion`] given to [`ApiServer::start_version`]) on free loopback
//!   ports in a temporary directory, with a kubeconfig and a `kube::Client`
//!   ([`ApiServer::shared`] shares one per release between the tests running
//!   at the same time);
//!   [`ControllerManager`] adds a kube-controller-manager of the same release to it
//!   ([`volume_controllers`] names the volume controllers in that release's words), and
//!   [`Scheduler`] a kube-scheduler (the one-node cluster of `plugreg-cluster` adds the
//!   kubelet).
//! * [`RealPluginManager`] and [`RealExamplePlugin`] run the real kubelet
//!   plugin manager and the real example plugin of a [`KubeVersion`], hiding
//!   how each release's harness is started and what its lines look like, so
//!   one test body covers every release in [`KubeVersion::ALL`].

mod apiserver;
pub mod bench;
mod component;
mod controller_manager;
mod error;
pub mod goplugin;
mod kubelet;
mod peers;
mod process;
pub mod rbac;
mod scheduler;
pub mod sidecar;
mod snapshot;

pub use apiserver::{ApiServer, ApiServerOptions, free_port};
pub use controller_manager::{
    ControllerManager, VOLUME_CONTROLLERS, VOLUME_CONTROLLERS_V1_20, volume_controllers,
};
pub use error::{Error, MissingPeer};
pub use kubelet::{
    APISERVER_V1_36, CONTROLLER_MANAGER_V1_36, EXAMPLE_PLUGIN_V1_36, HandlerCall, HandlerEvent,
    KUBELET_PLUGINS_V1_36, KUBELET_V1_36, KubeVersion, Notification, PLUGIN_MANAGER_V1_36,
    PluginManagerOptions, RealExamplePlugin, RealPluginManager, SCHEDULER_V1_36,
};
pub use peers::{
    APISERVER, CONTROLLER_MANAGER, ETCD, EXAMPLE_PLUGIN, KUBELET, PEERS_DIR_ENV,
    PLUGIN_MANAGER_HARNESS, SCHEDULER, peer, peers_dir,
};
pub use process::{
    JsonLines, LinesFrom, PEER_LOG_ENV, PeerProcess, event_is, event_named, is_klog_error,
};
pub use scheduler::Scheduler;
pub use snapshot::{SNAPSHOT_CONTROLLER, SNAPSHOT_CRDS, SnapshotController, install_snapshot_crds};

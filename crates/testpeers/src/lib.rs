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
//! * [`ApiServer`] runs etcd and kube-apiserver v1.20 on free loopback
//!   ports in a temporary directory, with a kubeconfig and a `kube::Client`.

mod apiserver;
mod error;
pub mod goplugin;
mod peers;
mod process;

pub use apiserver::ApiServer;
pub use error::{Error, MissingPeer};
pub use peers::{
    APISERVER, ETCD, EXAMPLE_PLUGIN, PEERS_DIR_ENV, PLUGIN_MANAGER_HARNESS, peer, peers_dir,
};
pub use process::{JsonLines, LinesFrom, PEER_LOG_ENV, PeerProcess, event_is, event_named};

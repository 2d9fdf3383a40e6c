//! The kit's Kubernetes clients (`ratelimit::client_builder`) set TCP_NODELAY on their sockets,
//! as every Go program's connections have (issue 33: with Nagle's algorithm on, a request
//! waited 40 ms for the API server's delayed ACK). Against a real kube-apiserver: the client
//! works (TLS, token, base URI), and every socket it opened to the API server has the option.
//! One test in its own binary, so that the sockets this process opens meanwhile are the
//! client's.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::Api;
use kube::config::{KubeConfigOptions, Kubeconfig};
use plugreg_sidecar_kit::ratelimit;
use plugreg_testpeers::{ApiServer, KubeVersion};

/// A copy of this process's descriptor `fd` (pidfd_getfd: the same open socket), if it is
/// still open.
fn copy_of(fd: i32) -> Option<OwnedFd> {
    use rustix::process::{PidfdFlags, PidfdGetfdFlags, getpid, pidfd_getfd, pidfd_open};
    let me = pidfd_open(getpid(), PidfdFlags::empty()).ok()?;
    pidfd_getfd(&me, fd, PidfdGetfdFlags::empty()).ok()
}

/// This process's open descriptors that are TCP sockets connected to a loopback `port`.
fn sockets_to(port: u16) -> BTreeSet<i32> {
    let mut out = BTreeSet::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let is_socket = std::fs::read_link(entry.path())
            .is_ok_and(|t| t.to_string_lossy().starts_with("socket:"));
        if !is_socket {
            continue;
        }
        let peer = copy_of(fd)
            .and_then(|s| rustix::net::getpeername(&s).ok().flatten())
            .and_then(|a| SocketAddr::try_from(a).ok());
        if peer.is_some_and(|p| p.port() == port && p.ip().is_loopback()) {
            out.insert(fd);
        }
    }
    out
}

#[tokio::test]
async fn the_clients_sockets_have_tcp_nodelay() {
    let api = ApiServer::shared(KubeVersion::V1_36_2).await.unwrap();
    let before = sockets_to(api.port());
    let kc = Kubeconfig::read_from(api.kubeconfig_path()).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap();
    let (high, _low, _limiter) = ratelimit::clients(config, -1.0, 10).unwrap();
    let namespaces: Api<Namespace> = Api::all(high);
    // Two requests at once: the client opens a second connection for the second.
    let (a, b) = tokio::join!(namespaces.get("default"), namespaces.get("kube-system"));
    assert_eq!(a.unwrap().metadata.name.as_deref(), Some("default"));
    assert_eq!(b.unwrap().metadata.name.as_deref(), Some("kube-system"));

    let ours: Vec<i32> = sockets_to(api.port())
        .difference(&before)
        .copied()
        .collect();
    assert!(
        !ours.is_empty(),
        "the client holds no connection to the API server"
    );
    for fd in ours {
        // The client keeps its idle connections open.
        let socket = copy_of(fd).expect("the client's connection is open");
        assert!(
            rustix::net::sockopt::tcp_nodelay(&socket).unwrap(),
            "a connection to the API server without TCP_NODELAY"
        );
    }
}

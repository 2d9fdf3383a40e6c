//! The kit's Kubernetes clients (`ratelimit::Transport`) against a real kube-apiserver: they
//! work (TLS, token, base URI); the clients of one transport share one HTTP/2 connection for
//! requests made at once (issue 29: kube's HTTP/1.1 took one connection per request in
//! flight), a client of its own has its own; and every socket they open to the API server has
//! TCP_NODELAY, as every Go program's connections have (issue 33: with Nagle's algorithm on, a
//! request waited 40 ms for the API server's delayed ACK); a transport on HTTP/1.1 only takes a
//! connection per request in flight. One test in its own binary, so that
//! the sockets this process opens meanwhile are the clients'.

use std::collections::BTreeMap;
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

/// This process's open TCP sockets connected to a loopback `port`, by socket (its inode, as
/// `/proc/self/fd` names it: a descriptor's number may be reused by a later socket), with a
/// descriptor of each.
fn sockets_to(port: u16) -> BTreeMap<String, i32> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Some(socket) = std::fs::read_link(entry.path())
            .ok()
            .map(|t| t.to_string_lossy().into_owned())
            .filter(|t| t.starts_with("socket:"))
        else {
            continue;
        };
        let peer = copy_of(fd)
            .and_then(|s| rustix::net::getpeername(&s).ok().flatten())
            .and_then(|a| SocketAddr::try_from(a).ok());
        if peer.is_some_and(|p| p.port() == port && p.ip().is_loopback()) {
            out.insert(socket, fd);
        }
    }
    out
}

/// The sockets to `port` opened since `before`, with a descriptor of each.
fn opened_since(before: &BTreeMap<String, i32>, port: u16) -> Vec<i32> {
    sockets_to(port)
        .into_iter()
        .filter(|(socket, _)| !before.contains_key(socket))
        .map(|(_, fd)| fd)
        .collect()
}

#[tokio::test]
async fn one_http2_connection_per_transport_with_tcp_nodelay() {
    let api = ApiServer::shared(KubeVersion::V1_36_2).await.unwrap();
    let before = sockets_to(api.port());
    let kc = Kubeconfig::read_from(api.kubeconfig_path()).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap();
    let transport = ratelimit::Transport::new(config.clone()).unwrap();
    let (high, low, _limiter) = ratelimit::clients_on(&transport, -1.0, 10).unwrap();
    let namespaces: Api<Namespace> = Api::all(high);
    let low_namespaces: Api<Namespace> = Api::all(low);
    // Three requests at once, two clients: HTTP/1.1 would take three connections.
    let (a, b, c) = tokio::join!(
        namespaces.get("default"),
        namespaces.get("kube-system"),
        low_namespaces.get("kube-public")
    );
    assert_eq!(a.unwrap().metadata.name.as_deref(), Some("default"));
    assert_eq!(b.unwrap().metadata.name.as_deref(), Some("kube-system"));
    assert_eq!(c.unwrap().metadata.name.as_deref(), Some("kube-public"));
    let shared = opened_since(&before, api.port());
    assert_eq!(
        shared.len(),
        1,
        "the clients of one transport hold {} connections to the API server",
        shared.len()
    );

    // A client of its own (the leader election's) has a connection of its own.
    let own: Api<Namespace> = Api::all(ratelimit::own_client(config.clone(), -1.0, 10).unwrap());
    assert!(own.get("default").await.is_ok());
    assert_eq!(opened_since(&before, api.port()).len(), 2);

    // HTTP/1.1 only (the hop benchmark's side to compare with): one connection per request
    // in flight, as kube's own client has.
    let http1 = ratelimit::Transport::new_http1(config).unwrap();
    let http1: Api<Namespace> = Api::all(ratelimit::unlimited_client_on(&http1).unwrap());
    let (a, b, c) = tokio::join!(
        http1.get("default"),
        http1.get("kube-system"),
        http1.get("kube-public")
    );
    assert!(a.is_ok() && b.is_ok() && c.is_ok());
    let ours = opened_since(&before, api.port());
    assert_eq!(ours.len(), 5, "connections: {ours:?}");
    for fd in ours {
        // The clients keep their idle connections open.
        let socket = copy_of(fd).expect("the client's connection is open");
        assert!(
            rustix::net::sockopt::tcp_nodelay(&socket).unwrap(),
            "a connection to the API server without TCP_NODELAY"
        );
    }
}

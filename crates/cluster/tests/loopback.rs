//! The network rule, without exception: nothing the cluster runs sends a packet beyond
//! 127.0.0.0/8 or ::1. Checked on a cluster of each release with the driver deployed and a pod
//! using a volume: every pod is on the host network with no address beyond loopback, every
//! container's API server address is 127.0.0.1, and every TCP and UDP socket of every process
//! of the cluster (control plane, containerd, kubelet, shims, containers) has loopback
//! addresses at both ends. And the host is left alone: no kernel setting, iptables chain or
//! well-known directory of the kubelet or containerd changed while the cluster runs.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

use common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use plugreg_testpeers::KubeVersion;

/// The kernel settings the kubelet would change.
const SYSCTLS: &[&str] = &[
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

/// Where a kubelet or containerd left alone writes on a host.
const HOST_PATHS: &[&str] = &[
    "/var/lib/kubelet",
    "/var/lib/containerd",
    "/var/lib/cni",
    "/var/log/pods",
    "/var/log/containers",
    "/run/containerd",
    "/opt/containerd",
    "/usr/libexec/kubernetes",
    "/etc/kubernetes",
];

/// What the host looks like: kernel settings, the kubelet's iptables chains, which of its
/// directories exist.
fn host_state() -> (BTreeMap<String, String>, BTreeSet<String>, BTreeSet<String>) {
    let sysctls = SYSCTLS
        .iter()
        .map(|k| {
            let v = std::fs::read_to_string(format!("/proc/sys/{k}")).unwrap_or_default();
            ((*k).to_owned(), v.trim().to_owned())
        })
        .collect();
    let mut chains = BTreeSet::new();
    for cmd in ["iptables-save", "ip6tables-save"] {
        if let Ok(out) = std::process::Command::new(cmd).output() {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if line.contains("KUBE-") {
                    chains.insert(format!("{cmd}: {line}"));
                }
            }
        }
    }
    let paths = HOST_PATHS
        .iter()
        .filter(|p| Path::new(p).exists())
        .map(|p| (*p).to_owned())
        .collect();
    (sysctls, chains, paths)
}

/// 127.0.0.0/8 or ::1 (an IPv4-mapped IPv6 address counts as its IPv4 address).
fn loopback(ip: IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

/// `0100007F:1F90` (little-endian IPv4 words, as /proc/net prints them) or the 32-digit IPv6
/// form, to an address.
fn proc_net_addr(field: &str) -> IpAddr {
    let (addr, _) = field.split_once(':').expect("addr:port");
    if addr.len() == 8 {
        let n = u32::from_str_radix(addr, 16).expect("hex");
        IpAddr::V4(Ipv4Addr::from(n.swap_bytes()))
    } else {
        let mut bytes = [0u8; 16];
        for (i, word) in addr.as_bytes().chunks(8).enumerate() {
            let n = u32::from_str_radix(std::str::from_utf8(word).expect("ascii"), 16)
                .expect("hex")
                .swap_bytes();
            bytes[i * 4..i * 4 + 4].copy_from_slice(&n.to_be_bytes());
        }
        let v6 = Ipv6Addr::from(bytes);
        v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
    }
}

/// Every socket of `/proc/<pid>/net/{tcp,tcp6,udp,udp6}`: inode -> (table, local, remote).
fn sockets_of_netns(pid: u32) -> BTreeMap<u64, (String, IpAddr, IpAddr)> {
    let mut out = BTreeMap::new();
    for table in ["tcp", "tcp6", "udp", "udp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 {
                continue;
            }
            let inode: u64 = f[9].parse().unwrap_or(0);
            out.insert(
                inode,
                (table.to_owned(), proc_net_addr(f[1]), proc_net_addr(f[2])),
            );
        }
    }
    out
}

/// The socket inodes a process holds.
fn socket_inodes(pid: u32) -> Vec<u64> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|l| {
            l.to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect()
}

fn command_of(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
        .unwrap_or_default()
        .split('\0')
        .next()
        .unwrap_or_default()
        .to_owned()
}

async fn nothing_leaves_loopback(version: KubeVersion) {
    let before = host_state();
    let cluster = cluster_with_driver(version, None).await;
    let (_, _) = running_pod_with_volume(&cluster, "net", "loopback only").await;

    // Every pod: host network, no address beyond loopback.
    let pods = Api::<Pod>::all(cluster.client())
        .list(&Default::default())
        .await
        .expect("list pods")
        .items;
    assert!(
        pods.len() >= 3,
        "the driver's two pods and the app: {}",
        pods.len()
    );
    let mut containers = 0;
    for pod in &pods {
        let name = pod.metadata.name.clone().unwrap_or_default();
        assert_eq!(
            pod.spec.as_ref().and_then(|s| s.host_network),
            Some(true),
            "{name} on the host network"
        );
        let status = pod.status.clone().unwrap_or_default();
        let ips = status
            .pod_ip
            .iter()
            .cloned()
            .chain(status.pod_ips.iter().flatten().map(|p| p.ip.clone()));
        for ip in ips {
            let ip: IpAddr = ip.parse().expect("an IP");
            assert!(loopback(ip), "{name} has address {ip}");
        }
        // Every container's API server address, as its processes have it.
        for c in status.container_statuses.iter().flatten() {
            let Some(id) = c.container_id.as_deref() else {
                continue;
            };
            let pids = cluster.node().container_processes(id);
            assert!(!pids.is_empty(), "{name}/{}: no process", c.name);
            for pid in pids {
                let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
                let env = String::from_utf8_lossy(&env);
                let host = env
                    .split('\0')
                    .find_map(|kv| kv.strip_prefix("KUBERNETES_SERVICE_HOST="));
                assert_eq!(host, Some("127.0.0.1"), "{name}/{} (pid {pid})", c.name);
            }
            containers += 1;
        }
    }
    assert!(containers >= 6, "checked {containers} containers");

    // Every socket of every process of the cluster.
    let pids = cluster.processes();
    assert!(pids.len() >= 10, "the cluster's processes: {pids:?}");
    let mut tables: BTreeMap<String, BTreeMap<u64, (String, IpAddr, IpAddr)>> = BTreeMap::new();
    let mut checked = 0;
    for pid in pids {
        let Ok(netns) = std::fs::read_link(format!("/proc/{pid}/ns/net")) else {
            continue;
        };
        let table = tables
            .entry(netns.display().to_string())
            .or_insert_with(|| sockets_of_netns(pid));
        for inode in socket_inodes(pid) {
            let Some((proto, local, remote)) = table.get(&inode) else {
                continue; // a unix socket
            };
            let unspecified_peer = remote.is_unspecified();
            assert!(
                loopback(*local) && (unspecified_peer || loopback(*remote)),
                "{} (pid {pid}) has a {proto} socket {local} -> {remote}",
                command_of(pid)
            );
            checked += 1;
        }
    }
    assert!(checked >= 10, "only {checked} sockets found");

    // The host is as it was.
    let during = host_state();
    assert_eq!(during.0, before.0, "kernel settings changed");
    assert_eq!(during.1, before.1, "iptables chains changed");
    assert_eq!(
        during.2, before.2,
        "the kubelet's or containerd's host directories changed"
    );
    cluster.shutdown().await.expect("tear down");
    let after = host_state();
    assert_eq!(after, before, "the host changed after tear-down");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_leaves_loopback_v1_20_2() {
    nothing_leaves_loopback(KubeVersion::V1_20_2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_leaves_loopback_v1_36_2() {
    nothing_leaves_loopback(KubeVersion::V1_36_2).await;
}

#[test]
fn reads_proc_net_addresses() {
    assert_eq!(
        proc_net_addr("0100007F:1F90"),
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    );
    assert_eq!(
        proc_net_addr("00000000000000000000000001000000:0050"),
        IpAddr::V6(Ipv6Addr::LOCALHOST)
    );
    assert_eq!(
        proc_net_addr("0000000000000000FFFF00000100007F:0050"),
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    );
    assert_eq!(
        proc_net_addr("0201A8C0:0050"),
        IpAddr::V4(Ipv4Addr::new(192, 168, 1, 2))
    );
}

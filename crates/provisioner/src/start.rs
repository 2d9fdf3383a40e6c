//! The provisioner's start-up after the driver is identified, shared by `csi-provisioner` and
//! `csi-sidecars`: this node as the driver sees it (`--node-deployment`), the provisioner
//! identity, capacity tracking's client, owner and API, and the [`Service`] the command line
//! asks for. The binaries keep their own order and log lines around these steps.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use plugreg_sidecar_kit::leader;
use plugreg_sidecar_kit::service::Kube;

use crate::capacity;
use crate::csi::{Capabilities, Driver};
use crate::flags::{self, FeatureGates, Options};
use crate::node;
use crate::request::RequestOptions;
use crate::service::Service;

/// What start-up found out, for the controller.
#[derive(Clone)]
pub struct Started {
    /// The driver (= provisioner) name.
    pub name: String,
    /// The provisioner identity (§2 step 15).
    pub identity: String,
    /// The driver's calls.
    pub driver: Arc<Driver>,
    /// What the driver can do.
    pub capabilities: Capabilities,
    /// Capacity tracking's configuration and client (`--enable-capacity`).
    pub capacity: Option<(capacity::Config, kube::Client)>,
    /// This node (`--node-deployment`).
    pub local: Option<node::Local>,
}

/// The first feature switched on that this provisioner does not implement yet (exit 1, rather
/// than silently doing nothing).
pub fn unsupported(gates: &FeatureGates) -> Option<&'static str> {
    if gates.cross_namespace_volume_data_source {
        return Some(
            "the CrossNamespaceVolumeDataSource feature gate is not supported by this csi-provisioner yet; remove it or use the upstream image",
        );
    }
    None
}

/// This node as the driver sees it (§B.2 step 3: NodeGetInfo, always asked); `Err` is
/// upstream's fatal line.
pub async fn local_node(driver: &Driver, node: &str) -> Result<node::Local, String> {
    match driver.node_info().await {
        Ok(info) => Ok(node::Local {
            node: node.to_owned(),
            node_id: info.node_id,
            segment: info
                .accessible_topology
                .map(|t| t.segments.into_iter().collect()),
        }),
        Err(e) => Err(format!(
            "Failed to get node info from CSI driver: {}",
            plugreg_runtime::report::grpc(&e.to_status())
        )),
    }
}

/// The provisioner identity of this process (§2 step 15) for `driver`, on `node` with
/// `--node-deployment`.
pub fn identity(driver: &str, node: Option<&str>) -> String {
    let millis = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    // A number in 0..10000 that differs between processes (upstream: `rand.Intn(10000)`).
    let random = (plugreg_runtime::backoff::random_u64() % 10_000) as u32;
    flags::provisioner_identity(millis, random, driver, node)
}

/// Capacity tracking's start, step 17 (`docs/upstream/upstream-capacity-and-node-deployment.md` §A.2): the capacity client
/// at `--kube-api-capacity-qps/-burst`, `NAMESPACE`, the owner from `POD_NAME` and
/// `--capacity-ownerref-level`, the manager id and the API version. Every replica does this;
/// only the leader runs the controller. The client has a bucket of its own on `transport`, the
/// connection the provisioner's work shares.
pub async fn capacity(
    options: &Options,
    transport: &plugreg_sidecar_kit::ratelimit::Transport,
    driver: &str,
    local: Option<&node::Local>,
) -> Result<(capacity::Config, kube::Client), String> {
    let client = plugreg_sidecar_kit::ratelimit::own_client_on(
        transport,
        f64::from(options.kube_api_capacity_qps),
        u32::try_from(options.kube_api_capacity_burst.max(0)).unwrap_or(u32::MAX),
    )
    .map_err(|e| format!("Failed to create client: {e}"))?;
    let namespace = std::env::var("NAMESPACE")
        .ok()
        .filter(|n| !n.is_empty())
        .ok_or_else(|| capacity::StartError::Namespace.to_string())?;
    let level = options.capacity_ownerref_level;
    let owner = if level >= 0 {
        let pod = std::env::var("POD_NAME")
            .ok()
            .filter(|n| !n.is_empty())
            .ok_or_else(|| capacity::StartError::PodName.to_string())?;
        let owner = capacity::owner(&client, &namespace, &pod, level)
            .await
            .map_err(|e| e.to_string())?;
        if let Some(o) = &owner {
            tracing::info!(
                "using {}/{} {} as owner of CSIStorageCapacity objects",
                o.api_version,
                o.kind,
                o.name
            );
        }
        owner
    } else {
        None
    };
    let api = capacity::detect_api(&client, &namespace)
        .await
        .map_err(|e| e.to_string())?;
    Ok((
        capacity::Config {
            driver: driver.to_owned(),
            namespace,
            owner,
            manager: capacity::manager_id(local.map(|l| l.node.as_str())),
            immediate_binding: options.capacity_for_immediate_binding,
            poll: options.capacity_poll_interval,
            workers: usize::try_from(options.capacity_threads)
                .unwrap_or(usize::MAX)
                .max(1),
            retry_start: options.retry_interval_start,
            retry_max: options.retry_interval_max,
            api,
            fixed: local.map(|l| l.segment.clone().unwrap_or_default()),
        },
        client,
    ))
}

/// The run the command line asks for, once started: `volume_attributes_class` is the gate
/// after the discovery check, `kube` the clients' settings and the election.
pub fn service(
    options: &Options,
    gates: &FeatureGates,
    volume_attributes_class: bool,
    kube: Kube,
    started: Started,
) -> Service {
    let caps = started.capabilities;
    Service {
        kube,
        driver: started.driver,
        driver_name: started.name,
        identity: started.identity,
        host: leader::hostname(),
        capabilities: caps,
        request: RequestOptions {
            volume_name_prefix: options.volume_name_prefix.clone(),
            volume_name_uuid_length: options.volume_name_uuid_length,
            extra_create_metadata: options.extra_create_metadata,
            default_fstype: options.default_fstype.clone(),
            controller_publish_readonly: options.controller_publish_readonly,
            strict_topology: options.strict_topology,
            immediate_topology: options.immediate_topology,
            topology: gates.topology && caps.accessibility_constraints,
            single_node_multi_writer: caps.single_node_multi_writer,
            volume_attributes_class,
            modify_volume: caps.modify_volume,
            create_delete_snapshot: caps.create_delete_snapshot,
            clone_volume: caps.clone_volume,
            prevent_volume_mode_conversion: options.prevent_volume_mode_conversion,
        },
        workers: usize::try_from(options.worker_threads).unwrap_or(usize::MAX),
        retry_start: options.retry_interval_start,
        retry_max: options.retry_interval_max,
        timeout: options.timeout,
        clone_protection_workers: usize::try_from(options.cloning_protection_threads)
            .unwrap_or(usize::MAX),
        snapshot_sweep: options.snapshot_orphan_sweep_interval,
        record_namespace: leader::namespace(&options.controller.leader_election_namespace),
        capacity: started.capacity,
        node: started.local.map(|local| node::NodeDeployment {
            local,
            immediate_binding: options.node_deployment_immediate_binding,
            base_delay: options.node_deployment_base_delay,
            max_delay: options.node_deployment_max_delay,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_features_are_named() {
        assert!(unsupported(&FeatureGates::default()).is_none());
        let g = FeatureGates {
            cross_namespace_volume_data_source: true,
            ..FeatureGates::default()
        };
        assert!(
            unsupported(&g)
                .unwrap()
                .contains("CrossNamespaceVolumeDataSource")
        );
    }
}

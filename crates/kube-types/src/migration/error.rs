//! Why a translation failed, each variant displaying upstream's text.

use std::collections::BTreeSet;

use plugreg_goflag::gotext::quote;

/// A translation that failed; `Display` is csi-translation-lib's error text (the sidecars wrap
/// it in their own prefixes, as upstream's do).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A StorageClass for an in-tree plugin csi-translation-lib does not know.
    #[error("could not find in-tree storage class parameter translation logic for {}", quote(.0))]
    UnknownStorageClassPlugin(String),
    /// A PV (named here) without any in-tree source csi-translation-lib knows.
    #[error("could not find in-tree plugin translation logic for {}", quote(.0))]
    NotMigratable(String),
    /// A CSI → in-tree translation of a PV without `spec.csi`.
    #[error("CSI persistent volume was nil")]
    NoCsiSource,
    /// A CSI → in-tree translation of a PV whose CSI driver is no migration target.
    #[error("could not find in-tree plugin translation logic for {0}")]
    UnknownDriver(String),
    /// [`repair_volume_handle`](super::repair_volume_handle) for a driver that is no migration
    /// target.
    #[error("could not find In-Tree driver name for CSI plugin {0}")]
    NoInTreePlugin(String),
    /// A StorageClass with both `zone`/`zones` and `allowedTopologies`.
    #[error("cannot simultaneously set allowed topologies and zone/zones parameters")]
    TopologyConflict,
    /// An EBS `volumeID` that is no volume ID (the inner text names the ID).
    #[error("failed to translate Kubernetes ID to EBS Volume ID {0}")]
    EbsVolumeId(String),
    /// An EBS `partition` volume attribute that is no integer.
    #[error("failed to convert partition {value} to integer: {reason}")]
    EbsPartition {
        /// The attribute.
        value: String,
        /// Go's `strconv.Atoi` error.
        reason: String,
    },
    /// A GCE PD `partition` volume attribute that is no integer.
    #[error("Failed to convert partition {value} to integer: {reason}")]
    GcePartition {
        /// The attribute.
        value: String,
        /// Go's `strconv.Atoi` error.
        reason: String,
    },
    /// The node affinity of a CSI PV could not be written back (the PV's name, then why). Go
    /// prints the whole PV struct in place of the name; that dump cannot be reproduced.
    #[error("failed to translate topology. PV:{{Name:{pv}}}. Error:{reason}")]
    Topology {
        /// The PV's name.
        pv: String,
        /// What failed.
        reason: TopologyError,
    },
    /// A GCE PD volume handle with fewer than six `/`-separated parts.
    #[error("failed to get id components.Got: {0}, wanted 6 components or more. ")]
    GceVolumeId(usize),
    /// A GCE PD PV whose zone labels name no single region.
    #[error("failed to get region from zones: {0}")]
    GceRegionFromZones(RegionError),
    /// An Azure Disk whose `kind` is not `Managed`.
    #[error("kind({0}) is not supported in csi migration")]
    AzureDiskKind(String),
    /// An Azure Disk handle in neither the managed nor the unmanaged form.
    #[error("could not get disk name from {uri}, correct format: {pattern}")]
    AzureDiskName {
        /// The handle.
        uri: String,
        /// The regular expression it had to match.
        pattern: &'static str,
    },
    /// An Azure File PV with neither `secretNamespace` nor a claim.
    #[error("could not find a secret namespace in PersistentVolumeSource or ClaimRef")]
    AzureFileSecretNamespace,
    /// An Azure File handle with fewer than three `#`-separated parts.
    #[error("error parsing volume id: {}, should at least contain two #", quote(.0))]
    AzureFileVolumeId(String),
    /// [`repair_volume_handle`](super::repair_volume_handle): a GCE handle with fewer than six
    /// parts.
    #[error("volume handle has wrong number of elements; got {0}, wanted 6 or more")]
    RepairVolumeHandle(usize),
    /// [`repair_volume_handle`](super::repair_volume_handle): a node ID with fewer than six
    /// parts.
    #[error("node handle has wrong number of elements; got {0}, wanted 6 or more")]
    RepairNodeId(usize),
    /// [`repair_volume_handle`](super::repair_volume_handle): a regional handle whose node's
    /// zone names no region.
    #[error("failed to get region from zone {zone}: {reason}")]
    RepairRegion {
        /// The node's zone.
        zone: String,
        /// Why.
        reason: RegionError,
    },
    /// [`repair_volume_handle`](super::repair_volume_handle): neither `zones` nor `regions`.
    #[error("expected volume handle to have zones or regions regionality value, got: {0}")]
    RepairRegionality(String),
}

/// Why the node affinity of a CSI PV could not be translated back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    /// A term's zones name no single region.
    #[error("Failed to handle region topology. error: {0}")]
    Region(RegionError),
}

/// Why a region could not be derived from zones.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegionError {
    /// No zone at all.
    #[error("no zones specified")]
    NoZones,
    /// A zone that is no AWS zone.
    #[error("Unexpected zone format: {0} is not a valid AWS zone")]
    AwsZone(String),
    /// A zone that is not `{locale}-{region}-{zone}`.
    #[error("zone in unexpected format, expected: {{locale}}-{{region}}-{{zone}}, got: {0}")]
    GceZone(String),
    /// The zones are in several regions (Go prints the set as a map).
    #[error("multiple or no regions gotten from zones, got: {}", go_set(.0))]
    NotOneRegion(BTreeSet<String>),
}

/// A Go `sets.String` printed with `%v`: `map[a:{} b:{}]`.
fn go_set(set: &BTreeSet<String>) -> String {
    let items: Vec<String> = set.iter().map(|s| format!("{s}:{{}}")).collect();
    format!("map[{}]", items.join(" "))
}

//! The translation checklist of `spec/upstream-csi-migration.md` §7, case by case, on the
//! objects (each table row names the checklist item or the rule of §2-§3 it proves).

use k8s_openapi::api::core::v1::PersistentVolume;
use k8s_openapi::api::storage::v1::StorageClass;
use serde_json::{Value, json};

use super::*;

const K_EBS: &str = "topology.ebs.csi.aws.com/zone";
const K_GCE: &str = "topology.gke.io/zone";
const K_AZ: &str = "topology.disk.csi.azure.com/zone";
const K_CINDER: &str = "topology.cinder.csi.openstack.org/zone";
const GA_ZONE: &str = "topology.kubernetes.io/zone";
const GA_REGION: &str = "topology.kubernetes.io/region";
const BETA_ZONE: &str = "failure-domain.beta.kubernetes.io/zone";
const BETA_REGION: &str = "failure-domain.beta.kubernetes.io/region";

fn class(provisioner: &str, parameters: Value, allowed: Value) -> StorageClass {
    serde_json::from_value(json!({
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": "sc"},
        "provisioner": provisioner,
        "parameters": parameters,
        "allowedTopologies": allowed,
    }))
    .unwrap_or_else(|e| panic!("class: {e}"))
}

fn pv(metadata: Value, spec: Value) -> PersistentVolume {
    let mut metadata = metadata;
    if metadata.get("name").is_none() {
        metadata["name"] = json!("pv1");
    }
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": metadata,
        "spec": spec,
    }))
    .unwrap_or_else(|e| panic!("pv: {e}"))
}

/// Each field named in `want` (`{"spec": {...}, "metadata": {...}}`) equals the translated
/// object's (absent = null).
fn assert_fields(case: &str, got: &PersistentVolume, want: &Value) {
    let got = serde_json::to_value(got).unwrap_or_default();
    for part in ["spec", "metadata"] {
        for (field, value) in want
            .get(part)
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
        {
            let actual = got
                .get(part)
                .and_then(|p| p.get(field))
                .unwrap_or(&Value::Null);
            assert_eq!(actual, value, "{case}: {part}.{field}");
        }
    }
}

fn affinity(terms: Value) -> Value {
    json!({"required": {"nodeSelectorTerms": terms}})
}

fn term(exps: &[(&str, &[&str])]) -> Value {
    let exps: Vec<Value> = exps
        .iter()
        .map(|(k, v)| json!({"key": k, "operator": "In", "values": v}))
        .collect();
    json!({"matchExpressions": exps})
}

#[test]
fn storage_classes_translate_as_each_plugin_does() {
    let cases = [
        (
            "4: EBS fsType renamed, iopsPerGB kept plus allowautoiopspergbincrease",
            "kubernetes.io/aws-ebs",
            json!({"type": "gp3", "fsType": "xfs", "iopsPerGB": "10", "encrypted": "true"}),
            Value::Null,
            json!({"type": "gp3", "iopsPerGB": "10", "allowautoiopspergbincrease": "true",
                   "encrypted": "true", "csi.storage.k8s.io/fstype": "xfs"}),
            Value::Null,
        ),
        (
            "5: EBS zones split on commas, untrimmed",
            "kubernetes.io/aws-ebs",
            json!({"zones": "us-east-1a, us-east-1b"}),
            Value::Null,
            json!({}),
            json!([{"matchLabelExpressions": [{"key": K_EBS, "values": ["us-east-1a", " us-east-1b"]}]}]),
        ),
        (
            "EBS zone: one term",
            "kubernetes.io/aws-ebs",
            json!({"Zone": "us-east-1a"}),
            Value::Null,
            json!({}),
            json!([{"matchLabelExpressions": [{"key": K_EBS, "values": ["us-east-1a"]}]}]),
        ),
        (
            "7: allowedTopologies zone keys (GA and beta) become K, regions stay",
            "kubernetes.io/aws-ebs",
            json!({"type": "gp2"}),
            json!([{"matchLabelExpressions": [
                {"key": GA_ZONE, "values": ["a"]},
                {"key": BETA_ZONE, "values": ["b"]},
                {"key": GA_REGION, "values": ["r"]}]}]),
            json!({"type": "gp2"}),
            json!([{"matchLabelExpressions": [
                {"key": K_EBS, "values": ["a"]},
                {"key": K_EBS, "values": ["b"]},
                {"key": GA_REGION, "values": ["r"]}]}]),
        ),
        (
            "GCE: fstype renamed, zone into topology, the rest copied",
            "kubernetes.io/gce-pd",
            json!({"type": "pd-ssd", "replication-type": "regional-pd", "FSTYPE": "ext4",
                   "zones": "us-central1-a,us-central1-b"}),
            Value::Null,
            json!({"type": "pd-ssd", "replication-type": "regional-pd",
                   "csi.storage.k8s.io/fstype": "ext4"}),
            json!([{"matchLabelExpressions": [{"key": K_GCE, "values": ["us-central1-a", "us-central1-b"]}]}]),
        ),
        (
            "15: Azure Disk keeps fsType, a fault-domain zone becomes empty",
            "kubernetes.io/azure-disk",
            json!({"skuName": "Premium_LRS", "fsType": "ext4", "zones": "1"}),
            Value::Null,
            json!({"skuName": "Premium_LRS", "fsType": "ext4"}),
            json!([{"matchLabelExpressions": [{"key": K_AZ, "values": [""]}]}]),
        ),
        (
            "Azure Disk allowedTopologies: zone keys renamed, digits-only values emptied",
            "kubernetes.io/azure-disk",
            json!({}),
            json!([{"matchLabelExpressions": [
                {"key": GA_ZONE, "values": ["eastus-1", "2"]},
                {"key": GA_REGION, "values": ["3"]}]}]),
            json!({}),
            json!([{"matchLabelExpressions": [
                {"key": K_AZ, "values": ["eastus-1", ""]},
                {"key": GA_REGION, "values": ["3"]}]}]),
        ),
        (
            "17: Azure File classes pass unchanged",
            "kubernetes.io/azure-file",
            json!({"skuName": "Standard_LRS", "fsType": "ext4", "zone": "z"}),
            json!([{"matchLabelExpressions": [{"key": GA_ZONE, "values": ["z"]}]}]),
            json!({"skuName": "Standard_LRS", "fsType": "ext4", "zone": "z"}),
            json!([{"matchLabelExpressions": [{"key": GA_ZONE, "values": ["z"]}]}]),
        ),
        (
            "Cinder copies availability and zone, renames fstype and allowedTopologies",
            "kubernetes.io/cinder",
            json!({"availability": "nova", "fsType": "ext4", "zone": "z1"}),
            json!([{"matchLabelExpressions": [{"key": BETA_ZONE, "values": ["z1"]}]}]),
            json!({"availability": "nova", "zone": "z1", "csi.storage.k8s.io/fstype": "ext4"}),
            json!([{"matchLabelExpressions": [{"key": K_CINDER, "values": ["z1"]}]}]),
        ),
        (
            "18: vSphere lower-cases, renames, drops the rest, marks csimigration",
            "kubernetes.io/vsphere-volume",
            json!({"storagePolicyName": "gold", "datastore": "ds1", "foo": "bar", "fstype": "ext4",
                   "DiskFormat": "thin"}),
            json!([{"matchLabelExpressions": [{"key": GA_ZONE, "values": ["z1"]},
                                              {"key": GA_REGION, "values": ["r1"]}]}]),
            json!({"storagepolicyname": "gold", "datastore-migrationparam": "ds1",
                   "diskformat-migrationparam": "thin", "csimigration": "true",
                   "csi.storage.k8s.io/fstype": "ext4"}),
            json!([{"matchLabelExpressions": [{"key": "topology.csi.vmware.com/zone", "values": ["z1"]},
                                              {"key": GA_REGION, "values": ["r1"]}]}]),
        ),
        (
            "19: Portworx auth secret becomes every operation's secret",
            "kubernetes.io/portworx-volume",
            json!({"repl": "2", "openstorage.io/auth-secret-name": "s1",
                   "openstorage.io/auth-secret-namespace": "ns1"}),
            Value::Null,
            json!({"repl": "2",
                "csi.storage.k8s.io/provisioner-secret-name": "s1",
                "csi.storage.k8s.io/provisioner-secret-namespace": "ns1",
                "csi.storage.k8s.io/controller-publish-secret-name": "s1",
                "csi.storage.k8s.io/controller-publish-secret-namespace": "ns1",
                "csi.storage.k8s.io/node-publish-secret-name": "s1",
                "csi.storage.k8s.io/node-publish-secret-namespace": "ns1",
                "csi.storage.k8s.io/node-stage-secret-name": "s1",
                "csi.storage.k8s.io/node-stage-secret-namespace": "ns1",
                "csi.storage.k8s.io/controller-expand-secret-name": "s1",
                "csi.storage.k8s.io/controller-expand-secret-namespace": "ns1",
                "csi.storage.k8s.io/node-expand-secret-name": "s1",
                "csi.storage.k8s.io/node-expand-secret-namespace": "ns1"}),
            Value::Null,
        ),
    ];
    for (case, plugin, params, allowed, want_params, want_allowed) in cases {
        let sc = class(plugin, params, allowed);
        let got = translate_storage_class(plugin, &sc).unwrap_or_else(|e| panic!("{case}: {e}"));
        let got = serde_json::to_value(&got).unwrap_or_default();
        assert_eq!(got["parameters"], want_params, "{case}: parameters");
        assert_eq!(
            got.get("allowedTopologies").unwrap_or(&Value::Null),
            &want_allowed,
            "{case}: allowedTopologies"
        );
        let want_provisioner = if plugin == "kubernetes.io/portworx-volume" {
            "pxd.portworx.com"
        } else {
            plugin
        };
        assert_eq!(got["provisioner"], want_provisioner, "{case}: provisioner");
    }
}

#[test]
fn zone_parameters_beside_allowed_topologies_are_refused() {
    let allowed = json!([{"matchLabelExpressions": [{"key": GA_ZONE, "values": ["a"]}]}]);
    for plugin in [
        "kubernetes.io/aws-ebs",
        "kubernetes.io/gce-pd",
        "kubernetes.io/azure-disk",
    ] {
        for key in ["zone", "zones"] {
            let sc = class(plugin, json!({key: "a"}), allowed.clone());
            assert_eq!(
                translate_storage_class(plugin, &sc)
                    .map_err(|e| e.to_string())
                    .err(),
                Some(
                    "cannot simultaneously set allowed topologies and zone/zones parameters"
                        .to_owned()
                ),
                "6: {plugin} {key}"
            );
        }
    }
}

#[test]
fn a_class_of_an_unknown_plugin_is_refused_quoted() {
    let sc = class("kubernetes.io/rbd", json!({}), Value::Null);
    assert_eq!(
        translate_storage_class("kubernetes.io/rbd", &sc)
            .unwrap_err()
            .to_string(),
        "could not find in-tree storage class parameter translation logic for \"kubernetes.io/rbd\""
    );
}

#[test]
fn in_tree_pvs_translate_to_csi() {
    let cases = [
        (
            "23: static EBS aws:// ID; the zone label becomes K on a new term",
            json!({"labels": {GA_ZONE: "us-east-1a"}}),
            json!({"awsElasticBlockStore": {"volumeID": "aws://us-east-1a/vol-0abc", "fsType": "ext4"},
                   "accessModes": ["ReadWriteOnce"]}),
            json!({"spec": {
                "awsElasticBlockStore": null,
                "csi": {"driver": "ebs.csi.aws.com", "volumeHandle": "vol-0abc", "fsType": "ext4",
                        "volumeAttributes": {"partition": "0"}},
                "nodeAffinity": affinity(json!([term(&[(K_EBS, &["us-east-1a"])])])),
                "accessModes": ["ReadWriteOnce"]},
              "metadata": {"labels": {GA_ZONE: "us-east-1a"}}}),
        ),
        (
            "EBS multi-zone label: split, trimmed, deduplicated, sorted, on every term",
            json!({"labels": {BETA_ZONE: "b__ a__a__"}}),
            json!({"awsElasticBlockStore": {"volumeID": "vol-1", "partition": 2, "readOnly": true},
                   "nodeAffinity": affinity(json!([term(&[("x", &["1"])]), term(&[("y", &["2"])])]))}),
            json!({"spec": {
                "csi": {"driver": "ebs.csi.aws.com", "volumeHandle": "vol-1", "readOnly": true,
                        "volumeAttributes": {"partition": "2"}},
                "nodeAffinity": affinity(json!([
                    term(&[("x", &["1"]), (K_EBS, &["a", "b"])]),
                    term(&[("y", &["2"]), (K_EBS, &["a", "b"])])]))}}),
        ),
        (
            "EBS beta zone and region expressions: zone to K, region to GA",
            json!({}),
            json!({"awsElasticBlockStore": {"volumeID": "vol-1"},
                   "nodeAffinity": affinity(json!([term(&[(BETA_ZONE, &["us-east-1a"]), (BETA_REGION, &["us-east-1"])])]))}),
            json!({"spec": {"nodeAffinity": affinity(json!([term(&[(K_EBS, &["us-east-1a"]), (GA_REGION, &["us-east-1"])])]))}}),
        ),
        (
            "24: static GCE zonal label, RWX counts as RWO, partition empty",
            json!({"labels": {GA_ZONE: "us-central1-a"}}),
            json!({"gcePersistentDisk": {"pdName": "pd1"}, "accessModes": ["ReadWriteMany"]}),
            json!({"spec": {
                "gcePersistentDisk": null,
                "csi": {"driver": "pd.csi.storage.gke.io",
                        "volumeHandle": "projects/UNSPECIFIED/zones/us-central1-a/disks/pd1",
                        "volumeAttributes": {"partition": ""}},
                "nodeAffinity": affinity(json!([term(&[(K_GCE, &["us-central1-a"])])])),
                "accessModes": ["ReadWriteOnce"]}}),
        ),
        (
            "24: GCE ROX stays ROX",
            json!({"labels": {GA_ZONE: "us-central1-a"}}),
            json!({"gcePersistentDisk": {"pdName": "pd1", "partition": 3}, "accessModes": ["ReadOnlyMany"]}),
            json!({"spec": {
                "csi": {"driver": "pd.csi.storage.gke.io",
                        "volumeHandle": "projects/UNSPECIFIED/zones/us-central1-a/disks/pd1",
                        "volumeAttributes": {"partition": "3"}},
                "accessModes": ["ReadOnlyMany"]}}),
        ),
        (
            "14: GCE without labels: zones/UNSPECIFIED",
            json!({}),
            json!({"gcePersistentDisk": {"pdName": "pvc-x"}}),
            json!({"spec": {"csi": {"driver": "pd.csi.storage.gke.io",
                    "volumeHandle": "projects/UNSPECIFIED/zones/UNSPECIFIED/disks/pvc-x",
                    "volumeAttributes": {"partition": ""}},
                "nodeAffinity": null, "accessModes": null}}),
        ),
        (
            "14: GCE two-zone label: regions/<region>; the beta label wins over GA",
            json!({"labels": {BETA_ZONE: "us-central1-a__us-central1-b", GA_ZONE: "europe-west1-b"}}),
            json!({"gcePersistentDisk": {"pdName": "pvc-x"}}),
            json!({"spec": {"csi": {"driver": "pd.csi.storage.gke.io",
                    "volumeHandle": "projects/UNSPECIFIED/regions/us-central1/disks/pvc-x",
                    "volumeAttributes": {"partition": ""}},
                "nodeAffinity": affinity(json!([term(&[(K_GCE, &["europe-west1-b"])])]))}}),
        ),
        (
            "25: Azure Disk kind Managed: kind, cachingmode and fstype as attributes",
            json!({}),
            json!({"azureDisk": {"diskName": "d1", "kind": "Managed", "cachingMode": "ReadWrite",
                                 "fsType": "ext4", "readOnly": false,
                                 "diskURI": "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/disks/d1"},
                   "nodeAffinity": affinity(json!([term(&[(GA_ZONE, &["eastus-1"])])]))}),
            json!({"spec": {
                "azureDisk": null,
                "csi": {"driver": "disk.csi.azure.com", "fsType": "ext4", "readOnly": false,
                        "volumeHandle": "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/disks/d1",
                        "volumeAttributes": {"kind": "Managed", "cachingmode": "ReadWrite", "fstype": "ext4"}},
                "nodeAffinity": affinity(json!([term(&[(GA_ZONE, &["eastus-1"])])]))}}),
        ),
        (
            "Azure Disk without kind: only kind Managed",
            json!({}),
            json!({"azureDisk": {"diskName": "d1", "kind": "managed", "diskURI": "uri"}}),
            json!({"spec": {"csi": {"driver": "disk.csi.azure.com", "volumeHandle": "uri",
                                    "volumeAttributes": {"kind": "Managed"}}}}),
        ),
        (
            "26: Azure File namespace from the claim; account from the secret name",
            json!({"name": "pv-af"}),
            json!({"azureFile": {"secretName": "azure-storage-account-acct-secret", "shareName": "share"},
                   "claimRef": {"namespace": "ns1", "name": "c"}}),
            json!({"spec": {"azureFile": null, "csi": {
                "driver": "file.csi.azure.com", "volumeHandle": "#acct#share#pv-af#ns1",
                "nodeStageSecretRef": {"name": "azure-storage-account-acct-secret", "namespace": "ns1"},
                "volumeAttributes": {"sharename": "share"}}}}),
        ),
        (
            "Azure File: secretNamespace first, resource group from the annotation",
            json!({"name": "pv-af", "annotations": {"kubernetes.io/azure-file-resource-group": "rg"}}),
            json!({"azureFile": {"secretName": "plain", "shareName": "s", "secretNamespace": "sns",
                                 "readOnly": true},
                   "claimRef": {"namespace": "ns1", "name": "c"}}),
            json!({"spec": {"csi": {
                "driver": "file.csi.azure.com", "volumeHandle": "rg#plain#s#pv-af#sns", "readOnly": true,
                "nodeStageSecretRef": {"name": "plain", "namespace": "sns"},
                "volumeAttributes": {"sharename": "s"}}}}),
        ),
        (
            "Cinder: volumeID, no attributes, GA zone expression to K",
            json!({}),
            json!({"cinder": {"volumeID": "c1", "fsType": "ext4"},
                   "nodeAffinity": affinity(json!([term(&[(GA_ZONE, &["nova"])])]))}),
            json!({"spec": {"cinder": null, "csi": {"driver": "cinder.csi.openstack.org", "volumeHandle": "c1",
                    "fsType": "ext4", "volumeAttributes": {}},
                "nodeAffinity": affinity(json!([term(&[(K_CINDER, &["nova"])])]))}}),
        ),
        (
            "vSphere: path, policy, zone and region labels (unsplit) to vmware keys",
            json!({"labels": {GA_ZONE: "z1__z2", GA_REGION: "r1"}}),
            json!({"vsphereVolume": {"volumePath": "[ds] vol.vmdk", "storagePolicyName": "gold", "fsType": "ext4"}}),
            json!({"spec": {"vsphereVolume": null, "csi": {"driver": "csi.vsphere.vmware.com",
                    "volumeHandle": "[ds] vol.vmdk", "fsType": "ext4",
                    "volumeAttributes": {"storagepolicyname": "gold"}},
                "nodeAffinity": affinity(json!([term(&[
                    ("topology.csi.vmware.com/zone", &["z1__z2"]),
                    ("topology.csi.vmware.com/region", &["r1"])])]))}}),
        ),
        (
            "Portworx: readOnly dropped, auth annotations as five secret references",
            json!({"annotations": {"openstorage.io/auth-secret-name": "s", "openstorage.io/auth-secret-namespace": "n"}}),
            json!({"portworxVolume": {"volumeID": "px1", "fsType": "ext4", "readOnly": true}}),
            json!({"spec": {"portworxVolume": null, "csi": {"driver": "pxd.portworx.com", "volumeHandle": "px1",
                "fsType": "ext4", "volumeAttributes": {},
                "controllerPublishSecretRef": {"name": "s", "namespace": "n"},
                "nodeStageSecretRef": {"name": "s", "namespace": "n"},
                "nodePublishSecretRef": {"name": "s", "namespace": "n"},
                "controllerExpandSecretRef": {"name": "s", "namespace": "n"},
                "nodeExpandSecretRef": {"name": "s", "namespace": "n"}}}}),
        ),
        (
            "Portworx: one auth annotation alone gives no secret",
            json!({"annotations": {"openstorage.io/auth-secret-name": "s"}}),
            json!({"portworxVolume": {"volumeID": "px1"}}),
            json!({"spec": {"csi": {"driver": "pxd.portworx.com", "volumeHandle": "px1", "volumeAttributes": {}}}}),
        ),
    ];
    for (case, metadata, spec, want) in cases {
        let input = pv(metadata, spec);
        assert!(is_pv_migratable(&input), "{case}: migratable");
        let got = translate_in_tree_pv_to_csi(&input).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_fields(case, &got, &want);
    }
}

#[test]
fn in_tree_pvs_that_do_not_translate_say_why() {
    let cases = [
        (
            "23: EBS ID that is not vol-",
            json!({}),
            json!({"awsElasticBlockStore": {"volumeID": "aws://us-east-1a/bad"}}),
            "failed to translate Kubernetes ID to EBS Volume ID Invalid format for AWS volume (aws://us-east-1a/bad)",
        ),
        (
            "25: Azure Disk of the defaulted kind Shared",
            json!({}),
            json!({"azureDisk": {"diskName": "d1", "kind": "Shared", "diskURI": "https://a/vhds/d1.vhd"}}),
            "kind(Shared) is not supported in csi migration",
        ),
        (
            "26: Azure File without secretNamespace or claim",
            json!({}),
            json!({"azureFile": {"secretName": "s", "shareName": "share"}}),
            "could not find a secret namespace in PersistentVolumeSource or ClaimRef",
        ),
        (
            "GCE zones of two regions",
            json!({"labels": {GA_ZONE: "us-central1-a__europe-west1-b"}}),
            json!({"gcePersistentDisk": {"pdName": "p"}}),
            "failed to get region from zones: multiple or no regions gotten from zones, got: map[europe-west1:{} us-central1:{}]",
        ),
        (
            "GCE multi-zone label with an empty zone",
            json!({"labels": {GA_ZONE: "us-central1-a__"}}),
            json!({"gcePersistentDisk": {"pdName": "p"}}),
            "failed to get region from zones: zone in unexpected format, expected: {locale}-{region}-{zone}, got: ",
        ),
        (
            "28/32: NFS is not migratable",
            json!({"name": "nfs-pv"}),
            json!({"nfs": {"server": "s", "path": "/"}}),
            "could not find in-tree plugin translation logic for \"nfs-pv\"",
        ),
        (
            "a CSI PV is not in-tree",
            json!({"name": "csi-pv"}),
            json!({"csi": {"driver": "ebs.csi.aws.com", "volumeHandle": "vol-1"}}),
            "could not find in-tree plugin translation logic for \"csi-pv\"",
        ),
    ];
    for (case, metadata, spec, want) in cases {
        let input = pv(metadata, spec);
        let got = translate_in_tree_pv_to_csi(&input).map_err(|e| e.to_string());
        assert_eq!(got.err().as_deref(), Some(want), "{case}");
    }
    assert!(!is_pv_migratable(&pv(
        json!({}),
        json!({"nfs": {"server": "s", "path": "/"}})
    )));
}

#[test]
fn gce_access_modes_become_what_the_driver_accepts() {
    type Modes<'a> = Option<&'a [&'a str]>;
    let cases: [(Modes, Modes); 7] = [
        (None, None),
        (Some(&["ReadWriteMany"]), Some(&["ReadWriteOnce"])),
        (
            Some(&["ReadWriteOnce", "ReadOnlyMany"]),
            Some(&["ReadWriteOnce"]),
        ),
        (
            Some(&["ReadOnlyMany", "ReadWriteMany"]),
            Some(&["ReadWriteOnce"]),
        ),
        (Some(&["ReadOnlyMany"]), Some(&["ReadOnlyMany"])),
        (Some(&["ReadWriteOncePod"]), Some(&["ReadWriteOnce"])),
        (Some(&[]), Some(&["ReadWriteOnce"])),
    ];
    for (input, want) in cases {
        let own = |m: Option<&[&str]>| m.map(|m| m.iter().map(|s| (*s).to_owned()).collect());
        let got: Option<Vec<String>> = gce_pd::access_modes(own(input));
        assert_eq!(got, own(want), "{input:?}");
    }
}

#[test]
fn csi_pvs_translate_back_in_tree() {
    let cases = [
        (
            "8: EBS write-back: GA zone plus GA region term, both labels",
            json!({"annotations": {"pv.kubernetes.io/provisioned-by": "kubernetes.io/aws-ebs"}}),
            json!({"csi": {"driver": "ebs.csi.aws.com", "volumeHandle": "vol-0abc", "fsType": "ext4",
                   "volumeAttributes": {"partition": "0", "storage.kubernetes.io/csiProvisionerIdentity": "x"}},
                   "nodeAffinity": affinity(json!([term(&[(GA_ZONE, &["us-east-1a"])])])),
                   "accessModes": ["ReadWriteOnce"], "mountOptions": ["debug"]}),
            json!({"spec": {
                "csi": null,
                "awsElasticBlockStore": {"volumeID": "vol-0abc", "fsType": "ext4", "partition": 0},
                "nodeAffinity": affinity(json!([term(&[(GA_ZONE, &["us-east-1a"]), (GA_REGION, &["us-east-1"])])])),
                "accessModes": ["ReadWriteOnce"], "mountOptions": ["debug"]},
              "metadata": {"labels": {GA_ZONE: "us-east-1a", GA_REGION: "us-east-1"},
                           "annotations": {"pv.kubernetes.io/provisioned-by": "kubernetes.io/aws-ebs"}}}),
        ),
        (
            "9: EBS K renamed to GA zone; two terms give a joined zone label and one region",
            json!({}),
            json!({"csi": {"driver": "ebs.csi.aws.com", "volumeHandle": "vol-1"},
                   "nodeAffinity": affinity(json!([term(&[(K_EBS, &["us-east-1b"])]), term(&[(K_EBS, &["us-east-1a"])])]))}),
            json!({"spec": {
                "awsElasticBlockStore": {"volumeID": "vol-1"},
                "nodeAffinity": affinity(json!([
                    term(&[(GA_ZONE, &["us-east-1b"]), (GA_REGION, &["us-east-1"])]),
                    term(&[(GA_ZONE, &["us-east-1a"]), (GA_REGION, &["us-east-1"])])]))},
              "metadata": {"labels": {GA_ZONE: "us-east-1a__us-east-1b", GA_REGION: "us-east-1"}}}),
        ),
        (
            "EBS on a PV with beta labels keeps the beta keys; a term with a region is left alone",
            json!({"labels": {BETA_ZONE: "us-gov-east-1a"}}),
            json!({"csi": {"driver": "ebs.csi.aws.com", "volumeHandle": "vol-1"},
                   "nodeAffinity": affinity(json!([term(&[(K_EBS, &["us-gov-east-1a"])]),
                                                   term(&[(K_EBS, &["us-west-2-lax-1a"]), (BETA_REGION, &["x"])])]))}),
            json!({"spec": {"nodeAffinity": affinity(json!([
                    term(&[(BETA_ZONE, &["us-gov-east-1a"]), (BETA_REGION, &["us-gov-east-1"])]),
                    term(&[(BETA_ZONE, &["us-west-2-lax-1a"]), (BETA_REGION, &["x"])])]))},
              "metadata": {"labels": {BETA_ZONE: "us-gov-east-1a"}}}),
        ),
        (
            "EBS without node affinity: no topology, no labels",
            json!({}),
            json!({"csi": {"driver": "ebs.csi.aws.com", "volumeHandle": "vol-1"}}),
            json!({"spec": {"awsElasticBlockStore": {"volumeID": "vol-1"}, "nodeAffinity": null},
                   "metadata": {"labels": null}}),
        ),
        (
            "12: GCE write-back: pdName, GA zone and region, labels",
            json!({}),
            json!({"csi": {"driver": "pd.csi.storage.gke.io",
                   "volumeHandle": "projects/p1/zones/us-central1-a/disks/pvc-x",
                   "volumeAttributes": {"partition": ""}},
                   "nodeAffinity": affinity(json!([term(&[(K_GCE, &["us-central1-a"])])]))}),
            json!({"spec": {"csi": null, "gcePersistentDisk": {"pdName": "pvc-x"},
                "nodeAffinity": affinity(json!([term(&[(GA_ZONE, &["us-central1-a"]), (GA_REGION, &["us-central1"])])]))},
              "metadata": {"labels": {GA_ZONE: "us-central1-a", GA_REGION: "us-central1"}}}),
        ),
        (
            "GCE partition parsed",
            json!({}),
            json!({"csi": {"driver": "pd.csi.storage.gke.io", "volumeHandle": "projects/p/zones/z/disks/d",
                   "volumeAttributes": {"partition": "2"}, "readOnly": true}}),
            json!({"spec": {"gcePersistentDisk": {"pdName": "d", "partition": 2, "readOnly": true}}}),
        ),
        (
            "16: Azure Disk write-back keeps K in the node affinity",
            json!({}),
            json!({"csi": {"driver": "disk.csi.azure.com",
                   "volumeHandle": "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/disks/d1",
                   "volumeAttributes": {"cachingmode": "ReadOnly"}},
                   "nodeAffinity": affinity(json!([term(&[(K_AZ, &["eastus-1"])])]))}),
            json!({"spec": {"csi": null, "azureDisk": {"diskName": "d1", "kind": "Managed",
                    "cachingMode": "ReadOnly", "fsType": "", "readOnly": false,
                    "diskURI": "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/disks/d1"},
                "nodeAffinity": affinity(json!([term(&[(K_AZ, &["eastus-1"])])]))},
              "metadata": {"labels": null}}),
        ),
        (
            "Azure Disk: a non-empty fstype attribute overrides the CSI fsType",
            json!({}),
            json!({"csi": {"driver": "disk.csi.azure.com", "fsType": "ext4",
                   "volumeHandle": "https://acct/vhds/d1.vhd",
                   "volumeAttributes": {"fsType": "xfs", "cachingMode": ""}}}),
            json!({"spec": {"azureDisk": {"diskName": "d1.vhd", "kind": "Managed", "fsType": "xfs",
                    "readOnly": false, "diskURI": "https://acct/vhds/d1.vhd"}}}),
        ),
        (
            "17: Azure File from the handle: share, secret, namespace default, resource group",
            json!({}),
            json!({"csi": {"driver": "file.csi.azure.com", "volumeHandle": "rg#acct#s1#x",
                   "volumeAttributes": {"sharename": "s1"}}}),
            json!({"spec": {"csi": null, "azureFile": {"shareName": "s1",
                    "secretName": "azure-storage-account-acct-secret", "secretNamespace": "default"}},
              "metadata": {"annotations": {"kubernetes.io/azure-file-resource-group": "rg"}}}),
        ),
        (
            "Azure File: the node-stage secret names secret and namespace",
            json!({}),
            json!({"csi": {"driver": "file.csi.azure.com", "volumeHandle": "unused",
                   "volumeAttributes": {"ShareName": "s1", "secretnamespace": "lost"},
                   "nodeStageSecretRef": {"name": "sec", "namespace": "ns"}}}),
            json!({"spec": {"azureFile": {"shareName": "s1", "secretName": "sec", "secretNamespace": "ns"}},
              "metadata": {"annotations": null}}),
        ),
        (
            "18: vSphere volumePath from initialvolumefilepath; labels take the first value",
            json!({}),
            json!({"csi": {"driver": "csi.vsphere.vmware.com", "volumeHandle": "uuid", "fsType": "ext4",
                   "volumeAttributes": {"initialvolumefilepath": "[ds] v.vmdk"}},
                   "nodeAffinity": affinity(json!([term(&[("topology.csi.vmware.com/zone", &["z2", "z1"]),
                                                          ("topology.csi.vmware.com/region", &["r1"])])]))}),
            json!({"spec": {"vsphereVolume": {"volumePath": "[ds] v.vmdk", "fsType": "ext4"},
                "nodeAffinity": affinity(json!([term(&[(GA_ZONE, &["z2", "z1"]), (GA_REGION, &["r1"])])]))},
              "metadata": {"labels": {GA_ZONE: "z1", GA_REGION: "r1"}}}),
        ),
        (
            "Cinder: K back to GA zone, zone label, no region",
            json!({}),
            json!({"csi": {"driver": "cinder.csi.openstack.org", "volumeHandle": "c1"},
                   "nodeAffinity": affinity(json!([term(&[(K_CINDER, &["nova"])])]))}),
            json!({"spec": {"cinder": {"volumeID": "c1"},
                "nodeAffinity": affinity(json!([term(&[(GA_ZONE, &["nova"])])]))},
              "metadata": {"labels": {GA_ZONE: "nova"}}}),
        ),
        (
            "Portworx: secret references are lost",
            json!({}),
            json!({"csi": {"driver": "pxd.portworx.com", "volumeHandle": "px1", "readOnly": true,
                   "controllerExpandSecretRef": {"name": "s", "namespace": "n"}}}),
            json!({"spec": {"csi": null, "portworxVolume": {"volumeID": "px1", "readOnly": true}}}),
        ),
    ];
    for (case, metadata, spec, want) in cases {
        let input = pv(metadata, spec);
        let got = translate_csi_pv_to_in_tree(&input).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_fields(case, &got, &want);
    }
}

#[test]
fn csi_pvs_that_do_not_translate_back_say_why() {
    let ebs_topology = |exps: &[(&str, &[&str])]| {
        json!({"csi": {"driver": "ebs.csi.aws.com", "volumeHandle": "vol-1"},
               "nodeAffinity": affinity(json!([term(exps)]))})
    };
    let cases = [
        (
            "10: topology without a zone",
            ebs_topology(&[("topology.hostpath.csi/node", &["n1"])]),
            "failed to translate topology. PV:{Name:pv1}. Error:Failed to handle region topology. error: no zones specified",
        ),
        (
            "AWS zone of no known form",
            ebs_topology(&[(K_EBS, &["moon"])]),
            "failed to translate topology. PV:{Name:pv1}. Error:Failed to handle region topology. error: Unexpected zone format: moon is not a valid AWS zone",
        ),
        (
            "AWS zones of two regions in one term",
            ebs_topology(&[(K_EBS, &["us-east-1a", "us-west-2b"])]),
            "failed to translate topology. PV:{Name:pv1}. Error:Failed to handle region topology. error: multiple or no regions gotten from zones, got: map[us-east-1:{} us-west-2:{}]",
        ),
        (
            "11: EBS partition present but empty",
            json!({"csi": {"driver": "ebs.csi.aws.com", "volumeHandle": "vol-1",
                   "volumeAttributes": {"partition": ""}}}),
            "failed to convert partition  to integer: strconv.Atoi: parsing \"\": invalid syntax",
        ),
        (
            "13: GCE handle of fewer than six parts",
            json!({"csi": {"driver": "pd.csi.storage.gke.io", "volumeHandle": "pvc-x"}}),
            "failed to get id components.Got: 1, wanted 6 components or more. ",
        ),
        (
            "GCE partition that is no number",
            json!({"csi": {"driver": "pd.csi.storage.gke.io", "volumeHandle": "projects/p/zones/z/disks/d",
                   "volumeAttributes": {"partition": "x"}}}),
            "Failed to convert partition x to integer: strconv.Atoi: parsing \"x\": invalid syntax",
        ),
        (
            "GCE zone not {locale}-{region}-{zone}",
            json!({"csi": {"driver": "pd.csi.storage.gke.io", "volumeHandle": "projects/p/zones/z/disks/d"},
                   "nodeAffinity": affinity(json!([term(&[(K_GCE, &["zone1"])])]))}),
            "failed to translate topology. PV:{Name:pv1}. Error:Failed to handle region topology. error: zone in unexpected format, expected: {locale}-{region}-{zone}, got: zone1",
        ),
        (
            "16: Azure Disk handle of neither form",
            json!({"csi": {"driver": "disk.csi.azure.com", "volumeHandle": "vol-1"}}),
            "could not get disk name from vol-1, correct format: .*/subscriptions/(?:.*)/resourceGroups/(?:.*)/providers/Microsoft.Compute/disks/(.+)",
        ),
        (
            "Azure File handle with one #",
            json!({"csi": {"driver": "file.csi.azure.com", "volumeHandle": "a#b"}}),
            "error parsing volume id: \"a#b\", should at least contain two #",
        ),
        (
            "a driver that is no migration target",
            json!({"csi": {"driver": "hostpath.csi.k8s.io", "volumeHandle": "v"}}),
            "could not find in-tree plugin translation logic for hostpath.csi.k8s.io",
        ),
        (
            "a PV without spec.csi",
            json!({"nfs": {"server": "s", "path": "/"}}),
            "CSI persistent volume was nil",
        ),
    ];
    for (case, spec, want) in cases {
        let input = pv(json!({}), spec);
        let got = translate_csi_pv_to_in_tree(&input).map_err(|e| e.to_string());
        assert_eq!(got.err().as_deref(), Some(want), "{case}");
    }
}

#[test]
fn regions_come_from_zones_as_upstream_parses_them() {
    let aws = [
        (&["us-east-1a"][..], Ok("us-east-1")),
        (&["us-gov-east-1a"][..], Ok("us-gov-east-1")),
        (&["us-west-2-lax-1a"][..], Ok("us-west-2")),
        (&["us-east-1-wl1-bos-wlz-1"][..], Ok("us-east-1")),
        (&["us-east-1a", "us-east-1b"][..], Ok("us-east-1")),
        (&[][..], Err("no zones specified")),
        (
            &["us-east-10a"][..],
            Err("Unexpected zone format: us-east-10a is not a valid AWS zone"),
        ),
    ];
    for (zones, want) in aws {
        let zones: Vec<String> = zones.iter().map(|z| (*z).to_owned()).collect();
        let got = topology::aws_region(&zones).map_err(|e| e.to_string());
        assert_eq!(
            got,
            want.map(str::to_owned).map_err(str::to_owned),
            "aws {zones:?}"
        );
    }
    let gce = [
        (&["us-central1-a"][..], Ok("us-central1")),
        (&["us-central1-a", "us-central1-c"][..], Ok("us-central1")),
        (&[][..], Err("no zones specified")),
        (
            &["us-central1"][..],
            Err("zone in unexpected format, expected: {locale}-{region}-{zone}, got: us-central1"),
        ),
    ];
    for (zones, want) in gce {
        let zones: Vec<String> = zones.iter().map(|z| (*z).to_owned()).collect();
        let got = topology::gce_region(&zones).map_err(|e| e.to_string());
        assert_eq!(
            got,
            want.map(str::to_owned).map_err(str::to_owned),
            "gce {zones:?}"
        );
    }
}

#[test]
fn gce_handles_are_repaired_from_the_node_id() {
    const NODE: &str = "projects/p1/zones/us-central1-a/instances/n1";
    let cases = [
        (
            "30: zonal UNSPECIFIED",
            "pd.csi.storage.gke.io",
            "projects/UNSPECIFIED/zones/UNSPECIFIED/disks/d1",
            NODE,
            Ok("projects/p1/zones/us-central1-a/disks/d1"),
        ),
        (
            "30: project only",
            "pd.csi.storage.gke.io",
            "projects/UNSPECIFIED/zones/us-central1-b/disks/d1",
            NODE,
            Ok("projects/p1/zones/us-central1-b/disks/d1"),
        ),
        (
            "regional UNSPECIFIED",
            "pd.csi.storage.gke.io",
            "projects/UNSPECIFIED/regions/UNSPECIFIED/disks/d1",
            NODE,
            Ok("projects/p1/regions/us-central1/disks/d1"),
        ),
        (
            "a known project is kept, whatever the node",
            "pd.csi.storage.gke.io",
            "projects/p9/zones/z/disks/d1",
            "bad",
            Ok("projects/p9/zones/z/disks/d1"),
        ),
        (
            "short handle",
            "pd.csi.storage.gke.io",
            "d1",
            NODE,
            Err("volume handle has wrong number of elements; got 1, wanted 6 or more"),
        ),
        (
            "short node ID",
            "pd.csi.storage.gke.io",
            "projects/UNSPECIFIED/zones/UNSPECIFIED/disks/d1",
            "n1",
            Err("node handle has wrong number of elements; got 1, wanted 6 or more"),
        ),
        (
            "regional with a node zone of no region",
            "pd.csi.storage.gke.io",
            "projects/UNSPECIFIED/regions/UNSPECIFIED/disks/d1",
            "projects/p1/zones/zone1/instances/n1",
            Err(
                "failed to get region from zone zone1: zone in unexpected format, expected: {locale}-{region}-{zone}, got: zone1",
            ),
        ),
        (
            "neither zones nor regions",
            "pd.csi.storage.gke.io",
            "projects/UNSPECIFIED/global/x/disks/d1",
            NODE,
            Err("expected volume handle to have zones or regions regionality value, got: global"),
        ),
        (
            "other targets keep the handle",
            "ebs.csi.aws.com",
            "vol-1",
            "",
            Ok("vol-1"),
        ),
        (
            "not a target",
            "hostpath.csi.k8s.io",
            "v",
            "",
            Err("could not find In-Tree driver name for CSI plugin hostpath.csi.k8s.io"),
        ),
    ];
    for (case, driver, handle, node, want) in cases {
        let got = repair_volume_handle(driver, handle, node).map_err(|e| e.to_string());
        assert_eq!(
            got,
            want.map(str::to_owned).map_err(str::to_owned),
            "{case}"
        );
    }
}

#[test]
fn translation_leaves_its_input_alone_and_round_trips() {
    let input = pv(
        json!({"labels": {GA_ZONE: "us-central1-a"}}),
        json!({"gcePersistentDisk": {"pdName": "pd1"}, "accessModes": ["ReadWriteOnce"]}),
    );
    let before = input.clone();
    let csi = translate_in_tree_pv_to_csi(&input).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(input, before);
    let back = translate_csi_pv_to_in_tree(&csi).unwrap_or_else(|e| panic!("{e}"));
    assert_fields(
        "round trip",
        &back,
        &json!({"spec": {"csi": null, "gcePersistentDisk": {"pdName": "pd1"},
            "nodeAffinity": affinity(json!([term(&[(GA_ZONE, &["us-central1-a"]), (GA_REGION, &["us-central1"])])]))},
          "metadata": {"labels": {GA_ZONE: "us-central1-a", GA_REGION: "us-central1"}}}),
    );
}

//! AWS EBS: `kubernetes.io/aws-ebs` ↔ `ebs.csi.aws.com` (§3.1).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    AWSElasticBlockStoreVolumeSource, CSIPersistentVolumeSource, PersistentVolume,
};
use k8s_openapi::api::storage::v1::StorageClass;

use super::error::Error;
use super::topology;
use plugreg_goflag::gotext;

/// The driver.
const DRIVER: &str = "ebs.csi.aws.com";
/// The driver's zone key.
pub(super) const TOPOLOGY_KEY: &str = "topology.ebs.csi.aws.com/zone";

/// `fstype` renamed, `zone`/`zones` into topology, `iopsPerGB` kept plus
/// `allowautoiopspergbincrease: "true"`, the rest copied.
pub(super) fn storage_class(sc: &mut StorageClass) -> Result<(), Error> {
    topology::zoned_storage_class(sc, TOPOLOGY_KEY, |lower, k, v, params| {
        if lower != "iopspergb" {
            return false;
        }
        params.insert(k.to_owned(), v.to_owned());
        params.insert("allowautoiopspergbincrease".to_owned(), "true".to_owned());
        true
    })
}

/// The EBS volume ID of a Kubernetes volume ID: verbatim, unless `aws://<zone>/<vol-...>`.
fn ebs_volume_id(id: &str) -> Result<String, Error> {
    let Some(rest) = id.strip_prefix("aws://") else {
        return Ok(id.to_owned());
    };
    let path = url_path(id, rest)
        .map_err(|e| Error::EbsVolumeId(format!("Invalid disk name ({id}): {e}")))?;
    let trimmed = path.trim_matches('/');
    if trimmed.starts_with("vol-") && !trimmed.contains('/') {
        Ok(trimmed.to_owned())
    } else {
        Err(Error::EbsVolumeId(format!(
            "Invalid format for AWS volume ({id})"
        )))
    }
}

/// The decoded path of `aws://<rest>` as Go's `url.Parse` gives it, or its error text for the
/// cases an EBS ID can meet (control characters, bad escapes, a bad port).
fn url_path(whole: &str, rest: &str) -> Result<String, String> {
    let parse = |why: String| format!("parse {}: {why}", gotext::quote(whole));
    if whole.chars().any(|c| (c as u32) < 0x20 || c == '\u{7f}') {
        return Err(parse(
            "net/url: invalid control character in URL".to_owned(),
        ));
    }
    let rest = rest.split_once('#').map_or(rest, |(r, _)| r);
    let rest = rest.split_once('?').map_or(rest, |(r, _)| r);
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if let Some((_, port)) = host.rsplit_once(':')
        && !host.ends_with(']')
        && !port.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(parse(format!(
            "invalid port {} after host",
            gotext::quote(&format!(":{port}"))
        )));
    }
    unescape(host).map_err(&parse)?;
    unescape(path).map_err(&parse)
}

/// Percent-decoding, with Go's error for an invalid escape.
fn unescape(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3).and_then(|h| {
                std::str::from_utf8(h)
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
            });
            let Some(b) = hex else {
                let end = (i + 3).min(bytes.len());
                let bad = String::from_utf8_lossy(&bytes[i..end]);
                return Err(format!("invalid URL escape {}", gotext::quote(&bad)));
            };
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// `awsElasticBlockStore` → CSI: the EBS ID, `{"partition": "<n>"}`, topology.
pub(super) fn pv_to_csi(pv: &mut PersistentVolume) -> Result<(), Error> {
    let spec = pv.spec.get_or_insert_with(Default::default);
    let Some(ebs) = spec.aws_elastic_block_store.take() else {
        return Ok(());
    };
    let handle = ebs_volume_id(&ebs.volume_id)?;
    let csi = CSIPersistentVolumeSource {
        driver: DRIVER.to_owned(),
        volume_handle: handle,
        read_only: ebs.read_only,
        fs_type: ebs.fs_type,
        volume_attributes: Some(BTreeMap::from([(
            "partition".to_owned(),
            ebs.partition.unwrap_or(0).to_string(),
        )])),
        ..Default::default()
    };
    spec.csi = Some(csi);
    topology::in_tree_to_csi(pv, TOPOLOGY_KEY);
    Ok(())
}

/// CSI → `awsElasticBlockStore`: the handle as `volumeID`, `partition` parsed when present,
/// topology with AWS regions.
pub(super) fn pv_to_in_tree(pv: &mut PersistentVolume) -> Result<(), Error> {
    let Some(csi) = pv.spec.as_ref().and_then(|s| s.csi.clone()) else {
        return Err(Error::NoCsiSource);
    };
    let mut ebs = AWSElasticBlockStoreVolumeSource {
        volume_id: csi.volume_handle,
        fs_type: csi.fs_type,
        read_only: csi.read_only,
        partition: None,
    };
    if let Some(p) = csi
        .volume_attributes
        .as_ref()
        .and_then(|a| a.get("partition"))
    {
        let n = gotext::atoi32(p).map_err(|reason| Error::EbsPartition {
            value: p.clone(),
            reason,
        })?;
        ebs.partition = Some(n);
    }
    topology::csi_to_in_tree(pv, TOPOLOGY_KEY, Some(topology::aws_region))?;
    let spec = pv.spec.get_or_insert_with(Default::default);
    spec.csi = None;
    spec.aws_elastic_block_store = Some(ebs);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubernetes_ids_become_ebs_ids() {
        let ok = [
            ("vol-0abc", "vol-0abc"),
            ("anything/goes", "anything/goes"),
            ("aws://us-east-1a/vol-0abc", "vol-0abc"),
            ("aws:///vol-0abc", "vol-0abc"),
            ("aws://us-east-1a/vol-0abc/", "vol-0abc"),
            ("aws://us-east-1a/vol-%41bc", "vol-Abc"),
        ];
        for (id, want) in ok {
            assert_eq!(ebs_volume_id(id).as_deref(), Ok(want), "{id}");
        }
        let bad = [
            (
                "aws://us-east-1a/bad",
                "failed to translate Kubernetes ID to EBS Volume ID Invalid format for AWS volume (aws://us-east-1a/bad)",
            ),
            (
                "aws://us-east-1a/x/vol-1",
                "failed to translate Kubernetes ID to EBS Volume ID Invalid format for AWS volume (aws://us-east-1a/x/vol-1)",
            ),
            (
                "aws://us-east-1a/vol-%zz",
                "failed to translate Kubernetes ID to EBS Volume ID Invalid disk name (aws://us-east-1a/vol-%zz): parse \"aws://us-east-1a/vol-%zz\": invalid URL escape \"%zz\"",
            ),
            (
                "aws://zone:x/vol-1",
                "failed to translate Kubernetes ID to EBS Volume ID Invalid disk name (aws://zone:x/vol-1): parse \"aws://zone:x/vol-1\": invalid port \":x\" after host",
            ),
        ];
        for (id, want) in bad {
            assert_eq!(
                ebs_volume_id(id).map_err(|e| e.to_string()),
                Err(want.to_owned()),
                "{id}"
            );
        }
    }
}

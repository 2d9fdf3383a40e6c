//! Extended resource names, as the kubelet checks a device plugin's resource.

/// Whether `name` is an extended resource name: it has a `/`, is not in a `kubernetes.io/`
/// namespace, does not start with `requests.`, and `requests.<name>` is a qualified name (a
/// DNS-1123 subdomain prefix, then up to 63 characters of `[A-Za-z0-9._-]` starting and ending
/// alphanumeric).
pub fn is_extended_resource_name(name: &str) -> bool {
    if !name.contains('/') || name.contains("kubernetes.io/") || name.starts_with("requests.") {
        return false;
    }
    let quota = format!("requests.{name}");
    let Some((prefix, local)) = quota.split_once('/') else {
        return false;
    };
    !local.contains('/') && is_dns1123_subdomain(prefix) && is_qualified_local_name(local)
}

fn is_dns1123_subdomain(s: &str) -> bool {
    s.len() <= 253
        && !s.is_empty()
        && s.split('.').all(|label| {
            let b = label.as_bytes();
            !b.is_empty()
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
                && b[0] != b'-'
                && b[b.len() - 1] != b'-'
        })
}

fn is_qualified_local_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extended_resource_names_follow_the_kubelet() {
        for ok in [
            "vendor.com/gpu",
            "example.com/widget",
            "a/b",
            "nvidia.com/GPU_x.1",
            "x-y.z/A",
        ] {
            assert!(is_extended_resource_name(ok), "{ok} must be accepted");
        }
        for bad in [
            "",
            "gpu",
            "kubernetes.io/gpu",
            "foo.kubernetes.io/gpu",
            "Vendor.com/gpu",
            "requests.vendor.com/gpu",
            "vendor.com/",
            "/gpu",
            "vendor.com/a/b",
            "vendor.com/-gpu",
            "vendor.com/gpu-",
            "vendor..com/gpu",
            "vendor.com/gp u",
            "-vendor.com/gpu",
        ] {
            assert!(!is_extended_resource_name(bad), "{bad:?} must be refused");
        }
        assert!(is_extended_resource_name(&format!(
            "vendor.com/{}",
            "a".repeat(63)
        )));
        assert!(!is_extended_resource_name(&format!(
            "vendor.com/{}",
            "a".repeat(64)
        )));
        // "requests." counts towards the 253 characters of the prefix.
        let long = format!("{}.com", "a".repeat(240));
        assert!(is_extended_resource_name(&format!("{long}/x")));
        let too_long = format!("{}.com", "a".repeat(241));
        assert!(!is_extended_resource_name(&format!("{too_long}/x")));
    }
}

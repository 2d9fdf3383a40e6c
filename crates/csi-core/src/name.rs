//! The CSI driver name rule, shared by both sides: the sidecar checks the name GetPluginInfo
//! returns before it becomes part of a path (`<dir>/<name>-reg.sock`, R2), the CSI handler
//! before it reaches a Node annotation or a CSINode (D7).
//!
//! 1 to 63 characters forming, compared case-insensitively, a DNS-1123 subdomain (the CSI
//! spec's limit and what the API server demands of a CSINode driver name). That excludes `/`,
//! `..`, NUL and white space; those are named in the error, since they could escape a path.

/// Longest CSI driver name.
pub const MAX_DRIVER_NAME_LEN: usize = 63;

/// Why a driver name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DriverNameError {
    /// GetPluginInfo returned an empty name (upstream's wording).
    #[error("driver name is empty")]
    Empty,
    /// Longer than 63 characters.
    #[error("invalid CSI driver name {name:?}: {len} characters, more than {MAX_DRIVER_NAME_LEN}")]
    TooLong {
        /// The name (cut to 80 characters).
        name: String,
        /// Its length in characters.
        len: usize,
    },
    /// Contains something that must never reach a path.
    #[error("invalid CSI driver name {name:?}: it contains {what}")]
    Unsafe {
        /// The name.
        name: String,
        /// What was found.
        what: &'static str,
    },
    /// Breaks the CSI naming rules.
    #[error(
        "invalid CSI driver name {name:?}: it must consist of alphanumeric characters, '-' and \
         '.', and every dot-separated part must start and end with an alphanumeric character"
    )]
    Syntax {
        /// The name.
        name: String,
    },
}

/// Checks a CSI driver name returned by GetPluginInfo.
pub fn check_driver_name(name: &str) -> Result<(), DriverNameError> {
    if name.is_empty() {
        return Err(DriverNameError::Empty);
    }
    let unsafe_part = [
        ("/", "'/'"),
        ("..", "'..'"),
        ("\0", "a NUL byte"),
        ("\\", "'\\'"),
    ]
    .into_iter()
    .find(|(needle, _)| name.contains(needle));
    if let Some((_, what)) = unsafe_part {
        return Err(DriverNameError::Unsafe {
            name: name.to_owned(),
            what,
        });
    }
    let len = name.chars().count();
    if len > MAX_DRIVER_NAME_LEN {
        return Err(DriverNameError::TooLong {
            name: name.chars().take(80).collect(),
            len,
        });
    }
    let label_ok = |l: &str| {
        let b = l.as_bytes();
        !b.is_empty()
            && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-')
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
    };
    if !name.split('.').all(label_ok) {
        return Err(DriverNameError::Syntax {
            name: name.to_owned(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_real_driver_names() {
        for ok in [
            "csi.example.com",
            "hostpath.csi.k8s.io",
            "ebs.csi.aws.com",
            "Disk.CSI.Azure.com",
            "x",
            "a-b.c-d",
            &"a".repeat(63),
        ] {
            assert_eq!(check_driver_name(ok), Ok(()), "{ok}");
        }
    }

    #[test]
    fn refuses_names_that_could_escape_or_break_the_path() {
        assert_eq!(check_driver_name(""), Err(DriverNameError::Empty));
        for (bad, what) in [
            ("a/b", "'/'"),
            ("/abs", "'/'"),
            ("..", "'..'"),
            ("a..b", "'..'"),
            ("../x", "'/'"),
            ("a\0b", "a NUL byte"),
            ("a\\b", "'\\'"),
        ] {
            match check_driver_name(bad) {
                Err(DriverNameError::Unsafe { what: w, .. }) => assert_eq!(w, what, "{bad:?}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        assert!(matches!(
            check_driver_name(&"a".repeat(64)),
            Err(DriverNameError::TooLong { len: 64, .. })
        ));
        for bad in [".a", "a.", "-a", "a-", "a_b", "a b", "a.-b", "é"] {
            assert!(
                matches!(check_driver_name(bad), Err(DriverNameError::Syntax { .. })),
                "{bad:?}"
            );
        }
        let msg = check_driver_name("a/b").unwrap_err().to_string();
        assert_eq!(msg, "invalid CSI driver name \"a/b\": it contains '/'");
    }
}

//! CSI version rules: which supported-version lists a driver may register with, and when a second
//! registration of an already registered driver name is allowed (upstream `csi_plugin.go`).
//!
//! Versions are parsed loosely, like Kubernetes' `ParseGeneric`: optional surrounding white space
//! and a leading `v`, at least `major.minor` numeric components, anything after the numeric part
//! ignored. Pure functions only; the handler calls them from Validate and again from Register.

use std::cmp::Ordering;
use std::fmt;

/// A version with at least two numeric components (`1.0`, `v1.2.3`, `1.0.0-rc1` is `1.0.0`).
///
/// Compared component by component, missing components counting as 0 (`1.0` == `1.0.0`).
#[derive(Debug, Clone, Eq)]
pub struct Version {
    components: Vec<u64>,
}

/// Why a version string could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// No leading number.
    #[error("could not parse {0:?} as version")]
    NotAVersion(String),
    /// Only a major component (`"1"`).
    #[error("illegal version string {0:?}")]
    TooFewComponents(String),
    /// A component does not fit in 64 bits.
    #[error("illegal version string {0:?}: component out of range")]
    OutOfRange(String),
}

impl Version {
    /// Parses `s` as a generic version (see the module docs).
    pub fn parse_generic(s: &str) -> Result<Version, ParseError> {
        let trimmed = s.trim();
        let rest = trimmed.strip_prefix('v').unwrap_or(trimmed);
        let mut components = Vec::new();
        let mut chars = rest;
        loop {
            let digits = chars.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 {
                break;
            }
            let n = chars[..digits]
                .parse::<u64>()
                .map_err(|_| ParseError::OutOfRange(s.to_owned()))?;
            components.push(n);
            chars = &chars[digits..];
            // A dot continues the numeric part only when a digit follows it.
            match chars.strip_prefix('.') {
                Some(after) if after.starts_with(|c: char| c.is_ascii_digit()) => chars = after,
                _ => break,
            }
        }
        match components.len() {
            0 => Err(ParseError::NotAVersion(s.to_owned())),
            1 => Err(ParseError::TooFewComponents(s.to_owned())),
            _ => Ok(Version { components }),
        }
    }

    /// The first component.
    pub fn major(&self) -> u64 {
        self.components[0]
    }

    fn component(&self, i: usize) -> u64 {
        self.components.get(i).copied().unwrap_or(0)
    }
}

impl PartialEq for Version {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl PartialOrd for Version {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Version {
    fn cmp(&self, other: &Self) -> Ordering {
        let n = self.components.len().max(other.components.len());
        (0..n)
            .map(|i| self.component(i).cmp(&other.component(i)))
            .find(|o| o.is_ne())
            .unwrap_or(Ordering::Equal)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, c) in self.components.iter().enumerate() {
            if i > 0 {
                f.write_str(".")?;
            }
            write!(f, "{c}")?;
        }
        Ok(())
    }
}

/// Why a supported-version list (or a re-registration) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VersionError {
    /// The driver sent no versions at all.
    #[error(
        "csi: {caller} for CSI driver {driver:?} failed. Plugin returned an empty list for supported versions"
    )]
    Empty {
        /// `ValidatePlugin` or `RegisterPlugin`.
        caller: &'static str,
        /// The driver name.
        driver: String,
    },
    /// No entry is a usable 1.x version.
    #[error(
        "csi: {caller} for CSI driver {driver:?} failed. None of the versions specified {versions:?} are supported. err={reason}"
    )]
    Unsupported {
        /// `ValidatePlugin` or `RegisterPlugin`.
        caller: &'static str,
        /// The driver name.
        driver: String,
        /// The versions as sent.
        versions: Vec<String>,
        /// Why none qualified.
        reason: String,
    },
    /// The name is registered already with the same or a higher version.
    #[error(
        "csi: {caller} for CSI driver {driver:?} failed. Another driver with the same name is already registered with a higher supported version: \"{registered}\""
    )]
    NotHigher {
        /// `ValidatePlugin` or `RegisterPlugin`.
        caller: &'static str,
        /// The driver name.
        driver: String,
        /// The highest version of the driver registered now.
        registered: Version,
    },
}

/// The highest usable version in `versions`: entries that do not parse or have a major version
/// above 1 are skipped; the maximum of the rest must be a 1.x version.
///
/// The error text is upstream's (it becomes the `err=` part of [`VersionError::Unsupported`]).
pub fn highest_supported(versions: &[String]) -> Result<Version, String> {
    let mut highest: Option<Version> = None;
    let mut last_parse_error: Option<ParseError> = None;
    // Upstream walks the list from the end; the result does not depend on the order, only which
    // parse error is reported does.
    for v in versions.iter().rev() {
        let parsed = match Version::parse_generic(v) {
            Ok(p) => p,
            Err(e) => {
                last_parse_error = Some(e);
                continue;
            }
        };
        if parsed.major() > 1 {
            continue;
        }
        if highest.as_ref().is_none_or(|h| *h < parsed) {
            highest = Some(parsed);
        }
    }
    let Some(highest) = highest else {
        let reason = last_parse_error.map_or_else(|| "<nil>".to_owned(), |e| e.to_string());
        return Err(format!(
            "could not find a highest supported version from versions ({}) reported by this driver: {reason}",
            go_list(versions)
        ));
    };
    if highest.major() != 1 {
        return Err(format!(
            "highest supported version reported by driver is {highest}, must be v1.x"
        ));
    }
    Ok(highest)
}

/// Checks a driver's versions for `caller` (`ValidatePlugin` or `RegisterPlugin`): the list is
/// not empty, its highest usable version is 1.x, and if the name is `registered` already with
/// version `r`, the new highest version is strictly greater than `r`.
pub fn check_versions(
    caller: &'static str,
    driver: &str,
    versions: &[String],
    registered: Option<&Version>,
) -> Result<Version, VersionError> {
    if versions.is_empty() {
        return Err(VersionError::Empty {
            caller,
            driver: driver.to_owned(),
        });
    }
    let highest = highest_supported(versions).map_err(|reason| VersionError::Unsupported {
        caller,
        driver: driver.to_owned(),
        versions: versions.to_vec(),
        reason,
    })?;
    if let Some(r) = registered
        && *r >= highest
    {
        return Err(VersionError::NotHigher {
            caller,
            driver: driver.to_owned(),
            registered: r.clone(),
        });
    }
    Ok(highest)
}

/// Go's `%v` of a string slice: `[a b c]`.
fn go_list(items: &[String]) -> String {
    format!("[{}]", items.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn version_table_matches_upstream() {
        let table: &[(&[&str], Option<&str>)] = &[
            (&["1.0.0"], Some("1.0.0")),
            (&["v1.2"], Some("1.2")),
            (&["0.3.0", "1.0.0"], Some("1.0.0")),
            (&["1.0.0", "0.3.0"], Some("1.0.0")),
            (&["1.0.0", "2.0.0"], Some("1.0.0")),
            (&["1.1.0-rc1", "junk"], Some("1.1.0")),
            (&[" v1.5.1 "], Some("1.5.1")),
            (&["0.3.0"], None),
            (&["2.0.0"], None),
            (&["1"], None),
            (&["v1"], None),
            (&["junk"], None),
            (&[""], None),
        ];
        for (versions, want) in table {
            let got = check_versions("ValidatePlugin", "d", &strings(versions), None);
            match want {
                Some(w) => assert_eq!(
                    got.as_ref().map(ToString::to_string).ok(),
                    Some((*w).to_owned()),
                    "{versions:?} must pass as {w}, got {got:?}"
                ),
                None => assert!(got.is_err(), "{versions:?} must fail, got {got:?}"),
            }
        }
    }

    #[test]
    fn empty_list_has_upstreams_message() {
        let err = check_versions("ValidatePlugin", "d.example.com", &[], None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "csi: ValidatePlugin for CSI driver \"d.example.com\" failed. \
             Plugin returned an empty list for supported versions"
        );
    }

    #[test]
    fn unsupported_lists_say_why() {
        let err = check_versions("RegisterPlugin", "d", &strings(&["0.3.0"]), None).unwrap_err();
        assert!(
            err.to_string()
                .ends_with("highest supported version reported by driver is 0.3.0, must be v1.x"),
            "{err}"
        );
        let err = check_versions("RegisterPlugin", "d", &strings(&["2.0.0"]), None).unwrap_err();
        assert!(
            err.to_string().contains(
                "could not find a highest supported version from versions ([2.0.0]) reported by this driver"
            ),
            "{err}"
        );
        let err = check_versions("RegisterPlugin", "d", &strings(&["1"]), None).unwrap_err();
        assert!(err.to_string().contains("illegal version string"), "{err}");
    }

    #[test]
    fn same_name_needs_a_strictly_higher_version() {
        let registered = Version::parse_generic("1.0.0").unwrap();
        for (new, ok) in [
            ("1.0.0", false),
            ("1.0", false),
            ("v1.0.0", false),
            ("0.9.0", false),
            ("1.0.1", true),
            ("1.1", true),
        ] {
            let got = check_versions("ValidatePlugin", "d", &strings(&[new]), Some(&registered));
            assert_eq!(got.is_ok(), ok, "{new} after 1.0.0: {got:?}");
        }
        let err = check_versions(
            "ValidatePlugin",
            "d",
            &strings(&["1.0.0"]),
            Some(&registered),
        )
        .unwrap_err();
        assert!(
            err.to_string().ends_with(
                "Another driver with the same name is already registered with a higher supported version: \"1.0.0\""
            ),
            "{err}"
        );
    }

    #[test]
    fn versions_compare_with_missing_components_as_zero() {
        let v = |s| Version::parse_generic(s).unwrap();
        assert_eq!(v("1.0"), v("1.0.0"));
        assert!(v("1.10") > v("1.9"));
        assert!(v("1.0.0.1") > v("1.0"));
        assert_eq!(v("v1.2.3-beta+x").to_string(), "1.2.3");
        assert!(Version::parse_generic("99999999999999999999.0").is_err());
    }
}

//! The checks of a plugin's GetInfo reply before any handler sees it (D7): every field is
//! length- and character-checked, since it came over a socket from an untrusted process.
//!
//! Standard library only, so the `plugininfo` fuzz target can include this very file.

/// Longest plugin name accepted (a DNS subdomain prefix plus a name, with room to spare).
pub const MAX_NAME_LEN: usize = 316;
/// Longest plugin type accepted.
pub const MAX_TYPE_LEN: usize = 63;
/// Longest endpoint accepted.
pub const MAX_ENDPOINT_LEN: usize = 4096;
/// Longest version string accepted.
pub const MAX_VERSION_LEN: usize = 128;
/// Most versions accepted.
pub const MAX_VERSIONS: usize = 64;
/// How many characters of an offending value a message quotes.
const QUOTED_CHARS: usize = 80;

/// Checks the fields of a GetInfo reply. The error is one line (control characters escaped) of
/// bounded length, fit to be sent back to the plugin and logged.
pub fn check_fields(
    plugin_type: &str,
    name: &str,
    endpoint: &str,
    versions: &[String],
) -> Result<(), String> {
    fn printable(s: &str) -> bool {
        s.bytes().all(|c| c.is_ascii_graphic())
    }
    if plugin_type.is_empty() {
        return Err("plugin type is empty".into());
    }
    if plugin_type.len() > MAX_TYPE_LEN || !printable(plugin_type) {
        return Err(format!(
            "plugin type {:?} is not 1-{MAX_TYPE_LEN} printable ASCII characters",
            truncated(plugin_type)
        ));
    }
    if name.is_empty() {
        return Err("plugin name is empty".into());
    }
    if name.len() > MAX_NAME_LEN || !printable(name) {
        return Err(format!(
            "plugin name {:?} is not 1-{MAX_NAME_LEN} printable ASCII characters without spaces",
            truncated(name)
        ));
    }
    if endpoint.len() > MAX_ENDPOINT_LEN || endpoint.chars().any(char::is_control) {
        return Err(format!(
            "endpoint {:?} is longer than {MAX_ENDPOINT_LEN} bytes or holds control characters",
            truncated(endpoint)
        ));
    }
    if versions.len() > MAX_VERSIONS {
        return Err(format!(
            "{} supported versions, more than {MAX_VERSIONS}",
            versions.len()
        ));
    }
    if let Some(v) = versions
        .iter()
        .find(|v| v.is_empty() || v.len() > MAX_VERSION_LEN || !printable(v))
    {
        return Err(format!(
            "version {:?} is not 1-{MAX_VERSION_LEN} printable ASCII characters",
            truncated(v)
        ));
    }
    Ok(())
}

/// At most [`QUOTED_CHARS`] characters of `s`, for messages about oversized input.
fn truncated(s: &str) -> String {
    match s.char_indices().nth(QUOTED_CHARS) {
        None => s.to_owned(),
        Some((cut, _)) => format!("{}...", &s[..cut]),
    }
}

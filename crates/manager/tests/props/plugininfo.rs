//! The property of the PluginInfo checks, shared by the `properties` test (arbtest) and the
//! `plugininfo` fuzz target (libFuzzer), which both include this file.
//!
//! The including crate provides `crate::arbitrary` (the `arbitrary` crate) and
//! `crate::info_check` (the manager's `info_check` module).

use crate::arbitrary::{Arbitrary, Result, Unstructured};
use crate::info_check::{
    MAX_ENDPOINT_LEN, MAX_NAME_LEN, MAX_TYPE_LEN, MAX_VERSION_LEN, MAX_VERSIONS, check_fields,
};

/// Longest error message the check may produce (quotes at most 80 characters, escaped).
const MAX_MESSAGE_LEN: usize = 1024;

/// One GetInfo reply's fields.
#[derive(Debug)]
pub struct Reply {
    pub plugin_type: String,
    pub name: String,
    pub endpoint: String,
    pub versions: Vec<String>,
}

/// A string that is often near a limit and often almost valid, sometimes anything at all.
fn field(u: &mut Unstructured, max: usize) -> Result<String> {
    Ok(match u.int_in_range(0u8..=4)? {
        0 => String::arbitrary(u)?,
        1 => String::new(),
        2 | 3 => {
            let len = u.int_in_range(max.saturating_sub(2)..=max + 1)?;
            let len = if u.arbitrary()? {
                len
            } else {
                u.int_in_range(1..=8)?
            };
            let mut s: String = (0..len)
                .map(|_| u.int_in_range(0x21u8..=0x7e).map(char::from))
                .collect::<Result<_>>()?;
            if u.ratio(1, 3)? && !s.is_empty() {
                let at = u.choose_index(s.len())?;
                let odd = *u.choose(&[' ', '\n', '\0', '\u{7f}', 'é', '\u{202e}', '\t'])?;
                s.replace_range(at..at + 1, odd.encode_utf8(&mut [0; 4]));
            }
            s
        }
        _ => {
            let base = *u.choose(&["CSIPlugin", "DevicePlugin", "example.com/gpu", "v1beta1"])?;
            base.to_owned()
        }
    })
}

impl<'a> Arbitrary<'a> for Reply {
    fn arbitrary(u: &mut Unstructured<'a>) -> Result<Self> {
        let plugin_type = field(u, MAX_TYPE_LEN)?;
        let name = field(u, MAX_NAME_LEN)?;
        let endpoint = field(u, MAX_ENDPOINT_LEN)?;
        let n = u.int_in_range(0..=MAX_VERSIONS + 1)?;
        let n = if u.ratio(1, 4)? { n } else { n.min(3) };
        let versions = (0..n)
            .map(|_| field(u, MAX_VERSION_LEN))
            .collect::<Result<_>>()?;
        Ok(Reply {
            plugin_type,
            name,
            endpoint,
            versions,
        })
    }
}

/// The rules, written independently of the check: what may reach a handler.
fn acceptable(r: &Reply) -> bool {
    let token = |s: &str, max: usize| {
        (1..=max).contains(&s.len()) && s.bytes().all(|b| (0x21..=0x7e).contains(&b))
    };
    token(&r.plugin_type, MAX_TYPE_LEN)
        && token(&r.name, MAX_NAME_LEN)
        && r.endpoint.len() <= MAX_ENDPOINT_LEN
        && !r.endpoint.chars().any(|c| c.is_control())
        && r.versions.len() <= MAX_VERSIONS
        && r.versions.iter().all(|v| token(v, MAX_VERSION_LEN))
}

/// The property: the check accepts exactly the acceptable replies, never panics, and explains
/// a refusal in one bounded line.
pub fn check(u: &mut Unstructured) -> Result<()> {
    let r = Reply::arbitrary(u)?;
    let got = check_fields(&r.plugin_type, &r.name, &r.endpoint, &r.versions);
    assert_eq!(got.is_ok(), acceptable(&r), "{r:?}: {got:?}");
    if let Err(msg) = got {
        assert!(!msg.is_empty());
        assert!(msg.len() <= MAX_MESSAGE_LEN, "{} bytes: {msg:?}", msg.len());
        assert!(!msg.chars().any(char::is_control), "{msg:?}");
    }
    Ok(())
}

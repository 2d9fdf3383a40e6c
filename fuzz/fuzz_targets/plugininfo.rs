//! The PluginInfo checks (a plugin's GetInfo reply, before any handler sees it): the property
//! of `crates/manager/tests/props/plugininfo.rs` on libFuzzer's input.

#![no_main]

use libfuzzer_sys::{arbitrary, fuzz_target};

#[path = "../../crates/manager/src/info_check.rs"]
#[allow(dead_code)]
mod info_check;
#[path = "../../crates/manager/tests/props/plugininfo.rs"]
mod props;

fuzz_target!(|data: &[u8]| {
    let mut u = arbitrary::Unstructured::new(data);
    let _ = props::check(&mut u);
});

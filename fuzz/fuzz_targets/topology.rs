//! The provisioner's CreateVolume accessibility requirements from allowedTopologies, bounded; the
//! checks live in the crate's tests, `crates/provisioner/tests/props/topology.rs`, which
//! `tests/props.rs` runs as a property test.
#![no_main]

use libfuzzer_sys::arbitrary;

#[path = "../../crates/provisioner/tests/props/topology.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = check::check(&mut arbitrary::Unstructured::new(data));
});

//! The provisioner's claim and PV fields from arbitrary JSON, through every reader; the checks live
//! in the crate's tests, `crates/provisioner/tests/props/claim_fields.rs`, which `tests/props.rs`
//! runs as a property test.
#![no_main]

use libfuzzer_sys::arbitrary;

#[path = "../../crates/provisioner/tests/props/claim_fields.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = check::check(&mut arbitrary::Unstructured::new(data));
});

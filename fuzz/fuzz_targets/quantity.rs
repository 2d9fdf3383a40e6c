//! The provisioner's resource quantities as byte counts (the claim's request, the PV's capacity);
//! the checks live in the crate's tests, `crates/provisioner/tests/props/quantity.rs`, which
//! `tests/props.rs` runs as a property test.
#![no_main]

use libfuzzer_sys::arbitrary;

#[path = "../../crates/provisioner/tests/props/quantity.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = check::check(&mut arbitrary::Unstructured::new(data));
});

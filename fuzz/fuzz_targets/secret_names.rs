//! The provisioner's Secret references from a StorageClass's name and namespace templates; the
//! checks live in the crate's tests, `crates/provisioner/tests/props/secret_names.rs`, which
//! `tests/props.rs` runs as a property test.
#![no_main]

use libfuzzer_sys::arbitrary;

#[path = "../../crates/provisioner/tests/props/secret_names.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = check::check(&mut arbitrary::Unstructured::new(data));
});

//! Arbitrary client bytes through the `:authority` rewriter of plugreg-transport, checked
//! against h2's own HPACK decoder; the checks are `crates/transport/tests/support/
//! authority_check.rs`, which `cargo test -p plugreg-transport --test authority_props` runs
//! as a property test.
#![no_main]

#[path = "../../crates/transport/tests/support/authority_check.rs"]
mod authority_check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = authority_check::check(data);
});

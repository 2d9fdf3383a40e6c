//! Go `flag` syntax and the flag table of csi-node-driver-registrar (`flags::parse`) and the Go
//! value parsers (`gosyntax`); the checks live in the crate's tests, where `tests/props.rs` runs
//! them as a property test.
#![no_main]

#[path = "../../crates/node-driver-registrar/tests/props/goflags.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::check(data));

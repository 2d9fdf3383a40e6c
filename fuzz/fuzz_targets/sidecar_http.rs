//! csi-node-driver-registrar's HTTP endpoint (`/healthz`, `/metrics`): arbitrary bytes as one
//! client connection to the real handler; the checks live in the crate's tests, where
//! `tests/props.rs` runs them as a property test.
#![no_main]

#[path = "../../crates/node-driver-registrar/tests/props/sidecar_http.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::check(data));

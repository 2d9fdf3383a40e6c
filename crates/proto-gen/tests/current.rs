//! The checked-in generated code (`crates/proto/src/gen`) is what the `.proto` files generate
//! now: CI runs this with `cargo test --workspace`, so a `.proto` change without regenerating
//! (or a hand edit of generated code) fails here.

#[test]
fn checked_in_code_matches_the_protos() {
    let fresh = tempfile::tempdir().unwrap();
    plugreg_proto_gen::generate(fresh.path()).unwrap();
    let diffs =
        plugreg_proto_gen::differences(&plugreg_proto_gen::gen_dir(), fresh.path()).unwrap();
    assert!(
        diffs.is_empty(),
        "crates/proto/src/gen is stale ({}): run `cargo run -p plugreg-proto-gen` and commit the result",
        diffs.join(", ")
    );
}

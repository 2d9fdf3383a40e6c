//! Property tests (arbtest) of the provisioner's parsers of what a StorageClass, a claim and a
//! PV hold: the same checks the libFuzzer targets in `fuzz/` run for longer, here briefly on
//! every `cargo test`. Each module is one target's checks (`fuzz/fuzz_targets/<name>.rs`
//! includes it with `#[path]`).

use arbtest::arbitrary;

#[path = "props/quantity.rs"]
mod quantity;

#[path = "props/secret_names.rs"]
mod secret_names;

#[path = "props/class_parameters.rs"]
mod class_parameters;

#[path = "props/topology.rs"]
mod topology;

#[path = "props/claim_fields.rs"]
mod claim_fields;

/// Each property's time in the normal suite.
const BUDGET_MS: u64 = 1_000;

#[test]
fn quantities_parse_as_apimachinery_reads_them() {
    arbtest::arbtest(quantity::check).budget_ms(BUDGET_MS);
}

#[test]
fn quantity_known_inputs() {
    for s in [
        "",
        "-",
        "+",
        ".",
        "+.",
        "-0",
        "0",
        "00",
        "0.0",
        "Ki",
        ".Ki",
        "1",
        "1.5Gi",
        "0.1Ki",
        "100m",
        "1e3",
        "1E3",
        "1e+3",
        "1e-3",
        "1e",
        "1e+",
        "e3",
        "1Ee3",
        "1KiB",
        "1K",
        "1.G",
        "5.",
        ".5",
        "9223372036854775807",
        "9223372036854775808",
        "9223372036854775807.1",
        "8Ei",
        "7.99999Ei",
        "1e18",
        "10e18",
        "1e19",
        "1e-400",
        "1e9223372036854775807",
        "1e-9223372036854775808",
        "1e9223372036854775808",
        "1e4294967296",
        "0e9223372036854775807",
        "0.0000000000000000000000000000000000001Ei",
        "18446744073709551616Ki",
    ] {
        quantity::check_str(s);
    }
}

#[test]
fn secret_name_templates_resolve_to_valid_names_or_clear_errors() {
    arbtest::arbtest(secret_names::check).budget_ms(BUDGET_MS);
}

#[test]
fn class_parameters_split_between_provisioner_and_driver() {
    arbtest::arbtest(class_parameters::check).budget_ms(BUDGET_MS);
}

#[test]
fn topology_expansion_is_bounded() {
    arbtest::arbtest(topology::check).budget_ms(BUDGET_MS);
}

#[test]
fn claim_and_pv_fields_from_any_json() {
    arbtest::arbtest(claim_fields::check).budget_ms(BUDGET_MS);
}

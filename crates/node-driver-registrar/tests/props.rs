//! Property tests (arbtest) of what the fuzz targets check (`fuzz/fuzz_targets/`): the same check
//! functions, run briefly on every `cargo test`.

#[path = "props/goflags.rs"]
mod goflags;

#[test]
fn goflags_parse_any_command_line() {
    arbtest::arbtest(|u| {
        let data: Vec<u8> = u.arbitrary()?;
        goflags::check(&data);
        Ok(())
    })
    .budget_ms(2_000);
}

#[test]
fn goflags_known_tricky_inputs() {
    for s in [
        "1.999999999999999999999999999999h",
        "0.999999999999999999999999999999999999h",
        "9223372036854775807ns",
        "-9223372036854775808ns",
        "2562047h47m16.854775807s",
        "0x8000000000000000",
        "-0x8000000000000000",
    ] {
        goflags::check_values(s);
    }
}

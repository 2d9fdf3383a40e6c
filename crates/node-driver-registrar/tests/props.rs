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

#[path = "props/sidecar_http.rs"]
mod sidecar_http;

#[test]
fn sidecar_http_answers_or_closes_on_any_bytes() {
    arbtest::arbtest(|u| {
        let data: Vec<u8> = u.arbitrary()?;
        sidecar_http::check(&data);
        Ok(())
    })
    .budget_ms(2_000);
}

#[test]
fn sidecar_http_known_requests() {
    for request in [
        &b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        b"HEAD /healthz HTTP/1.0\r\n\r\n",
        b"POST /healthz HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n",
        b"GET /metrics HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"",
        b"\r\n\r\n\r\n",
    ] {
        sidecar_http::exchange(request);
    }
}

//! The `:authority` rewriter against h2's own decoder on arbitrary input (the property-test
//! form of the `authority` fuzz target; see `support/authority_check.rs`).

#[path = "support/authority_check.rs"]
mod authority_check;

/// Valid requests, with a socket-path or host authority, to mutate from: random bytes alone
/// rarely make a header block.
/// Also says whether bytes were changed.
fn seed(
    u: &mut arbtest::arbitrary::Unstructured<'_>,
) -> arbtest::arbitrary::Result<(Vec<u8>, bool)> {
    let mut enc = loona_hpack::Encoder::new();
    let mut data = vec![u.arbitrary::<u8>()?];
    data.extend_from_slice(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
    let mut stream = 1u32;
    for _ in 0..u.int_in_range(0..=4)? {
        let authority: &[u8] = match u.int_in_range(0..=3)? {
            0 => b"/var/lib/kubelet/plugins_registry/x-reg.sock",
            1 => b"localhost",
            2 => b"",
            _ => b"example.com:8080",
        };
        let mut headers: Vec<(Vec<u8>, Vec<u8>)> = vec![
            (b":method".to_vec(), b"POST".to_vec()),
            (b":scheme".to_vec(), b"http".to_vec()),
            (
                b":path".to_vec(),
                b"/pluginregistration.Registration/GetInfo".to_vec(),
            ),
            (b":authority".to_vec(), authority.to_vec()),
            (b"content-type".to_vec(), b"application/grpc".to_vec()),
        ];
        for _ in 0..u.int_in_range(0..=3)? {
            let name: String = u.arbitrary::<String>()?.to_lowercase();
            headers.push((name.into_bytes(), u.arbitrary::<Vec<u8>>()?));
        }
        let block = enc.encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        let len = block.len();
        data.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, 0x1, 0x4]);
        data.extend_from_slice(&stream.to_be_bytes());
        data.extend_from_slice(&block);
        data.extend_from_slice(&[0, 0, 2, 0x0, 0x1]);
        data.extend_from_slice(&stream.to_be_bytes());
        data.extend_from_slice(&[0xab, 0xcd]);
        stream += 2;
    }
    // Then change a few bytes.
    let changes = u.int_in_range(0..=3)?;
    for _ in 0..changes {
        let i = u.choose_index(data.len())?;
        data[i] = u.arbitrary()?;
    }
    Ok((data, changes > 0))
}

#[test]
fn the_rewriter_agrees_with_h2_on_valid_requests_with_a_few_bytes_changed() {
    arbtest::arbtest(|u| {
        let (data, changed) = seed(u)?;
        let accepted = authority_check::check(&data);
        assert!(accepted || changed, "refused valid requests: {data:02x?}");
        Ok(())
    })
    .budget_ms(2_000);
}

#[test]
fn the_rewriter_agrees_with_h2_on_arbitrary_bytes() {
    arbtest::arbtest(|u| {
        let data: Vec<u8> = u.arbitrary()?;
        let _ = authority_check::check(&data);
        Ok(())
    })
    .budget_ms(1_000);
}

#[test]
fn the_committed_fuzz_corpus_passes() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/authority");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        let accepted = authority_check::check(&data);
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        // The hand-written seeds say what they expect.
        if name.starts_with("valid-") {
            assert!(accepted, "{name} refused");
        }
        if name.starts_with("refused-") {
            assert!(!accepted, "{name} accepted");
        }
        n += 1;
    }
    assert!(n > 0, "no seeds in {}", dir.display());
}

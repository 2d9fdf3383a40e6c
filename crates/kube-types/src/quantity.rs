//! Kubernetes resource quantities as byte counts: the claim's storage request in, the PV's
//! capacity out. k8s-openapi's `Quantity` is only the string, so both directions live here.
//!
//! Parsing follows apimachinery's `ParseQuantity` grammar (sign, digits, optional fraction,
//! then one suffix: `Ki`..`Ei`, `n` `u` `m` `""` `k` `M` `G` `T` `P` `E`, or `e<int>`/`E<int>`)
//! and `Quantity.Value()`'s rounding: the exact value rounded up to a whole byte. It works on
//! the digits, never on floats, so any length of input takes linear time and cannot overflow.

use std::fmt;

/// Why a quantity string is not a byte count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuantityError {
    /// Not the quantity grammar (apimachinery's `ErrFormatWrong` / `ErrSuffix`).
    Format,
    /// Negative (a storage request cannot be).
    Negative,
    /// More bytes than an `int64` holds.
    TooLarge,
}

impl fmt::Display for QuantityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            // apimachinery's texts for the two grammar errors.
            Self::Format => {
                "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
            }
            Self::Negative => "a negative quantity is not a size",
            Self::TooLarge => "quantity is larger than 9223372036854775807 bytes",
        })
    }
}

impl std::error::Error for QuantityError {}

enum Suffix {
    /// Times 2^(10 * n).
    Binary(u32),
    /// Times 10^n.
    Decimal(i64),
}

fn suffix(s: &str) -> Option<Suffix> {
    Some(match s {
        "Ki" => Suffix::Binary(1),
        "Mi" => Suffix::Binary(2),
        "Gi" => Suffix::Binary(3),
        "Ti" => Suffix::Binary(4),
        "Pi" => Suffix::Binary(5),
        "Ei" => Suffix::Binary(6),
        "n" => Suffix::Decimal(-9),
        "u" => Suffix::Decimal(-6),
        "m" => Suffix::Decimal(-3),
        "" => Suffix::Decimal(0),
        "k" => Suffix::Decimal(3),
        "M" => Suffix::Decimal(6),
        "G" => Suffix::Decimal(9),
        "T" => Suffix::Decimal(12),
        "P" => Suffix::Decimal(15),
        "E" => Suffix::Decimal(18),
        _ => {
            // `e3`, `E-2`, `e+7`: Go's strconv.ParseInt on the rest (sign allowed, digits only).
            let rest = s.strip_prefix(['e', 'E'])?;
            let digits = rest.strip_prefix(['+', '-']).unwrap_or(rest);
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            Suffix::Decimal(rest.parse().ok()?)
        }
    })
}

/// The number of bytes in `s`, rounded up to a whole byte (`"1Gi"` -> 2^30, `"100m"` -> 1,
/// `"1.5k"` -> 1500). Like apimachinery, an empty number reads as zero (`"Ki"`, `"."`).
pub fn parse_bytes(s: &str) -> Result<i64, QuantityError> {
    if s.is_empty() {
        return Err(QuantityError::Format);
    }
    let (negative, body) = match s.as_bytes()[0] {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    let int_len = body.bytes().take_while(u8::is_ascii_digit).count();
    let (int_part, rest) = body.split_at(int_len);
    let (frac_part, suffix_str) = match rest.strip_prefix('.') {
        Some(after) => {
            let n = after.bytes().take_while(u8::is_ascii_digit).count();
            after.split_at(n)
        }
        None => ("", rest),
    };
    let suffix = suffix(suffix_str).ok_or(QuantityError::Format)?;
    // A number without a digit is zero, except where apimachinery takes its slow path (suffixes
    // past 2^40, exponents below -9): there the number text itself must parse, and "", "+" or
    // "." do not.
    if int_part.is_empty()
        && frac_part.is_empty()
        && matches!(suffix, Suffix::Binary(5..) | Suffix::Decimal(..-9))
    {
        return Err(QuantityError::Format);
    }

    // Significant digits: leading zeros of the integer and trailing zeros of the fraction
    // change nothing.
    let int_part = int_part.trim_start_matches('0');
    let frac_part = frac_part.trim_end_matches('0');
    if int_part.is_empty() && frac_part.is_empty() {
        return Ok(0);
    }
    if negative {
        return Err(QuantityError::Negative);
    }
    match suffix {
        Suffix::Decimal(exp) => decimal(int_part, frac_part, exp),
        Suffix::Binary(n) => binary(int_part, frac_part, 10 * n),
    }
}

/// `int.frac * 10^exp`, rounded up.
fn decimal(int_part: &str, frac_part: &str, exp: i64) -> Result<i64, QuantityError> {
    // The value is D * 10^e with D the significant digits as one integer.
    let digits: String = [int_part, frac_part].concat();
    let digits = digits.trim_start_matches('0');
    let trailing = digits.len() - digits.trim_end_matches('0').len();
    let digits = digits.trim_end_matches('0');
    let e = i128::from(exp) - frac_part.len() as i128 + trailing as i128;
    // D has n digits, so 10^(n-1+e) <= value < 10^(n+e).
    let magnitude = digits.len() as i128 + e;
    if magnitude > 19 {
        return Err(QuantityError::TooLarge);
    }
    if magnitude <= 0 {
        // Below one byte but not zero.
        return Ok(1);
    }
    let whole_len = magnitude as usize;
    let value: u128 = if whole_len <= digits.len() {
        // A fraction remains exactly when digits are cut off (the last digit is not 0).
        let whole: u128 = digits[..whole_len]
            .parse()
            .map_err(|_| QuantityError::Format)?;
        whole + u128::from(whole_len < digits.len())
    } else {
        let d: u128 = digits.parse().map_err(|_| QuantityError::Format)?;
        d * 10u128.pow((whole_len - digits.len()) as u32)
    };
    i64::try_from(value).map_err(|_| QuantityError::TooLarge)
}

/// `int.frac * 2^shift`, rounded up.
fn binary(int_part: &str, frac_part: &str, shift: u32) -> Result<i64, QuantityError> {
    if int_part.len() > 19 {
        return Err(QuantityError::TooLarge);
    }
    let whole: u128 = if int_part.is_empty() {
        0
    } else {
        int_part.parse().map_err(|_| QuantityError::Format)?
    };
    // 0.frac * 2^shift, digit by digit from the right: carry < 2^shift, and the digits left
    // behind are the fraction of the product.
    let factor = 1u128 << shift;
    let mut carry: u128 = 0;
    let mut remainder = false;
    for d in frac_part.bytes().rev() {
        let t = u128::from(d - b'0') * factor + carry;
        remainder |= !t.is_multiple_of(10);
        carry = t / 10;
    }
    let value = (whole << shift) + carry + u128::from(remainder);
    i64::try_from(value).map_err(|_| QuantityError::TooLarge)
}

/// `n` bytes as apimachinery prints `NewQuantity(n, BinarySI)`: below 1024 in decimal SI
/// (`"0"`, `"500"`, `"1k"`), otherwise the largest power of 1024 that divides it exactly
/// (`"1Gi"`, `"1536Mi"`, `"1500"`). Either form parses back to exactly `n`.
pub fn format_binary_si(n: i64) -> String {
    let abs = n.unsigned_abs();
    let sign = if n < 0 { "-" } else { "" };
    if abs < 1024 {
        // Canonical decimal SI: the exponent is a multiple of three; only 1000 has a factor.
        return if abs == 1000 {
            format!("{sign}1k")
        } else {
            n.to_string()
        };
    }
    const SUFFIXES: [&str; 7] = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    let mut mantissa = abs;
    let mut power = 0;
    while power < 6 && mantissa.is_multiple_of(1024) {
        mantissa /= 1024;
        power += 1;
    }
    format!("{sign}{mantissa}{}", SUFFIXES[power])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_suffix_rounding_up() {
        let ok: &[(&str, i64)] = &[
            ("0", 0),
            ("1", 1),
            ("+7", 7),
            ("-0", 0),
            ("1Ki", 1024),
            ("1Mi", 1 << 20),
            ("1Gi", 1 << 30),
            ("1Ti", 1 << 40),
            ("1Pi", 1 << 50),
            ("1Ei", 1 << 60),
            ("1.5Gi", 3 << 29),
            ("0.1Ki", 103), // 102.4 -> 103
            ("1k", 1000),
            ("500M", 500_000_000),
            ("1G", 1_000_000_000),
            ("1T", 1_000_000_000_000),
            ("1P", 1_000_000_000_000_000),
            ("1E", 1_000_000_000_000_000_000),
            ("1.5k", 1500),
            ("1.0001k", 1001), // 1000.1 -> 1001
            ("100m", 1),
            ("1500m", 2),
            ("2000m", 2),
            ("1n", 1),
            ("1u", 1),
            ("1e3", 1000),
            ("1E3", 1000),
            ("1e+3", 1000),
            ("1e-3", 1),
            ("12e-1", 2),
            ("5.", 5),
            (".5", 1),
            ("007", 7),
            ("1.G", 1_000_000_000),
            ("Ki", 0), // apimachinery reads an empty number as zero
            ("+.Ti", 0),
            ("-n", 0),
            (".e-9", 0),
            ("0e-10", 0),
            ("0.Ei", 0),
            ("0.000Gi", 0),
            ("9223372036854775807", i64::MAX),
            ("7Ei", 7 << 60),
            ("0.0000000000000000000000000000001Ki", 1),
        ];
        for (s, want) in ok {
            assert_eq!(parse_bytes(s), Ok(*want), "{s:?}");
        }
    }

    #[test]
    fn rejects_bad_grammar_negatives_and_overflow() {
        for bad in [
            "", "1KiB", "1 Gi", "1e", "e", "1ee3", "1x", "1..5", "1Gi1", "0x10", "1e3.5",
            // No digit where apimachinery must parse the number text (checked against its
            // ParseQuantity): Pi and Ei, exponents below -9.
            "Ei", "+Pi", ".Ei", "-.Pi", "e-10", "+.e-20",
        ] {
            assert_eq!(parse_bytes(bad), Err(QuantityError::Format), "{bad:?}");
        }
        for neg in ["-1", "-1Gi", "-0.5"] {
            assert_eq!(parse_bytes(neg), Err(QuantityError::Negative), "{neg:?}");
        }
        for big in [
            "9223372036854775808",
            "8Ei",
            "10E",
            "1e19",
            "1e99999999999999999",
            "99999999999999999999Ki",
        ] {
            assert_eq!(parse_bytes(big), Err(QuantityError::TooLarge), "{big:?}");
        }
        // An exponent that does not fit an int64 is a suffix error, as in Go.
        assert_eq!(
            parse_bytes("1e99999999999999999999"),
            Err(QuantityError::Format)
        );
    }

    #[test]
    fn formats_like_new_quantity_binary_si() {
        let cases: &[(i64, &str)] = &[
            (0, "0"),
            (1, "1"),
            (500, "500"),
            (1000, "1k"),
            (1023, "1023"),
            (1024, "1Ki"),
            (1500, "1500"),
            (1 << 30, "1Gi"),
            (3 << 29, "1536Mi"),
            (1_000_000_000, "1000000000"),
            (1 << 62, "4Ei"),
            (i64::MAX, "9223372036854775807"),
        ];
        for (n, want) in cases {
            assert_eq!(format_binary_si(*n), *want, "{n}");
            assert_eq!(parse_bytes(want), Ok(*n), "{want} parses back");
        }
    }

    /// Against exact rational arithmetic on small numbers: `ceil((I * 10^f + F) * base / 10^f)`.
    #[test]
    fn parsing_matches_exact_arithmetic() {
        const SUFFIXES: &[(&str, u128, u128)] = &[
            // (suffix, multiplier, divisor)
            ("n", 1, 1_000_000_000),
            ("u", 1, 1_000_000),
            ("m", 1, 1_000),
            ("", 1, 1),
            ("k", 1_000, 1),
            ("M", 1_000_000, 1),
            ("G", 1_000_000_000, 1),
            ("T", 1_000_000_000_000, 1),
            ("Ki", 1 << 10, 1),
            ("Mi", 1 << 20, 1),
            ("Gi", 1 << 30, 1),
            ("Ti", 1 << 40, 1),
            ("Pi", 1 << 50, 1),
            ("e-2", 1, 100),
            ("e5", 100_000, 1),
        ];
        arbtest::arbtest(|u| {
            let int: u128 = u.int_in_range(0..=999_999)?;
            let frac_digits: u32 = u.int_in_range(0..=6)?;
            let frac: u128 = u.int_in_range(0..=10u128.pow(frac_digits) - 1)?;
            let &(suffix, mul, div) = u.choose(SUFFIXES)?;
            let text = if frac_digits == 0 {
                format!("{int}{suffix}")
            } else {
                format!("{int}.{frac:0width$}{suffix}", width = frac_digits as usize)
            };
            let num = (int * 10u128.pow(frac_digits) + frac) * mul;
            let den = 10u128.pow(frac_digits) * div;
            let want = i64::try_from(num.div_ceil(den)).map_err(|_| QuantityError::TooLarge);
            assert_eq!(parse_bytes(&text), want, "{text}");
            Ok(())
        });
    }

    #[test]
    fn parsing_never_panics_and_formatting_round_trips() {
        arbtest::arbtest(|u| {
            // Bias towards the quantity alphabet so the deep paths are reached.
            const ALPHABET: &[u8] = b"0123456789.+-eEinumkKMGTP ";
            let len = u.int_in_range(0..=40)?;
            let mut s = String::with_capacity(len);
            for _ in 0..len {
                s.push(*u.choose(ALPHABET)? as char);
            }
            let _ = parse_bytes(&s);
            let raw: String = u.arbitrary()?;
            let _ = parse_bytes(&raw);
            let n: i64 = u.int_in_range(0..=i64::MAX)?;
            assert_eq!(parse_bytes(&format_binary_si(n)), Ok(n));
            Ok(())
        });
    }

    /// The real kube-apiserver re-prints every quantity in canonical form, exactly; our parser
    /// must read the same number of bytes from what was sent and from what came back (for odd
    /// spellings, fractions of a byte and a sample of generated ones).
    async fn api_server_reads_the_same_sizes(version: plugreg_testpeers::KubeVersion) {
        use k8s_openapi::api::core::v1::{
            CSIPersistentVolumeSource, PersistentVolume, PersistentVolumeSpec,
        };
        use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
        use kube::api::{Api, PostParams};
        let server = plugreg_testpeers::ApiServer::shared(version)
            .await
            .expect("start kube-apiserver");
        let pvs: Api<PersistentVolume> = Api::all(server.client().await.expect("client"));
        let mut inputs: Vec<String> = [
            "1.5Gi",
            "0.5Ki",
            "0.1Ki",
            "3.14159Mi",
            "1e3",
            "1E3",
            "1e+3",
            "1e-3",
            "12e-1",
            "2.5e2",
            "100m",
            "1500m",
            "1.0001k",
            ".5",
            "5.",
            "007",
            "1.G",
            "+7",
            "1n",
            "999999999999n",
            "1.5",
            "123456789.123456789",
            "1000000",
            "1048576Ki",
            "7Ei",
            "9223372036854775807",
            "0.000000001Ki",
            "1u",
            "4096m",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        // A fixed sample of generated spellings (a small LCG: reproducible without a seed).
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |m: u64| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (x >> 33) % m
        };
        const SUFFIXES: [&str; 15] = [
            "", "n", "u", "m", "k", "M", "G", "T", "Ki", "Mi", "Gi", "Ti", "e2", "e-4", "E6",
        ];
        for _ in 0..60 {
            let int = next(1_000_000);
            let frac_len = next(5) as usize;
            let frac: String = (0..frac_len)
                .map(|_| char::from(b'0' + next(10) as u8))
                .collect();
            let suffix = SUFFIXES[next(SUFFIXES.len() as u64) as usize];
            inputs.push(if frac.is_empty() {
                format!("{}{suffix}", int + 1)
            } else {
                format!("{int}.{frac}{suffix}")
            });
        }
        let v = match version {
            plugreg_testpeers::KubeVersion::V1_20_2 => "q20",
            plugreg_testpeers::KubeVersion::V1_36_2 => "q36",
        };
        for (i, input) in inputs.iter().enumerate() {
            let ours = parse_bytes(input).unwrap_or_else(|e| panic!("{input}: {e}"));
            if ours == 0 {
                continue; // a PV needs a positive size
            }
            let pv = PersistentVolume {
                metadata: ObjectMeta {
                    name: Some(format!("{v}-{i}")),
                    ..Default::default()
                },
                spec: Some(PersistentVolumeSpec {
                    access_modes: Some(vec!["ReadWriteOnce".into()]),
                    capacity: Some(
                        [("storage".to_owned(), Quantity(input.clone()))]
                            .into_iter()
                            .collect(),
                    ),
                    csi: Some(CSIPersistentVolumeSource {
                        driver: "csi.example.com".into(),
                        volume_handle: format!("h{i}"),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                status: None,
            };
            let got = pvs
                .create(&PostParams::default(), &pv)
                .await
                .unwrap_or_else(|e| panic!("{version:?}, {input}: {e}"));
            let printed = &got.spec.unwrap().capacity.unwrap()["storage"].0;
            assert_eq!(
                parse_bytes(printed),
                Ok(ours),
                "{input} came back as {printed}"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kube_apiserver_v1_20_reads_the_same_sizes() {
        api_server_reads_the_same_sizes(plugreg_testpeers::KubeVersion::V1_20_2).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kube_apiserver_v1_36_reads_the_same_sizes() {
        api_server_reads_the_same_sizes(plugreg_testpeers::KubeVersion::V1_36_2).await;
    }
}

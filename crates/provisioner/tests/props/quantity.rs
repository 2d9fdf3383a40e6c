//! The checks behind the `quantity` fuzz target and its property test: Kubernetes resource
//! quantities as byte counts (`plugreg_provisioner::quantity`), the claim's storage request in
//! and the PV's capacity out.
//!
//! Shared by `tests/props.rs` (arbtest, in the normal suite) and `fuzz/fuzz_targets/quantity.rs`
//! (libFuzzer), which include this file with `#[path]`; the including crate provides
//! `crate::arbitrary` (the `arbitrary` crate).
//!
//! The oracle is written apart from the parser: apimachinery's `parseQuantityString`, suffix
//! table and slow path decide what is accepted, and the value is computed with exact big-number
//! arithmetic. It was checked once against apimachinery's own `ParseQuantity` and `Value()` on
//! 174,627 generated strings: the same strings accepted, and the same value wherever Go's fits
//! an `int64`. The known differences are on purpose: Go keeps only the low 32 bits of an
//! `e<int>` exponent (`1e4294967296` is 1 there), here the exponent is taken as written; past
//! `int64` Go's `Value()` returns 0 or a wrapped number (`10E` asks for 0 bytes), here it is
//! `TooLarge`; negative sizes are refused.

use crate::arbitrary::{Result, Unstructured};
use plugreg_provisioner::quantity::{QuantityError, format_binary_si, parse_bytes};

/// The suffixes apimachinery's tables know, and a few it does not.
const SUFFIXES: &[&str] = &[
    "",
    "n",
    "u",
    "m",
    "k",
    "M",
    "G",
    "T",
    "P",
    "E",
    "Ki",
    "Mi",
    "Gi",
    "Ti",
    "Pi",
    "Ei",
    "K",
    "e",
    "E3",
    "e-3",
    "e+18",
    "e19",
    "e-9",
    "e-10",
    "E0",
    "e9223372036854775807",
    "e-9223372036854775808",
    "e9223372036854775808",
    "e2147483648",
    "e4294967296",
    "KiB",
    "i",
    "mi",
    "Ee3",
    "e3e",
    "e+",
    "e-",
    "+3",
    " ",
    "Gi ",
    "\u{0}",
];

/// A digit run: often empty or short, sometimes long, with zeros favoured at the ends.
fn digits(u: &mut Unstructured, max: usize) -> Result<String> {
    let len = match u.int_in_range(0u8..=9)? {
        0 => 0,
        1..=6 => u.int_in_range(1..=4)?,
        7 | 8 => u.int_in_range(5..=24)?,
        _ => u.int_in_range(0..=max)?,
    };
    (0..len)
        .map(|_| {
            Ok(if u.ratio(1, 3)? {
                '0'
            } else {
                char::from(b'0' + u.int_in_range(0..=9)?)
            })
        })
        .collect()
}

/// A string in or near the quantity grammar, or anything at all.
pub fn input(u: &mut Unstructured) -> Result<String> {
    if u.ratio(1, 8)? {
        return u.arbitrary();
    }
    let mut s = String::new();
    match u.int_in_range(0u8..=5)? {
        0 => s.push('-'),
        1 => s.push('+'),
        _ => {}
    }
    s.push_str(&digits(u, 400)?);
    if u.ratio(1, 2)? {
        s.push('.');
        s.push_str(&digits(u, 400)?);
    }
    if u.ratio(1, 8)? {
        // An exponent of any size.
        s.push(*u.choose(&['e', 'E'])?);
        let e: i64 = u.arbitrary()?;
        s.push_str(&if u.ratio(1, 2)? {
            (e % 60).to_string()
        } else {
            e.to_string()
        });
    } else {
        s.push_str(u.choose(SUFFIXES)?);
    }
    if u.ratio(1, 16)? {
        // One stray byte of the grammar's alphabet somewhere.
        let at = u.int_in_range(0..=s.len())?;
        if s.is_char_boundary(at) {
            s.insert(at, *u.choose(&['.', '-', '+', 'e', 'i', '0', 'x'])?);
        }
    }
    Ok(s)
}

/// Go's `strconv.ParseInt(s, 10, 64)` succeeds.
fn go_parse_int(s: &str) -> Option<i64> {
    let digits = s.strip_prefix(['+', '-']).unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// The suffix as apimachinery's `quantitySuffixer.interpret` reads it: (base, exponent).
fn go_suffix(s: &str) -> Option<(u32, i64)> {
    let decimal = ["n", "u", "m", "", "k", "M", "G", "T", "P", "E"];
    let exps = [-9, -6, -3, 0, 3, 6, 9, 12, 15, 18];
    if let Some(i) = decimal.iter().position(|d| *d == s) {
        return Some((10, exps[i]));
    }
    let binary = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    if let Some(i) = binary.iter().position(|b| *b == s) {
        return Some((2, 10 * (i as i64 + 1)));
    }
    if s.len() > 1 && (s.starts_with('e') || s.starts_with('E')) {
        return Some((10, go_parse_int(&s[1..])?));
    }
    None
}

/// A quantity as apimachinery's `parseQuantityString` splits it, then with its suffix read:
/// (negative, integer digits, fraction digits, base, exponent), or `None` where Go errs.
fn go_parse(s: &str) -> Option<(bool, &str, &str, u32, i64)> {
    let b = s.as_bytes();
    if b.is_empty() {
        return None;
    }
    let negative = b[0] == b'-';
    let mut i = usize::from(b[0] == b'-' || b[0] == b'+');
    let int_start = i;
    while i < b.len() && b[i].is_ascii_digit() {
        i += 1;
    }
    let int = &s[int_start..i];
    let mut frac = "";
    if i < b.len() && b[i] == b'.' {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        frac = &s[start..i];
    }
    let suffix_start = i;
    while i < b.len() && b"eEinumkKMGTP".contains(&b[i]) {
        i += 1;
    }
    if i < b.len() && (b[i] == b'+' || b[i] == b'-') {
        i += 1;
    }
    while i < b.len() && b[i].is_ascii_digit() {
        i += 1;
    }
    if i < b.len() {
        return None;
    }
    let (base, exp) = go_suffix(&s[suffix_start..])?;
    Some((negative, int, frac, base, exp))
}

/// A non-negative big integer, base 10^9, least significant limb first.
#[derive(Debug, Clone)]
struct Big(Vec<u64>);

const LIMB: u64 = 1_000_000_000;

impl Big {
    fn from_digits(d: &str) -> Big {
        let mut big = Big(Vec::new());
        for c in d.bytes() {
            big.mul_add(10, u64::from(c - b'0'));
        }
        big
    }

    fn mul_add(&mut self, m: u64, mut carry: u64) {
        for limb in &mut self.0 {
            let t = *limb * m + carry;
            *limb = t % LIMB;
            carry = t / LIMB;
        }
        while carry > 0 {
            self.0.push(carry % LIMB);
            carry /= LIMB;
        }
    }

    /// Divides in place; whether a remainder was left.
    fn div(&mut self, d: u64) -> bool {
        let mut rem = 0;
        for limb in self.0.iter_mut().rev() {
            let t = rem * LIMB + *limb;
            *limb = t / d;
            rem = t % d;
        }
        while self.0.last() == Some(&0) {
            self.0.pop();
        }
        rem != 0
    }

    fn is_zero(&self) -> bool {
        self.0.iter().all(|l| *l == 0)
    }

    fn to_i64(&self) -> Option<i64> {
        let mut v: i128 = 0;
        for limb in self.0.iter().rev() {
            v = v.checked_mul(i128::from(LIMB))? + i128::from(*limb);
            if v > i128::from(i64::MAX) {
                return None;
            }
        }
        i64::try_from(v).ok()
    }
}

/// The exact value of `int.frac * base^exp`, rounded up to a whole byte.
fn exact(int: &str, frac: &str, base: u32, exp: i64) -> std::result::Result<i64, QuantityError> {
    let mut n = Big::from_digits(&[int, frac].concat());
    if n.is_zero() {
        return Ok(0);
    }
    // The decimal exponent left to apply, after the binary factor (2^10 to 2^60).
    let mut e10 = -(frac.len() as i128);
    if base == 2 {
        for _ in 0..exp / 10 {
            n.mul_add(1024, 0);
        }
    } else {
        e10 += i128::from(exp);
    }
    // n < 10^significant.
    let significant = n.0.len() as i128 * 9;
    if e10 > 19 {
        // At least 10^20.
        return Err(QuantityError::TooLarge);
    }
    if e10 < -(significant + 20) {
        // Below one, above zero.
        return Ok(1);
    }
    let mut remainder = false;
    for _ in 0..e10.max(0) {
        n.mul_add(10, 0);
    }
    let mut down = (-e10).max(0);
    while down > 0 {
        let step = down.min(9) as u32;
        remainder |= n.div(10u64.pow(step));
        down -= i128::from(step);
    }
    let v = n.to_i64().ok_or(QuantityError::TooLarge)?;
    if remainder {
        v.checked_add(1).ok_or(QuantityError::TooLarge)
    } else {
        Ok(v)
    }
}

/// What the parser must answer for `s`.
fn expected(s: &str) -> std::result::Result<i64, QuantityError> {
    let Some((negative, int, frac, base, exp)) = go_parse(s) else {
        return Err(QuantityError::Format);
    };
    // No digit at all: Go's fast path reads zero; its slow path (taken for Pi, Ei and
    // exponents below -9) parses the number text with inf.Dec, which refuses "", "+" and ".".
    let fast = if base == 2 {
        13 - exp * 3 / 10 >= 0
    } else {
        exp >= -9
    };
    if int.is_empty() && frac.is_empty() && !fast {
        return Err(QuantityError::Format);
    }
    let zero = int.bytes().chain(frac.bytes()).all(|b| b == b'0');
    if zero {
        return Ok(0);
    }
    if negative {
        return Err(QuantityError::Negative);
    }
    exact(int, frac, base, exp)
}

/// The property on one string: accepted exactly when apimachinery accepts it, the exact value
/// rounded up, an error that is one short line, and any byte count printed so that it reads
/// back as itself.
pub fn check_str(s: &str) {
    let got = parse_bytes(s);
    assert_eq!(got, expected(s), "{s:?}");
    match got {
        Ok(n) => {
            assert!(n >= 0);
            let printed = format_binary_si(n);
            assert_eq!(parse_bytes(&printed), Ok(n), "{s:?} -> {n} -> {printed}");
        }
        Err(e) => {
            let text = e.to_string();
            assert!(!text.is_empty() && text.len() < 200 && !text.contains('\n'));
        }
    }
}

/// The property on arbitrary input: a generated string, and an arbitrary byte count printed and
/// read back.
pub fn check(u: &mut Unstructured) -> Result<()> {
    let s = input(u)?;
    check_str(&s);
    let n: i64 = u.arbitrary()?;
    let n = n.checked_abs().unwrap_or(i64::MAX);
    assert_eq!(parse_bytes(&format_binary_si(n)), Ok(n), "{n}");
    Ok(())
}

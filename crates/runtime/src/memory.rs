//! Giving freed heap memory back to the kernel, for long-running daemons.
//!
//! glibc's malloc keeps the pages of freed memory inside its arenas: after a peak of work
//! (64 registrations in flight, a large `/plugins` answer) the process's RSS stays at the peak's
//! level even though the live heap is back to its usual size. Measured on `plugreg manager`
//! in the churn soak (`BENCHMARKS.md`): the live heap stayed between 3.8 and 5.4 MB for 250,000
//! cycles while malloc's arenas grew from 7.5 to 9.3 MB, and RSS by as much; a `malloc_trim(0)`
//! at that point gave 1.7 MiB back at once. [`trim_every`] calls it periodically, so RSS
//! follows the live heap instead of the highest peak so far.
//!
//! On other C libraries (musl returns freed memory by itself) this does nothing.
//!
//! [`release_code`] does the same for code: the kernel maps a binary's code in blocks of 64 KiB
//! or more around each page first run, so start-up alone (kubeconfig parsing, TLS set-up,
//! flag parsing) leaves most of a 16 MB binary resident for good. Dropping the process's
//! mappings of its code pages (the page cache keeps them) lets RSS follow the code that still
//! runs; a page run again is mapped again by a minor fault, from the page cache.

use std::time::Duration;

/// Gives the free pages of every malloc arena back to the kernel now. A no-op where the C
/// library is not glibc.
///
/// The workspace denies `unsafe_code`; this is its one allowed use: a foreign call with no
/// arguments to check, justified below.
#[allow(unsafe_code)]
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` takes no pointers and only walks malloc's own free lists under
    // malloc's locks; glibc documents it as thread-safe (MT-Safe), so calling it while other
    // threads allocate is sound.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Drops this process's mappings of the pages of its read-only code mappings (`r-xp` file
/// mappings: the executable's and the shared libraries' code) that hold no private copy of a
/// page, so the code pages count in RSS again only once they run again. Returns the bytes of
/// the mappings released. A no-op (`Ok(0)`) off Linux.
///
/// Sound because such a mapping is never written: without write permission and without a
/// private (anonymous) page, every page of it equals the file's page, which a later fault maps
/// again unchanged.
#[allow(unsafe_code)]
pub fn release_code() -> std::io::Result<usize> {
    #[cfg(target_os = "linux")]
    {
        let smaps = std::fs::read_to_string("/proc/self/smaps")?;
        let mut released = 0;
        for (start, end) in code_mappings(&smaps) {
            // SAFETY: `start..end` is a whole mapping of this process that
            // `code_mappings` found read-only, executable, private, file-backed and without
            // a single anonymous (privately modified) page: MADV_DONTNEED only removes the
            // page-table entries, and the next access maps the same bytes from the page
            // cache. No Rust object lives in it, so no reference is invalidated.
            let rc = unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED)
            };
            if rc == 0 {
                released += end - start;
            }
        }
        Ok(released)
    }
    #[cfg(not(target_os = "linux"))]
    Ok(0)
}

/// The `(start, end)` of each `r-xp` file mapping in `smaps` (`/proc/self/smaps`) whose
/// `Anonymous:` is 0 kB.
fn code_mappings(smaps: &str) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut current: Option<(usize, usize)> = None;
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let first = fields.next().unwrap_or_default();
        if let Some((a, b)) = first.split_once('-')
            && !first.ends_with(':')
        {
            let perms = fields.next();
            let path = fields.nth(3);
            current = match (
                usize::from_str_radix(a, 16),
                usize::from_str_radix(b, 16),
                perms,
                path,
            ) {
                (Ok(a), Ok(b), Some("r-xp"), Some(p)) if p.starts_with('/') && a < b => {
                    Some((a, b))
                }
                _ => None,
            };
        } else if first == "Anonymous:"
            && let Some(range) = current.take()
            && fields.next() == Some("0")
        {
            out.push(range);
        }
    }
    out
}

/// Calls [`trim`] every `period` until the returned future is dropped (or its task aborted).
/// A trim walks the free lists of a few MiB of heap: well under a millisecond here, so a
/// period of seconds costs nothing measurable.
pub async fn trim_every(period: Duration) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick fires at once; there is nothing to give back at start-up.
    tick.tick().await;
    loop {
        tick.tick().await;
        trim();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_unmodified_private_code_mappings_are_released() {
        let smaps = "\
55d0a0000000-55d0a0100000 r--p 00000000 08:01 42 /usr/bin/x
Rss:                 400 kB
Anonymous:             0 kB
55d0a0100000-55d0a0900000 r-xp 00100000 08:01 42 /usr/bin/x
Rss:                8000 kB
Anonymous:             0 kB
55d0a0900000-55d0a0a00000 r-xp 00900000 08:01 42 /usr/bin/x
Rss:                  64 kB
Anonymous:             4 kB
55d0a0a00000-55d0a0b00000 rw-p 00a00000 08:01 42 /usr/bin/x
Anonymous:            12 kB
7f0000000000-7f0000100000 r-xs 00000000 08:01 43 /usr/lib/shared
Anonymous:             0 kB
7ffd00000000-7ffd00002000 r-xp 00000000 00:00 0 [vdso]
Anonymous:             0 kB
7f1000000000-7f1000200000 r-xp 00028000 08:01 44 /usr/lib/x86_64-linux-gnu/libc.so.6
Anonymous:             0 kB
";
        assert_eq!(
            code_mappings(smaps),
            vec![
                (0x55d0a0100000, 0x55d0a0900000),
                (0x7f1000000000, 0x7f1000200000)
            ]
        );
    }

    #[test]
    fn code_still_runs_after_its_pages_are_released() {
        let released = release_code().unwrap();
        assert!(released > 0, "no code mapping found");
        // Code of this binary and of libc, run again after the release.
        let v: Vec<String> = (0..1000u32).map(|i| format!("{i:x}")).collect();
        assert_eq!(v[255], "ff");
        assert_eq!(
            v.iter().map(String::len).sum::<usize>(),
            16 + 240 * 2 + 744 * 3
        );
        trim();
    }

    #[test]
    fn a_trim_after_freeing_a_peak_keeps_the_heap_usable() {
        // What can be asserted without reading RSS (which the soak measures): trimming never
        // disturbs live allocations.
        let keep: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 4096]).collect();
        let peak: Vec<Vec<u8>> = (0..4096).map(|_| vec![0xAB; 1024]).collect();
        drop(peak);
        trim();
        for (i, v) in keep.iter().enumerate() {
            assert!(v.iter().all(|&b| b == i as u8));
        }
        let again: Vec<u8> = vec![7; 1 << 20];
        assert_eq!(again.iter().map(|&b| b as u64).sum::<u64>(), 7 << 20);
    }
}

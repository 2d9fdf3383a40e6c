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

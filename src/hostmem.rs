//! The host allocator's settings for a long-running process (`tensorfold serve`).
//!
//! glibc's malloc maps blocks of at least its mmap threshold on their own and unmaps them when
//! freed, but it raises that threshold to the size of every mapped block freed (up to 32 MiB).
//! After the first sequences of a server end, their states' arrays (KV caches, recurrent
//! states, snapshot copies: 128 KiB to megabytes each) then come from the heap, which keeps
//! what they free resident at the high-water mark of everything that ran at once
//! (bench/results/2026-12-03-cpu-soak.md). [`fix_map_threshold`] keeps the threshold where it
//! starts. The step path allocates no such block (the engine, the runtime and the CPU backend
//! reuse their per-step buffers, and the CPU backend its freed slots' recurrent states), so
//! mapping them costs the page faults of new states' memory only.

/// The fixed mmap threshold, bytes: glibc's initial one.
pub const MAP_THRESHOLD: usize = 128 << 10;

/// Fixes glibc's mmap threshold at [`MAP_THRESHOLD`] (`mallopt(M_MMAP_THRESHOLD)`, which also
/// stops the trim threshold from moving): blocks that large are then always their own mappings,
/// given back to the system when freed. Call it at the start of the process, before its
/// threads allocate. Returns whether it set it: not off glibc, nor when `GLIBC_TUNABLES` sets
/// `glibc.malloc.mmap_threshold` (that choice stands).
pub fn fix_map_threshold() -> bool {
    if std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("mmap_threshold")) {
        return false;
    }
    set_map_threshold()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_map_threshold() -> bool {
    use std::ffi::c_int;
    extern "C" {
        fn mallopt(param: c_int, value: c_int) -> c_int;
    }
    const M_MMAP_THRESHOLD: c_int = -3;
    // SAFETY: mallopt only sets malloc's parameters (under the main arena's lock); returns 1 on
    // success.
    unsafe { mallopt(M_MMAP_THRESHOLD, MAP_THRESHOLD as c_int) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_map_threshold() -> bool {
    false
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_threshold_is_fixed_on_glibc_unless_the_tunables_set_it() {
        let tunables = std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("mmap_threshold"));
        assert_eq!(super::fix_map_threshold(), cfg!(all(target_os = "linux", target_env = "gnu")) && !tunables);
    }
}

//! What this machine can do at best, measured with the backend's own threads: the memory copy
//! bandwidth and the float32 FMA peak. `tensorfold bench` reports its phases against these.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use super::pool::ThreadPool;
use super::simd::Isa;

/// Bytes of each of the two buffers of the copy: far larger than any cache, so the copy
/// measures memory.
pub const COPY_BUFFER_BYTES: usize = 512 << 20;

/// Memory bandwidth in bytes per second: `(bytes read + bytes written) / time` of copying a
/// [`COPY_BUFFER_BYTES`] buffer into another with every thread of `pool`, each thread a
/// contiguous slice with the C library's `memcpy`. Both buffers are written once first (no
/// page faults in the timing). Returns each of `repeats` copies' figure.
pub fn copy_bandwidth(pool: &ThreadPool, repeats: usize) -> Vec<f64> {
    let n = COPY_BUFFER_BYTES;
    let src: Vec<u8> = (0..n).map(|i| (i as u8).wrapping_mul(31)).collect();
    let mut dst = vec![1u8; n];
    let threads = pool.threads();
    let (sp, dp) = (src.as_ptr() as usize, dst.as_mut_ptr() as usize);
    let copy = || {
        pool.run(threads, &|i| {
            let (a, b) = (n * i / threads, n * (i + 1) / threads);
            // SAFETY: task i copies bytes a..b, disjoint from every other task's; both buffers
            // hold n bytes and outlive the region.
            unsafe { std::ptr::copy_nonoverlapping((sp + a) as *const u8, (dp + a) as *mut u8, b - a) };
        });
    };
    let out = timed_passes(repeats, 2.0 * n as f64, copy);
    std::hint::black_box(&dst);
    out
}

/// Memory read bandwidth in bytes per second: bytes read / time of summing a
/// [`COPY_BUFFER_BYTES`] buffer (as 64-bit words, eight independent sums) with every thread of
/// `pool`, each thread a contiguous slice. Not what the bench's percentages are taken of (that is
/// [`copy_bandwidth`], the definition), but the ceiling of a phase that mostly reads, as
/// decode does: on some machines reading alone streams slower than a copy's reads and writes
/// together. Returns each of `repeats` passes' figure.
pub fn read_bandwidth(pool: &ThreadPool, repeats: usize) -> Vec<f64> {
    let words: Vec<u64> = (0..COPY_BUFFER_BYTES / 8).map(|i| (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
    let threads = pool.threads();
    let sums: Vec<AtomicUsize> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
    let read = || {
        pool.run(threads, &|i| {
            let (a, b) = (words.len() * i / threads, words.len() * (i + 1) / threads);
            let mut acc = [0u64; 8];
            let chunks = words[a..b].chunks_exact(8);
            let tail: u64 = chunks.remainder().iter().fold(0, |s, &w| s.wrapping_add(w));
            for c in chunks {
                for k in 0..8 {
                    acc[k] = acc[k].wrapping_add(c[k]);
                }
            }
            let total = acc.iter().fold(tail, |s, &w| s.wrapping_add(w));
            sums[i].store(total as usize, Ordering::Relaxed);
        });
    };
    let out = timed_passes(repeats, COPY_BUFFER_BYTES as f64, read);
    std::hint::black_box(&sums);
    out
}

/// Runs `pass` once untimed (page faults, caches), then `repeats` times: `bytes` per second of
/// each timed pass.
fn timed_passes(repeats: usize, bytes: f64, pass: impl Fn()) -> Vec<f64> {
    pass();
    (0..repeats)
        .map(|_| {
            let t = Instant::now();
            pass();
            bytes / t.elapsed().as_secs_f64()
        })
        .collect()
}

/// Independent FMA chains per thread in the peak loop: more than the FMA latency times the
/// number of FMA ports, so the loop is bound by FMA throughput.
const CHAINS: usize = 12;

/// The float32 FMA peak in FLOP/s (an FMA counts 2): every thread of `pool` at once runs
/// [`CHAINS`] independent chains of `acc = fma(acc, m, c)` on the widest vectors of `isa`
/// (16 lanes for AVX-512, 8 for AVX2, scalar for the portable path) for `iters` steps. A spin
/// barrier makes every task start on its own thread.
pub fn fma_peak(isa: Isa, pool: &ThreadPool, iters: usize) -> f64 {
    let threads = pool.threads();
    let started = AtomicUsize::new(0);
    let t = Instant::now();
    pool.run(threads, &|_| {
        started.fetch_add(1, Ordering::AcqRel);
        while started.load(Ordering::Acquire) < threads {
            std::hint::spin_loop();
        }
        std::hint::black_box(fma_loop(isa, iters));
    });
    let secs = t.elapsed().as_secs_f64();
    (threads * iters * CHAINS * lanes(isa) * 2) as f64 / secs
}

/// f32 lanes of one FMA instruction of `isa`'s peak loop.
pub fn lanes(isa: Isa) -> usize {
    match isa {
        Isa::Avx512 => 16,
        Isa::Avx2 => 8,
        Isa::Portable => 1,
    }
}

fn fma_loop(isa: Isa, iters: usize) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the ISA was detected at run time.
        Isa::Avx512 => unsafe { x86::fma512(iters) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::fma256(iters) },
        _ => {
            let mut acc = [0.0f32; CHAINS];
            for (i, a) in acc.iter_mut().enumerate() {
                *a = i as f32;
            }
            let (m, c) = (std::hint::black_box(0.999f32), std::hint::black_box(1e-3f32));
            for _ in 0..iters {
                for a in &mut acc {
                    *a = a.mul_add(m, c);
                }
            }
            acc.iter().sum()
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::CHAINS;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn fma512(iters: usize) -> f32 {
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for (i, a) in acc.iter_mut().enumerate() {
            *a = _mm512_set1_ps(i as f32);
        }
        let m = _mm512_set1_ps(std::hint::black_box(0.999));
        let c = _mm512_set1_ps(std::hint::black_box(1e-3));
        for _ in 0..iters {
            for a in &mut acc {
                *a = _mm512_fmadd_ps(*a, m, c);
            }
        }
        let mut s = _mm512_setzero_ps();
        for a in acc {
            s = _mm512_add_ps(s, a);
        }
        _mm512_reduce_add_ps(s)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fma256(iters: usize) -> f32 {
        let mut acc = [_mm256_setzero_ps(); CHAINS];
        for (i, a) in acc.iter_mut().enumerate() {
            *a = _mm256_set1_ps(i as f32);
        }
        let m = _mm256_set1_ps(std::hint::black_box(0.999));
        let c = _mm256_set1_ps(std::hint::black_box(1e-3));
        for _ in 0..iters {
            for a in &mut acc {
                *a = _mm256_fmadd_ps(*a, m, c);
            }
        }
        let mut s = _mm256_setzero_ps();
        for a in acc {
            s = _mm256_add_ps(s, a);
        }
        let mut out = [0.0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), s);
        out.iter().sum()
    }
}

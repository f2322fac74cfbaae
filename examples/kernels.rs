//! Times the CPU matrix-product kernels on random 4-bit weights (`BITS=8` for 8-bit, `GS` for
//! the group size) in isolation (one thread):
//! `cargo run --release --example kernels -- [tokens] [rows] [cols] [reps]`. Prints ms per
//! call, weight GB/s and GFLOP/s. `PRODUCTS=int` times the integer-exact products instead
//! (and the input's quantization); `CPU_TIME=1` measures the calling
//! thread's CPU time rather than wall time (steadier on a shared machine, one thread only).
//! A development aid; `tensorfold bench` measures the model.

use tensorfold::backend::cpu::intdot::{self, Layout, QuantRows};
use tensorfold::backend::cpu::simd::{self, Isa, Transposed};
use tensorfold::checkpoint::Bytes;
use tensorfold::model::weights::{FloatType, Matrix, MatrixData};

fn main() {
    let a: Vec<usize> = std::env::args().skip(1).map(|s| s.parse().unwrap()).collect();
    let tokens = *a.first().unwrap_or(&1);
    let rows = *a.get(1).unwrap_or(&8192);
    let cols = *a.get(2).unwrap_or(&1024);
    let reps = *a.get(3).unwrap_or(&20);
    // `BITS` (4 or 8) and `GS` (32, 64, 128) pick the codes and the group size.
    let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|s| s.parse().ok()).unwrap_or(d);
    let (bits, gs) = (env("BITS", 4), env("GS", 64));
    let mut state = 1u64;
    let mut next = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) as u32
    };
    let codes: Vec<u8> = (0..rows * cols * bits / 8).map(|_| next() as u8).collect();
    let sc: Vec<u8> = (0..rows * cols / gs).flat_map(|_| half::bf16::from_f32(0.01 + (next() % 100) as f32 * 1e-4).to_bits().to_le_bytes()).collect();
    let bi: Vec<u8> = (0..rows * cols / gs).flat_map(|_| half::bf16::from_f32(-0.05).to_bits().to_le_bytes()).collect();
    let w = Matrix {
        name: "w".into(),
        rows,
        cols,
        data: MatrixData::Affine {
            bits: bits as u32,
            group_size: gs,
            weight: Bytes::from_vec(codes),
            scales: Bytes::from_vec(sc),
            biases: Bytes::from_vec(bi),
            scale_dtype: FloatType::BF16,
        },
    };
    let x: Vec<f32> = (0..tokens * cols).map(|_| (next() % 1000) as f32 / 1000.0 - 0.5).collect();
    let mut y = vec![0.0f32; tokens * rows];
    let only = std::env::var("ISA").ok();
    if std::env::var("PRODUCTS").as_deref() == Ok("int") {
        for isa in Isa::available().into_iter().rev().filter(|i| only.as_deref().is_none_or(|o| o == i.name())) {
            {
                let mut xq = QuantRows::default();
                let (mut best, mut best_q) = (f64::MAX, f64::MAX);
                let mut scratch = intdot::Scratch::default();
                for _ in 0..reps {
                    let t = Instant::now();
                    xq.shape(isa, tokens, cols, Layout::of(&w).unwrap());
                    let base = xq.base();
                    unsafe { xq.fill_rows(base, &x, 0, tokens) };
                    best_q = best_q.min(t.elapsed().as_secs_f64());
                    let t = Instant::now();
                    let threads: usize = std::env::var("THREADS").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
                    if threads == 1 {
                        unsafe { intdot::matmul(isa, &w, &xq, y.as_mut_ptr(), rows, 0, rows, &mut scratch) };
                    } else {
                        // `THREADS` threads each take a contiguous share of the rows.
                        let (yp, w, xq) = (y.as_mut_ptr() as usize, &w, &xq);
                        std::thread::scope(|sc| {
                            for th in 0..threads {
                                sc.spawn(move || {
                                    let (r0, r1) = (rows * th / threads, rows * (th + 1) / threads);
                                    unsafe { intdot::matmul(isa, w, xq, yp as *mut f32, rows, r0, r1 - r0, &mut intdot::Scratch::default()) };
                                });
                            }
                        });
                    }
                    best = best.min(t.elapsed().as_secs_f64());
                    if isa == Isa::Portable {
                        break;
                    }
                }
                let bytes = w.storage_bytes() as f64;
                println!(
                    "int {:8} tokens {tokens:4} rows {rows} cols {cols}: {:8.3} ms  {:6.2} GB/s  {:6.1} GOP/s  (quantize {:.3} ms)",
                    isa.name(),
                    best * 1e3,
                    bytes / best / 1e9,
                    2.0 * (rows * cols * tokens) as f64 / best / 1e9,
                    best_q * 1e3
                );
            }
        }
        return;
    }
    let xt = Transposed::new(&x, tokens, cols, 8);
    for isa in Isa::available().into_iter().rev().filter(|i| only.as_deref().is_none_or(|o| o == i.name())) {
        let mut best = f64::MAX;
        for _ in 0..reps {
            let t = Instant::now();
            // In tasks of `TASK` rows, as the backend splits a product; `THREADS` threads each
            // take a contiguous share of the rows (the memory-bound case needs every core).
            let task: usize = std::env::var("TASK").ok().and_then(|s| s.parse().ok()).unwrap_or(rows);
            let threads: usize = std::env::var("THREADS").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
            let yp = y.as_mut_ptr() as usize;
            std::thread::scope(|sc| {
                for th in 0..threads {
                    let (w, xt) = (&w, &xt);
                    let part = move || {
                        let (r0, r1) = (rows * th / threads, rows * (th + 1) / threads);
                        let mut panel = Vec::new();
                        let mut n = r0;
                        while n < r1 {
                            let c = task.min(r1 - n);
                            unsafe { simd::matmul(isa, w, xt, yp as *mut f32, rows, n, c, &mut panel) };
                            n += c;
                        }
                    };
                    // One thread runs here: spawning one per call would cost more than a
                    // cache-resident product.
                    if threads == 1 {
                        part();
                    } else {
                        sc.spawn(part);
                    }
                }
            });
            best = best.min(t.elapsed().as_secs_f64());
            if isa == Isa::Portable {
                break;
            }
        }
        let bytes = w.storage_bytes() as f64;
        println!(
            "{:8} tokens {tokens:4} rows {rows} cols {cols}: {:8.3} ms  {:6.2} GB/s  {:6.1} GFLOP/s",
            isa.name(),
            best * 1e3,
            bytes / best / 1e9,
            2.0 * (rows * cols * tokens) as f64 / best / 1e9
        );
    }
}

/// Wall time, or the calling thread's CPU time with `CPU_TIME=1`.
struct Instant(f64);

impl Instant {
    fn now() -> Self {
        Instant(now())
    }
    fn elapsed(&self) -> Secs {
        Secs(now() - self.0)
    }
}

struct Secs(f64);

impl Secs {
    fn as_secs_f64(&self) -> f64 {
        self.0
    }
}

fn now() -> f64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    if std::env::var("CPU_TIME").as_deref() == Ok("1") {
        thread_cpu_seconds()
    } else {
        START.get_or_init(std::time::Instant::now).elapsed().as_secs_f64()
    }
}

/// CPU time of the calling thread (Linux; elsewhere wall time).
fn thread_cpu_seconds() -> f64 {
    #[cfg(target_os = "linux")]
    {
        #[repr(C)]
        struct Timespec {
            sec: i64,
            nsec: i64,
        }
        extern "C" {
            fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
        }
        const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
        let mut ts = Timespec { sec: 0, nsec: 0 };
        // SAFETY: a valid out-pointer for the call's duration.
        unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        ts.sec as f64 + ts.nsec as f64 * 1e-9
    }
    #[cfg(not(target_os = "linux"))]
    {
        static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        START.get_or_init(std::time::Instant::now).elapsed().as_secs_f64()
    }
}

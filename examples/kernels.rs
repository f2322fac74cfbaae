//! Times the CPU matrix-product kernels on random 4-bit weights in isolation (one thread):
//! `cargo run --release --example kernels -- [tokens] [rows] [cols] [reps]`. Prints ms per
//! call, weight GB/s and GFLOP/s. A development aid; `tensorfold bench` measures the model.

use std::time::Instant;
use tensorfold::backend::cpu::simd::{self, Isa, Transposed};
use tensorfold::checkpoint::Bytes;
use tensorfold::model::weights::{FloatType, Matrix, MatrixData};

fn main() {
    let a: Vec<usize> = std::env::args().skip(1).map(|s| s.parse().unwrap()).collect();
    let tokens = *a.first().unwrap_or(&1);
    let rows = *a.get(1).unwrap_or(&8192);
    let cols = *a.get(2).unwrap_or(&1024);
    let reps = *a.get(3).unwrap_or(&20);
    let gs = 64;
    let mut state = 1u64;
    let mut next = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) as u32
    };
    let codes: Vec<u8> = (0..rows * cols / 2).map(|_| next() as u8).collect();
    let sc: Vec<u8> = (0..rows * cols / gs).flat_map(|_| half::bf16::from_f32(0.01 + (next() % 100) as f32 * 1e-4).to_bits().to_le_bytes()).collect();
    let bi: Vec<u8> = (0..rows * cols / gs).flat_map(|_| half::bf16::from_f32(-0.05).to_bits().to_le_bytes()).collect();
    let w = Matrix {
        name: "w".into(),
        rows,
        cols,
        data: MatrixData::Affine {
            bits: 4,
            group_size: gs,
            weight: Bytes::from_vec(codes),
            scales: Bytes::from_vec(sc),
            biases: Bytes::from_vec(bi),
            scale_dtype: FloatType::BF16,
        },
    };
    let x: Vec<f32> = (0..tokens * cols).map(|_| (next() % 1000) as f32 / 1000.0 - 0.5).collect();
    let xt = Transposed::new(&x, tokens, cols, 8);
    let mut y = vec![0.0f32; tokens * rows];
    let only = std::env::var("ISA").ok();
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

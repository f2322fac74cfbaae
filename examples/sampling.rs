//! What sampling one token costs on the host, per logits row of Qwen3.5's vocabulary
//! (248 320 ids): the settings OpenAI clients send (no top-k, top-p 1 or 0.95), llama.cpp's
//! defaults (top-k 40), and with penalties. The logits are a fixed pseudo-random row shaped like
//! a model's (a few large values over a wide spread).
//! `cargo run --release --example sampling -- [vocab] [repeats]`. Results in bench/results/.

use std::time::Instant;

use tensorfold::sampling::{philox4x32_10, Sampler, SamplingParams};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let v: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(248_320);
    let repeats: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(50);
    // A sum of four uniforms (roughly normal, std ~2.3) plus a few large logits.
    let logits: Vec<f32> = (0..v as u32)
        .map(|i| {
            let w = philox4x32_10([i, 0, 0, 0], [12345, 678]);
            let s: f32 = w.iter().map(|&x| (x >> 8) as f32 / (1u32 << 24) as f32).sum::<f32>() * 8.0 - 16.0;
            if i % 50_000 == 7 {
                s + 25.0
            } else {
                s
            }
        })
        .collect();
    let history: Vec<u32> = (0..64).map(|i| (i * 7919 % v) as u32).collect();
    let cases = [
        ("temperature 0.8, no top-k, top-p 1 (OpenAI's defaults)", SamplingParams { temperature: 0.8, top_k: 0, top_p: 1.0, min_p: 0.0, ..SamplingParams::default() }),
        ("temperature 0.7, no top-k, top-p 0.95", SamplingParams { temperature: 0.7, top_k: 0, top_p: 0.95, min_p: 0.0, ..SamplingParams::default() }),
        ("llama.cpp's defaults (top-k 40, top-p 0.95, min-p 0.05)", SamplingParams::default()),
        ("top-k 40, repetition penalty 1.1, frequency 0.5", SamplingParams { repetition_penalty: 1.1, frequency_penalty: 0.5, ..SamplingParams::default() }),
        ("no top-k, top-p 0.9, presence penalty 0.5", SamplingParams { temperature: 1.0, top_k: 0, top_p: 0.9, presence_penalty: 0.5, ..SamplingParams::default() }),
    ];
    println!("vocabulary {v}, {repeats} draws per case (positions 0..{repeats}), one thread");
    let mut sampler = Sampler::new();
    for (name, p) in cases {
        let mut times = Vec::with_capacity(repeats);
        let mut check = 0u64;
        for pos in 0..repeats as u64 {
            let t = Instant::now();
            let id = sampler.sample(&logits, &history, pos, &p);
            times.push(t.elapsed().as_secs_f64());
            check = check.wrapping_mul(31).wrapping_add(u64::from(id));
        }
        times.sort_by(f64::total_cmp);
        println!("{:>9.1} us median  {:>9.1} us min   {name}  (ids hash {check:x})", times[times.len() / 2] * 1e6, times[0] * 1e6);
    }
}

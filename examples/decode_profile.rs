//! Wall time of each operation of CPU decode steps (greedy, one token per step):
//! `cargo run --release --example decode_profile -- MODEL_DIR [steps]`. A development aid: it
//! times between the probes of `forward_probed`, so each line is the operation (and whatever
//! work fused into it) that ends at that probe.

use std::collections::BTreeMap;
use std::time::Instant;
use tensorfold::backend::cpu::Cpu;
use tensorfold::backend::{Backend, Batch};
use tensorfold::model::{forward_probed, HostModel, Model};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = std::path::PathBuf::from(&args[0]);
    let steps: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(64);
    let host = HostModel::open(&dir).expect("open model");
    // TENSORFOLD_PRODUCTS=int profiles the integer-exact products.
    let products = tensorfold::backend::Products::from_env().expect("TENSORFOLD_PRODUCTS").unwrap_or_default();
    let model = Model::new(&host, Cpu::new().with_products(products)).expect("model");
    let mut states = model.backend.new_states(&model.config).unwrap();
    let slot = model.backend.alloc_slot(&mut states).unwrap();
    let mut scratch = model.scratch(1, 1).unwrap();
    let vocab = model.config.vocab_size;
    let mut per_op: BTreeMap<String, f64> = BTreeMap::new();
    let mut id = 1u32;
    let warm = 8;
    let mut total = 0.0;
    let mut argmax_t = 0.0;
    for step in 0..steps + warm {
        let batch = Batch::single(slot, step as u32, &[id], false);
        let t0 = Instant::now();
        model.backend.begin_step(&mut states, &batch).unwrap();
        let mut last = Instant::now();
        let mut local: Vec<(String, f64)> = Vec::new();
        forward_probed(&model, &batch, &mut states, &mut scratch, &mut |_, op, _| {
            let now = Instant::now();
            let dt = (now - last).as_secs_f64();
            last = now;
            let kind = op.to_string();
            local.push((kind, dt));
        });
        model.backend.end_step(&mut states, &batch).unwrap();
        let ta = Instant::now();
        id = model.backend.argmax_read(&scratch.logits, 1, vocab).unwrap()[0];
        let te = Instant::now();
        if step >= warm {
            for (k, dt) in local {
                *per_op.entry(k).or_default() += dt;
            }
            argmax_t += (te - ta).as_secs_f64();
            total += (te - t0).as_secs_f64();
        }
    }
    let n = steps as f64;
    let mut v: Vec<_> = per_op.into_iter().collect();
    v.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
    println!("{:.3} ms/token ({:.1} tok/s)", total / n * 1e3, n / total);
    for (k, t) in v {
        if t / n > 1e-6 {
            println!("{:8.3} ms  {:5.1}%  {k}", t / n * 1e3, 100.0 * t / total);
        }
    }
    println!("{:8.3} ms  {:5.1}%  read logits + argmax", argmax_t / n * 1e3, 100.0 * argmax_t / total);
}

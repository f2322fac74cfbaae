//! Wall time of each operation of a CPU prompt (prefill):
//! `cargo run --release --example prompt_profile -- MODEL_DIR [tokens] [chunk] [reps]`. A
//! development aid like `decode_profile`: it times between the probes of `forward_probed`, so
//! each line is the operation (and whatever work fused into it) that ends at that probe, summed
//! over the layers; GDN and attention layers are kept apart. Prints the best of `reps` prompts.

use std::collections::BTreeMap;
use std::time::Instant;
use tensorfold::backend::cpu::Cpu;
use tensorfold::backend::{Backend, Batch};
use tensorfold::config::LayerType;
use tensorfold::model::{forward_probed, HostModel, Model};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = std::path::PathBuf::from(&args[0]);
    let tokens: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(512);
    let chunk: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(256);
    let reps: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(3);
    let host = HostModel::open(&dir).expect("open model");
    // TENSORFOLD_PRODUCTS=int profiles the integer-exact products.
    let products = tensorfold::backend::Products::from_env().expect("TENSORFOLD_PRODUCTS").unwrap_or_default();
    let model = Model::new(&host, Cpu::new().with_products(products)).expect("model");
    let types = model.config.layer_types.clone();
    let mut scratch = model.scratch(chunk, 1).unwrap();
    let vocab = model.config.vocab_size as u32;
    let ids: Vec<u32> = (0..tokens as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut best: Option<(f64, BTreeMap<String, f64>)> = None;
    for _ in 0..reps + 1 {
        let mut states = model.backend.new_states(&model.config).unwrap();
        let slot = model.backend.alloc_slot(&mut states).unwrap();
        let mut per_op: BTreeMap<String, f64> = BTreeMap::new();
        let t0 = Instant::now();
        let mut pos = 0;
        while pos < tokens {
            let n = chunk.min(tokens - pos);
            let batch = Batch::single(slot, pos as u32, &ids[pos..pos + n], false);
            let tb = Instant::now();
            model.backend.begin_step(&mut states, &batch).unwrap();
            let mut last = Instant::now();
            *per_op.entry("begin_step".into()).or_default() += (last - tb).as_secs_f64();
            forward_probed(&model, &batch, &mut states, &mut scratch, &mut |l, op, _| {
                let now = Instant::now();
                let kind = match types.get(l) {
                    Some(LayerType::LinearAttention) => format!("gdn  {op}"),
                    Some(_) => format!("attn {op}"),
                    None => op.to_string(),
                };
                *per_op.entry(kind).or_default() += (now - last).as_secs_f64();
                last = now;
            });
            model.backend.end_step(&mut states, &batch).unwrap();
            pos += n;
        }
        let total = t0.elapsed().as_secs_f64();
        if best.as_ref().is_none_or(|b| total < b.0) {
            best = Some((total, per_op));
        }
    }
    let (total, per_op) = best.unwrap();
    println!("{tokens} tokens in chunks of {chunk}: {:.1} ms ({:.1} tok/s)", total * 1e3, tokens as f64 / total);
    let mut v: Vec<_> = per_op.into_iter().collect();
    v.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
    for (k, t) in v {
        if t > 1e-6 {
            println!("{:9.2} ms  {:5.1}%  {k}", t * 1e3, 100.0 * t / total);
        }
    }
}

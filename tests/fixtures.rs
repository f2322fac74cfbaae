//! The engine against independent implementations, on every checkpoint in ../shared:
//! teacher-forced logits against mlx-lm and transformers, greedy continuations, and the
//! chunked-prefill == token-by-token contract.

use tensorfold::backend::{cpu::Cpu, Backend, Batch, SeqRows};
use tensorfold::model::{HostModel, Model};
use tensorfold::testutil::{greedy_ids, shared, Reference};

/// The bound of ../shared/fixtures/README.md: "above 1e-3 is a bug, not rounding".
const BOUND: f64 = 1e-3;

struct Fixture {
    /// Directory under ../shared holding `reference.safetensors`.
    root: &'static str,
    prompt_len: usize,
}

const MLX: &[Fixture] = &[
    Fixture { root: "fixtures/tiny", prompt_len: 12 },
    Fixture { root: "fixtures/heads", prompt_len: 20 },
    Fixture { root: "fixtures/vocab", prompt_len: 18 },
    Fixture { root: "models/tensorfold-demo-py28m", prompt_len: 9 },
];

fn load(dir: &str) -> Model<Cpu> {
    let host = HostModel::open(&shared(dir)).unwrap_or_else(|e| panic!("{dir}: {e}"));
    Model::new(&host, Cpu::new()).unwrap()
}

/// Logits of `rows` after feeding `ids` in chunks of `chunk` tokens (all rows' logits kept).
fn logits_in_chunks(model: &Model<Cpu>, ids: &[u32], chunk: usize, rows: &[usize]) -> Vec<f32> {
    let mut states = model.backend.new_states(&model.config).unwrap();
    let slot = model.backend.alloc_slot(&mut states).unwrap();
    let mut scratch = model.scratch(chunk, chunk).unwrap();
    let v = model.config.vocab_size;
    let mut out = vec![0.0f32; rows.len() * v];
    let mut buf = Vec::new();
    for (c, part) in ids.chunks(chunk).enumerate() {
        let start = c * chunk;
        let wanted: Vec<(usize, usize)> = rows.iter().enumerate().filter(|(_, &r)| r >= start && r < start + part.len()).map(|(i, &r)| (i, r)).collect();
        let batch = Batch {
            ids: part.to_vec(),
            seqs: vec![SeqRows { slot, first_row: 0, len: part.len() as u32, pos: start as u32 }],
            logit_rows: wanted.iter().map(|&(_, r)| (r - start) as u32).collect(),
        };
        model.step(&batch, &mut states, &mut scratch).unwrap();
        model.backend.read_tensor(&scratch.logits, wanted.len(), &mut buf).unwrap();
        for (j, &(i, _)) in wanted.iter().enumerate() {
            out[i * v..(i + 1) * v].copy_from_slice(&buf[j * v..(j + 1) * v]);
        }
    }
    out
}

#[test]
fn mlx_checkpoints_match_mlx_lm_teacher_forced() {
    for f in MLX {
        let model = load(&format!("{}/mlx-q4", f.root));
        let r = Reference::read(&shared(&format!("{}/reference.safetensors", f.root)));
        let got = logits_in_chunks(&model, &r.ids, r.ids.len(), &r.positions);
        let score = Reference::score(&got, &r.mlx_full);
        println!("{}: max |tensorfold − mlx_full| / std = {score:.2e}", f.root);
        assert!(score < BOUND, "{}: {score:.2e}", f.root);
    }
}

#[test]
fn hf_checkpoints_match_transformers_teacher_forced() {
    // tiny/hf lands at 9.8e-4: transformers' hf_full is itself 9.8e-4 from a float64 recurrence
    // (tools/reference_f64.py), from its chunked delta rule; tensorfold is 1.1e-4 from it.
    for root in ["fixtures/tiny", "models/tensorfold-demo-py28m"] {
        let model = load(&format!("{root}/hf"));
        let r = Reference::read(&shared(&format!("{root}/reference.safetensors")));
        let got = logits_in_chunks(&model, &r.ids, r.ids.len(), &r.positions);
        let score = Reference::score(&got, r.hf_full.as_ref().unwrap());
        println!("{root}/hf: max |tensorfold − hf_full| / std = {score:.2e}");
        assert!(score < BOUND, "{root}: {score:.2e}");
    }
}

#[test]
fn greedy_decoding_reproduces_mlx_lm_ids() {
    for f in MLX {
        let model = load(&format!("{}/mlx-q4", f.root));
        let r = Reference::read(&shared(&format!("{}/reference.safetensors", f.root)));
        let ids = greedy_ids(&model, &r.ids[..f.prompt_len], r.ids.len());
        assert_eq!(ids, r.ids, "{}", f.root);
    }
}

#[test]
fn chunked_prefill_equals_token_by_token_bit_for_bit() {
    for root in ["fixtures/tiny/mlx-q4", "fixtures/heads/mlx-q4", "fixtures/tiny/hf", "models/tensorfold-demo-py28m/mlx-q4"] {
        let model = load(root);
        let r = Reference::read(&shared(&format!("{}/reference.safetensors", root.rsplit_once('/').unwrap().0)));
        let rows: Vec<usize> = (0..r.ids.len()).collect();
        let one = logits_in_chunks(&model, &r.ids, 1, &rows);
        for chunk in [3, 16, r.ids.len()] {
            let got = logits_in_chunks(&model, &r.ids, chunk, &rows);
            let same = one.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{root}: chunks of {chunk} differ from one token at a time");
        }
    }
}

#[test]
fn batched_sequences_equal_their_solo_runs() {
    // Two sequences in one step (different positions, different lengths) give the bits each
    // gives alone: a row's logits do not depend on the rest of the batch.
    let model = load("fixtures/heads/mlx-q4");
    let r = Reference::read(&shared("fixtures/heads/reference.safetensors"));
    let (a, b) = (&r.ids[..30], &r.ids[5..25]);
    let solo_a = logits_in_chunks(&model, a, a.len(), &(0..a.len()).collect::<Vec<_>>());
    let solo_b = logits_in_chunks(&model, b, b.len(), &(0..b.len()).collect::<Vec<_>>());
    let mut states = model.backend.new_states(&model.config).unwrap();
    let sa = model.backend.alloc_slot(&mut states).unwrap();
    let sb = model.backend.alloc_slot(&mut states).unwrap();
    let mut scratch = model.scratch(64, 64).unwrap();
    // Step 1: a[0..10] and b[0..4]; step 2: a[10..30] and b[4..20].
    let mut got_a = Vec::new();
    let mut got_b = Vec::new();
    let v = model.config.vocab_size;
    let mut buf = Vec::new();
    for (ra, rb) in [(0..10, 0..4), (10..30, 4..20)] {
        let (na, nb) = (ra.len() as u32, rb.len() as u32);
        let mut ids = a[ra.clone()].to_vec();
        ids.extend_from_slice(&b[rb.clone()]);
        let batch = Batch {
            ids,
            seqs: vec![SeqRows { slot: sa, first_row: 0, len: na, pos: ra.start as u32 }, SeqRows { slot: sb, first_row: na, len: nb, pos: rb.start as u32 }],
            logit_rows: (0..na + nb).collect(),
        };
        model.step(&batch, &mut states, &mut scratch).unwrap();
        model.backend.read_tensor(&scratch.logits, (na + nb) as usize, &mut buf).unwrap();
        got_a.extend_from_slice(&buf[..na as usize * v]);
        got_b.extend_from_slice(&buf[na as usize * v..]);
    }
    assert!(got_a.iter().zip(&solo_a).all(|(x, y)| x.to_bits() == y.to_bits()));
    assert!(got_b.iter().zip(&solo_b).all(|(x, y)| x.to_bits() == y.to_bits()));
}

#[test]
fn every_instruction_set_and_thread_count_gives_the_same_bits() {
    use tensorfold::backend::cpu::simd::Isa;
    // The SIMD paths against the portable fallback on the same inputs, through the whole model
    // (prefill and decode), on a checkpoint with real head geometry and one with bf16 weights.
    for root in ["fixtures/heads", "fixtures/tiny"] {
        for layout in ["mlx-q4", "hf"] {
            // Not every fixture ships every layout (heads has no hf/).
            let dir = shared(root).join(layout);
            if !dir.exists() {
                continue;
            }
            let host = HostModel::open(&dir).unwrap();
            let r = Reference::read(&shared(&format!("{root}/reference.safetensors")));
            let rows: Vec<usize> = (0..r.ids.len()).collect();
            let mut results = Vec::new();
            for isa in Isa::available() {
                for threads in [1, 3] {
                    let model = Model::new(&host, Cpu::with(isa, threads)).unwrap();
                    let mut l = logits_in_chunks(&model, &r.ids[..24], 24, &rows[..24]);
                    l.extend(logits_in_chunks(&model, &r.ids[..24], 1, &rows[..24]));
                    results.push((isa, threads, l));
                }
            }
            let (_, _, first) = &results[0];
            for (isa, threads, l) in &results[1..] {
                assert!(l.iter().zip(first).all(|(a, b)| a.to_bits() == b.to_bits()), "{root}/{layout}: {isa:?} with {threads} threads differs from portable");
            }
            assert!(results.len() >= 2);
        }
    }
}

/// The integer-exact products (numerics §2.2) on every MLX fixture: within the bound of
/// mlx-lm's logits, every greedy token, chunks of any size and every instruction set and thread
/// count giving the same bits.
#[test]
fn int_products_keep_the_accuracy_bar_greedy_ids_and_bits() {
    use tensorfold::backend::cpu::simd::Isa;
    use tensorfold::backend::Products;
    for f in MLX {
        let host = HostModel::open(&shared(&format!("{}/mlx-q4", f.root))).unwrap();
        let model = Model::new(&host, Cpu::new().with_products(Products::Int)).unwrap();
        let r = Reference::read(&shared(&format!("{}/reference.safetensors", f.root)));
        let got = logits_in_chunks(&model, &r.ids, r.ids.len(), &r.positions);
        let score = Reference::score(&got, &r.mlx_full);
        println!("{} (integer products): max |tensorfold − mlx_full| / std = {score:.2e}", f.root);
        assert!(score < BOUND, "{}: {score:.2e}", f.root);
        // The f32 form gives other bits (a test that both forms ran).
        let f32_model = Model::new(&host, Cpu::new().with_products(Products::F32)).unwrap();
        let f32_logits = logits_in_chunks(&f32_model, &r.ids, r.ids.len(), &r.positions);
        assert!(got.iter().zip(&f32_logits).any(|(a, b)| a.to_bits() != b.to_bits()), "{}: integer and f32 products agree bit for bit", f.root);
        assert_eq!(greedy_ids(&model, &r.ids[..f.prompt_len], r.ids.len()), r.ids, "{}", f.root);
    }
    let host = HostModel::open(&shared("fixtures/heads/mlx-q4")).unwrap();
    let r = Reference::read(&shared("fixtures/heads/reference.safetensors"));
    let rows: Vec<usize> = (0..r.ids.len()).collect();
    let mut first: Option<Vec<f32>> = None;
    for isa in Isa::available() {
        for threads in [1, 3] {
            let model = Model::new(&host, Cpu::with(isa, threads).with_products(Products::Int)).unwrap();
            for chunk in [1, 7, r.ids.len()] {
                let l = logits_in_chunks(&model, &r.ids, chunk, &rows);
                match &first {
                    None => first = Some(l),
                    Some(f) => assert!(l.iter().zip(f).all(|(a, b)| a.to_bits() == b.to_bits()), "{isa:?}, {threads} threads, chunks of {chunk}"),
                }
            }
        }
    }
}

//! Sessions keep the numerical contract: interleaved, swapped, forked, saved and restored (in
//! another process), resumed from a snapshot, a session gives the bits of one uninterrupted
//! run. Also the state-size formula of ARCHITECTURE.md, session-file errors, and the `run`
//! and `chat` commands around them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use tensorfold::backend::cpu::Cpu;
use tensorfold::backend::{Backend, Products};
use tensorfold::engine::Engine;
use tensorfold::model::cost::Costs;
use tensorfold::model::{HostModel, Model};
use tensorfold::sampling::{Sampler, SamplingParams};
use tensorfold::session::{ModelIdentity, Session, SessionData, SessionError, SnapshotConfig, SnapshotHome};
use tensorfold::testutil::{shared, TempDir};

const TINY: &str = "fixtures/tiny/mlx-q4";
const HEADS: &str = "fixtures/heads/mlx-q4";
const VOCAB: &str = "fixtures/vocab/mlx-q4";

fn engine(dir: &str) -> Engine<Cpu> {
    engine_with(dir, Products::F32)
}

fn engine_with(dir: &str, products: Products) -> Engine<Cpu> {
    let host = HostModel::open(&shared(dir)).unwrap_or_else(|e| panic!("{dir}: {e}"));
    Engine::new(Model::new(&host, Cpu::new().with_products(products)).unwrap(), 16).unwrap().with_model_dir(shared(dir))
}

/// splitmix64: a deterministic stream for prompts and interleavings.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn ids(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|_| self.below(vocab) as u32).collect()
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn sampling(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 0.9, top_k: 0, top_p: 1.0, min_p: 0.0, seed, ..SamplingParams::default() }
}

/// One decode step of a session: sample from `logits`, push, feed. Returns the id and the new
/// logits.
fn step(e: &mut Engine<Cpu>, s: &mut Session, sampler: &mut Sampler, logits: &[f32]) -> (u32, Vec<f32>) {
    let next = s.sample(sampler, logits);
    s.push(next);
    (next, e.feed(s, &[], false, &mut |_, _| {}).unwrap().to_vec())
}

/// A session alone: the prompt, then `steps` sampled tokens. Returns the ids and every logits
/// row (the prompt's last, then one per step).
fn solo(e: &mut Engine<Cpu>, prompt: &[u32], params: SamplingParams, steps: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut s = e.new_session(params).unwrap();
    let mut sampler = Sampler::new();
    let mut rows = vec![e.feed(&mut s, prompt, false, &mut |_, _| {}).unwrap().to_vec()];
    let mut ids = Vec::new();
    for _ in 0..steps {
        let (id, l) = step(e, &mut s, &mut sampler, rows.last().unwrap());
        ids.push(id);
        rows.push(l);
    }
    e.free_session(s).unwrap();
    (ids, rows)
}

/// Sessions decoded in an interleaving equal their solo runs; `order` picks the next session.
fn interleaved_equals_solo(dir: &str, n: usize, steps: usize, mut order: impl FnMut(&[usize]) -> usize) {
    let mut e = engine(dir);
    let v = e.vocab_size();
    let mut rng = Rng(n as u64);
    let prompts: Vec<Vec<u32>> = (0..n).map(|i| rng.ids(3 + 5 * i % 17, v)).collect();
    let solos: Vec<_> = (0..n).map(|i| solo(&mut e, &prompts[i], sampling(100 + i as u64), steps)).collect();

    let mut sessions: Vec<Session> = (0..n).map(|i| e.new_session(sampling(100 + i as u64)).unwrap()).collect();
    let mut samplers = vec![Sampler::new(); n];
    let mut rows: Vec<Vec<Vec<f32>>> = vec![Vec::new(); n];
    let mut ids: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut left: Vec<usize> = (0..n).collect();
    while !left.is_empty() {
        let k = order(&left);
        let i = left[k];
        if rows[i].is_empty() {
            rows[i].push(e.feed(&mut sessions[i], &prompts[i], false, &mut |_, _| {}).unwrap().to_vec());
        } else {
            let (id, l) = step(&mut e, &mut sessions[i], &mut samplers[i], rows[i].last().unwrap());
            ids[i].push(id);
            rows[i].push(l);
        }
        if ids[i].len() == steps {
            left.remove(k);
        }
    }
    for i in 0..n {
        assert_eq!(ids[i], solos[i].0, "{dir}: session {i} of {n} sampled other ids than alone");
        for (t, (a, b)) in rows[i].iter().zip(&solos[i].1).enumerate() {
            assert!(bits(a) == bits(b), "{dir}: session {i} of {n}, step {t}: logits differ from its solo run");
        }
    }
}

#[test]
fn two_sessions_decoded_in_turn_equal_their_solo_runs() {
    let mut turn = 0;
    interleaved_equals_solo(HEADS, 2, 24, |left| {
        turn += 1;
        turn % left.len()
    });
}

#[test]
fn eight_sessions_in_a_random_interleaving_equal_their_solo_runs() {
    let mut rng = Rng(0x5E55_1075);
    interleaved_equals_solo(TINY, 8, 20, |left| rng.below(left.len()));
}

#[test]
fn swapping_out_and_in_before_every_step_changes_nothing() {
    let mut e = engine(TINY);
    let prompt = Rng(7).ids(10, e.vocab_size());
    let (want_ids, want_rows) = solo(&mut e, &prompt, sampling(42), 200);

    let mut s = e.new_session(sampling(42)).unwrap();
    let mut sampler = Sampler::new();
    let mut logits = e.feed(&mut s, &prompt, false, &mut |_, _| {}).unwrap().to_vec();
    for t in 0..200 {
        let slot = s.slot().unwrap();
        e.swap_out(&mut s).unwrap();
        assert!(!s.is_resident());
        // The slot is released: the backend no longer knows it.
        assert!(e.model.backend.slot_position(e.states(), slot).is_err(), "step {t}: slot {slot} still allocated after swap_out");
        // Half the steps swap in explicitly, half let feed do it.
        if t % 2 == 0 {
            e.swap_in(&mut s).unwrap();
            assert!(s.is_resident());
        }
        let (id, l) = step(&mut e, &mut s, &mut sampler, &logits);
        assert_eq!(id, want_ids[t], "step {t}");
        assert!(bits(&l) == bits(&want_rows[t + 1]), "step {t}: logits differ after a swap");
        logits = l;
    }
}

/// Logits of every position of `ids` from a fresh session.
fn all_logits(e: &mut Engine<Cpu>, ids: &[u32]) -> Vec<f32> {
    let mut s = e.new_session(SamplingParams::greedy()).unwrap();
    let l = e.feed(&mut s, ids, true, &mut |_, _| {}).unwrap().to_vec();
    e.free_session(s).unwrap();
    l
}

#[test]
fn a_fork_continued_two_ways_equals_two_fresh_runs() {
    let mut e = engine(TINY);
    let v = e.vocab_size();
    let mut rng = Rng(11);
    let (p, x, y) = (rng.ids(20, v), rng.ids(15, v), rng.ids(9, v));
    for swapped in [false, true] {
        let mut a = e.new_session(SamplingParams::greedy()).unwrap();
        e.feed(&mut a, &p, false, &mut |_, _| {}).unwrap();
        if swapped {
            e.swap_out(&mut a).unwrap();
        }
        let mut b = e.fork(&a).unwrap();
        assert_eq!(b.tokens(), &p[..]);
        assert!(b.is_resident() && b.slot() != a.slot());
        // Interleave the two continuations token by token.
        let (mut got_x, mut got_y) = (Vec::new(), Vec::new());
        for t in 0..x.len().max(y.len()) {
            if let Some(&id) = x.get(t) {
                got_x.extend_from_slice(e.feed(&mut a, &[id], false, &mut |_, _| {}).unwrap());
            }
            if let Some(&id) = y.get(t) {
                got_y.extend_from_slice(e.feed(&mut b, &[id], false, &mut |_, _| {}).unwrap());
            }
        }
        for (cont, got) in [(&x, &got_x), (&y, &got_y)] {
            let full: Vec<u32> = p.iter().chain(cont.iter()).copied().collect();
            let want = all_logits(&mut e, &full);
            assert!(bits(got) == bits(&want[p.len() * v..]), "fork (swapped out: {swapped}) differs from a fresh run of the full prompt");
        }
        e.free_session(a).unwrap();
        e.free_session(b).unwrap();
    }
}

#[test]
fn resuming_from_a_snapshot_equals_processing_the_whole_prompt() {
    const STRIDE: usize = 8;
    let host = HostModel::open(&shared(TINY)).unwrap();
    let new_engine = |snapshots: Option<SnapshotConfig>| {
        let mut e = Engine::new(Model::new(&host, Cpu::new()).unwrap(), 5).unwrap();
        if let Some(c) = snapshots {
            e.set_snapshots(c);
        }
        e
    };
    let mut plain = new_engine(None);
    let v = plain.vocab_size();
    let mut rng = Rng(3);
    let base = rng.ids(5 * STRIDE, v);
    let tail = rng.ids(3, v);
    let more = rng.ids(4, v);
    // Snapshots in host memory; in backend slots (resumed by a slot copy); in slots with room
    // for two (the older ones dropped), then idle time moving the older of those to host memory.
    let two = 2 * tensorfold::session::snapshot_bytes(&host.config, base.len());
    let configs = [(1 << 30, 0), (0, 1 << 30), (1 << 30, two)].map(|(host, device)| SnapshotConfig { every: STRIDE, budget_bytes: host, device_budget_bytes: device });
    for config in configs {
        for k in 1..=5 {
            for len in [k * STRIDE - 1, k * STRIDE, k * STRIDE + 1] {
                for with_tail in [false, true] {
                    let len = len.min(base.len());
                    let prompt: Vec<u32> = base[..len].iter().chain(if with_tail { &tail[..] } else { &[] }).copied().collect();
                    // An engine that has seen `base` (snapshots at every multiple of the stride and
                    // at its end), then a new session with `prompt`.
                    let mut e = new_engine(Some(config));
                    let mut first = e.new_session(SamplingParams::greedy()).unwrap();
                    let (r0, _) = e.prompt(&mut first, &base, &mut |_, _| {}).unwrap();
                    assert_eq!((r0.reused, r0.processed), (0, base.len()));
                    assert_eq!(e.snapshots().iter().map(|s| s.tokens().len()).max(), Some(base.len()));
                    while e.spill_idle() {}
                    let mut held: Vec<(usize, bool)> = e.snapshots().iter().map(|s| (s.tokens().len(), matches!(s.home(), SnapshotHome::Slot(_)))).collect();
                    held.sort();
                    let every: Vec<usize> = (1..=base.len() / STRIDE).map(|k| k * STRIDE).collect();
                    let want_held: Vec<(usize, bool)> = match configs.iter().position(|c| *c == config).unwrap() {
                        0 => every.iter().map(|&l| (l, false)).collect(),
                        1 => every.iter().map(|&l| (l, true)).collect(),
                        _ => vec![(base.len() - STRIDE, false), (base.len(), true)],
                    };
                    assert_eq!(held, want_held, "{config:?}");
                    let mut s = e.new_session(SamplingParams::greedy()).unwrap();
                    let (reuse, logits) = e.prompt(&mut s, &prompt, &mut |_, _| {}).unwrap();
                    let logits = logits.to_vec();
                    // The longest snapshot held that leaves at least one token to feed.
                    let want_reused = held.iter().map(|h| h.0).filter(|&h| h <= (prompt.len() - 1).min(len)).max().unwrap_or(0);
                    assert_eq!(reuse.reused, want_reused, "prompt of {} tokens", prompt.len());
                    assert_eq!(reuse.from_snapshot, want_reused > 0);
                    assert_eq!(reuse.processed, prompt.len() - want_reused);
                    assert_eq!(s.tokens(), &prompt[..]);
                    let want = all_logits(&mut plain, &prompt);
                    assert!(bits(&logits) == bits(&want[want.len() - v..]), "prompt of {} tokens resumed at {}: logits differ", prompt.len(), reuse.reused);
                    // The state, not only the last row: a continuation matches too.
                    let cont = e.feed(&mut s, &more, true, &mut |_, _| {}).unwrap().to_vec();
                    let full: Vec<u32> = prompt.iter().chain(&more).copied().collect();
                    let want = all_logits(&mut plain, &full);
                    assert!(bits(&cont) == bits(&want[prompt.len() * v..]), "continuation after resuming at {}", reuse.reused);
                    // And the first session's own state is reused when a prompt extends it.
                    let ext: Vec<u32> = base.iter().chain(&more).copied().collect();
                    let (r, l) = e.prompt(&mut first, &ext, &mut |_, _| {}).unwrap();
                    assert_eq!((r.reused, r.from_snapshot), (base.len(), false));
                    let want = all_logits(&mut plain, &ext);
                    assert!(bits(l) == bits(&want[want.len() - v..]));
                }
            }
        }
    }
}

#[test]
fn state_and_snapshot_bytes_follow_the_architecture_formula() {
    for dir in [TINY, HEADS] {
        let host = HostModel::open(&shared(dir)).unwrap();
        let c = &host.config;
        let costs = Costs::of(c, &host.loaded.weights);
        // ARCHITECTURE.md: conv L_gdn·(Kc−1)·conv_dim·4 + recurrent L_gdn·Hv·dv·dk·4 bytes, and
        // L_attn·2·Hkv·Dh·4 bytes of KV cache per token; conv_dim = 2·Hk·dk + Hv·dv.
        let l_gdn = c.layer_types.iter().filter(|t| **t == tensorfold::config::LayerType::LinearAttention).count() as u64;
        let l_attn = c.num_hidden_layers as u64 - l_gdn;
        let conv_dim = (2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim) as u64;
        let conv = l_gdn * (c.linear_conv_kernel_dim as u64 - 1) * conv_dim * 4;
        let rec = l_gdn * (c.linear_num_value_heads * c.linear_value_head_dim * c.linear_key_head_dim) as u64 * 4;
        let kv = l_attn * 2 * (c.num_key_value_heads * c.head_dim) as u64 * 4;
        assert_eq!((costs.conv_state_bytes, costs.recurrent_state_bytes, costs.kv_bytes_per_token), (conv, rec, kv), "{dir}");

        // The state a session really holds, and its snapshots.
        const STRIDE: usize = 6;
        let mut e = Engine::new(Model::new(&host, Cpu::new()).unwrap(), 16).unwrap();
        let budget = 2 * tensorfold::session::snapshot_bytes(c, 20) + 100;
        e.set_snapshots(SnapshotConfig { every: STRIDE, budget_bytes: budget, device_budget_bytes: 0 });
        let mut s = e.new_session(SamplingParams::greedy()).unwrap();
        let ids = Rng(5).ids(20, e.vocab_size());
        e.prompt(&mut s, &ids, &mut |_, _| {}).unwrap();
        let st = e.model.backend.export_slot(e.states(), s.slot().unwrap()).unwrap();
        let held = 4 * (st.conv.iter().chain(&st.recurrent).chain(&st.keys).chain(&st.values).map(Vec::len).sum::<usize>() as u64);
        assert_eq!(held, conv + rec + 20 * kv, "{dir}: exported state");
        assert_eq!(costs.state_bytes(20), held);
        for snap in e.snapshots().iter() {
            let p = snap.tokens().len() as u64;
            assert_eq!(snap.bytes(), conv + rec + p * kv + 4 * p, "{dir}: snapshot of {p} tokens");
            assert_eq!(snap.bytes(), costs.snapshot_bytes(p as usize));
        }
        // Snapshots at 6, 12, 18 and 20 do not all fit: the least recently used went.
        let mut lens: Vec<usize> = e.snapshots().iter().map(|s| s.tokens().len()).collect();
        lens.sort();
        assert!(e.snapshots().bytes() <= budget);
        assert_eq!(lens, vec![18, 20], "{dir}");

        // `tensorfold info` prints the same numbers.
        let out = tensorfold_cmd(&["info", "-m", shared(dir).to_str().unwrap()], None);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains(&format!("state bytes      {conv} + {rec} + {kv}·tokens")), "{dir}: {text}");
        assert!(text.contains(&format!("({} bytes)", conv + rec + 256 * (kv + 4))), "{dir}: {text}");
    }
}

#[test]
fn a_saved_session_restored_in_a_new_engine_continues_exactly() {
    let tmp = TempDir::new("session-save");
    let mut e = engine(TINY);
    let prompt = Rng(9).ids(12, e.vocab_size());
    let (want_ids, want_rows) = solo(&mut e, &prompt, sampling(77), 15);

    // Stop after 5 sampled tokens (the 5th pushed, not fed), once resident and once swapped
    // out; restore in an engine built from scratch.
    for swapped in [false, true] {
        let mut s = e.new_session(sampling(77)).unwrap();
        let mut sampler = Sampler::new();
        let mut logits = e.feed(&mut s, &prompt, false, &mut |_, _| {}).unwrap().to_vec();
        for &want in &want_ids[..4] {
            let (id, l) = step(&mut e, &mut s, &mut sampler, &logits);
            assert_eq!(id, want);
            logits = l;
        }
        s.push(s.sample(&mut sampler, &logits));
        s.meta = "{\"note\": \"kept\"}".into();
        if swapped {
            e.swap_out(&mut s).unwrap();
        }
        let path = tmp.path().join("a.session");
        e.save_session(&s, &path).unwrap();
        e.save_session(&s, &path).unwrap(); // over an existing file
        let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|d| d.unwrap().file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("a.session")], "no temporary file left behind");

        let mut e2 = engine(TINY);
        let mut r = e2.load_session(&path).unwrap();
        assert_eq!(r.tokens(), s.tokens());
        assert_eq!((r.position(), r.pending().len()), (prompt.len() + 4, 1));
        assert_eq!(r.params, sampling(77));
        assert_eq!(r.meta, s.meta);
        let mut sampler = Sampler::new();
        let mut logits = e2.feed(&mut r, &[], false, &mut |_, _| {}).unwrap().to_vec();
        assert!(bits(&logits) == bits(&want_rows[5]));
        for t in 5..15 {
            let (id, l) = step(&mut e2, &mut r, &mut sampler, &logits);
            assert_eq!(id, want_ids[t], "step {t} after restore");
            assert!(bits(&l) == bits(&want_rows[t + 1]), "step {t} after restore: logits differ");
            logits = l;
        }
        e.free_session(s).unwrap();
    }
}

#[test]
fn a_session_saved_with_integer_products_resumes_only_with_them_and_then_exactly() {
    let tmp = TempDir::new("session-products");
    let mut int = engine_with(TINY, Products::Int);
    let mut f32 = engine_with(TINY, Products::F32);
    let prompt = Rng(13).ids(12, int.vocab_size());
    let (want_ids, want_rows) = solo(&mut int, &prompt, sampling(41), 12);
    let (_, f32_rows) = solo(&mut f32, &prompt, sampling(41), 1);
    assert!(bits(&want_rows[0]) != bits(&f32_rows[0]), "the two modes must give other bits, or this test shows nothing");

    // Saved with integer products after 4 sampled tokens (the 5th pushed, not fed).
    let mut s = int.new_session(sampling(41)).unwrap();
    let mut sampler = Sampler::new();
    let mut logits = int.feed(&mut s, &prompt, false, &mut |_, _| {}).unwrap().to_vec();
    for &want in &want_ids[..4] {
        let (id, l) = step(&mut int, &mut s, &mut sampler, &logits);
        assert_eq!(id, want);
        logits = l;
    }
    s.push(s.sample(&mut sampler, &logits));
    let path = tmp.path().join("int.session");
    int.save_session(&s, &path).unwrap();

    // Refused by an f32 engine, naming the file, both modes and the flag that resumes it.
    let x = f32.load_session(&path).expect_err("a session of integer products restored with f32 products");
    let msg = x.to_string();
    assert!(matches!(x, SessionError::Products { saved: Products::Int, this: Products::F32, .. }), "{msg}");
    assert!(msg.contains(&path.display().to_string()) && msg.contains("saved with int products") && msg.contains("uses f32 products") && msg.contains("--products int"), "{msg}");
    // The same through SessionData (the runtime's clients).
    let (cfg, id) = (&int.model.config, int.identity().unwrap());
    assert!(matches!(SessionData::load(&path, cfg, id, Products::F32), Err(SessionError::Products { saved: Products::Int, this: Products::F32, .. })));
    assert_eq!(SessionData::load(&path, cfg, id, Products::Int).unwrap().products, Products::Int);
    // And the other way round: an f32 session in an integer engine.
    let mut g = f32.new_session(sampling(41)).unwrap();
    f32.feed(&mut g, &prompt, false, &mut |_, _| {}).unwrap();
    let f32_path = tmp.path().join("f32.session");
    f32.save_session(&g, &f32_path).unwrap();
    assert!(matches!(int.load_session(&f32_path), Err(SessionError::Products { saved: Products::F32, this: Products::Int, .. })));

    // Restored with integer products in a new engine: the bits of the uninterrupted run.
    let mut int2 = engine_with(TINY, Products::Int);
    let mut r = int2.load_session(&path).unwrap();
    assert_eq!(r.tokens(), s.tokens());
    let mut sampler = Sampler::new();
    let mut logits = int2.feed(&mut r, &[], false, &mut |_, _| {}).unwrap().to_vec();
    assert!(bits(&logits) == bits(&want_rows[5]));
    for t in 5..12 {
        let (id, l) = step(&mut int2, &mut r, &mut sampler, &logits);
        assert_eq!(id, want_ids[t], "step {t} after restore");
        assert!(bits(&l) == bits(&want_rows[t + 1]), "step {t} after restore: logits differ");
        logits = l;
    }
}

#[test]
fn session_files_of_other_models_truncated_or_corrupt_are_refused() {
    let tmp = TempDir::new("session-errors");
    let mut e = engine(TINY);
    let mut s = e.new_session(sampling(1)).unwrap();
    e.feed(&mut s, &Rng(2).ids(9, e.vocab_size()), false, &mut |_, _| {}).unwrap();
    let good = tmp.path().join("good.session");
    e.save_session(&s, &good).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let write = |name: &str, b: &[u8]| -> PathBuf {
        let p = tmp.path().join(name);
        std::fs::write(&p, b).unwrap();
        p
    };
    let err = |e: &mut Engine<Cpu>, p: &Path| -> (SessionError, String) {
        let x = e.load_session(p).expect_err("must be refused");
        let msg = x.to_string();
        assert!(msg.contains(&p.display().to_string()), "the message names the file: {msg}");
        (x, msg)
    };

    // Another model.
    let mut other = engine(HEADS);
    let (x, msg) = err(&mut other, &good);
    assert!(matches!(x, SessionError::OtherModel { .. }), "{msg}");
    let (mine, theirs) = (e.identity().unwrap(), other.identity().unwrap());
    assert_ne!(mine, theirs);
    assert!(msg.contains(&format!("belongs to a different model (identity {mine}, this model {theirs})")), "{msg}");
    assert_eq!(ModelIdentity::of_dir(&shared(TINY)).unwrap(), mine, "the identity is a function of the files");

    // Truncated, at the end and inside the header.
    for keep in [bytes.len() - 100, 30, 5] {
        let (x, msg) = err(&mut e, &write("short.session", &bytes[..keep]));
        assert!(matches!(x, SessionError::Truncated { .. }), "{keep} bytes: {msg}");
        if keep >= 24 {
            assert!(msg.contains(&format!("truncated: expected {} bytes, found {keep}", bytes.len())), "{msg}");
        }
    }
    // One flipped bit anywhere past the fixed header: in the state, a token, the token count, the
    // identity; and bytes appended.
    for at in [bytes.len() - 20, 160, 96, 30] {
        let mut b = bytes.clone();
        b[at] ^= 0x10;
        let (x, msg) = err(&mut e, &write("flipped.session", &b));
        assert!(matches!(x, SessionError::Checksum { .. }), "byte {at}: {msg}");
        assert!(msg.contains("checksum mismatch"), "{msg}");
    }
    let mut b = bytes.clone();
    b.push(0);
    assert!(matches!(err(&mut e, &write("long.session", &b)).0, SessionError::Checksum { .. }));
    // Not a session file; another version.
    assert!(matches!(err(&mut e, &write("text.session", b"hello, I am not a session file, but long enough")).0, SessionError::NotASession { .. }));
    let mut b = bytes.clone();
    b[8] = 2;
    let (x, msg) = err(&mut e, &write("v2.session", &b));
    assert!(matches!(x, SessionError::Version { found: 2, supported: 1, .. }), "{msg}");
    // Missing.
    assert!(matches!(err(&mut e, &tmp.path().join("missing.session")).0, SessionError::Io { .. }));
    // The intact file still loads.
    let r = e.load_session(&good).unwrap();
    assert_eq!(r.tokens(), s.tokens());
}

#[test]
fn session_files_with_ids_outside_the_vocabulary_or_non_finite_state_are_refused() {
    // Issue 21: a file with a valid checksum was accepted whatever it held. These are written by
    // the engine's own writer, so every checksum is right.
    let tmp = TempDir::new("session-contents");
    let mut e = engine(TINY);
    let v = e.vocab_size();
    let prompt = Rng(3).ids(9, v);
    let mut s = e.new_session(sampling(1)).unwrap();
    e.feed(&mut s, &prompt, false, &mut |_, _| {}).unwrap();
    let state = e.export_state(&s).unwrap();
    let path = tmp.path().join("bad.session");

    // A pending id past the embedding (pushed, never fed).
    let mut bad = e.fork(&s).unwrap();
    bad.push(v as u32 + 3);
    e.save_session(&bad, &path).unwrap();
    e.free_session(bad).unwrap();
    let err = e.load_session(&path).expect_err("an id outside the vocabulary is refused");
    assert!(matches!(err, SessionError::TokenId { index: 9, id, vocab_size, .. } if id == v as u32 + 3 && vocab_size == v), "{err}");
    assert_eq!(err.to_string(), format!("{}: token 9 of the history is id {}, outside this model's vocabulary of {v}", path.display(), v + 3));

    // NaN or infinity in each kind of state array. The fixture's layers are GDN 0-2 and attention 3.
    let nan = f32::NAN;
    for (array, i, layer, element, value) in
        [("conv window", 1, 1, 5, nan), ("recurrent state", 2, 2, 100, f32::INFINITY), ("key cache", 0, 3, 7, f32::NEG_INFINITY), ("value cache", 0, 3, 9, nan)]
    {
        let mut st = state.clone();
        let arrays = match array {
            "conv window" => &mut st.conv,
            "recurrent state" => &mut st.recurrent,
            "key cache" => &mut st.keys,
            _ => &mut st.values,
        };
        arrays[i][element] = value;
        let bad = e.session_from_state(&st, &prompt, sampling(1)).unwrap();
        e.save_session(&bad, &path).unwrap();
        e.free_session(bad).unwrap();
        let err = e.load_session(&path).expect_err("a non-finite state is refused");
        assert!(matches!(err, SessionError::NonFinite { .. }), "{array}: {err}");
        assert_eq!(err.to_string(), format!("{}: {array} of layer {layer} holds {value} at element {element}", path.display()));
    }
    // The unmodified state still round-trips (the checks refuse only what is wrong).
    e.save_session(&s, &path).unwrap();
    let r = e.load_session(&path).unwrap();
    assert_eq!(r.tokens(), s.tokens());
    assert!(bits(&e.export_state(&r).unwrap().recurrent[2]) == bits(&state.recurrent[2]));
}

#[test]
fn saving_over_a_directory_fails_naming_it_and_leaves_no_temporary_file() {
    let tmp = TempDir::new("session-write");
    let mut e = engine(TINY);
    let mut s = e.new_session(sampling(1)).unwrap();
    e.feed(&mut s, &[1, 2, 3], false, &mut |_, _| {}).unwrap();
    let names = || -> Vec<String> {
        let mut n: Vec<String> = std::fs::read_dir(tmp.path()).unwrap().map(|d| d.unwrap().file_name().to_string_lossy().into_owned()).collect();
        n.sort();
        n
    };
    let dir = tmp.path().join("sessions");
    std::fs::create_dir(&dir).unwrap();
    let err = e.save_session(&s, &dir).expect_err("a directory cannot be replaced");
    assert!(matches!(err, SessionError::Write(_)), "{err}");
    assert_eq!(err.to_string(), format!("{}: is a directory", dir.display()));
    assert_eq!(names(), ["sessions"]);
    // A file of the user's beside the target with the name the writer used to take for its
    // temporary file (`NAME.tmp.<pid>`, replaced and then renamed away) is left alone.
    let theirs = format!("a.session.tmp.{}", std::process::id());
    std::fs::write(tmp.path().join(&theirs), "mine").unwrap();
    e.save_session(&s, &tmp.path().join("a.session")).unwrap();
    assert_eq!(std::fs::read_to_string(tmp.path().join(&theirs)).unwrap(), "mine");
    assert_eq!(names(), ["a.session".to_string(), theirs, "sessions".into()]);
}

fn tensorfold_cmd(args: &[&str], stdin: Option<&str>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tensorfold"));
    c.args(args).stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() }).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = c.spawn().expect("run tensorfold");
    if let Some(text) = stdin {
        use std::io::Write;
        child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    }
    child.wait_with_output().unwrap()
}

fn ok(args: &[&str], stdin: Option<&str>) -> Output {
    let out = tensorfold_cmd(args, stdin);
    assert!(out.status.success(), "tensorfold {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    out
}

/// `logits` and `ids` of a `--dump-logits` file.
fn read_dump(path: &Path) -> (Vec<u32>, Vec<i32>) {
    let b = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&b).unwrap();
    let l = st.tensor("logits").unwrap().data().chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
    let i = st.tensor("ids").unwrap().data().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect();
    (l, i)
}

#[test]
fn run_saved_and_loaded_in_a_new_process_equals_one_uninterrupted_run() {
    let tmp = TempDir::new("session-cli");
    let t = |n: &str| tmp.path().join(n).to_str().unwrap().to_string();
    let model = shared(TINY).to_str().unwrap().to_string();
    let common = ["run", "-m", &model, "--prompt-ids", "5,17,300,42,9,1000,7", "--print-ids", "--temp", "0.9", "--top-k", "0", "--seed", "31"];
    let args = |extra: &[&str]| -> Vec<String> { common.iter().chain(extra).map(|s| s.to_string()).collect() };
    let run = |a: Vec<String>| ok(&a.iter().map(String::as_str).collect::<Vec<_>>(), None);

    let whole = run(args(&["-n", "20", "--dump-logits", &t("whole.st")]));
    let first = run(args(&["-n", "8", "--dump-logits", &t("a.st"), "--save-session", &t("s.session")]));
    // No sampling flags: the session's own settings (seed 31, temp 0.9) must apply.
    let second = ok(&["run", "-m", &model, "--load-session", &t("s.session"), "-n", "12", "--print-ids", "--dump-logits", &t("b.st")], None);
    let lines = |o: &Output| String::from_utf8(o.stdout.clone()).unwrap().lines().map(str::to_string).collect::<Vec<_>>();
    let whole_ids = lines(&whole);
    assert_eq!(whole_ids.len(), 20);
    assert_eq!([lines(&first), lines(&second)].concat(), whole_ids, "sampled ids across save and load");
    let (wl, wi) = read_dump(t("whole.st").as_ref());
    let (al, ai) = read_dump(t("a.st").as_ref());
    let (bl, bi) = read_dump(t("b.st").as_ref());
    assert_eq!(wi.len(), 7 + 19);
    assert_eq!([ai, bi].concat(), wi);
    assert!([al, bl].concat() == wl, "logits across save and load differ from the uninterrupted run");

    // Another model refuses the file, naming it.
    let out = tensorfold_cmd(&["run", "-m", shared(HEADS).to_str().unwrap(), "--load-session", &t("s.session"), "-n", "1"], None);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("belongs to a different model") && err.contains("s.session"), "{err}");
}

#[test]
fn run_refuses_a_session_of_other_products_and_resumes_it_with_the_same() {
    let tmp = TempDir::new("session-cli-products");
    let t = |n: &str| tmp.path().join(n).to_str().unwrap().to_string();
    let model = shared(TINY).to_str().unwrap().to_string();
    let common = ["run", "-m", &model, "--device", "cpu", "--prompt-ids", "5,17,300,42,9,1000,7", "--print-ids", "--temp", "0"];
    let run = |extra: &[&str]| -> Output { ok(&common.iter().chain(extra).copied().collect::<Vec<_>>(), None) };
    let lines = |o: &Output| String::from_utf8(o.stdout.clone()).unwrap().lines().map(str::to_string).collect::<Vec<_>>();
    let (session, whole_dump, b_dump) = (t("int.session"), t("whole.st"), t("b.st"));
    let whole = run(&["--products", "int", "-n", "12", "--dump-logits", &whole_dump]);
    let first = run(&["--products", "int", "-n", "5", "--save-session", &session]);

    let resume = |products: &str, dump: &str| {
        tensorfold_cmd(&["run", "-m", &model, "--device", "cpu", "--products", products, "--load-session", &session, "-n", "7", "--print-ids", "--dump-logits", dump], None)
    };
    let out = resume("f32", &t("never.st"));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("int.session") && err.contains("saved with int products") && err.contains("--products int"), "{err}");
    assert!(!Path::new(&t("never.st")).exists(), "refused before any work");

    let second = resume("int", &b_dump);
    assert!(second.status.success(), "{}", String::from_utf8_lossy(&second.stderr));
    assert_eq!([lines(&first), lines(&second)].concat(), lines(&whole));
    let (wl, _) = read_dump(whole_dump.as_ref());
    let (bl, _) = read_dump(b_dump.as_ref());
    assert!(wl.ends_with(&bl), "logits after the resume differ from the uninterrupted run");
}

#[test]
fn chat_feeds_only_new_tokens_and_saves_loads_and_resets() {
    let tmp = TempDir::new("session-chat");
    let file = tmp.path().join("chat.session");
    let file = file.to_str().unwrap();
    let model = shared(VOCAB).to_str().unwrap().to_string();
    let chat = |input: &str| ok(&["chat", "-m", &model, "-n", "6", "--temp", "0.8", "--seed", "5", "--snapshot-every", "4"], Some(input));
    let text = |o: &Output| String::from_utf8(o.stdout.clone()).unwrap();

    // Three turns in one process, and the same split by /save and /load across two.
    let whole = chat("Hello there\nHow are you?\nTell me more.\n");
    let a = chat(&format!("Hello there\nHow are you?\n/save {file}\n"));
    let b = chat(&format!("/load {file}\nTell me more.\n/quit\nnot read\n"));
    assert_eq!(text(&whole).lines().count(), 3);
    assert_eq!(text(&a) + &text(&b), text(&whole), "a conversation saved and loaded in another process continues exactly");

    // Each later turn reuses the earlier tokens: stats lines "[prompt N tokens: R reused ..., P processed".
    let stats: Vec<(usize, usize, usize)> = String::from_utf8_lossy(&whole.stderr)
        .lines()
        .filter_map(|l| {
            let l = l.strip_prefix("[prompt ")?;
            let n: usize = l.split(' ').next()?.parse().ok()?;
            let r: usize = l.split(": ").nth(1)?.split(' ').next()?.parse().ok()?;
            let p: usize = l.split(", ").nth(1)?.split(' ').next()?.parse().ok()?;
            Some((n, r, p))
        })
        .collect();
    assert_eq!(stats.len(), 3, "{}", String::from_utf8_lossy(&whole.stderr));
    assert_eq!(stats[0].1, 0);
    for (i, &(n, r, p)) in stats.iter().enumerate().skip(1) {
        assert_eq!(r + p, n);
        // At least the previous turn's prompt is reused (its end-of-prompt snapshot).
        assert!(r >= stats[i - 1].0, "turn {i}: reused {r} of {n}, the previous prompt had {}", stats[i - 1].0);
    }

    // /reset: the same first message gives the same reply, resumed from a snapshot.
    let r = chat("Hello there\n/reset\nHello there\n");
    let out = text(&r);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0], lines[1]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(err.contains("(conversation reset)") && err.contains("reused from a snapshot"), "{err}");

    // A session of another model is refused with a clear message and the chat goes on.
    let mut e = engine(TINY);
    let mut s = e.new_session(SamplingParams::greedy()).unwrap();
    e.feed(&mut s, &[1, 2, 3], false, &mut |_, _| {}).unwrap();
    let foreign = tmp.path().join("tiny.session");
    e.save_session(&s, &foreign).unwrap();
    let out = chat(&format!("/load {}\nHello there\n", foreign.display()));
    assert!(String::from_utf8_lossy(&out.stderr).contains("belongs to a different model"));
    assert_eq!(text(&out).lines().next(), text(&whole).lines().next());

    // A model without a chat template: a clear error.
    let out = tensorfold_cmd(&["chat", "-m", shared("models/tensorfold-demo-py28m/mlx-q4").to_str().unwrap()], Some("hi\n"));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("has no chat template"), "{}", String::from_utf8_lossy(&out.stderr));
}

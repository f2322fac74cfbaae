//! Many sequences decoding together, as the batched runtime drives a backend: each sequence
//! prefilled alone, then one model step per tick holding one token of every sequence, greedy on
//! the device, logits for every row. Every sequence must get the ids and logits bits of its solo
//! run, on the CPU and on CUDA (where the step runs on the graph of a batch-size bucket, padded
//! with inert rows, or on its own shape, or eagerly past the largest bucket), and the two
//! backends must agree. Also `Backend::copy_slot` (a copy then both continue as the source) and
//! device sampling of more than 64 rows. On a machine without a CUDA device the GPU tests print
//! that they skipped and pass. `CUDA_BATCH_NS=2,63,65` runs the decode test at those N only and
//! `CUDA_BATCH_FIXTURES=1` on the first fixture only (for compute-sanitizer, which is slow).
//! `TENSORFOLD_PRODUCTS=int` runs both backends with integer products (numerics §2.2).

use tensorfold::backend::cpu::Cpu;
use tensorfold::backend::cuda::{self, Cuda};
use tensorfold::backend::{Backend, BackendError, Batch, Products, RowSampling, SeqRows};
use tensorfold::model::{HostModel, Model, Scratch};
use tensorfold::sampling::{self, SamplingParams};
use tensorfold::testutil::shared;

/// The products both backends run: `TENSORFOLD_PRODUCTS`, else f32.
fn products() -> Products {
    Products::from_env().unwrap().unwrap_or_default()
}

fn cpu_backend() -> Cpu {
    Cpu::new().with_products(products())
}

fn cuda_backend() -> Cuda {
    Cuda::new(0).unwrap().with_products(products())
}

const FIXTURES: [&str; 2] = ["fixtures/tiny/mlx-q4", "fixtures/heads/mlx-q4"];
/// Decode ticks after the prefill.
const STEPS: usize = 8;

/// Prompt `i`: 2 to 18 ids, different for every `i`.
fn prompt(i: usize, vocab: usize) -> Vec<u32> {
    let len = 2 + i % 7 + (i % 3) * 5;
    prompt_of_len(i, len, vocab)
}

fn prompt_of_len(i: usize, len: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|t| ((i * 7919 + t * 104_729 + 13) % vocab) as u32).collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// One sequence: its slot, position, ids so far (prompt, then every greedy id) and the logits
/// bits of each decode tick.
#[derive(Clone)]
struct Seq {
    slot: u32,
    pos: usize,
    ids: Vec<u32>,
    logits: Vec<Vec<u32>>,
}

/// Prompts are at most this long.
const MAX_PROMPT: usize = 300;

/// The prompt as one step in `slot`, its next id chosen on the device.
fn prefill<B: Backend>(m: &Model<B>, states: &mut B::States, pre: &mut Scratch<B>, slot: u32, p: &[u32]) -> Seq {
    let next = m.step_greedy(&Batch::single(slot, 0, p, false), states, pre, m.config.vocab_size).unwrap();
    let mut ids = p.to_vec();
    ids.push(next[0]);
    Seq { slot, pos: p.len(), ids, logits: Vec::new() }
}

/// `STEPS` ticks of every sequence together, one row each (in reverse order when `reverse`),
/// logits for every row, greedy on the device, on `scratch`.
fn decode_together<B: Backend>(m: &Model<B>, states: &mut B::States, seqs: &mut [Seq], scratch: &mut Scratch<B>, reverse: bool) {
    let v = m.config.vocab_size;
    let n = seqs.len();
    let order: Vec<usize> = if reverse { (0..n).rev().collect() } else { (0..n).collect() };
    let mut buf = Vec::new();
    for _ in 0..STEPS {
        let batch = Batch {
            ids: order.iter().map(|&i| *seqs[i].ids.last().unwrap()).collect(),
            seqs: order.iter().enumerate().map(|(r, &i)| SeqRows { slot: seqs[i].slot, first_row: r as u32, len: 1, pos: seqs[i].pos as u32 }).collect(),
            logit_rows: (0..n as u32).collect(),
        };
        let next = m.step_greedy(&batch, states, scratch, v).unwrap();
        assert_eq!(next.len(), n);
        m.backend.read_tensor(&scratch.logits, n, &mut buf).unwrap();
        for (r, &i) in order.iter().enumerate() {
            seqs[i].logits.push(bits(&buf[r * v..(r + 1) * v]));
            seqs[i].ids.push(next[r]);
            seqs[i].pos += 1;
        }
    }
}

/// Each prompt alone: prefilled, then `STEPS` one-row ticks.
fn solos<B: Backend>(m: &Model<B>, prompts: &[Vec<u32>]) -> Vec<Seq> {
    let mut states = m.backend.new_states(&m.config).unwrap();
    let (mut pre, mut one) = (m.scratch(MAX_PROMPT, 1).unwrap(), m.scratch(1, 1).unwrap());
    prompts
        .iter()
        .map(|p| {
            let slot = m.backend.alloc_slot(&mut states).unwrap();
            let mut s = [prefill(m, &mut states, &mut pre, slot, p)];
            decode_together(m, &mut states, &mut s, &mut one, false);
            m.backend.free_slot(&mut states, slot).unwrap();
            let [s] = s;
            s
        })
        .collect()
}

fn solo<B: Backend>(m: &Model<B>, p: &[u32]) -> Seq {
    solos(m, std::slice::from_ref(&p.to_vec())).remove(0)
}

fn same(got: &Seq, want: &Seq, what: &str) {
    assert_eq!(got.ids, want.ids, "{what}: ids");
    assert_eq!(got.logits.len(), want.logits.len(), "{what}: ticks");
    for (k, (a, b)) in got.logits.iter().zip(&want.logits).enumerate() {
        assert!(a == b, "{what}: logits of tick {k} differ");
    }
}

/// `n` sequences (prompts 0..n) prefilled alone, decoded together on scratch of `cap` rows.
fn batched<B: Backend>(m: &Model<B>, prompts: &[Vec<u32>], cap: usize, reverse: bool) -> Vec<Seq> {
    let mut states = m.backend.new_states(&m.config).unwrap();
    let mut pre = m.scratch(MAX_PROMPT, 1).unwrap();
    let mut seqs: Vec<Seq> = prompts
        .iter()
        .map(|p| {
            let slot = m.backend.alloc_slot(&mut states).unwrap();
            prefill(m, &mut states, &mut pre, slot, p)
        })
        .collect();
    decode_together(m, &mut states, &mut seqs, &mut m.scratch(cap, cap).unwrap(), reverse);
    seqs
}

/// A slot copied onto a longer one (its KV pages shrink), a longer one onto a short one (they
/// grow), onto a fresh slot, and onto itself; then all decode together, each as its source alone.
fn copy_then_continue<B: Backend>(m: &Model<B>, what: &str) {
    let v = m.config.vocab_size;
    let short = prompt(5, v);
    let long = prompt_of_len(7, 300, v);
    let (want_short, want_long) = (solo(m, &short), solo(m, &long));
    let b = &m.backend;
    let mut states = b.new_states(&m.config).unwrap();
    let mut slot = || b.alloc_slot(&mut states).unwrap();
    let (s0, l0, s1, l1, fresh) = (slot(), slot(), slot(), slot(), slot());
    let mut pre = m.scratch(MAX_PROMPT, 1).unwrap();
    let a = prefill(m, &mut states, &mut pre, s0, &short);
    let la = prefill(m, &mut states, &mut pre, l0, &long);
    let _ = prefill(m, &mut states, &mut pre, s1, &long); // overwritten below by the short state
    let _ = prefill(m, &mut states, &mut pre, l1, &short); // overwritten below by the long state
    b.copy_slot(&mut states, s0, s1).unwrap();
    b.copy_slot(&mut states, l0, l1).unwrap();
    b.copy_slot(&mut states, l0, fresh).unwrap();
    b.copy_slot(&mut states, s0, s0).unwrap();
    assert_eq!(b.slot_position(&states, s1).unwrap(), short.len());
    assert_eq!(b.slot_position(&states, l1).unwrap(), long.len());
    assert_eq!(b.slot_position(&states, fresh).unwrap(), long.len());
    // Unallocated source or destination: an error naming the slot.
    b.free_slot(&mut states, fresh).unwrap();
    assert!(matches!(b.copy_slot(&mut states, s0, fresh), Err(BackendError::Slot { slot, .. }) if slot == fresh as usize));
    assert!(matches!(b.copy_slot(&mut states, fresh, s0), Err(BackendError::Slot { slot, .. }) if slot == fresh as usize));
    let fresh = b.alloc_slot(&mut states).unwrap();
    b.copy_slot(&mut states, l0, fresh).unwrap();
    let mut seqs = vec![a.clone(), la.clone(), Seq { slot: s1, ..a.clone() }, Seq { slot: l1, ..la.clone() }, Seq { slot: fresh, ..la.clone() }];
    decode_together(m, &mut states, &mut seqs, &mut m.scratch(8, 8).unwrap(), false);
    for (i, s) in seqs.iter().enumerate() {
        let want = if i % 2 == 0 && i != 4 { &want_short } else { &want_long };
        same(s, want, &format!("{what}: copied slot {i}"));
    }
}

/// `Backend::snapshot_slot`: a snapshot of a sequence whose last KV page is partly filled (a
/// 280-token prompt: one full page and 24 positions of the next), which the sequence goes on
/// writing while the snapshot holds it (on CUDA the snapshot shares the pages). Resumed into
/// fresh slots, the snapshots continue as cold runs; a slot sharing a page with a snapshot and
/// then given another state (copy_slot onto it) leaves the snapshot intact; where the backend
/// shares (`shares`), a step that continues a snapshot is refused.
fn snapshot_then_continue<B: Backend>(m: &Model<B>, what: &str, shares: bool) {
    let v = m.config.vocab_size;
    // Room for STEPS more: the solo run of the state after the decode ticks prefills it all.
    let long = prompt_of_len(7, 280, v);
    let mid = prompt_of_len(8, 200, v);
    let b = &m.backend;
    let mut states = b.new_states(&m.config).unwrap();
    let mut pre = m.scratch(MAX_PROMPT, 1).unwrap();
    let mut scratch = m.scratch(8, 8).unwrap();
    let (sa, sb) = (b.alloc_slot(&mut states).unwrap(), b.alloc_slot(&mut states).unwrap());
    let a0 = prefill(m, &mut states, &mut pre, sa, &long);
    let b0 = prefill(m, &mut states, &mut pre, sb, &mid);
    let snap = b.snapshot_slot(&mut states, sa).unwrap();
    assert_eq!(b.slot_position(&states, snap).unwrap(), long.len());
    if shares {
        let step = Batch::single(snap, long.len() as u32, &a0.ids[long.len()..], false);
        assert!(matches!(m.step_greedy(&step, &mut states, &mut pre, v), Err(BackendError::Slot { slot, .. }) if slot == snap as usize), "{what}: a step continued a snapshot");
    }
    // The source writes on into the page it shares with the snapshot.
    let mut run = vec![a0.clone(), b0.clone()];
    decode_together(m, &mut states, &mut run, &mut scratch, false);
    let later = b.snapshot_slot(&mut states, sa).unwrap();
    // The source's slot takes another state: its shared pages must stay as the snapshots hold them.
    b.copy_slot(&mut states, sb, sa).unwrap();
    let resumed = |states: &mut B::States, from: u32| {
        let slot = b.alloc_slot(states).unwrap();
        b.copy_slot(states, from, slot).unwrap();
        slot
    };
    let (r0, r1) = (resumed(&mut states, snap), resumed(&mut states, later));
    b.free_slot(&mut states, snap).unwrap();
    let mut seqs = vec![Seq { slot: r0, ..a0.clone() }, Seq { slot: r1, logits: Vec::new(), ..run[0].clone() }, Seq { slot: sa, logits: Vec::new(), ..run[1].clone() }];
    decode_together(m, &mut states, &mut seqs, &mut scratch, true);
    same(&run[0], &solo(m, &long), &format!("{what}: the source of the snapshots"));
    same(&seqs[0], &solo(m, &long), &format!("{what}: resumed from the snapshot at the end of the prompt"));
    let at = run[0].pos;
    same(&seqs[1], &solo(m, &run[0].ids[..at]), &format!("{what}: resumed from the snapshot after the decode ticks"));
    let at = run[1].pos;
    same(&seqs[2], &solo(m, &run[1].ids[..at]), &format!("{what}: the slot given another state"));
}

#[test]
fn cpu_snapshot_slot_then_resume() {
    let host = HostModel::open(&shared(FIXTURES[0])).unwrap();
    snapshot_then_continue(&Model::new(&host, cpu_backend()).unwrap(), "cpu", false);
}

#[test]
fn gpu_snapshot_slot_then_resume() {
    if gpu().is_none() {
        return;
    }
    for dir in FIXTURES {
        let host = HostModel::open(&shared(dir)).unwrap();
        snapshot_then_continue(&Model::new(&host, cuda_backend()).unwrap(), dir, true);
    }
}

#[test]
fn cpu_copy_slot_then_both_continue_as_the_source() {
    for dir in FIXTURES {
        let host = HostModel::open(&shared(dir)).unwrap();
        copy_then_continue(&Model::new(&host, cpu_backend()).unwrap(), dir);
    }
}

#[test]
fn cpu_sequences_decoded_together_match_their_solo_runs() {
    let host = HostModel::open(&shared(FIXTURES[0])).unwrap();
    let cpu = Model::new(&host, cpu_backend()).unwrap();
    let prompts: Vec<Vec<u32>> = (0..9).map(|i| prompt(i, host.config.vocab_size)).collect();
    let runs = batched(&cpu, &prompts, 9, true);
    for (i, want) in solos(&cpu, &prompts).iter().enumerate() {
        same(&runs[i], want, &format!("cpu sequence {i}"));
    }
}

fn gpu() -> Option<()> {
    if cuda::device_count() == 0 {
        eprintln!("skipped: no CUDA device");
        return None;
    }
    Some(())
}

/// At N = 1, 2, 63, 64, 65, 128 (buckets; 63 and 65 padded) and 257 (past the largest bucket:
/// eager), and 65 on buffers of 65 rows (a graph of its own shape): every sequence has the bits
/// of its solo run, which are the CPU's.
#[test]
fn gpu_sequences_decoded_together_match_their_solo_runs_and_the_cpu() {
    if gpu().is_none() {
        return;
    }
    let cases = [(1, 256, Some(1)), (2, 256, Some(2)), (63, 256, Some(64)), (64, 256, Some(64)), (65, 256, Some(128)), (65, 65, Some(65)), (128, 256, Some(128)), (257, 257, None)];
    let only: Option<Vec<usize>> = std::env::var("CUDA_BATCH_NS").ok().map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect());
    let cases: Vec<_> = cases.into_iter().filter(|c| only.as_ref().is_none_or(|o| o.contains(&c.0))).collect();
    let fixtures = std::env::var("CUDA_BATCH_FIXTURES").ok().and_then(|v| v.parse().ok()).unwrap_or(FIXTURES.len());
    for dir in &FIXTURES[..fixtures] {
        let host = HostModel::open(&shared(dir)).unwrap();
        let v = host.config.vocab_size;
        let gpu = Model::new(&host, cuda_backend()).unwrap();
        let cpu = Model::new(&host, cpu_backend()).unwrap();
        let most = cases.iter().map(|c| c.0).max().unwrap_or(0).max(65);
        let prompts: Vec<Vec<u32>> = (0..most).map(|i| prompt(i, v)).collect();
        let solos_gpu = solos(&gpu, &prompts);
        for (i, want) in solos(&cpu, &prompts).iter().enumerate() {
            same(&solos_gpu[i], want, &format!("{dir}: solo {i}, cuda vs cpu"));
        }
        let solos = solos_gpu;
        for &(n, cap, graph) in &cases {
            let runs = batched(&gpu, &prompts[..n], cap, n % 2 == 1);
            for (i, r) in runs.iter().enumerate() {
                same(r, &solos[i], &format!("{dir}: N = {n} (buffers of {cap}), sequence {i}"));
            }
            if let Some(g) = graph {
                assert!(gpu.backend.graph_rows().contains(&g), "{dir}: N = {n}: graphs of {:?} rows, wanted {g}", gpu.backend.graph_rows());
            }
            eprintln!("{dir}: N = {n} on buffers of {cap}: bit-identical to solo; graphs (rows, kernels) {:?}", gpu.backend.graph_nodes());
        }
        let runs = batched(&cpu, &prompts[..65], 65, true);
        for (i, r) in runs.iter().enumerate() {
            same(r, &solos[i], &format!("{dir}: cpu N = 65, sequence {i}"));
        }
    }
}

/// The mixture-of-experts fixture (8 experts, 2 per token, a shared expert): routing on the
/// device, the expert products over rows grouped by expert in each tile shape (one token per
/// item at N = 1, tiles of 4 at N = 3, of 8 at N = 64 and 65, eager at 257): every sequence has
/// the bits of its solo run, which are the CPU's.
#[test]
fn gpu_mixture_of_experts_decoded_together_match_their_solo_runs_and_the_cpu() {
    if gpu().is_none() {
        return;
    }
    if products() == Products::Int {
        // The CUDA backend has no integer expert products yet (Model::new refuses them).
        eprintln!("skipped: integer products on a mixture of experts");
        return;
    }
    // Relative to the package root, where cargo runs tests (and the GPU machine runs the binary).
    let dir = "tests/data/moe/mlx-q4";
    let host = HostModel::open(std::path::Path::new(dir)).unwrap();
    assert!(host.config.moe.is_some(), "{dir} is not a mixture of experts");
    let v = host.config.vocab_size;
    let gpu = Model::new(&host, cuda_backend()).unwrap();
    let cpu = Model::new(&host, cpu_backend()).unwrap();
    let prompts: Vec<Vec<u32>> = (0..257).map(|i| prompt(i, v)).collect();
    let solos_gpu = solos(&gpu, &prompts);
    for (i, want) in solos(&cpu, &prompts).iter().enumerate() {
        same(&solos_gpu[i], want, &format!("moe: solo {i}, cuda vs cpu"));
    }
    for (n, cap) in [(1, 256), (3, 256), (64, 256), (65, 65), (257, 257)] {
        let runs = batched(&gpu, &prompts[..n], cap, n % 2 == 1);
        for (i, r) in runs.iter().enumerate() {
            same(r, &solos_gpu[i], &format!("moe: N = {n} (buffers of {cap}), sequence {i}"));
        }
    }
}

#[test]
fn gpu_copy_slot_then_both_continue_as_the_source() {
    if gpu().is_none() {
        return;
    }
    for dir in FIXTURES {
        let host = HostModel::open(&shared(dir)).unwrap();
        copy_then_continue(&Model::new(&host, cuda_backend()).unwrap(), dir);
    }
}

/// 65 and 128 rows sampled on the device (a temperature, top-k, a penalty window; 65 padded to
/// the bucket of 128) give the host sampler's ids for the same logits.
#[test]
fn gpu_samples_more_than_64_rows() {
    if gpu().is_none() {
        return;
    }
    let host = HostModel::open(&shared(FIXTURES[1])).unwrap();
    let v = host.config.vocab_size;
    let gpu = Model::new(&host, cuda_backend()).unwrap();
    for n in [65usize, 128] {
        let mut states = gpu.backend.new_states(&gpu.config).unwrap();
        let mut pre = gpu.scratch(MAX_PROMPT, 1).unwrap();
        let seqs: Vec<Seq> = (0..n)
            .map(|i| {
                let slot = gpu.backend.alloc_slot(&mut states).unwrap();
                prefill(&gpu, &mut states, &mut pre, slot, &prompt(i, v))
            })
            .collect();
        let params: Vec<SamplingParams> = (0..n).map(|i| SamplingParams { seed: i as u64, repetition_penalty: 1.1, repeat_last_n: 8, ..SamplingParams::default() }).collect();
        let rows: Vec<RowSampling> =
            seqs.iter().zip(&params).map(|(s, p)| RowSampling { params: *p, window: s.ids[s.ids.len().saturating_sub(8)..].to_vec(), position: s.ids.len() as u64 }).collect();
        assert!(gpu.backend.set_sampling(&rows).unwrap(), "{n} rows sample on the device");
        let batch = Batch {
            ids: seqs.iter().map(|s| *s.ids.last().unwrap()).collect(),
            seqs: seqs.iter().enumerate().map(|(r, s)| SeqRows { slot: s.slot, first_row: r as u32, len: 1, pos: s.pos as u32 }).collect(),
            logit_rows: (0..n as u32).collect(),
        };
        let mut scratch = gpu.scratch(128, 128).unwrap();
        let got = gpu.step_sample(&batch, &mut states, &mut scratch, v).unwrap();
        let mut logits = Vec::new();
        gpu.backend.read_tensor(&scratch.logits, n, &mut logits).unwrap();
        for (r, s) in seqs.iter().enumerate() {
            let want = sampling::sample(&logits[r * v..(r + 1) * v], &s.ids, s.ids.len() as u64, &params[r]);
            assert_eq!(got[r], want, "N = {n}, row {r}");
        }
        // More rows than set_sampling prepared: an error, and the backend goes on.
        let batch2 = Batch { ids: got.clone(), seqs: batch.seqs.iter().map(|s| SeqRows { pos: s.pos + 1, ..*s }).collect(), logit_rows: batch.logit_rows.clone() };
        assert!(gpu.backend.set_sampling(&rows[..1]).unwrap());
        assert!(matches!(gpu.step_sample(&batch2, &mut states, &mut scratch, v), Err(BackendError::Batch(_))));
    }
    // The limits are errors, not device faults, and the context lives on.
    let mut states = gpu.backend.new_states(&gpu.config).unwrap();
    let slot = gpu.backend.alloc_slot(&mut states).unwrap();
    let big = Batch::single(slot, 0, &vec![1; gpu.backend.max_rows() + 1], false);
    assert!(matches!(gpu.backend.begin_step(&mut states, &big), Err(BackendError::Batch(_))));
    let bad = Batch::single(slot, 0, &[v as u32], false);
    assert!(matches!(gpu.backend.begin_step(&mut states, &bad), Err(BackendError::TokenId { .. })));
    let s = solo(&gpu, &prompt(3, v));
    let again = solo(&gpu, &prompt(3, v));
    same(&again, &s, "after the refusals");
}

/// Prefix snapshots kept in CUDA slots (device copies; room for three, then idle time moves
/// the oldest to host memory): a prompt resumed from one at, before and after each stride
/// multiple gives the logits bits of the CPU's cold run, and so does its continuation.
#[test]
fn gpu_slot_snapshots_resume_with_the_cpu_bits() {
    use tensorfold::engine::Engine;
    use tensorfold::session::{snapshot_bytes, SnapshotConfig, SnapshotHome};
    if gpu().is_none() {
        return;
    }
    const STRIDE: usize = 8;
    let host = HostModel::open(&shared(FIXTURES[0])).unwrap();
    let v = host.config.vocab_size;
    let base = prompt_of_len(3, 4 * STRIDE, v);
    let more = prompt_of_len(4, 3, v);
    let mut cpu = Engine::new(Model::new(&host, cpu_backend()).unwrap(), 5).unwrap();
    let mut cold = |ids: &[u32]| {
        let mut s = cpu.new_session(SamplingParams::greedy()).unwrap();
        let l = bits(cpu.feed(&mut s, ids, false, &mut |_, _| {}).unwrap());
        cpu.free_session(s).unwrap();
        l
    };
    let mut e = Engine::new(Model::new(&host, cuda_backend()).unwrap(), 5).unwrap();
    let three = 3 * snapshot_bytes(&host.config, base.len());
    e.set_snapshots(SnapshotConfig { every: STRIDE, budget_bytes: 1 << 30, device_budget_bytes: three });
    let mut first = e.new_session(SamplingParams::greedy()).unwrap();
    e.prompt(&mut first, &base, &mut |_, _| {}).unwrap();
    while e.spill_idle() {}
    let mut homes: Vec<(usize, bool)> = e.snapshots().iter().map(|s| (s.tokens().len(), matches!(s.home(), SnapshotHome::Slot(_)))).collect();
    homes.sort();
    // 8 dropped; 16 and 24 spilled (three in slots is more than half the budget, one is not).
    assert_eq!(homes, vec![(16, false), (24, false), (32, true)]);
    for k in 1..=4 {
        for len in [k * STRIDE - 1, k * STRIDE, k * STRIDE + 1] {
            let mut p = base[..len.min(base.len())].to_vec();
            p.push(7);
            // The longest snapshot held (the ones above, and those of the prompts before)
            // that prefixes the prompt and leaves a token to feed.
            let want = e.snapshots().iter().map(|s| s.tokens()).filter(|t| t.len() < p.len() && p.starts_with(t)).map(<[u32]>::len).max().unwrap_or(0);
            let mut s = e.new_session(SamplingParams::greedy()).unwrap();
            let (reuse, logits) = e.prompt(&mut s, &p, &mut |_, _| {}).unwrap();
            assert_eq!(reuse.reused, want, "prompt of {}", p.len());
            assert!(bits(logits) == cold(&p), "prompt of {} resumed at {}: logits differ from the cpu", p.len(), reuse.reused);
            let cont = bits(e.feed(&mut s, &more, false, &mut |_, _| {}).unwrap());
            let full: Vec<u32> = p.iter().chain(&more).copied().collect();
            assert!(cont == cold(&full), "prompt of {} resumed at {}: continuation differs", p.len(), reuse.reused);
            e.free_session(s).unwrap();
        }
    }
}

//! `tensorfold verify`: the CPU reference and a GPU side by side, logits compared bit for bit
//! at every step; on a difference, the first layer and operation that differs.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use std::sync::Arc;
use tensorfold::backend::cpu::Cpu;
use tensorfold::backend::cuda::Cuda;
use tensorfold::backend::Products;
use tensorfold::engine::Engine;
use tensorfold::model::{HostModel, Model};
use tensorfold::runtime::{Event, FinishReason, Handle, Request, Runtime, RuntimeConfig, StopRules};
use tensorfold::sampling::argmax;
use tensorfold::sampling::SamplingParams;
use tensorfold::session::{Session, SnapshotConfig};
use tensorfold::tokenizer::Tokenizer;

#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// Model directory; default: the demo model.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Decode steps after the prompt.
    #[arg(long, default_value_t = 200)]
    pub steps: usize,
    /// Prompt text (default: "def fibonacci(n):").
    #[arg(short = 'p', long = "prompt", conflicts_with = "prompt_ids")]
    pub prompt: Option<String>,
    /// Prompt token ids, comma-separated.
    #[arg(long = "prompt-ids", value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// A prompt of this many pseudo-random ids (long-context checks).
    #[arg(long = "random-prompt")]
    pub random_prompt: Option<usize>,
    /// The GPU to compare against the CPU.
    #[arg(long, default_value = "cuda:0")]
    pub device: super::Device,
    /// Both sides (the CPU reference and --device) run the products given here.
    #[command(flatten)]
    pub products: super::ProductsArgs,
    /// Tokens per prompt step.
    #[arg(long, default_value_t = 256)]
    pub chunk: usize,
    /// Instead: N distinct requests through the batched runtime on --device (cpu allowed),
    /// arriving at different ticks, greedy and seeded sampling mixed, one cancelled midway,
    /// each compared bit for bit (ids and logits) with its solo run on the CPU.
    #[arg(long = "concurrency", value_name = "N")]
    pub concurrency: Option<usize>,
}

fn same(a: &[f32], b: &[f32]) -> (bool, f32) {
    let mut max = 0.0f32;
    let mut eq = a.len() == b.len();
    for (x, y) in a.iter().zip(b) {
        if x.to_bits() != y.to_bits() {
            eq = false;
            max = max.max((x - y).abs());
        }
    }
    (eq, max)
}

pub fn verify(a: VerifyArgs) -> Result<()> {
    // One mode for both sides: the CPU is the reference of that mode's bits.
    let products = a.products.resolve()?;
    if let Some(n) = a.concurrency {
        return concurrent(&a, n, products);
    }
    let super::Device::Cuda(ordinal) = a.device else { bail!("verify compares the CPU with a GPU: pass --device cuda[:N]") };
    let dir = super::model_dir(a.model.as_deref())?;
    let host = HostModel::open(&dir).with_context(|| format!("loading the model in {}", dir.display()))?;
    let vocab = host.config.vocab_size;
    let n_ids = Tokenizer::from_dir(&dir).map(|t| t.vocab_size().min(vocab)).unwrap_or(vocab);
    let prompt: Vec<u32> = if let Some(ids) = &a.prompt_ids {
        ids.clone()
    } else if let Some(n) = a.random_prompt {
        // SplitMix64 over the positions: a fixed, reproducible prompt of any length.
        (0..n as u64)
            .map(|i| {
                let mut z = i.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                ((z ^ (z >> 31)) % n_ids as u64) as u32
            })
            .collect()
    } else {
        let t = Tokenizer::from_dir(&dir)?;
        t.encode(a.prompt.as_deref().unwrap_or("def fibonacci(n):"))?
    };
    if prompt.is_empty() || prompt.iter().any(|&i| i as usize >= vocab) {
        bail!("the prompt must be non-empty ids below vocab_size {vocab}");
    }
    let gpu = super::run::cuda_backend(ordinal, products)?;
    let device = gpu.device_name();
    let mut ec = Engine::new(Model::new(&host, Cpu::new().with_products(products))?, a.chunk)?;
    let mut eg = Engine::new(Model::new(&host, gpu)?, a.chunk)?;

    // The portable functions on the device against the host, over a sweep of inputs.
    let xs: Vec<f32> = (0..200_000).map(|i| -120.0 + 240.0 * (i as f32 / 200_000.0)).chain([0.0, -0.0, 1e-40, 88.7, -103.9, f32::INFINITY, f32::NAN]).collect();
    let dev = eg.model.backend.numerics_check(&xs)?;
    let mut bad = 0;
    for (i, &x) in xs.iter().enumerate() {
        let host_v =
            [tensorfold::numerics::exp(x), tensorfold::numerics::log(x), tensorfold::numerics::softplus(x), tensorfold::numerics::sigmoid(x), tensorfold::numerics::silu(x)];
        for (k, h) in host_v.iter().enumerate() {
            let d = dev[5 * i + k];
            if d.to_bits() != h.to_bits() && !(d.is_nan() && h.is_nan()) {
                if bad < 5 {
                    eprintln!("numerics: f{k}({x:e}) host {h:e} device {d:e}");
                }
                bad += 1;
            }
        }
    }
    if bad > 0 {
        bail!("{bad} device evaluations of exp/log/softplus/sigmoid/silu differ from the host");
    }
    println!("numerics: exp, log, softplus, sigmoid, silu: {} inputs, device == host bit for bit", xs.len());

    let mut sc = ec.new_session(SamplingParams::greedy())?;
    let mut sg = eg.new_session(SamplingParams::greedy())?;
    let t0 = Instant::now();
    let lc = ec.feed(&mut sc, &prompt, true, &mut |_, _| {})?.to_vec();
    let lg = eg.feed(&mut sg, &prompt, true, &mut |_, _| {})?.to_vec();
    let (eq, max) = same(&lc, &lg);
    if !eq {
        let row = lc.chunks(vocab).zip(lg.chunks(vocab)).position(|(x, y)| !same(x, y).0).unwrap_or(0);
        println!("prompt: logits differ (max abs {max:e}), first at prompt position {row}");
        let mut fc = ec.new_session(SamplingParams::greedy())?;
        let mut fg = eg.new_session(SamplingParams::greedy())?;
        return diagnose(&mut ec, &mut eg, &mut fc, &mut fg, &prompt[..=row.min(prompt.len() - 1)]);
    }
    println!("prompt: {} tokens, {} logits rows bit-identical ({:.2} s)", prompt.len(), prompt.len(), t0.elapsed().as_secs_f64());

    let mut tok = argmax(&lc[lc.len() - vocab..][..n_ids]);
    let small = host.config.num_full_layers() * 2 * host.config.num_key_value_heads * host.config.head_dim * 4 * (prompt.len() + a.steps) < (512 << 20);
    let launches0 = eg.model.backend.launches();
    let t1 = Instant::now();
    for step in 0..a.steps {
        let pre = if small { Some((ec.export_state(&sc)?, sc.tokens().to_vec())) } else { None };
        let lc = ec.feed(&mut sc, &[tok], false, &mut |_, _| {})?.to_vec();
        let next_g = eg.feed_greedy(&mut sg, &[tok], n_ids, &mut |_, _| {})?;
        let lg = eg.decode_logits(1)?;
        let next_c = argmax(&lc[..n_ids]);
        let (eq, max) = same(&lc, &lg);
        if !eq || next_c != next_g {
            println!("decode step {step} (position {}): logits {} (max abs {max:e}), greedy ids cpu {next_c} gpu {next_g}", sc.position() - 1, if eq { "equal" } else { "differ" });
            if let Some((state, tokens)) = pre {
                let mut fc = ec.session_from_state(&state, &tokens, SamplingParams::greedy())?;
                let mut fg = eg.session_from_state(&state, &tokens, SamplingParams::greedy())?;
                return diagnose(&mut ec, &mut eg, &mut fc, &mut fg, &[tok]);
            }
            bail!("logits differ at decode step {step}");
        }
        tok = next_c;
        // Swapping the session out and back (into whichever slot is free) changes nothing.
        if step % 7 == 3 {
            eg.swap_out(&mut sg)?;
        }
    }
    let dt = t1.elapsed().as_secs_f64();
    let launches = eg.model.backend.launches() - launches0;
    println!(
        "decode: {} steps from position {}, logits bit-identical and greedy ids equal at every step; \
         {} graph(s) recorded, {} kernel launches recorded over the run (graph replays count 0); {:.2} s",
        a.steps,
        prompt.len(),
        eg.model.backend.graphs(),
        launches,
        dt
    );

    // Sampling on the device against the host sampler, from the same state: llama.cpp's
    // defaults with a repetition penalty, so every step of the contract runs.
    let params = SamplingParams { repetition_penalty: 1.1, ..SamplingParams::default() };
    sc.params = params;
    sg.params = params;
    let sample_steps = a.steps.min(100);
    let mut pending: Vec<u32> = vec![tok];
    for step in 0..sample_steps {
        let lc = ec.feed(&mut sc, &pending, false, &mut |_, _| {})?.to_vec();
        let mut sampler = tensorfold::sampling::Sampler::new();
        let next_c = sc.sample(&mut sampler, &lc[..n_ids]);
        let Some(next_g) = eg.feed_sample(&mut sg, &pending, n_ids, &mut |_, _| {})? else {
            bail!("the GPU did not accept sampling settings {params:?}");
        };
        let lg = eg.decode_logits(1)?;
        let (eq, max) = same(&lc, &lg);
        if !eq || next_c != next_g {
            bail!("sampling step {step}: logits {} (max abs {max:e}), sampled ids cpu {next_c} gpu {next_g}", if eq { "equal" } else { "differ" });
        }
        pending = vec![next_c];
    }
    println!(
        "sampling: {sample_steps} steps (temp {}, top-k {}, top-p {}, min-p {}, repeat-penalty {}): device ids == host ids",
        params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty
    );
    println!("verify: OK on {device} ({products} products on both)");
    Ok(())
}

/// Reruns one step on both backends operation by operation and names the first that differs.
fn diagnose(ec: &mut Engine<Cpu>, eg: &mut Engine<Cuda>, fc: &mut Session, fg: &mut Session, ids: &[u32]) -> Result<()> {
    eg.model.backend.set_graphs(false);
    let mut cpu = Vec::new();
    ec.probe_step(fc, ids, &mut |l, op, v| cpu.push((l, op.to_string(), v)))?;
    let mut gpu = Vec::new();
    eg.probe_step(fg, ids, &mut |l, op, v| gpu.push((l, op.to_string(), v)))?;
    for ((l, op, c), (_, _, g)) in cpu.iter().zip(&gpu) {
        let (eq, max) = same(c, g);
        if !eq {
            let layer = if *l == usize::MAX { "outside the layers".to_string() } else { format!("layer {l}") };
            bail!("first difference: {layer}, {op}: max abs error {max:e}");
        }
    }
    bail!("the step differs, but every operation's output matched when rerun eagerly (a graph-only difference)")
}

/// One request's outcome: ids, the bits of the logits rows they were sampled from, the finish.
struct Outcome {
    ids: Vec<u32>,
    logits: Vec<Vec<u32>>,
    reason: Option<FinishReason>,
}

fn drain(h: &mut Handle, cancel_after: Option<usize>) -> Outcome {
    let mut o = Outcome { ids: Vec::new(), logits: Vec::new(), reason: None };
    while let Some(ev) = h.blocking_next() {
        match ev {
            Event::Token(t) => {
                o.ids.push(t.id);
                o.logits.push(t.logits.unwrap_or_default().iter().map(|x| x.to_bits()).collect());
                if cancel_after == Some(o.ids.len()) {
                    h.cancel();
                }
            }
            Event::Finished(f) => {
                o.reason = Some(f.reason);
                break;
            }
            _ => {}
        }
    }
    o
}

/// The snapshot stride of the batched run of `verify --concurrency`: small enough that
/// prompts of a few hundred tokens take snapshots on the way.
const PREFIX_STRIDE: usize = 64;

/// `verify --concurrency N`.
fn concurrent(a: &VerifyArgs, n: usize, products: Products) -> Result<()> {
    if n == 0 {
        bail!("--concurrency must be at least 1");
    }
    let dir = super::model_dir(a.model.as_deref())?;
    let host = Arc::new(HostModel::open(&dir).with_context(|| format!("loading the model in {}", dir.display()))?);
    let vocab = host.config.vocab_size;
    let v_eff = Tokenizer::from_dir(&dir).map(|t| t.vocab_size().min(vocab)).unwrap_or(vocab);
    let steps = a.steps.max(2);
    let max_pos = host.config.max_position_embeddings;
    // Prompts of different lengths; greedy and seeded sampling alternate. Of the second half,
    // which arrives while the first decodes, some share a prefix with a prompt of the first
    // half, so the batched run resumes them from the prefix cache (its snapshots at the end of
    // prompts and every PREFIX_STRIDE positions, in device slots where the backend has them):
    // that prompt extended, that prompt again, and its first PREFIX_STRIDE + 1 tokens with new
    // ones after. The solo runs keep no snapshots, so each resumed sequence is compared with a
    // cold run.
    let first_wave = n.div_ceil(2);
    let room = max_pos.saturating_sub(steps + 1).max(1);
    let mut cases: Vec<(Vec<u32>, SamplingParams)> = Vec::with_capacity(n);
    for i in 0..n {
        let fresh = |len: usize, seed: u64| tensorfold::bench::ids(len.min(room), v_eff, seed);
        let mut prompt = fresh(1 + (i * 37) % 300, 100 + i as u64);
        if i >= first_wave {
            let earlier = &cases[i - first_wave].0;
            match i % 4 {
                1 => prompt = earlier.clone(),
                2 => prompt = earlier.iter().copied().chain(fresh(1 + i % 40, 900 + i as u64)).take(room).collect(),
                3 if earlier.len() > PREFIX_STRIDE + 1 => prompt = earlier[..PREFIX_STRIDE + 1].iter().copied().chain(fresh(1 + i % 30, 700 + i as u64)).take(room).collect(),
                _ => {}
            }
        }
        let p = if i % 2 == 0 { SamplingParams::greedy() } else { SamplingParams { seed: 7 + i as u64, repetition_penalty: 1.1, ..SamplingParams::default() } };
        cases.push((prompt, p));
    }
    let cancelled = n / 2;
    let request = |(p, sp): &(Vec<u32>, SamplingParams), unbounded: bool| {
        // The request to cancel asks for far more tokens, so it still runs when cancelled.
        let max_tokens = if unbounded { steps * 1000 } else { steps };
        let mut r = Request::new(p.clone(), *sp, StopRules { eos_ids: Vec::new(), strings: Vec::new(), max_tokens: Some(max_tokens) });
        r.return_logits = true;
        r
    };
    let chunk = a.chunk;
    let start = |device: super::Device, max_seqs: usize, snapshots: SnapshotConfig| -> Result<Runtime> {
        let h = host.clone();
        let cfg = RuntimeConfig { max_seqs, max_waiting: n.max(1), max_batch_tokens: chunk.max(max_seqs), chunk, state_budget: u64::MAX, snapshots, ..RuntimeConfig::default() };
        Ok(match device {
            super::Device::Cpu => Runtime::start(cfg, None, move || -> Result<_> { Ok(Engine::new(Model::new(&h, Cpu::new().with_products(products))?, chunk)?) })?,
            super::Device::Cuda(o) => Runtime::start(cfg, None, move || -> Result<_> { Ok(Engine::new(Model::new(&h, super::run::cuda_backend(o, products)?)?, chunk)?) })?,
        })
    };
    let t0 = Instant::now();
    let solo_rt = start(super::Device::Cpu, 1, SnapshotConfig::disabled())?;
    let solo: Vec<Outcome> = cases.iter().map(|c| Ok(drain(&mut solo_rt.submit(request(c, false))?, None))).collect::<Result<_>>()?;
    drop(solo_rt);
    println!("solo: {n} requests one at a time on the CPU, {steps} tokens each ({:.1} s)", t0.elapsed().as_secs_f64());

    let t1 = Instant::now();
    let rt = start(a.device, n, SnapshotConfig { every: PREFIX_STRIDE, budget_bytes: 1 << 30, device_budget_bytes: 1 << 30 })?;
    let backend = rt.info().backend.clone();
    // Half arrive at once; the others one by one as the first sequence generates.
    let mut handles: Vec<Handle> = cases[..first_wave].iter().enumerate().map(|(i, c)| rt.submit(request(c, i == cancelled && n > 1))).collect::<Result<_, _>>()?;
    let mut lead = Outcome { ids: Vec::new(), logits: Vec::new(), reason: None };
    let mut next = first_wave;
    while next < n {
        match handles[0].blocking_next() {
            Some(Event::Token(t)) => {
                lead.ids.push(t.id);
                lead.logits.push(t.logits.unwrap_or_default().iter().map(|x| x.to_bits()).collect());
                handles.push(rt.submit(request(&cases[next], next == cancelled && n > 1))?);
                next += 1;
            }
            Some(Event::Finished(f)) => {
                lead.reason = Some(f.reason);
                handles.extend(cases[next..].iter().enumerate().map(|(j, c)| rt.submit(request(c, next + j == cancelled && n > 1))).collect::<Result<Vec<_>, _>>()?);
                next = n;
            }
            Some(_) => {}
            None => bail!("the runtime stopped"),
        }
    }
    let mut bad = 0;
    for (i, h) in handles.iter_mut().enumerate() {
        let mut got = if i == 0 && lead.reason.is_some() {
            std::mem::replace(&mut lead, Outcome { ids: Vec::new(), logits: Vec::new(), reason: None })
        } else {
            drain(h, (i == cancelled && n > 1).then_some(steps / 2))
        };
        if i == 0 && !lead.ids.is_empty() {
            let mut ids = std::mem::take(&mut lead.ids);
            ids.extend(got.ids);
            got.ids = ids;
            let mut l = std::mem::take(&mut lead.logits);
            l.extend(got.logits);
            got.logits = l;
        }
        let want = &solo[i];
        let expect_cancel = i == cancelled && n > 1;
        // A cancelled request is compared over the tokens its solo run has.
        let k = got.ids.len().min(steps);
        let ok = got.ids[..k] == want.ids[..k]
            && got.logits[..k] == want.logits[..k]
            && if expect_cancel { got.reason == Some(FinishReason::Cancelled) && got.ids.len() >= steps / 2 } else { got.ids.len() == steps };
        if !ok {
            bad += 1;
            let at = got.ids.iter().zip(&want.ids).zip(got.logits.iter().zip(&want.logits)).position(|((a, b), (x, y))| a != b || x != y);
            println!(
                "sequence {i} (prompt {} tokens, {}): {k} tokens, {:?}; first difference at token {at:?}",
                cases[i].0.len(),
                if i % 2 == 0 { "greedy" } else { "sampled" },
                got.reason
            );
        }
    }
    let st = rt.stats();
    println!(
        "batched: {n} requests on {backend} ({:.1} s, {} ticks, {} preemptions, {} of {} prompts resumed from a snapshot, {} tokens reused)",
        t1.elapsed().as_secs_f64(),
        st.ticks,
        st.preemptions,
        st.prefix.hits,
        st.prefix.lookups,
        st.prefix.reused_tokens
    );
    if bad > 0 {
        bail!("{bad} of {n} sequences differ from their solo runs");
    }
    println!("verify --concurrency {n}: every sequence's ids and logits bit-identical to its solo CPU run (sequence {cancelled} cancelled once it had {} tokens)", steps / 2);
    Ok(())
}

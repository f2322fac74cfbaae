//! `tensorfold bench`: prompt processing and decode speed of a checkpoint, set against the
//! memory bandwidth and the FMA peak of the same machine measured in the same run.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use tensorfold::backend::cpu::{machine, Cpu};
use tensorfold::backend::{Backend, Products};
use tensorfold::bench::{self, Kind, Phase, Plan, Spread};
use tensorfold::engine::{Engine, DEFAULT_CHUNK};
use tensorfold::model::cost::Costs;
use tensorfold::model::weights::MatrixData;
use tensorfold::model::{HostModel, Model};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model directory; default: the demo model.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Prompt lengths to time (prompt processing from an empty sequence); default 128,512
    /// (--full: 128,512,4096).
    #[arg(short = 'p', long = "n-prompt", value_delimiter = ',')]
    pub prompts: Option<Vec<usize>>,
    /// Contexts at which to time decode; default 0,512 (--full: 0,512,4096).
    #[arg(short = 'c', long = "decode-context", value_delimiter = ',')]
    pub contexts: Option<Vec<usize>>,
    /// Tokens generated per decode phase.
    #[arg(short = 'n', long = "n-gen", default_value_t = 32)]
    pub decode_tokens: usize,
    /// Repetitions of every phase; the median and the spread are reported; default 2 (--full: 3).
    #[arg(short = 'r', long = "repetitions")]
    pub repeats: Option<usize>,
    /// The full sweep (pp128/512/4096, decode at 0/512/4096, 3 repetitions) instead of the quick
    /// default (pp128/512, decode at 0/512, 2 repetitions: about a minute on two cores).
    #[arg(long)]
    pub full: bool,
    /// Tokens per prompt-processing step.
    #[arg(long = "chunk", default_value_t = DEFAULT_CHUNK)]
    pub chunk: usize,
    /// Threads (default: `TENSORFOLD_THREADS`, else one per core).
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
    /// Where to run: `cpu`, `cuda` or `cuda:N` (each measures its own bandwidth and peak).
    #[arg(long = "device", default_value = "cpu")]
    pub device: super::Device,
    #[command(flatten)]
    pub products: super::ProductsArgs,
    /// GPU: also time every kernel of 32 decode tokens run without graphs (CUDA events) and print
    /// the device time per kernel; with --concurrency, of 16 steps of the largest level's rows.
    #[arg(long)]
    pub profile: bool,
    /// Also write the figures as JSON to this file.
    #[arg(long = "json")]
    pub json: Option<PathBuf>,
    /// Instead of the phases: this many requests at once through the batched runtime, for each
    /// value given (e.g. 1,8,32,64), each with a prompt of the first --n-prompt length and
    /// --n-gen generated tokens, greedy; beside the same sequences decoded by the backend
    /// driven directly.
    ///
    /// Columns (token times are when the step that computed the token returned):
    /// `decode t/s`: tokens of all sequences over the ticks where every one of them decodes
    /// (after the last sequence's first token, up to the first sequence's last), i.e. one row
    /// per sequence and no prompt chunk; `direct t/s`: the same sessions advanced by
    /// `Engine::step_sessions` in a plain loop, --n-gen − 1 steps of one row per sequence,
    /// greedy on the device, prompts fed beforehand and untimed; `vs direct`: the first over
    /// the second (the runtime's cost on the same steps); `window`: ticks in the decode window;
    /// `tick ms`: the median tick in that window and the median direct step (robust to stalls
    /// from other load); `tail t/s`: from the last sequence's first token to the very last token, so it also
    /// holds the ticks where sequences that started earlier have finished and fewer rows run
    /// (a tick holds max(--chunk, largest level) tokens, so prompts start a few per tick); `total
    /// t/s`: every prompt and generated token over submission to the last token; `ttft`: from
    /// submission; `itl`: gaps between a sequence's tokens; `host %`: the runtime thread's busy
    /// time outside model steps over its busy time, every tick of the level; `host/tick`: that
    /// time per tick. TENSORFOLD_TICK_LOG=FILE writes one line per tick (rows, step and host
    /// microseconds).
    #[arg(long = "concurrency", value_delimiter = ',', verbatim_doc_comment)]
    pub concurrency: Option<Vec<usize>>,
}

/// The arguments with the plan's defaults filled in.
struct Resolved {
    prompts: Vec<usize>,
    contexts: Vec<usize>,
    repeats: usize,
    products: Products,
    args: BenchArgs,
}

impl std::ops::Deref for Resolved {
    type Target = BenchArgs;
    fn deref(&self) -> &BenchArgs {
        &self.args
    }
}

/// What the device can do at best, measured in this run.
#[derive(Clone, Debug, serde::Serialize)]
struct MachineFigures {
    description: String,
    /// Copy bandwidth samples, bytes/s.
    copy_bandwidth: Vec<f64>,
    copy_bandwidth_method: String,
    /// Read bandwidth samples, bytes/s (CPU only: the ceiling of a phase that only reads).
    read_bandwidth: Vec<f64>,
    read_bandwidth_method: String,
    /// FLOP/s.
    fma_peak: f64,
    fma_peak_method: String,
}

#[derive(serde::Serialize)]
struct PhaseReport {
    name: String,
    #[serde(flatten)]
    phase: Phase,
    tokens_per_second: Spread,
    ms_per_token: Spread,
    /// Decode: bytes per token (averaged over the phase's contexts).
    bytes_per_token: Option<f64>,
    /// Decode: achieved GB/s (1e9 bytes) and % of the median copy bandwidth.
    gb_per_second: Option<Spread>,
    percent_of_bandwidth: Option<f64>,
    /// Decode on the CPU: achieved GB/s as % of the median read bandwidth.
    percent_of_read_bandwidth: Option<f64>,
    /// Prompt: achieved GFLOP/s and % of the FMA peak.
    gflop_per_second: Option<Spread>,
    percent_of_fma_peak: Option<f64>,
}

#[derive(serde::Serialize)]
struct Report {
    tool: &'static str,
    date: String,
    commit: String,
    cpu: String,
    model: String,
    model_summary: String,
    backend: String,
    machine: MachineFigures,
    copy_bandwidth_gb_s: Spread,
    read_bandwidth_gb_s: Option<Spread>,
    fma_peak_gflop_s: f64,
    chunk: usize,
    decode_tokens: usize,
    repetitions: usize,
    phases: Vec<PhaseReport>,
    /// Backend-specific facts (launches and waits per token on a GPU).
    notes: Vec<String>,
    definitions: Vec<&'static str>,
}

const DEFINITIONS: &[&str] = &[
    "decode bytes per token = every weight byte the token reads (packed codes, scales and biases of every projection, the whole LM head, one embedding row, the f32 norm/conv/gate vectors) + GDN conv and recurrent state read and written + KV cache read at the token's context + the new KV row written",
    "bandwidth = (bytes read + bytes written) / time of copying a large buffer into another with the whole device (CPU: memcpy of 512 MiB with every thread; GPU: a 1 GiB device-to-device copy), median; the machine line gives the method",
    "read bandwidth (CPU) = bytes / time of every thread summing its share of a 512 MiB buffer, median: a decode token mostly reads, so this is its ceiling; '% read' is decode GB/s over it",
    "prompt FLOPs = 2 x multiply-adds of every layer projection per token + the LM head for each chunk's last row + attention 4*Hq*Dh per (query, key) pair + delta rule 7*Hv*dv*dk per token per GDN layer (norms, conv, activations not counted)",
    "FMA peak = every core running independent chains of f32 FMAs, 2 FLOP per FMA (CPU: 12 chains per thread on the selected ISA; GPU: 8 chains per thread, 8 blocks of 256 per multiprocessor), best of 3",
    "decode generates greedily, one step per token, with the argmax taken where the logits are (on a GPU inside the step's CUDA graph); tokens/s counts the whole step as the host sees it",
];

/// The commit the binary was built from (build.rs: `git describe --always --dirty`).
fn commit() -> String {
    env!("TENSORFOLD_GIT_COMMIT").to_string()
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|s| s.trim().to_string()))
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// CPU: copy bandwidth (5 copies) and the FMA peak (best of 3, about 0.3 s each).
fn cpu_machine(cpu: &Cpu) -> MachineFigures {
    let probe = 200_000;
    let t = std::time::Instant::now();
    cpu.fma_peak(probe);
    let iters = ((0.3 / t.elapsed().as_secs_f64().max(1e-6)) * probe as f64) as usize;
    let peak = (0..3).map(|_| cpu.fma_peak(iters.max(probe))).fold(0.0, f64::max);
    MachineFigures {
        description: format!("{} thread(s), {}", cpu.threads(), cpu.isa().name()),
        copy_bandwidth: cpu.copy_bandwidth(5),
        copy_bandwidth_method: format!("memcpy of {} MiB with {} thread(s)", machine::COPY_BUFFER_BYTES >> 20, cpu.threads()),
        read_bandwidth: cpu.read_bandwidth(5),
        read_bandwidth_method: format!("sum of a {} MiB buffer as 64-bit words with {} thread(s)", machine::COPY_BUFFER_BYTES >> 20, cpu.threads()),
        fma_peak: peak,
        fma_peak_method: format!("12 chains x {} lanes of {} FMAs per thread, {} thread(s)", machine::lanes(cpu.isa()), cpu.isa().name(), cpu.threads()),
    }
}

fn gib(b: f64) -> String {
    format!("{:.1} MiB", b / (1u64 << 20) as f64)
}

pub fn bench(mut a: BenchArgs) -> Result<()> {
    // The quick default plan, or the full sweep; flags given win over both.
    let (prompts, contexts, repeats): (&[usize], &[usize], usize) = if a.full { (&[128, 512, 4096], &[0, 512, 4096], 3) } else { (&[128, 512], &[0, 512], 2) };
    let prompts = a.prompts.take().unwrap_or_else(|| prompts.to_vec());
    let contexts = a.contexts.take().unwrap_or_else(|| contexts.to_vec());
    let products = a.products.resolve()?;
    let a = Resolved { prompts, contexts, repeats: a.repeats.unwrap_or(repeats), products, args: a };
    // Arguments first, before a model loads or the machine is measured.
    if a.repeats == 0 {
        bail!("--repetitions must be at least 1");
    }
    if a.chunk == 0 {
        bail!("--chunk must be at least 1");
    }
    if a.prompts.contains(&0) {
        bail!("--n-prompt: a prompt of 0 tokens has nothing to time (give lengths of at least 1)");
    }
    let dir = super::model_dir(a.model.as_deref())?;
    let host = HostModel::open(&dir).with_context(|| format!("loading the model in {}", dir.display()))?;
    let costs = Costs::of(&host.config, &host.loaded.weights);
    let max_pos = host.config.max_position_embeddings;
    let top = a.prompts.iter().chain(&a.contexts).max().copied().unwrap_or(0) + a.decode_tokens;
    if top > max_pos {
        bail!("the bench would reach position {top}, beyond max_position_embeddings ({max_pos}) of {}", dir.display());
    }
    let quant = match &host.loaded.weights.embed_tokens.data {
        MatrixData::Affine { bits, group_size, .. } => format!("MLX affine {bits}-bit g{group_size}"),
        MatrixData::Float { dtype, .. } => format!("{dtype:?}"),
    };
    let model_summary = format!("{:.3} B parameters, {quant}, {} layers, hidden {}", costs.parameters as f64 / 1e9, host.config.num_hidden_layers, host.config.hidden_size);
    if let Some(levels) = &a.concurrency {
        return concurrency(&a, &dir, host, levels);
    }
    let plan = Plan { prompt_lens: a.prompts.clone(), decode_contexts: a.contexts.clone(), decode_tokens: a.decode_tokens, repeats: a.repeats };
    match a.device {
        super::Device::Cuda(n) => {
            let gpu = super::run::cuda_backend(n, a.products)?;
            eprintln!("measuring the device (copy bandwidth, FMA peak) ...");
            let m = MachineFigures {
                description: gpu.device_name(),
                copy_bandwidth: gpu.copy_bandwidth(1 << 30, 10)?,
                copy_bandwidth_method: "device-to-device copy of a 1 GiB buffer, bytes read + written, event-timed, 10 copies".into(),
                read_bandwidth: Vec::new(),
                read_bandwidth_method: String::new(),
                fma_peak: gpu.fma_peak()?,
                fma_peak_method: "8 independent fmaf chains per thread, 8 blocks of 256 threads per multiprocessor, event-timed, best of 3".into(),
            };
            let describe = gpu.describe();
            let model = Model::new(&host, gpu)?;
            let mut engine = Engine::new(model, a.chunk)?;
            print_header(&a, &dir, &model_summary, &describe, &m);
            let phases = bench::run(&mut engine, &costs, a.chunk, &plan, &mut |s| eprintln!("  {s}"), &mut |p| print_row(&phase_report(p.clone(), &m)))?;
            // What one decode token costs the host: launches and waits over 64 greedy tokens.
            let mut s = engine.new_session(tensorfold::sampling::SamplingParams::greedy())?;
            let v = engine.vocab_size();
            let mut tok = engine.feed_greedy(&mut s, &[1, 2, 3], v, &mut |_, _| {})?;
            let b = &engine.model.backend;
            let (l0, w0) = (b.launches(), b.host_waits());
            for _ in 0..64 {
                tok = engine.feed_greedy(&mut s, &[tok], v, &mut |_, _| {})?;
            }
            let b = &engine.model.backend;
            let launches = (b.launches() - l0) as f64 / 64.0;
            let waits = (b.host_waits() - w0) as f64 / 64.0;
            let nodes = b.decode_graph_nodes().unwrap_or(0);
            let mut notes = vec![format!("a decode token: 1 CUDA graph launch of {nodes} kernels + {launches:.1} other kernel launches, {waits:.1} host wait(s)")];
            // What limits decode: the chain of dependent kernels (timed empty) and the bytes
            // (at the copy bandwidth) are the two floors; the rest is work inside the kernels.
            // (A failure to time the empty graph only drops the line.)
            if let (true, Ok(chain)) = (nodes > 0, b.chain_floor(nodes as usize, 256)) {
                let bytes = phases.iter().find(|p| p.kind == Kind::Decode).map(|p| p.bytes as f64 / p.tokens as f64);
                let floor = bytes.map_or(String::new(), |b| format!("; its bytes at the median copy bandwidth take {:.3} ms", 1e3 * b / Spread::of(&m.copy_bandwidth).median));
                notes.push(format!(
                    "what limits decode: {nodes} dependent kernels cost {chain:.3} ms per token even empty (a graph of {nodes} kernels of 256 idle blocks){floor}; the rest of a token is the kernels' own latency and instruction issue"
                ));
            }
            if a.profile {
                // The same tokens eagerly, each kernel between two events.
                b.set_graphs(false);
                b.set_profile(true);
                let t = std::time::Instant::now();
                for _ in 0..32 {
                    tok = engine.feed_greedy(&mut s, &[tok], v, &mut |_, _| {})?;
                }
                let wall = t.elapsed().as_secs_f64() * 1e3 / 32.0;
                let b = &engine.model.backend;
                let rep = b.profile_report()?;
                b.set_profile(false);
                b.set_graphs(true);
                let total: f64 = rep.iter().map(|r| r.1).sum::<f64>() / 32.0;
                notes.push(format!("profile (32 eager decode tokens at context ~{}): {total:.3} ms of kernel time per token, {wall:.3} ms wall per eager token", s.position()));
                for (name, ms, n) in rep {
                    notes.push(format!("  {name:<36} {:>8.1} us/token  ({} launches/token, {:.2} us each)", 1e3 * ms / 32.0, n / 32, 1e3 * ms / n as f64));
                }
                // One prompt of the first length, eagerly, in the bench's chunks: where prefill goes.
                let len = a.prompts[0];
                let mut p = engine.new_session(tensorfold::sampling::SamplingParams::greedy())?;
                let ids: Vec<u32> = (0..len as u32).map(|i| 1 + i % (v as u32 - 1)).collect();
                let b = &engine.model.backend;
                b.set_graphs(false);
                b.set_profile(true);
                let t = std::time::Instant::now();
                engine.feed_greedy(&mut p, &ids, v, &mut |_, _| {})?;
                let wall = t.elapsed().as_secs_f64() * 1e3;
                let b = &engine.model.backend;
                let rep = b.profile_report()?;
                b.set_profile(false);
                b.set_graphs(true);
                let total: f64 = rep.iter().map(|r| r.1).sum::<f64>();
                notes.push(format!("profile (one eager prompt of {len} tokens in chunks of {}): {total:.3} ms of kernel time, {wall:.3} ms wall", a.chunk));
                for (name, ms, n) in rep {
                    notes.push(format!("  {name:<36} {:>9.3} ms  ({n} launches, {:.1} us each)", ms, 1e3 * ms / n as f64));
                }
            }
            let pre = m.clone();
            report(&a, &dir, model_summary, describe, &pre, m, phases, notes)
        }
        super::Device::Cpu => {
            let threads = a.threads.unwrap_or_else(|| Cpu::new().threads());
            let cpu = Cpu::with(tensorfold::backend::cpu::simd::Isa::detect(), threads).with_products(a.products);
            eprintln!("measuring the machine (copy bandwidth, FMA peak) ...");
            let mut m = cpu_machine(&cpu);
            let describe = cpu.describe();
            let model = Model::new(&host, cpu)?;
            print_header(&a, &dir, &model_summary, &describe, &m);
            let pre = m.clone();
            let phases = run(model, &costs, &a, &plan, &pre)?;
            // Bandwidth again after the phases (drift, other load).
            let cpu = Cpu::with(tensorfold::backend::cpu::simd::Isa::detect(), threads);
            m.copy_bandwidth.extend(cpu.copy_bandwidth(5));
            m.read_bandwidth.extend(cpu.read_bandwidth(5));
            report(&a, &dir, model_summary, describe, &pre, m, phases, Vec::new())
        }
    }
}

fn run<B: Backend>(model: Model<B>, costs: &Costs, a: &Resolved, plan: &Plan, m: &MachineFigures) -> Result<Vec<Phase>> {
    let mut engine = Engine::new(model, a.chunk)?;
    Ok(bench::run(&mut engine, costs, a.chunk, plan, &mut |s| eprintln!("  {s}"), &mut |p| print_row(&phase_report(p.clone(), m)))?)
}

/// A phase's figures against the machine's (measured before the phases).
fn phase_report(p: Phase, m: &MachineFigures) -> PhaseReport {
    let bw = Spread::of(&m.copy_bandwidth);
    let rbw = (!m.read_bandwidth.is_empty()).then(|| Spread::of(&m.read_bandwidth));
    let t = Spread::of(&p.seconds);
    let n = p.tokens as f64;
    let tps = t.map_decreasing(|s| n / s);
    let ms = Spread { median: 1e3 * t.median / n, min: 1e3 * t.min / n, max: 1e3 * t.max / n };
    let (mut bpt, mut gbs, mut pbw, mut prd, mut gfs, mut ppk) = (None, None, None, None, None, None);
    match p.kind {
        Kind::Decode => {
            let bytes = p.bytes as f64;
            bpt = Some(bytes / n);
            let g = t.map_decreasing(|s| bytes / s / 1e9);
            pbw = Some(100.0 * g.median * 1e9 / bw.median);
            prd = rbw.map(|r| 100.0 * g.median * 1e9 / r.median);
            gbs = Some(g);
        }
        Kind::Prompt => {
            let f = p.flops as f64;
            let g = t.map_decreasing(|s| f / s / 1e9);
            ppk = Some(100.0 * g.median * 1e9 / m.fma_peak);
            gfs = Some(g);
        }
    }
    PhaseReport {
        name: p.name(),
        phase: p,
        tokens_per_second: tps,
        ms_per_token: ms,
        bytes_per_token: bpt,
        gb_per_second: gbs,
        percent_of_bandwidth: pbw,
        percent_of_read_bandwidth: prd,
        gflop_per_second: gfs,
        percent_of_fma_peak: ppk,
    }
}

/// The lines before the table, and its header: printed before the phases run, so each row can
/// follow as soon as it is measured.
fn print_header(a: &Resolved, dir: &std::path::Path, model_summary: &str, backend: &str, m: &MachineFigures) {
    let date = jiff::fmt::strtime::format("%Y-%m-%d %H:%M:%S %Z", &jiff::ZonedDateTime::now()).unwrap_or_default();
    let bw = Spread::of(&m.copy_bandwidth);
    println!("tensorfold bench  {}  commit {}", date, commit());
    println!("model    {} ({})", dir.display(), model_summary);
    println!("device   {} on {}", backend, cpu_name());
    println!("machine  copy bandwidth {:.2} GB/s (median; {:.2}-{:.2}; {})", bw.median / 1e9, bw.min / 1e9, bw.max / 1e9, m.copy_bandwidth_method);
    if !m.read_bandwidth.is_empty() {
        let g = Spread::of(&m.read_bandwidth);
        println!(
            "         read bandwidth {:.2} GB/s (median; {:.2}-{:.2}; {}): the ceiling of decode, which mostly reads",
            g.median / 1e9,
            g.min / 1e9,
            g.max / 1e9,
            m.read_bandwidth_method
        );
    }
    println!("         f32 FMA peak {:.1} GFLOP/s ({})", m.fma_peak / 1e9, m.fma_peak_method);
    println!("{} repetitions per phase; median (min-max)", a.repeats);
    println!();
    let read_col = !m.read_bandwidth.is_empty();
    println!("{:<12} {:>22} {:>9} {:>13} {:>20} {:>8}{}", "phase", "tokens/s", "ms/tok", "bytes/tok", "GB/s | GFLOP/s", "% peak", if read_col { "   % read" } else { "" });
    let _ = std::io::Write::flush(&mut std::io::stdout());
}

/// One row of the table, printed as its phase finishes.
fn print_row(p: &PhaseReport) {
    let tps = format!("{:.1} ({:.1}-{:.1})", p.tokens_per_second.median, p.tokens_per_second.min, p.tokens_per_second.max);
    let (bytes, rate, pct) = match p.phase.kind {
        Kind::Decode => {
            let g = p.gb_per_second.unwrap();
            (gib(p.bytes_per_token.unwrap()), format!("{:.2} GB/s", g.median), format!("{:.0}% bw", p.percent_of_bandwidth.unwrap()))
        }
        Kind::Prompt => {
            let g = p.gflop_per_second.unwrap();
            ("-".to_string(), format!("{:.1} GFLOP/s", g.median), format!("{:.0}% fma", p.percent_of_fma_peak.unwrap()))
        }
    };
    let read = p.percent_of_read_bandwidth.map_or(String::new(), |x| format!(" {:>8}", format!("{x:.0}% rd")));
    println!("{:<12} {:>22} {:>9.2} {:>13} {:>20} {:>8}{read}", p.name, tps, p.ms_per_token.median, bytes, rate, pct);
    let _ = std::io::Write::flush(&mut std::io::stdout());
}

/// After the phases: notes, definitions and the JSON file. `pre` are the machine figures the
/// rows were computed against (measured before the phases); `m` adds any measured after.
#[allow(clippy::too_many_arguments)]
fn report(
    a: &Resolved,
    dir: &std::path::Path,
    model_summary: String,
    backend: String,
    pre: &MachineFigures,
    m: MachineFigures,
    phases: Vec<Phase>,
    notes: Vec<String>,
) -> Result<()> {
    let bw = Spread::of(&m.copy_bandwidth);
    let rbw = (!m.read_bandwidth.is_empty()).then(|| Spread::of(&m.read_bandwidth));
    let date = jiff::fmt::strtime::format("%Y-%m-%d %H:%M:%S %Z", &jiff::ZonedDateTime::now()).unwrap_or_default();
    let rows: Vec<PhaseReport> = phases.into_iter().map(|p| phase_report(p, pre)).collect();
    let r = Report {
        tool: "tensorfold bench",
        date,
        commit: commit(),
        cpu: cpu_name(),
        model: dir.display().to_string(),
        model_summary,
        backend,
        copy_bandwidth_gb_s: Spread { median: bw.median / 1e9, min: bw.min / 1e9, max: bw.max / 1e9 },
        read_bandwidth_gb_s: rbw.map(|r| Spread { median: r.median / 1e9, min: r.min / 1e9, max: r.max / 1e9 }),
        fma_peak_gflop_s: m.fma_peak / 1e9,
        machine: m,
        chunk: a.chunk,
        decode_tokens: a.decode_tokens,
        repetitions: a.repeats,
        phases: rows,
        notes,
        definitions: DEFINITIONS.to_vec(),
    };
    println!();
    if r.machine.copy_bandwidth.len() > pre.copy_bandwidth.len() {
        println!(
            "machine  after the phases, with the samples taken then: copy bandwidth {:.2} GB/s (median){}",
            r.copy_bandwidth_gb_s.median,
            r.read_bandwidth_gb_s.map_or(String::new(), |g| format!(", read bandwidth {:.2} GB/s", g.median))
        );
    }
    for n in &r.notes {
        println!("         {n}");
    }
    println!();
    for d in DEFINITIONS {
        println!("- {d}");
    }
    if let Some(path) = &a.json {
        let s = serde_json::to_string_pretty(&r)?;
        std::fs::write(path, s + "\n").with_context(|| format!("writing {}", path.display()))?;
        eprintln!("figures written to {}", path.display());
    }
    Ok(())
}

/// `bench --concurrency`: requests submitted together through the runtime, per level.
fn concurrency(a: &Resolved, dir: &std::path::Path, host: HostModel, levels: &[usize]) -> Result<()> {
    use std::sync::Arc;
    use tensorfold::runtime::{Runtime, RuntimeConfig};
    if levels.is_empty() || levels.contains(&0) {
        bail!("--concurrency: give levels of at least 1, e.g. 1,8,32,64");
    }
    let max = levels.iter().copied().max().unwrap_or(1);
    let prompt = a.prompts[0];
    let cfg = RuntimeConfig { max_seqs: max, max_waiting: max, max_batch_tokens: a.chunk.max(max), chunk: a.chunk, state_budget: u64::MAX, ..RuntimeConfig::default() };
    let (chunk, threads, products) = (a.chunk, a.threads, a.products);
    // The backend driven directly first (its own engine, dropped before the runtime starts).
    let mut direct = Vec::new();
    {
        let mut run_direct = |engine: &mut dyn FnMut(usize) -> Result<tensorfold::bench::Direct>| -> Result<()> {
            for &c in levels {
                direct.push(engine(c)?);
            }
            Ok(())
        };
        match a.device {
            super::Device::Cpu => {
                let mut e = Engine::new(Model::new(&host, super::run::cpu_backend(threads, products))?, chunk)?;
                run_direct(&mut |c| Ok(tensorfold::bench::direct(&mut e, c, prompt, a.decode_tokens, 1000, &mut |_, _| {})?))?;
            }
            super::Device::Cuda(n) => {
                let mut e = Engine::new(Model::new(&host, super::run::cuda_backend(n, products)?)?, chunk)?;
                run_direct(&mut |c| {
                    tensorfold::bench::direct(&mut e, c, prompt.min(16), 4, 1, &mut |_, _| {})?;
                    Ok(tensorfold::bench::direct(&mut e, c, prompt, a.decode_tokens, 1000, &mut |_, _| {})?)
                })?;
                if a.profile {
                    // Where a tick of many rows goes: the largest level's steps again, eagerly,
                    // each kernel between two events.
                    let (steps, mut report) = (16, Ok(Vec::new()));
                    tensorfold::bench::direct(&mut e, max, prompt, steps + 1, 1000, &mut |e, on| {
                        let b = &e.model.backend;
                        if !on {
                            report = b.profile_report();
                        }
                        b.set_graphs(!on);
                        b.set_profile(on);
                    })?;
                    let rep = report.map_err(anyhow::Error::from)?;
                    let total: f64 = rep.iter().map(|r| r.1).sum::<f64>() / steps as f64;
                    println!("profile (eager steps of {max} decode rows, {steps} steps): {total:.3} ms of kernel time per step");
                    for (name, ms, n) in rep {
                        println!("  {name:<44} {:>8.1} us/step  ({} launches/step, {:.2} us each)", 1e3 * ms / steps as f64, n / steps, 1e3 * ms / n as f64);
                    }
                }
            }
        }
    }
    let host = Arc::new(host);
    let h = host.clone();
    let rt = match a.device {
        super::Device::Cpu => Runtime::start(cfg, None, move || -> Result<_> { Ok(Engine::new(Model::new(&h, super::run::cpu_backend(threads, products))?, chunk)?) }),
        super::Device::Cuda(n) => Runtime::start(cfg, None, move || -> Result<_> { Ok(Engine::new(Model::new(&h, super::run::cuda_backend(n, products)?)?, chunk)?) }),
    }?;
    println!("model: {} ({}), commit {}", dir.display(), rt.info().backend, commit());
    println!(
        "{:>5} {:>7} {:>5} {:>12} {:>12} {:>9} {:>6} {:>13} {:>12} {:>12} {:>10} {:>10} {:>10} {:>10} {:>7} {:>9}",
        "conc",
        "prompt",
        "gen",
        "decode t/s",
        "direct t/s",
        "vs direct",
        "window",
        "tick ms",
        "tail t/s",
        "total t/s",
        "ttft med",
        "ttft p99",
        "itl med",
        "itl p99",
        "host %",
        "host/tick"
    );
    let mut rows = Vec::new();
    for (&c, &direct) in levels.iter().zip(&direct) {
        // Warm-up at this size (a device records its graphs for this batch shape).
        tensorfold::bench::concurrent(&rt, c, prompt.min(16), 4, 1).map_err(anyhow::Error::msg)?;
        let r = tensorfold::bench::concurrent(&rt, c, prompt, a.decode_tokens, 1000).map_err(anyhow::Error::msg)?;
        println!(
            "{:>5} {:>7} {:>5} {:>12.1} {:>12.1} {:>8.1}% {:>6} {:>13} {:>12.1} {:>12.1} {:>8.1}ms {:>8.1}ms {:>8.2}ms {:>8.2}ms {:>6.2}% {:>7.1}us",
            c,
            prompt,
            a.decode_tokens,
            r.decode_tokens_per_second,
            direct.tokens_per_second,
            100.0 * r.decode_tokens_per_second / direct.tokens_per_second,
            r.decode_window_ticks,
            format!("{:.2}|{:.2}", r.decode_tick_median * 1e3, direct.step_median * 1e3),
            r.tail_inclusive_tokens_per_second,
            r.total_tokens_per_second,
            r.ttft_median * 1e3,
            r.ttft_p99 * 1e3,
            r.itl_median * 1e3,
            r.itl_p99 * 1e3,
            r.host_share * 100.0,
            r.host_per_tick * 1e6
        );
        rows.push(serde_json::json!({ "runtime": r, "direct_decode_tokens_per_second": direct.tokens_per_second, "direct_step_median": direct.step_median }));
    }
    if let Some(p) = &a.json {
        let j =
            serde_json::json!({ "tool": "tensorfold bench --concurrency", "commit": commit(), "model": dir.display().to_string(), "backend": rt.info().backend, "levels": rows });
        std::fs::write(p, serde_json::to_string_pretty(&j)?).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

//! What computing grammar masks during the model step saves: the batched runtime decodes
//! constrained and unconstrained sequences together, once with the masks computed after each
//! step on the runtime's thread and once on helper threads while the step runs
//! (`RuntimeConfig::overlap_masks`), repetitions alternating, and prints per-tick step and
//! host time and tokens per second of each, and whether every sequence gave the same ids both
//! ways (it must).
//!
//! `cargo run --release --example grammar_overlap -- MODEL_DIR [--device cpu|cuda]
//! [--constrained 4] [--plain 4] [--tokens 64] [--reps 3] [--grammar tool|json]`. The model
//! directory needs a tokenizer (for a realistic mask cost, Qwen3.5's: the `vocab` fixture, or
//! `tensorfold synth` at a real size). `tool`: a forced call of a tool with a free-text
//! parameter (llguidance walks most of the token trie per token: the costly case); `json`: a
//! JSON schema. Random weights write long values, so sequences mostly run to `--tokens`.
//! Results: bench/results/.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tensorfold::backend::Backend;
use tensorfold::engine::{Engine, DEFAULT_CHUNK};
use tensorfold::grammar::{Constraint, Spec, Vocabulary};
use tensorfold::model::{HostModel, Model};
use tensorfold::runtime::{Event, FinishReason, Request, Runtime, RuntimeConfig, StopRules};
use tensorfold::sampling::SamplingParams;
use tensorfold::server::parse::ToolSchemas;
use tensorfold::server::{OutputFormat, ToolChoice};
use tensorfold::tokenizer::Tokenizer;

struct Args {
    dir: std::path::PathBuf,
    cuda: bool,
    constrained: usize,
    plain: usize,
    tokens: usize,
    reps: usize,
    tool: bool,
}

fn args() -> Args {
    let mut it = std::env::args().skip(1);
    let usage = "usage: grammar_overlap MODEL_DIR [--device cpu|cuda] [--constrained N] [--plain N] [--tokens N] [--reps N] [--grammar tool|json]";
    let mut a = Args { dir: it.next().expect(usage).into(), cuda: false, constrained: 4, plain: 4, tokens: 64, reps: 3, tool: true };
    while let Some(flag) = it.next() {
        let value = it.next().expect(usage);
        let n = || value.parse::<usize>().expect(usage);
        match flag.as_str() {
            "--device" => a.cuda = value == "cuda",
            "--constrained" => a.constrained = n(),
            "--plain" => a.plain = n(),
            "--tokens" => a.tokens = n(),
            "--reps" => a.reps = n(),
            "--grammar" => a.tool = value == "tool",
            _ => panic!("{usage}"),
        }
    }
    a
}

/// What one run gave: every sequence's ids, and the runtime's counters.
struct Outcome {
    ids: Vec<Vec<u32>>,
    wall: Duration,
    ticks: u64,
    step: Duration,
    host: Duration,
    generated: u64,
}

fn run<B: Backend + 'static>(a: &Args, overlap: bool, tokenizer: &Arc<Tokenizer>, constraint: &Constraint, make: impl FnOnce() -> Engine<B> + Send + 'static) -> Outcome {
    let n = a.constrained + a.plain;
    let cfg = RuntimeConfig { max_seqs: n, max_waiting: n, max_batch_tokens: 512, state_budget: u64::MAX, overlap_masks: overlap, ..RuntimeConfig::default() };
    let rt = Runtime::start(cfg, Some(tokenizer.clone()), move || Ok::<_, String>(make())).expect("the runtime starts");
    let prompt = tokenizer.encode_with("Call the tool that fits the question: what is the weather in Oslo this week?\n", false).expect("encode");
    let t = Instant::now();
    let mut handles: Vec<_> = (0..n)
        .map(|i| {
            // Seeded sampling for the constrained (the mask decides among many ids), greedy
            // for the others.
            let params = if i < a.constrained { SamplingParams { seed: 10 + i as u64, ..SamplingParams::default() } } else { SamplingParams::greedy() };
            let mut r = Request::new(prompt.clone(), params, StopRules { eos_ids: tokenizer.eos_ids().to_vec(), strings: Vec::new(), max_tokens: Some(a.tokens) });
            if i < a.constrained {
                r.constraint = Some(constraint.clone());
            }
            rt.submit(r).expect("submitted")
        })
        .collect();
    let mut ids = Vec::with_capacity(n);
    for h in &mut handles {
        let mut got = Vec::new();
        while let Some(e) = h.blocking_next() {
            match e {
                Event::Token(t) => got.push(t.id),
                Event::Finished(f) => {
                    assert!(!matches!(f.reason, FinishReason::Error(_)), "a sequence failed: {:?}", f.reason);
                    break;
                }
                _ => {}
            }
        }
        ids.push(got);
    }
    let wall = t.elapsed();
    // The stats are published after the last tick's events.
    std::thread::sleep(Duration::from_millis(50));
    let s = rt.stats();
    Outcome { ids, wall, ticks: s.ticks, step: s.step_time, host: s.host_time, generated: s.generated_tokens }
}

fn main() {
    let a = args();
    let tokenizer = Arc::new(Tokenizer::from_dir(&a.dir).expect("the model's tokenizer"));
    let vocab = Arc::new(Vocabulary::of(&tokenizer).expect("token table"));
    let mut tools = ToolSchemas::new();
    tools.insert("get_weather", Some(&json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]})));
    tools.insert("search", Some(&json!({"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}})));
    let schema = OutputFormat::JsonSchema {
        name: "person".into(),
        schema: Some(
            json!({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age"]}),
        ),
        strict: true,
    };
    let none = ToolSchemas::new();
    let spec = if a.tool {
        Spec { format: &OutputFormat::Text, tools: &tools, tool_choice: &ToolChoice::Required, parallel_tool_calls: false, starts_in_reasoning: false }
    } else {
        Spec { format: &schema, tools: &none, tool_choice: &ToolChoice::Auto, parallel_tool_calls: false, starts_in_reasoning: false }
    };
    let constraint = Constraint::build(&vocab, &spec).expect("builds").expect("constrains");
    println!(
        "{}: {} constrained ({}) + {} plain sequences, {} tokens each, {} repetitions per mode (after one warm-up each), {} cores",
        a.dir.display(),
        a.constrained,
        if a.tool { "forced tool call, free-text parameter" } else { "json_schema" },
        a.plain,
        a.tokens,
        a.reps,
        std::thread::available_parallelism().map_or(1, usize::from)
    );
    let mut results: [Vec<Outcome>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..=a.reps {
        for overlap in [false, true] {
            let dir = a.dir.clone();
            let o = if a.cuda {
                run(&a, overlap, &tokenizer, &constraint, move || {
                    let host = HostModel::open(&dir).expect("the model opens");
                    let backend = tensorfold::backend::cuda::Cuda::new(0).expect("CUDA device 0");
                    Engine::new(Model::new(&host, backend).expect("model"), DEFAULT_CHUNK).expect("engine")
                })
            } else {
                run(&a, overlap, &tokenizer, &constraint, move || {
                    let host = HostModel::open(&dir).expect("the model opens");
                    Engine::new(Model::new(&host, tensorfold::backend::cpu::Cpu::new()).expect("model"), DEFAULT_CHUNK).expect("engine")
                })
            };
            // The warm-up (rep 0) is timed out below; its ids still have to agree.
            results[usize::from(overlap)].push(o);
        }
    }
    let same = results[0].iter().chain(&results[1]).all(|o| o.ids == results[0][0].ids);
    for (overlap, runs) in results.iter().enumerate() {
        let runs = &runs[1..];
        let per_tick = |o: &Outcome, d: Duration| d.as_secs_f64() * 1e3 / o.ticks.max(1) as f64;
        let med = |mut xs: Vec<f64>| {
            xs.sort_by(f64::total_cmp);
            xs[xs.len() / 2]
        };
        let step = med(runs.iter().map(|o| per_tick(o, o.step)).collect());
        let host = med(runs.iter().map(|o| per_tick(o, o.host)).collect());
        let tps = med(runs.iter().map(|o| o.generated as f64 / o.wall.as_secs_f64()).collect());
        let ticks = med(runs.iter().map(|o| o.ticks as f64).collect());
        println!(
            "{:<26} per tick: step {step:.3} ms + host {host:.3} ms = {:.3} ms; {ticks:.0} ticks; {tps:.1} tok/s (medians of {})",
            if overlap == 1 { "masks during the step" } else { "masks after the step" },
            step + host,
            runs.len()
        );
    }
    // The mask work itself: each constrained sequence's ids replayed through its constraint on
    // this thread alone (what the serial mode adds to a tick's host time).
    let first = &results[0][0];
    let mut row = vec![0.0f32; vocab.len()];
    let t = Instant::now();
    let mut masks = 0usize;
    for ids in &first.ids[..a.constrained] {
        let mut c = constraint.clone();
        for &id in ids {
            c.mask(&mut row).expect("mask");
            c.advance(id).expect("the run's ids follow the grammar");
            masks += 1;
        }
    }
    let work = t.elapsed().as_secs_f64() * 1e3;
    println!(
        "mask + advance replayed alone: {:.0} us per token, {:.3} ms per tick of the serial run ({masks} tokens, {} ticks)",
        work * 1e3 / masks.max(1) as f64,
        work / first.ticks.max(1) as f64,
        first.ticks
    );
    println!("ids identical in every run and mode: {same}");
    assert!(same, "overlapping the masks changed the output");
}

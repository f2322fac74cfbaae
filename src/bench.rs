//! The benchmark behind `tensorfold bench`: prompt processing and decode phases timed through the
//! [`Engine`] API only, so any backend runs the same timed code. What the phases are compared
//! with (memory bandwidth, FMA peak) is measured by the caller for its device.
//!
//! Definitions (ARCHITECTURE.md, "Performance definitions"):
//! - a **prompt phase** `pp N` feeds `N` tokens to an empty sequence in chunks and times it;
//!   FLOPs are [`Costs::prefill_flops`];
//! - a **decode phase** `tg D @ C` generates `D` tokens greedily, one step each
//!   ([`Engine::feed_greedy`]: the argmax is taken where the logits are), in a sequence already
//!   holding `C` tokens, and times them; bytes are [`Costs::decode_bytes`] at each token's
//!   context, summed.

use crate::backend::{Backend, BackendError};
use crate::engine::Engine;
use crate::model::cost::Costs;
use crate::sampling::SamplingParams;
use crate::session::Session;

/// What to run.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Prompt lengths of the prompt-processing phases.
    pub prompt_lens: Vec<usize>,
    /// Context lengths at which decode is timed.
    pub decode_contexts: Vec<usize>,
    /// Tokens generated per decode phase.
    pub decode_tokens: usize,
    /// Repetitions of every phase (interleaved: repeat 1 of every phase, then repeat 2, …).
    pub repeats: usize,
}

/// Prompt processing or decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Prompt,
    Decode,
}

/// One phase's timings and work.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Phase {
    pub kind: Kind,
    /// Tokens fed per repetition.
    pub tokens: usize,
    /// Tokens already in the sequence when the phase starts.
    pub context: usize,
    /// Wall seconds of each repetition.
    pub seconds: Vec<f64>,
    /// FLOPs of one repetition (prompt phases).
    pub flops: u64,
    /// Bytes one repetition must move (decode phases).
    pub bytes: u64,
}

impl Phase {
    /// `pp512`, `tg@4096`.
    pub fn name(&self) -> String {
        match self.kind {
            Kind::Prompt => format!("pp{}", self.tokens),
            Kind::Decode => format!("tg{}@{}", self.tokens, self.context),
        }
    }
}

/// Median, minimum and maximum of a sample.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// Of a non-empty sample (the median of an even count is the mean of the middle two).
    pub fn of(xs: &[f64]) -> Self {
        let mut v = xs.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 { v[n / 2] } else { 0.5 * (v[n / 2 - 1] + v[n / 2]) };
        Self { median, min: v[0], max: v[n - 1] }
    }

    /// The spread of `f(x)` for a monotone decreasing `f` (times → rates).
    pub fn map_decreasing(&self, f: impl Fn(f64) -> f64) -> Self {
        Self { median: f(self.median), min: f(self.max), max: f(self.min) }
    }
}

/// Deterministic token ids in `0..vocab` (a 64-bit LCG): the benchmark's input does not depend
/// on a tokenizer, and every run feeds the same ids.
pub fn ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Runs `plan` on `engine`. `chunk` is the engine's prompt chunk (for the logits rows the
/// prompt phases compute); `progress` receives a line before each timed phase, and `done` each
/// phase as soon as its last repetition is timed (so a caller can print it then).
pub fn run<B: Backend>(
    engine: &mut Engine<B>,
    costs: &Costs,
    chunk: usize,
    plan: &Plan,
    progress: &mut dyn FnMut(&str),
    done: &mut dyn FnMut(&Phase),
) -> Result<Vec<Phase>, BackendError> {
    let vocab = engine.vocab_size();
    let d = plan.decode_tokens.max(1);
    let mut prompts: Vec<usize> = plan.prompt_lens.iter().copied().filter(|&n| n > 0).collect();
    prompts.sort_unstable();
    prompts.dedup();
    let mut contexts = plan.decode_contexts.clone();
    contexts.sort_unstable();
    contexts.dedup();
    let mut phases: Vec<Phase> = Vec::new();
    let decode_bytes = |c: usize| (0..d).map(|i| costs.decode_bytes(c + i)).sum::<u64>();
    for &n in &prompts {
        phases.push(Phase { kind: Kind::Prompt, tokens: n, context: 0, seconds: Vec::new(), flops: costs.prefill_flops(0, n, n.div_ceil(chunk)), bytes: 0 });
    }
    for &c in &contexts {
        phases.push(Phase { kind: Kind::Decode, tokens: d, context: c, seconds: Vec::new(), flops: 0, bytes: decode_bytes(c) });
    }
    let find =
        |phases: &[Phase], kind: Kind, key: usize| phases.iter().position(|p| p.kind == kind && if kind == Kind::Prompt { p.tokens == key } else { p.context == key }).unwrap();

    // Warm-up, untimed: touches every weight page and grows the buffers.
    {
        let mut seq = engine.new_session(SamplingParams::greedy())?;
        let mut next = engine.feed_greedy(&mut seq, &ids(16.min(chunk.max(2)), vocab, 99), vocab, &mut |_, _| {})?;
        for _ in 0..4 {
            next = engine.feed_greedy(&mut seq, &[next], vocab, &mut |_, _| {})?;
        }
        engine.free_session(seq)?;
    }

    // `d` greedy steps from `first`; seconds.
    let decode = |engine: &mut Engine<B>, seq: &mut Session, first: u32| -> Result<f64, BackendError> {
        let t = std::time::Instant::now();
        let mut next = first;
        for _ in 0..d {
            next = engine.feed_greedy(seq, &[next], vocab, &mut |_, _| {})?;
        }
        std::hint::black_box(next);
        Ok(t.elapsed().as_secs_f64())
    };

    for r in 0..plan.repeats.max(1) {
        let seed = 1000 * (r as u64 + 1);
        // Decode from an empty sequence.
        if contexts.first() == Some(&0) {
            progress(&format!("repeat {}/{}: tg{d}@0", r + 1, plan.repeats));
            let mut seq = engine.new_session(SamplingParams::greedy())?;
            let s = decode(engine, &mut seq, ids(1, vocab, seed)[0])?;
            engine.free_session(seq)?;
            let i = find(&phases, Kind::Decode, 0);
            phases[i].seconds.push(s);
            if r + 1 == plan.repeats.max(1) {
                done(&phases[i]);
            }
        }
        // Prompts, each followed by decode at that context when asked.
        for &n in &prompts {
            progress(&format!("repeat {}/{}: pp{n}", r + 1, plan.repeats));
            let mut seq = engine.new_session(SamplingParams::greedy())?;
            let toks = ids(n, vocab, seed + n as u64);
            let t = std::time::Instant::now();
            let next = engine.feed_greedy(&mut seq, &toks, vocab, &mut |_, _| {})?;
            let s = t.elapsed().as_secs_f64();
            let i = find(&phases, Kind::Prompt, n);
            phases[i].seconds.push(s);
            if r + 1 == plan.repeats.max(1) {
                done(&phases[i]);
            }
            if contexts.contains(&n) {
                progress(&format!("repeat {}/{}: tg{d}@{n}", r + 1, plan.repeats));
                let s = decode(engine, &mut seq, next)?;
                let i = find(&phases, Kind::Decode, n);
                phases[i].seconds.push(s);
                if r + 1 == plan.repeats.max(1) {
                    done(&phases[i]);
                }
            }
            engine.free_session(seq)?;
        }
        // Decode contexts no prompt phase reaches: fill untimed, then decode.
        for &c in contexts.iter().filter(|&&c| c > 0 && !prompts.contains(&c)) {
            progress(&format!("repeat {}/{}: tg{d}@{c} (filling {c} tokens)", r + 1, plan.repeats));
            let mut seq = engine.new_session(SamplingParams::greedy())?;
            let next = engine.feed_greedy(&mut seq, &ids(c, vocab, seed + 7), vocab, &mut |_, _| {})?;
            let s = decode(engine, &mut seq, next)?;
            engine.free_session(seq)?;
            let i = find(&phases, Kind::Decode, c);
            phases[i].seconds.push(s);
            if r + 1 == plan.repeats.max(1) {
                done(&phases[i]);
            }
        }
    }
    Ok(phases)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_and_ids() {
        let s = Spread::of(&[3.0, 1.0, 2.0, 10.0]);
        assert_eq!((s.median, s.min, s.max), (2.5, 1.0, 10.0));
        let r = Spread::of(&[2.0, 4.0, 1.0]).map_decreasing(|t| 8.0 / t);
        assert_eq!((r.median, r.min, r.max), (4.0, 2.0, 8.0));
        let a = ids(1000, 50, 3);
        assert!(a.iter().all(|&i| i < 50));
        assert_eq!(a, ids(1000, 50, 3));
        assert_ne!(a, ids(1000, 50, 4));
        // Every id appears: the generator is not stuck in a short cycle.
        assert!((0..50).all(|v| a.contains(&v)));
    }
}

/// The figures of one concurrency level ([`concurrent`]). Token times are the runtime's
/// [`Token::at`](crate::runtime::Token::at) stamps (when the step that computed the token
/// returned), measured from submission.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Concurrent {
    /// Requests submitted together.
    pub concurrency: usize,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Tokens per second of all sequences together while every one of them decodes: the ticks
    /// after the last sequence's first token up to the first sequence's last token. Those ticks
    /// carry one decode row per sequence and no prompt chunk, the steps [`direct`] times, so
    /// the two figures compare like for like.
    pub decode_tokens_per_second: f64,
    /// Ticks in that window, and rows per tick in it (the concurrency, unless a budget cut it).
    pub decode_window_ticks: usize,
    pub decode_window_rows_per_tick: f64,
    /// Median time from one tick's step end to the next in that window, seconds: robust to the
    /// stalls another process's load puts into a few ticks (compare [`Direct::step_median`]).
    pub decode_tick_median: f64,
    /// Tokens after the last sequence's first token over the time from then to the last
    /// token: the window also holds the tail where sequences that started earlier have
    /// finished and fewer rows run (what `decode t/s` measured before 2026-12-03).
    pub tail_inclusive_tokens_per_second: f64,
    /// Every token of every sequence (prompts included) over the time from submission to the
    /// last token.
    pub total_tokens_per_second: f64,
    /// Time to first token, seconds (from submission).
    pub ttft_median: f64,
    pub ttft_p99: f64,
    /// Gaps between a sequence's consecutive tokens, seconds.
    pub itl_median: f64,
    pub itl_p99: f64,
    /// The runtime thread's busy time outside model steps ([`Stats::host_time`]) as a share of
    /// its busy time, over every tick of the level (prompt ticks included).
    ///
    /// [`Stats::host_time`]: crate::runtime::Stats::host_time
    pub host_share: f64,
    /// Ticks of the level, and host seconds per tick.
    pub ticks: u64,
    pub host_per_tick: f64,
    pub seconds: f64,
}

/// The `q`-quantile of a sample (nearest rank).
fn quantile(xs: &mut [f64], q: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    let i = ((q * xs.len() as f64).ceil() as usize).clamp(1, xs.len()) - 1;
    xs[i]
}

/// The runtime's stats once its thread is idle (it publishes a tick's stats after sending that
/// tick's events, so the last `Finished` can arrive first); at most a second's wait.
fn settled(rt: &crate::runtime::Runtime) -> crate::runtime::Stats {
    let t = std::time::Instant::now();
    loop {
        let s = rt.stats();
        if (s.running == 0 && s.waiting == 0) || t.elapsed().as_secs() >= 1 {
            return s;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Submits `c` greedy requests of `prompt_len` distinct ids each, every one generating exactly
/// `generate` tokens (no end-of-sequence ids), all at once, and times their tokens.
///
/// The client reads the events every 20 ms rather than as they come: its times are the
/// runtime's stamps, and each wake of its thread takes a core from the step on a machine whose
/// cores the step uses (2-core CPU: polling every 50 us cost the steps 10-30 %, reading every
/// 2 ms still about 9 % of the median tick at 8 streams).
///
/// # Errors
/// A request the runtime refuses, or one that does not finish by length.
pub fn concurrent(rt: &crate::runtime::Runtime, c: usize, prompt_len: usize, generate: usize, seed: u64) -> Result<Concurrent, String> {
    use crate::runtime::{Event, FinishReason, Request, StopRules};
    use std::time::Instant;
    let vocab = rt.info().v_eff;
    let before = settled(rt);
    let t0 = Instant::now();
    let mut handles = Vec::with_capacity(c);
    for i in 0..c {
        let r = Request::new(ids(prompt_len, vocab, seed + i as u64), SamplingParams::greedy(), StopRules { eos_ids: Vec::new(), strings: Vec::new(), max_tokens: Some(generate) });
        handles.push(rt.submit(r).map_err(|e| e.to_string())?);
    }
    // Token times per sequence, seconds from submission (the channels keep every event).
    let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(generate); c];
    let mut open: Vec<bool> = vec![true; c];
    while open.iter().any(|&o| o) {
        for (i, h) in handles.iter_mut().enumerate() {
            while open[i] {
                match h.try_next() {
                    Some(Event::Token(t)) => times[i].push(t.at.saturating_duration_since(t0).as_secs_f64()),
                    Some(Event::Finished(f)) => {
                        open[i] = false;
                        if f.reason != FinishReason::Length {
                            return Err(format!("request {i} ended by {:?}", f.reason));
                        }
                    }
                    Some(_) => {}
                    None => break,
                }
            }
        }
        if open.iter().any(|&o| o) {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    let after = settled(rt);
    let first = |t: &Vec<f64>| t.first().copied();
    let last = |t: &Vec<f64>| t.last().copied();
    let all_started = times.iter().filter_map(first).fold(0.0, f64::max);
    let first_done = times.iter().filter_map(last).fold(f64::INFINITY, f64::min);
    let end = times.iter().filter_map(last).fold(0.0, f64::max);
    // Every token of a tick has the same stamp, so a window bounded by stamps holds whole ticks.
    let in_full: Vec<f64> = times.iter().flatten().copied().filter(|&t| t > all_started && t <= first_done).collect();
    let mut full_ticks = in_full.clone();
    full_ticks.sort_by(f64::total_cmp);
    full_ticks.dedup();
    let mut periods: Vec<f64> = std::iter::once(all_started).chain(full_ticks.iter().copied()).collect::<Vec<_>>().windows(2).map(|w| w[1] - w[0]).collect();
    let in_tail = times.iter().flatten().filter(|&&t| t > all_started).count();
    let mut ttft: Vec<f64> = times.iter().filter_map(first).collect();
    let mut itl: Vec<f64> = times.iter().flat_map(|t| t.windows(2).map(|w| w[1] - w[0])).collect();
    let host = (after.host_time - before.host_time).as_secs_f64();
    let step = (after.step_time - before.step_time).as_secs_f64();
    let ticks = after.ticks - before.ticks;
    let rate = |n: usize, dt: f64| if dt > 0.0 { n as f64 / dt } else { f64::NAN };
    Ok(Concurrent {
        concurrency: c,
        prompt_tokens: prompt_len,
        generated_tokens: generate,
        decode_tokens_per_second: rate(in_full.len(), first_done - all_started),
        decode_window_ticks: full_ticks.len(),
        decode_window_rows_per_tick: in_full.len() as f64 / full_ticks.len() as f64,
        decode_tick_median: quantile(&mut periods, 0.5),
        tail_inclusive_tokens_per_second: rate(in_tail, end - all_started),
        total_tokens_per_second: rate(c * (prompt_len + generate), end),
        ttft_median: quantile(&mut ttft, 0.5),
        ttft_p99: quantile(&mut ttft, 0.99),
        itl_median: quantile(&mut itl, 0.5),
        itl_p99: quantile(&mut itl, 0.99),
        host_share: host / (host + step),
        ticks,
        host_per_tick: host / ticks.max(1) as f64,
        seconds: end,
    })
}

/// The same work as [`concurrent`] without the runtime: `c` sessions, each prompt fed alone,
/// then `generate − 1` steps of all `c` rows at once through [`Engine::step_sessions`] with
/// greedy choice on the device; times those steps (the backend driven directly, the floor the
/// runtime's ticks are measured against). `around_steps` is called with `true` after the prompts
/// and with `false` after the last step (a profiler switched on for the steps alone).
///
/// # Errors
/// The backend's.
pub fn direct<B: Backend>(
    engine: &mut Engine<B>,
    c: usize,
    prompt_len: usize,
    generate: usize,
    seed: u64,
    around_steps: &mut dyn FnMut(&Engine<B>, bool),
) -> Result<Direct, BackendError> {
    use crate::engine::{Choose, Chosen, StepRows};
    let vocab = engine.vocab_size();
    let mut sessions = Vec::with_capacity(c);
    for i in 0..c {
        let mut s = engine.new_session(SamplingParams::greedy())?;
        let first = engine.feed_greedy(&mut s, &ids(prompt_len, vocab, seed + i as u64), vocab, &mut |_, _| {})?;
        s.push(first);
        sessions.push(s);
    }
    engine.set_batch_capacity(c);
    around_steps(engine, true);
    let t0 = std::time::Instant::now();
    let steps = generate.saturating_sub(1).max(1);
    let mut periods = Vec::with_capacity(steps);
    let mut prev = t0;
    for _ in 0..steps {
        let mut rows: Vec<StepRows<'_>> = sessions.iter_mut().map(|s| StepRows { session: s, take: 1, logits: true, all_logits: false, snapshot: false }).collect();
        let Chosen::Ids(next) = engine.step_sessions(&mut rows, Choose::Greedy { v_eff: vocab })? else { unreachable!("greedy steps return ids") };
        for (s, id) in sessions.iter_mut().zip(next) {
            s.push(id);
        }
        let now = std::time::Instant::now();
        periods.push((now - prev).as_secs_f64());
        prev = now;
    }
    let dt = t0.elapsed().as_secs_f64();
    around_steps(engine, false);
    for s in sessions {
        engine.free_session(s)?;
    }
    Ok(Direct { tokens_per_second: (steps * c) as f64 / dt, step_median: quantile(&mut periods, 0.5) })
}

/// What [`direct`] measures.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Direct {
    /// Tokens of all sequences over the steps' time.
    pub tokens_per_second: f64,
    /// Median time of one step (with the loop's own work), seconds.
    pub step_median: f64,
}

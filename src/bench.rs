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
/// prompt phases compute); `progress` receives a line before each timed phase.
pub fn run<B: Backend>(engine: &mut Engine<B>, costs: &Costs, chunk: usize, plan: &Plan, progress: &mut dyn FnMut(&str)) -> Result<Vec<Phase>, BackendError> {
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
    let find = |phases: &[Phase], kind: Kind, key: usize| phases.iter().position(|p| p.kind == kind && if kind == Kind::Prompt { p.tokens == key } else { p.context == key }).unwrap();

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
            if contexts.contains(&n) {
                progress(&format!("repeat {}/{}: tg{d}@{n}", r + 1, plan.repeats));
                let s = decode(engine, &mut seq, next)?;
                let i = find(&phases, Kind::Decode, n);
                phases[i].seconds.push(s);
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

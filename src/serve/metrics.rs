//! `/metrics`: the server's counters and histograms in the Prometheus text format, named as
//! vLLM names them (`vllm:` → `tensorfold:`), beside the runtime's own gauges ([`Stats`]).

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::runtime::{FinishReason, Stats};

/// A Prometheus histogram: cumulative bucket counts, sum and count.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistogramData>,
}

#[derive(Debug, Default)]
struct HistogramData {
    /// Observations `<=` each bound (not cumulative here; summed when written).
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// A histogram with these upper bounds (ascending; `+Inf` is implied).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, inner: Mutex::new(HistogramData { counts: vec![0; bounds.len()], sum: 0.0, count: 0 }) }
    }

    /// Records one value (seconds).
    pub fn observe(&self, v: f64) {
        if !v.is_finite() {
            return;
        }
        if let Ok(mut d) = self.inner.lock() {
            if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
                d.counts[i] += 1;
            }
            d.sum += v;
            d.count += 1;
        }
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let Ok(d) = self.inner.lock() else { return };
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&d.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}", d.count, d.sum, d.count);
    }
}

/// vLLM's time-to-first-token buckets, with finer ones below 10 ms for small models.
const TTFT_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0];
/// vLLM's inter-token-latency buckets, with finer ones below 10 ms.
const ITL_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
/// vLLM's end-to-end latency buckets, with finer ones below 0.3 s.
const E2E_BUCKETS: &[f64] = &[0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0];

/// The server's own counters (the runtime keeps the rest, read at each scrape).
#[derive(Debug)]
pub struct Metrics {
    /// Prompt and generated tokens of finished sequences (each of a request's `n` counts).
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// Prompt tokens looked up in the prefix cache, and those found (at admission).
    pub prefix_queries: AtomicU64,
    pub prefix_hits: AtomicU64,
    /// Finished sequences by vLLM's `finished_reason`: stop, length, abort, error.
    pub finished: [AtomicU64; 4],
    /// HTTP requests answered with a 4xx/5xx error object, and 503s for a full queue.
    pub errors: AtomicU64,
    pub rejected: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
}

const REASONS: [&str; 4] = ["stop", "length", "abort", "error"];

impl Default for Metrics {
    fn default() -> Self {
        Self {
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            prefix_queries: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            finished: Default::default(),
            errors: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
        }
    }
}

impl Metrics {
    /// Counts one finished sequence.
    pub fn finished(&self, reason: &FinishReason, prompt: usize, generated: usize) {
        let i = match reason {
            FinishReason::Eos(_) | FinishReason::StopString(_) => 0,
            FinishReason::Length | FinishReason::ContextFull => 1,
            FinishReason::Cancelled => 2,
            FinishReason::Error(_) => 3,
        };
        self.finished[i].fetch_add(1, Ordering::Relaxed);
        self.prompt_tokens.fetch_add(prompt as u64, Ordering::Relaxed);
        self.generation_tokens.fetch_add(generated as u64, Ordering::Relaxed);
    }

    /// The Prometheus text of these counters and the runtime's `stats`.
    pub fn render(&self, stats: &Stats, model: &str) -> String {
        let mut o = String::new();
        let label = format!("model_name=\"{}\"", model.replace('\\', "\\\\").replace('"', "\\\""));
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(o, "# HELP tensorfold:{name} {help}\n# TYPE tensorfold:{name} {kind}\ntensorfold:{name}{{{label}}} {value}");
        };
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed).to_string();
        metric("num_requests_running", "gauge", "Sequences resident in the runtime.", stats.running.to_string());
        metric("num_requests_waiting", "gauge", "Sequences waiting for a slot.", stats.waiting.to_string());
        metric("num_preemptions_total", "counter", "Sequences swapped to host memory to make room.", stats.preemptions.to_string());
        metric("prompt_tokens_total", "counter", "Prompt tokens of finished sequences.", get(&self.prompt_tokens));
        metric("generation_tokens_total", "counter", "Tokens generated by finished sequences.", get(&self.generation_tokens));
        metric("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", get(&self.prefix_queries));
        metric("prefix_cache_hits_total", "counter", "Prompt tokens whose state came from the prefix cache.", get(&self.prefix_hits));
        metric("state_memory_bytes", "gauge", "Bytes of the resident sequences' states.", stats.state_bytes.to_string());
        metric("snapshot_memory_bytes", "gauge", "Bytes held by prefix snapshots.", stats.snapshot_bytes.to_string());
        metric("snapshot_device_memory_bytes", "gauge", "Bytes of those kept in backend slots (device memory on a GPU).", stats.snapshot_slot_bytes.to_string());
        metric("snapshots", "gauge", "Prefix snapshots held.", stats.snapshots.to_string());
        metric("request_errors_total", "counter", "HTTP requests answered with an error object.", get(&self.errors));
        metric("request_rejected_total", "counter", "Requests refused because the queue was full (503).", get(&self.rejected));
        let _ = writeln!(o, "# HELP tensorfold:request_success_total Finished sequences by finish reason.\n# TYPE tensorfold:request_success_total counter");
        for (r, c) in REASONS.iter().zip(&self.finished) {
            let _ = writeln!(o, "tensorfold:request_success_total{{{label},finished_reason=\"{r}\"}} {}", c.load(Ordering::Relaxed));
        }
        self.ttft.write(&mut o, "tensorfold:time_to_first_token_seconds", "Time from the request's arrival to its first token.");
        self.itl.write(&mut o, "tensorfold:inter_token_latency_seconds", "Time between consecutive tokens of a sequence.");
        self.e2e.write(&mut o, "tensorfold:e2e_request_latency_seconds", "Time from the request's arrival to its last token.");
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_count_everything() {
        let h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.5, 0.7, 3.0, f64::NAN] {
            h.observe(v);
        }
        let mut s = String::new();
        h.write(&mut s, "x", "help");
        assert!(s.contains("x_bucket{le=\"0.1\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"1\"} 3\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"+Inf\"} 4\n"), "{s}");
        assert!(s.contains("x_sum 4.25\nx_count 4\n"), "{s}");
    }

    #[test]
    fn finish_reasons_land_under_vllm_labels() {
        let m = Metrics::default();
        m.finished(&FinishReason::StopString("x".into()), 5, 2);
        m.finished(&FinishReason::Cancelled, 3, 1);
        let text = m.render(&Stats { running: 2, ..Stats::default() }, "m\"q");
        assert!(text.contains("tensorfold:num_requests_running{model_name=\"m\\\"q\"} 2\n"), "{text}");
        assert!(text.contains("finished_reason=\"stop\"} 1\n"), "{text}");
        assert!(text.contains("finished_reason=\"abort\"} 1\n"), "{text}");
        assert!(text.contains("finished_reason=\"length\"} 0\n"), "{text}");
        assert!(text.contains("tensorfold:prompt_tokens_total{model_name=\"m\\\"q\"} 8\n"), "{text}");
    }
}

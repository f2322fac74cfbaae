//! The timeline probe: where a replayed decode graph's time goes, kernel by kernel.
//!
//! Only with kernels built with `-DTF_PROBE_TIMELINE` (`TENSORFOLD_CUDA_DEFINES`) and
//! `TENSORFOLD_TIMELINE=FILE` set: block 0 of every kernel then appends a `%globaltimer`
//! reading (nanoseconds) taken when its wait on the previous kernel returned (`pdl_enter`,
//! common.cuh) to a device buffer whose address each module's `tf_timeline` holds. The gap
//! between kernel i's reading and kernel i+1's is the time kernel i held the chain (its work
//! after the wait, its completion and the next kernel's release). The host clears the counter
//! before each replay and, after the token's wait, adds each gap to a per-node sum; the report
//! (written when the backend is dropped) gives the mean per graph node with the node's
//! launch label. `%globaltimer` ticks coarsely (about a microsecond), so a node's mean is only
//! good over many tokens. Timing only: this does not change what any kernel computes.

use std::fmt::Write as _;

use std::sync::Arc;

use cudarc::driver::{CudaModule, CudaSlice, CudaStream};

use crate::backend::BackendError;

/// Readings the device buffer holds (after its counter word); `pdl_enter` in common.cuh stops at
/// the same number.
pub const CAPACITY: usize = 4096;

/// One captured graph's nodes and the sums of their gaps.
#[derive(Default)]
struct Record {
    labels: Vec<String>,
    /// Sum over tokens of each node's gap, nanoseconds.
    sums: Vec<f64>,
    tokens: usize,
    /// Replays whose reading count differed from the node count (not summed).
    skipped: usize,
}

/// The probe's device buffer, labels and sums.
pub struct Timeline {
    path: String,
    buf: CudaSlice<u64>,
    records: Vec<Record>,
    /// The record of the graph being replayed, until its readings are collected.
    armed: Option<usize>,
}

impl Timeline {
    /// `Some` when `TENSORFOLD_TIMELINE` names a report file.
    pub fn from_env(stream: &Arc<CudaStream>) -> Result<Option<Self>, BackendError> {
        let Some(path) = std::env::var_os("TENSORFOLD_TIMELINE") else { return Ok(None) };
        let buf = stream.alloc_zeros::<u64>(CAPACITY + 1).map_err(|e| super::dev_err("allocating the timeline", e))?;
        Ok(Some(Timeline { path: path.to_string_lossy().into_owned(), buf, records: Vec::new(), armed: None }))
    }

    /// Points `module`'s `tf_timeline` at the buffer (modules built without the probe have none).
    pub fn attach(&self, module: &Arc<CudaModule>, stream: &Arc<CudaStream>) -> Result<(), BackendError> {
        let p = super::ptr(&self.buf, stream);
        if let Ok(mut g) = module.get_global("tf_timeline", stream) {
            stream.memcpy_htod(&p.to_le_bytes(), &mut g).map_err(|e| super::dev_err("setting tf_timeline", e))?;
        }
        Ok(())
    }

    /// A capture begins: its launches are labelled from here. Returns its record, which the
    /// graph's replays name in [`Timeline::arm`].
    pub fn begin_capture(&mut self) -> usize {
        self.records.push(Record::default());
        self.records.len() - 1
    }

    /// Labels the next node of the graph being captured.
    pub fn label(&mut self, label: &str) {
        if let Some(r) = self.records.last_mut() {
            r.labels.push(label.to_string());
        }
    }

    /// Before a replay of the graph whose record is `record`: clear the counter.
    pub fn arm(&mut self, stream: &Arc<CudaStream>, record: usize) -> Result<(), BackendError> {
        let mut head = self.buf.slice_mut(0..1);
        stream.memset_zeros(&mut head).map_err(|e| super::dev_err("clearing the timeline", e))?;
        self.armed = Some(record);
        Ok(())
    }

    /// After the replay's wait: add its gaps to the sums.
    pub fn collect(&mut self, stream: &Arc<CudaStream>) -> Result<(), BackendError> {
        let Some(record) = self.armed.take() else { return Ok(()) };
        let mut v = vec![0u64; CAPACITY + 1];
        stream.memcpy_dtoh(&self.buf, v.as_mut_slice()).map_err(|e| super::dev_err("reading the timeline", e))?;
        stream.synchronize().map_err(|e| super::dev_err("synchronize", e))?;
        let n = (v[0] & 0xffff_ffff) as usize;
        let Some(r) = self.records.get_mut(record) else { return Ok(()) };
        if n != r.labels.len() || !(2..=CAPACITY).contains(&n) {
            r.skipped += 1;
            return Ok(());
        }
        add_gaps(&mut r.sums, &v[1..1 + n]);
        r.tokens += 1;
        Ok(())
    }

    /// The report: per graph, mean microseconds per node and per label family.
    pub fn report(&self) -> String {
        report(&self.records)
    }
}

/// Adds to node i's sum the gap between readings i and i + 1 (nanoseconds); the last node has
/// no later reading and gets nothing.
fn add_gaps(sums: &mut Vec<f64>, readings: &[u64]) {
    sums.resize(readings.len(), 0.0);
    for (i, w) in readings.windows(2).enumerate() {
        sums[i] += w[1].wrapping_sub(w[0]) as f64;
    }
}

/// Per graph with tokens: each node's mean time in microseconds, then the labels' totals.
fn report(records: &[Record]) -> String {
    let mut s = String::new();
    for (g, r) in records.iter().enumerate() {
        if r.tokens == 0 {
            continue;
        }
        let t = r.tokens as f64;
        let total: f64 = r.sums.iter().sum::<f64>() / t / 1e3;
        let _ = writeln!(s, "graph {g}: {} nodes, {} tokens ({} skipped); first wait to last wait {total:.1} us", r.labels.len(), r.tokens, r.skipped);
        let mut fam: Vec<(String, f64, usize)> = Vec::new();
        for (i, l) in r.labels.iter().enumerate() {
            let us = r.sums.get(i).copied().unwrap_or(0.0) / t / 1e3;
            let _ = writeln!(s, "  {i:4} {us:8.2} us  {l}");
            match fam.iter_mut().find(|f| f.0 == *l) {
                Some(f) => {
                    f.1 += us;
                    f.2 += 1;
                }
                None => fam.push((l.clone(), us, 1)),
            }
        }
        fam.sort_by(|a, b| b.1.total_cmp(&a.1));
        let _ = writeln!(s, "  by label (us per token, nodes, us each):");
        for (l, us, n) in fam {
            let _ = writeln!(s, "    {us:8.1}  {n:3}  {:7.2}  {l}", us / n as f64);
        }
    }
    s
}

impl Drop for Timeline {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(&self.path, self.report()) {
            eprintln!("timeline: writing {}: {e}", self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_go_to_the_earlier_node_and_average_per_token() {
        let mut r = Record { labels: vec!["a".into(), "b".into(), "a".into()], ..Record::default() };
        add_gaps(&mut r.sums, &[1_000, 3_000, 4_000]);
        add_gaps(&mut r.sums, &[10_000, 14_000, 15_000]);
        r.tokens = 2;
        assert_eq!(r.sums, vec![6_000.0, 2_000.0, 0.0]);
        let text = report(&[Record::default(), r]);
        // The empty record is skipped; node 0 averages 3 us, node 1 1 us; label a totals 3 us over two nodes.
        assert!(text.starts_with("graph 1: 3 nodes, 2 tokens (0 skipped); first wait to last wait 4.0 us"), "{text}");
        assert!(text.contains("     0     3.00 us  a\n"), "{text}");
        assert!(text.contains("     1     1.00 us  b\n"), "{text}");
        assert!(text.contains("         3.0    2     1.50  a\n"), "{text}");
    }
}

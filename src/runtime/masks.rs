//! Grammar masks computed while the model step runs.
//!
//! A constrained row's mask at position t depends only on the ids up to t − 1, all known
//! before the step that computes the row's logits; so the runtime hands the constraints of
//! the rows a tick will sample to these helper threads before the step and takes them back
//! after it ([`Constraint::prepare`] in between). The helpers compute exactly what the
//! runtime's thread would (the same calls on the same states, in a different place), so ids
//! and logits keep their bits; rows without a constraint never come here.

use std::panic::AssertUnwindSafe;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use crate::grammar::Constraint;

/// One constraint in flight: the index of its sequence in the tick, and the constraint.
type Job = (usize, Constraint);

/// A few persistent threads that prepare masks; they start at the first constrained tick.
pub(super) struct Masker {
    jobs: Option<mpsc::Sender<Job>>,
    done: mpsc::Receiver<Job>,
    done_tx: mpsc::Sender<Job>,
    /// Receiving end of `jobs`, shared by the helpers.
    queue: Arc<Mutex<mpsc::Receiver<Job>>>,
    threads: Vec<JoinHandle<()>>,
    /// Helpers to start (at least one).
    limit: usize,
    /// Sequences whose constraints are sent and not yet taken back.
    in_flight: Vec<usize>,
}

impl Masker {
    /// Helpers to use: one for every few constrained rows a tick may hold, leaving the
    /// runtime's thread (and, on the CPU backend, the step's pool) the rest of the machine.
    pub(super) fn new() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let (jobs, queue) = mpsc::channel();
        let (done_tx, done) = mpsc::channel();
        Self { jobs: Some(jobs), done, done_tx, queue: Arc::new(Mutex::new(queue)), threads: Vec::new(), limit: (cores / 4).clamp(1, 4), in_flight: Vec::new() }
    }

    /// Hands the constraint in `slot` (that of sequence `index`) to a helper to prepare; the
    /// runtime holds it again after [`Masker::collect`]. Where no helper can take it, it stays
    /// in `slot` (and `mask` computes it after the step).
    pub(super) fn send(&mut self, index: usize, slot: &mut Option<Constraint>) {
        if self.threads.len() < self.limit.min(self.in_flight.len() + 1) {
            let queue = self.queue.clone();
            let done = self.done_tx.clone();
            let spawned = std::thread::Builder::new().name("tensorfold-masks".into()).spawn(move || loop {
                let job = match queue.lock() {
                    Ok(q) => q.recv(),
                    Err(_) => return,
                };
                let Ok((i, mut c)) = job else { return };
                // llguidance catches its own panics; this keeps a constraint from being lost
                // should anything else in `prepare` panic (the mask is then computed again by
                // `mask`, on the runtime's thread).
                let _ = std::panic::catch_unwind(AssertUnwindSafe(|| c.prepare()));
                if done.send((i, c)).is_err() {
                    return;
                }
            });
            if let Ok(t) = spawned {
                self.threads.push(t);
            }
        }
        let (Some(jobs), false) = (self.jobs.as_ref(), self.threads.is_empty()) else { return };
        let Some(c) = slot.take() else { return };
        match jobs.send((index, c)) {
            Ok(()) => self.in_flight.push(index),
            Err(mpsc::SendError((_, c))) => *slot = Some(c),
        }
    }

    /// Every constraint sent since the last call, back with its sequence's index (in any
    /// order); waits for the ones still being prepared. Every one comes back: a helper catches
    /// panics and lives as long as the `Masker`.
    pub(super) fn collect(&mut self) -> Vec<Job> {
        let mut back = Vec::with_capacity(self.in_flight.len());
        while back.len() < self.in_flight.len() {
            match self.done.recv() {
                Ok(job) => back.push(job),
                Err(_) => break,
            }
        }
        self.in_flight.clear();
        back
    }

    /// Whether constraints are out with the helpers.
    pub(super) fn busy(&self) -> bool {
        !self.in_flight.is_empty()
    }
}

impl Drop for Masker {
    fn drop(&mut self) {
        // Closing the queue ends the helpers.
        self.jobs = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

//! Grammar masks computed while the model step runs.
//!
//! A constrained row's mask at position t depends only on the ids up to t − 1, all known
//! before the step that computes the row's logits; so the runtime hands the constraints of
//! the rows a tick will sample to these helper threads before the step and takes them back
//! after it ([`Constraint::prepare`] in between). The helpers compute exactly what the
//! runtime's thread would (the same calls on the same states, in a different place), so ids
//! and logits keep their bits; rows without a constraint never come here.

use std::panic::AssertUnwindSafe;
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use crate::grammar::Constraint;

/// One constraint in flight: the index of its sequence in the tick, and the constraint.
type Job = (usize, Constraint);

/// A few persistent threads that prepare masks; they start at the first constrained tick.
pub(super) struct Masker {
    jobs: Option<mpsc::Sender<Job>>,
    /// Only the helpers hold its senders, so that it disconnects once every helper is gone
    /// rather than waiting on a dead one.
    done: mpsc::Receiver<Job>,
    /// Receiving end of `jobs`, shared by the helpers.
    queue: Arc<Mutex<mpsc::Receiver<Job>>>,
    threads: Vec<JoinHandle<()>>,
    /// Sequences whose constraints are sent and not yet taken back.
    in_flight: Vec<usize>,
}

/// A job a helper holds. Dropped, it goes back to the collector, failed where the helper's
/// thread is unwinding (a panic outside the catch around `prepare`): no constraint is lost
/// with a thread, and `collect` never waits for one that cannot come.
struct Held<'a> {
    job: Option<Job>,
    done: &'a mpsc::Sender<Job>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some((i, mut c)) = self.job.take() {
            if std::thread::panicking() {
                c.fail("the thread computing the grammar mask died".into());
            }
            // A closed channel: the Masker is gone, and the sequence with it.
            let _ = self.done.send((i, c));
        }
    }
}

/// A panic's message, where it has one.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    payload.downcast_ref::<&str>().copied().or_else(|| payload.downcast_ref::<String>().map(String::as_str)).unwrap_or("no message")
}

impl Masker {
    /// Starts the helpers: one for every few cores, leaving the runtime's thread (and, on the
    /// CPU backend, the step's pool) the rest of the machine.
    pub(super) fn new() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        Self::with_helpers((cores / 4).clamp(1, 4))
    }

    /// Starts `helpers` threads. All start now (an idle one only waits on the queue), so that
    /// no sender of `done` stays behind for later ones.
    pub(super) fn with_helpers(helpers: usize) -> Self {
        let (jobs, queue) = mpsc::channel();
        let (done_tx, done) = mpsc::channel();
        let queue = Arc::new(Mutex::new(queue));
        let threads = (0..helpers)
            .filter_map(|_| {
                let queue: Arc<Mutex<mpsc::Receiver<Job>>> = Arc::clone(&queue);
                let done = done_tx.clone();
                std::thread::Builder::new().name("tensorfold-masks".into()).spawn(move || helper(&queue, &done)).ok()
            })
            .collect();
        Self { jobs: Some(jobs), done, queue, threads, in_flight: Vec::new() }
    }

    /// Hands the constraint in `slot` (that of sequence `index`) to a helper to prepare; the
    /// runtime holds it again after [`Masker::collect`]. Where no helper can take it (none
    /// started, or all are gone), it stays in `slot` (and `mask` computes it after the step).
    pub(super) fn send(&mut self, index: usize, slot: &mut Option<Constraint>) {
        if self.threads.iter().all(JoinHandle::is_finished) {
            return;
        }
        let Some(jobs) = self.jobs.as_ref() else { return };
        let Some(c) = slot.take() else { return };
        match jobs.send((index, c)) {
            Ok(()) => self.in_flight.push(index),
            Err(mpsc::SendError((_, c))) => *slot = Some(c),
        }
    }

    /// Every constraint sent since the last call, back with its sequence's index (in any
    /// order); waits for the ones still being prepared. Every one comes back: one whose
    /// computation panicked, or whose helper died, failed ([`Constraint::fail`]: its sequence
    /// ends with an error); should every helper be gone, the ones none took unprepared.
    pub(super) fn collect(&mut self) -> Vec<Job> {
        let mut back = Vec::with_capacity(self.in_flight.len());
        while back.len() < self.in_flight.len() {
            match self.done.recv() {
                Ok(job) => back.push(job),
                // Every helper is gone.
                Err(_) => break,
            }
        }
        if back.len() < self.in_flight.len() {
            let queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            back.extend(std::iter::from_fn(|| queue.try_recv().ok()));
            for &i in &self.in_flight {
                if !back.iter().any(|(j, _)| *j == i) {
                    back.push((i, Constraint::failed("the grammar mask was lost with the thread computing it".into())));
                }
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

/// A helper's loop: prepare each constraint of the queue, send it back, until the queue closes.
fn helper(queue: &Mutex<mpsc::Receiver<Job>>, done: &mpsc::Sender<Job>) {
    loop {
        let job = match queue.lock() {
            Ok(q) => q.recv(),
            Err(_) => return,
        };
        let Ok(job) = job else { return };
        let mut held = Held { job: Some(job), done };
        let Some((_, c)) = held.job.as_mut() else { continue };
        // llguidance catches its own panics; anything else in `prepare` that panics may leave
        // the grammar state half-updated, so the constraint fails (that request ends with an
        // error, the others go on).
        if let Err(p) = std::panic::catch_unwind(AssertUnwindSafe(|| c.prepare())) {
            c.fail(format!("computing the grammar mask panicked: {}", panic_message(p.as_ref())));
        }
        #[cfg(test)]
        if c.injected() == Some(crate::grammar::TestFault::KillHelper) {
            panic!("a fault injected in the mask helper");
        }
        drop(held);
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

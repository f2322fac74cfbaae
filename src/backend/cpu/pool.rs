//! A small persistent thread pool for the CPU kernels.
//!
//! Decode runs a few hundred parallel regions per token, each only tens of microseconds long,
//! so the cost of starting one matters (candle#3134, #3627; rust-notes.md §6.3). Workers here
//! stay alive, spin briefly on a generation counter when a region ends, then sleep on a
//! condition variable. A region hands out task indices from an atomic counter; the calling
//! thread works too, and returns when every task has finished.
//!
//! Which thread runs which task never affects results: every task writes its own outputs with
//! the same arithmetic.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// The work of one parallel region: a closure over task indices, type-erased.
struct Job {
    /// `&(dyn Fn(usize) + Sync)` with its lifetime erased; valid until `remaining` reaches 0.
    f: *const (dyn Fn(usize) + Sync),
    tasks: usize,
    next: AtomicUsize,
    remaining: AtomicUsize,
}

// SAFETY: the closure is `Sync`, and the pointer is only dereferenced while the caller of
// `run` is blocked waiting for the job, which keeps the closure alive.
unsafe impl Send for Job {}
unsafe impl Sync for Job {}

struct Shared {
    /// The current job and its generation number.
    slot: Mutex<(u64, Option<Arc<Job>>)>,
    wake: Condvar,
    generation: AtomicUsize,
    shutdown: std::sync::atomic::AtomicBool,
}

/// A fixed set of worker threads (the caller counts as one).
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    threads: usize,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ThreadPool({} threads)", self.threads)
    }
}

/// Spins before sleeping: long enough to cover the gap between two kernels of one token.
const SPIN: usize = 20_000;

/// Spins between two yields of the processor while waiting: on a machine with more runnable
/// threads than cores, the thread being waited for (descheduled while holding a task) gets the
/// core back soon; on an idle machine a yield returns at once.
const YIELD_EVERY: usize = 64;

/// One step of a wait loop.
#[inline]
fn backoff(spins: usize) {
    if spins % YIELD_EVERY == YIELD_EVERY - 1 {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

impl ThreadPool {
    /// A pool of `threads` threads in all (`threads − 1` workers plus the caller); at least 1.
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            slot: Mutex::new((0, None)),
            wake: Condvar::new(),
            generation: AtomicUsize::new(0),
            shutdown: std::sync::atomic::AtomicBool::new(false),
        });
        let workers = (1..threads)
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new().name(format!("tensorfold-cpu-{i}")).spawn(move || worker(&s)).expect("spawn CPU worker thread")
            })
            .collect();
        Self { shared, workers, threads }
    }

    /// Threads that run tasks, the caller included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f(0) .. f(tasks − 1)` across the pool and returns when all have finished.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        if self.threads == 1 || tasks == 1 {
            (0..tasks).for_each(f);
            return;
        }
        // SAFETY: we erase the lifetime of `f`; `run` does not return before every task has
        // completed (`remaining == 0`), and workers never touch `f` after finishing a task.
        let f_static: *const (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f) };
        let job = Arc::new(Job { f: f_static, tasks, next: AtomicUsize::new(0), remaining: AtomicUsize::new(tasks) });
        {
            let mut slot = self.shared.slot.lock().unwrap();
            slot.0 += 1;
            slot.1 = Some(job.clone());
            self.shared.generation.fetch_add(1, Ordering::Release);
        }
        self.shared.wake.notify_all();
        work_on(&job);
        let mut spins = 0;
        while job.remaining.load(Ordering::Acquire) != 0 {
            backoff(spins);
            spins += 1;
        }
        self.shared.slot.lock().unwrap().1 = None;
    }
}

fn work_on(job: &Job) {
    loop {
        let i = job.next.fetch_add(1, Ordering::Relaxed);
        if i >= job.tasks {
            return;
        }
        // SAFETY: see `ThreadPool::run`: the closure outlives every task.
        unsafe { (*job.f)(i) };
        job.remaining.fetch_sub(1, Ordering::Release);
    }
}

fn worker(s: &Shared) {
    let mut seen = 0usize;
    loop {
        // Spin on the generation counter, then sleep.
        let mut spins = 0;
        while s.generation.load(Ordering::Acquire) == seen {
            if s.shutdown.load(Ordering::Relaxed) {
                return;
            }
            spins += 1;
            if spins < SPIN {
                backoff(spins);
                continue;
            }
            let guard = s.slot.lock().unwrap();
            if s.generation.load(Ordering::Acquire) == seen && !s.shutdown.load(Ordering::Relaxed) {
                let _guard = s.wake.wait(guard).unwrap();
            }
            spins = 0;
        }
        seen = s.generation.load(Ordering::Acquire);
        let job = s.slot.lock().unwrap().1.clone();
        if let Some(job) = job {
            work_on(&job);
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Relaxed);
        {
            let _g = self.shared.slot.lock().unwrap();
            self.shared.generation.fetch_add(1, Ordering::Release);
        }
        self.shared.wake.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_task_runs_once() {
        let pool = ThreadPool::new(3);
        for tasks in [1usize, 2, 7, 100] {
            let hits: Vec<AtomicU64> = (0..tasks).map(|_| AtomicU64::new(0)).collect();
            pool.run(tasks, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "tasks={tasks}");
        }
        // Many short regions back to back (the decode pattern).
        let total = AtomicU64::new(0);
        for _ in 0..2000 {
            pool.run(4, &|i| {
                total.fetch_add(i as u64, Ordering::Relaxed);
            });
        }
        assert_eq!(total.load(Ordering::Relaxed), 2000 * 6);
    }
}

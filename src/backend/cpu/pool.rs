//! A small persistent thread pool for the CPU kernels.
//!
//! Decode runs a few hundred parallel regions per token, each only tens of microseconds long,
//! so the cost of starting one matters (candle#3134, #3627; rust-notes.md §6.3). Workers here
//! stay alive, spin briefly on a generation counter when a region ends, then sleep on a
//! condition variable. A region gives each thread (the calling thread works too) a contiguous
//! share of the task indices, which it runs in increasing order; a thread whose share is done
//! takes tasks from the end of another's. The caller returns when every task has finished.
//!
//! A task that panics is caught on the thread that ran it: that thread skips the tasks nobody
//! has started (claims and counts them without running them) and stays in the pool, and the
//! caller resumes the panic once every thread has left the region, so no task outlives `run`.
//!
//! Contiguous shares matter for decode: the tasks of a matrix product are consecutive runs of
//! weight rows, so a thread streams one region of memory from start to end (its prefetches
//! run on into its own next task) instead of jumping between interleaved tasks, and claiming
//! a task touches only the thread's own cache line until the shares run out.
//!
//! Which thread runs which task never affects results: every task writes its own outputs with
//! the same arithmetic.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

/// The work of one parallel region: a closure over task indices, type-erased.
struct Job {
    /// `&(dyn Fn(usize) + Sync)` with its lifetime erased; valid until `remaining` reaches 0.
    f: *const (dyn Fn(usize) + Sync),
    /// Per thread, the tasks of its share not yet started: `front << 32 | back`, the range
    /// `front..back`; the owner takes from the front, others from the back.
    shares: Box<[Share]>,
    /// Tasks not yet finished (run, panicked or skipped after a panic).
    remaining: AtomicUsize,
    /// Whether a task panicked (`payload` holds the first panic's payload); read once
    /// `remaining` is 0, so a region without a panic never takes the lock.
    panicked: AtomicBool,
    payload: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Job {
    /// Keeps the payload of the first task that panicked.
    fn record_panic(&self, payload: Box<dyn Any + Send>) {
        let later = {
            let mut first = self.payload.lock().unwrap_or_else(PoisonError::into_inner);
            if first.is_none() {
                *first = Some(payload);
                None
            } else {
                Some(payload)
            }
        };
        self.panicked.store(true, Ordering::Relaxed);
        drop(later);
    }
}

/// One thread's share of a job's tasks, on its own cache line.
#[repr(align(64))]
struct Share(AtomicU64);

impl Share {
    /// Claims the first (`front`) or last task of the share, if any is left.
    fn claim(&self, front: bool) -> Option<usize> {
        let mut cur = self.0.load(Ordering::Relaxed);
        loop {
            let (f, b) = (cur >> 32, cur & 0xffff_ffff);
            if f >= b {
                return None;
            }
            let (next, task) = if front { ((f + 1) << 32 | b, f) } else { (f << 32 | (b - 1), b - 1) };
            match self.0.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(task as usize),
                Err(v) => cur = v,
            }
        }
    }
}

// SAFETY: the closure is `Sync`, and the pointer is only dereferenced while the caller of
// `run` is blocked waiting for the job (even when a task panicked), which keeps the closure
// alive.
unsafe impl Send for Job {}
unsafe impl Sync for Job {}

struct Shared {
    /// The current job and its generation number.
    slot: Mutex<(u64, Option<Arc<Job>>)>,
    wake: Condvar,
    generation: AtomicUsize,
    /// Workers asleep on `wake` (changed only under `slot`'s lock): a region wakes them only
    /// when there are any, so back-to-back regions with spinning workers make no system call.
    sleepers: AtomicUsize,
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
            sleepers: AtomicUsize::new(0),
            shutdown: std::sync::atomic::AtomicBool::new(false),
        });
        let workers = (1..threads)
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new().name(format!("tensorfold-cpu-{i}")).spawn(move || worker(&s, i)).expect("spawn CPU worker thread")
            })
            .collect();
        Self { shared, workers, threads }
    }

    /// Threads that run tasks, the caller included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f(0) .. f(tasks − 1)` across the pool and returns when all have finished.
    ///
    /// If a task panics, on the caller's thread or a worker's, `run` panics on the caller's
    /// thread with that task's payload (the first to be caught when several tasks panic), and it
    /// does so only after every thread has finished with `f`: no call of `f` is running or
    /// starts once `run` has returned or begun to unwind, so `f` may borrow anything of the
    /// caller's. Tasks that had not started when the panic was caught are skipped. A worker
    /// whose task panicked stays in the pool, which serves the next `run` as before.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        if self.threads == 1 || tasks == 1 {
            (0..tasks).for_each(f);
            return;
        }
        // SAFETY: we erase the lifetime of `f`; `run` neither returns nor unwinds before every
        // task has completed, panicked or been skipped (`remaining == 0`): `work_on` catches a
        // task's panic on every thread, this one included. Workers never touch `f` after
        // finishing a task.
        let f_static: *const (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f) };
        // Task indices fit the 32-bit halves of a share (a region has at most thousands).
        assert!(u32::try_from(tasks).is_ok(), "{tasks} tasks in one region");
        let t = self.threads;
        let shares = (0..t).map(|i| Share(AtomicU64::new(((tasks * i / t) as u64) << 32 | (tasks * (i + 1) / t) as u64))).collect();
        let job = Arc::new(Job { f: f_static, shares, remaining: AtomicUsize::new(tasks), panicked: AtomicBool::new(false), payload: Mutex::new(None) });
        let sleepers = {
            let mut slot = self.shared.slot.lock().unwrap();
            slot.0 += 1;
            slot.1 = Some(job.clone());
            self.shared.generation.fetch_add(1, Ordering::Release);
            // Read under the lock: a worker going to sleep counts itself under it too, after
            // which it re-checks the generation, so none is missed.
            self.shared.sleepers.load(Ordering::Relaxed)
        };
        if sleepers > 0 {
            self.shared.wake.notify_all();
        }
        work_on(&job, 0);
        let mut spins = 0;
        while job.remaining.load(Ordering::Acquire) != 0 {
            backoff(spins);
            spins += 1;
        }
        self.shared.slot.lock().unwrap().1 = None;
        if job.panicked.load(Ordering::Relaxed) {
            // Every thread is done with `f`; the recording thread's store is visible (its
            // `remaining` release, our acquire), and so is the payload (the lock).
            let payload = job.payload.lock().unwrap_or_else(PoisonError::into_inner).take();
            std::panic::resume_unwind(payload.expect("a panicked job keeps its payload"));
        }
    }
}

/// Runs tasks of `job` as thread `me`: its own share from the front, then the others' from
/// the back; counts them off `remaining` once at the end (one shared write per thread).
/// Never unwinds: a task's panic is caught, recorded in `job`, and the tasks nobody has
/// started are claimed and counted without running, so the caller hears of it soon.
fn work_on(job: &Job, me: usize) {
    let t = job.shares.len();
    let mut done = 0;
    let ran = std::panic::catch_unwind(AssertUnwindSafe(|| {
        for k in 0..t {
            let share = &job.shares[(me + k) % t];
            while let Some(i) = share.claim(k == 0) {
                // SAFETY: see `ThreadPool::run`: the closure outlives every task.
                unsafe { (*job.f)(i) };
                done += 1;
            }
        }
    }));
    if let Err(payload) = ran {
        done += 1; // the task that panicked
        for share in job.shares.iter() {
            while share.claim(false).is_some() {
                done += 1;
            }
        }
        job.record_panic(payload);
    }
    if done > 0 {
        job.remaining.fetch_sub(done, Ordering::Release);
    }
}

/// Worker `me` (1 ..; the caller of `run` is thread 0).
fn worker(s: &Shared, me: usize) {
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
                s.sleepers.fetch_add(1, Ordering::Relaxed);
                let _guard = s.wake.wait(guard).unwrap();
                s.sleepers.fetch_sub(1, Ordering::Relaxed);
            }
            spins = 0;
        }
        seen = s.generation.load(Ordering::Acquire);
        let job = s.slot.lock().unwrap().1.clone();
        if let Some(job) = job {
            work_on(&job, me);
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

    /// Runs 32 tasks on a pool of 4 threads, task `bad` panicking while another task runs, for
    /// each `bad` given. Checks that `run` hands that panic to its caller only once no task is
    /// running (the others last until `run` has returned, or 500 ms), that it returns at all (a
    /// dead worker would leave it waiting forever), that every worker is alive, and that the
    /// next region runs every task once. Runs on a helper thread so that a hang fails the test.
    fn panic_in_task(bads: &'static [usize]) {
        use std::sync::mpsc;
        use std::time::{Duration, Instant};
        let (done, finished) = mpsc::channel();
        let h = std::thread::spawn(move || {
            let pool = ThreadPool::new(4);
            let tasks = 32;
            for &bad in bads {
                let active = AtomicU64::new(0); // tasks running now
                let returned = AtomicBool::new(false); // `run` has returned
                let late = AtomicU64::new(0); // tasks that saw `returned`
                let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    pool.run(tasks, &|i| {
                        active.fetch_add(1, Ordering::SeqCst);
                        let start = Instant::now();
                        if i == bad {
                            while active.load(Ordering::SeqCst) < 2 && start.elapsed() < Duration::from_secs(5) {
                                std::thread::yield_now();
                            }
                            active.fetch_sub(1, Ordering::SeqCst);
                            panic!("task {i} fails");
                        }
                        while !returned.load(Ordering::SeqCst) && start.elapsed() < Duration::from_millis(500) {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        if returned.load(Ordering::SeqCst) {
                            late.fetch_add(1, Ordering::SeqCst);
                        }
                        active.fetch_sub(1, Ordering::SeqCst);
                    })
                }));
                let running = active.load(Ordering::SeqCst);
                returned.store(true, Ordering::SeqCst);
                let payload = r.expect_err("the task's panic reaches the caller");
                assert_eq!(payload.downcast_ref::<String>().map(String::as_str), Some(format!("task {bad} fails").as_str()));
                assert_eq!(running, 0, "bad={bad}: tasks still running when run returned");
                std::thread::sleep(Duration::from_millis(20));
                assert_eq!(late.load(Ordering::SeqCst), 0, "bad={bad}: tasks ran on after run returned");
                assert!(pool.workers.iter().all(|w| !w.is_finished()), "bad={bad}: a worker died");
                let hits: Vec<AtomicU64> = (0..tasks).map(|_| AtomicU64::new(0)).collect();
                pool.run(tasks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "bad={bad}: the next region");
            }
            done.send(()).unwrap();
        });
        match finished.recv_timeout(Duration::from_secs(60)) {
            Ok(()) => h.join().unwrap(),
            Err(mpsc::RecvTimeoutError::Disconnected) => std::panic::resume_unwind(h.join().unwrap_err()),
            Err(mpsc::RecvTimeoutError::Timeout) => panic!("run did not return within 60 s of a task's panic"),
        }
    }

    /// Task 0, the front of the caller's share: the caller panics while workers run tasks.
    #[test]
    fn a_panic_on_the_caller_waits_for_the_workers() {
        panic_in_task(&[0]);
    }

    /// The fronts of the shares of workers 1 and 3: a worker panics; it must count its tasks
    /// off and stay alive.
    #[test]
    fn a_panic_on_a_worker_reaches_the_caller() {
        panic_in_task(&[8, 24]);
    }
}

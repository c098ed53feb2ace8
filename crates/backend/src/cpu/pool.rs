//! The step's own fork-join: the threads of the pool stay awake for a whole
//! step and share each parallel loop's tasks.
//!
//! A decode step of a small model is a few hundred short parallel loops (the
//! matmuls and attention of every layer) with a little serial work between
//! them. Through rayon's `par_iter`, a worker that finds no work between two
//! loops parks, and the next loop pays for waking it (a futex call on each
//! side): measured, 10-12% of a batch-1 step of SmolLM2-135M on two threads.
//! Here [`run`] takes the pool's other threads for the step's length; they
//! spin on one atomic word (yielding after a while) for the next loop, and
//! every thread, the step's own included, takes task after task from it until
//! none is left. While they wait they also take rayon work, so the step's
//! remaining `par_iter` loops still spread. Outside a step, or inside a task,
//! [`for_each`] falls back to rayon (or runs the tasks in order), so nothing
//! depends on being called from a step.
//!
//! The word holds a loop's generation, the next task and the task count, so a
//! thread that wakes late for a loop can never take a task of the next one
//! (its claim fails on the generation) and reads a loop's closure only after
//! claiming one of its tasks, while the loop cannot have finished. A loop
//! returns when every task it handed out has finished. Tasks write what they
//! own (disjoint outputs), so the order they run in changes no result.

use std::cell::{Cell, UnsafeCell};
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// Tasks in one loop: the word's 24 low bits hold the next task, the next 24
/// the count, the high 16 the loop's generation.
const MAX_TASKS: usize = (1 << 24) - 1;

/// Spins between looks at the word before a waiting thread yields its core.
const SPINS: u32 = 1 << 14;

/// A waiting helper looks for rayon work every this many spins.
const RAYON_EVERY: u32 = 32;

type Task<'a> = &'a (dyn Fn(usize) + Sync);

fn word(generation: u64, count: usize, next: usize) -> u64 {
    (generation << 48) | ((count as u64) << 24) | next as u64
}
fn parts(w: u64) -> (u64, usize, usize) {
    (w >> 48, ((w >> 24) & MAX_TASKS as u64) as usize, (w & MAX_TASKS as u64) as usize)
}

struct Shared {
    word: AtomicU64,
    /// Tasks of the current loop that have finished.
    finished: AtomicUsize,
    /// The current loop's closure, set before its generation is published.
    task: UnsafeCell<Option<Task<'static>>>,
    /// A task panicked (its payload is re-raised by the loop's caller).
    panicked: AtomicBool,
    stop: AtomicBool,
}

// SAFETY: `task` is written only by the loop's caller before it publishes the
// loop (Release on `word`) and read only by a thread that has claimed one of
// its tasks (AcqRel on `word`), which keeps the loop, and so the closure, alive.
unsafe impl Sync for Shared {}

thread_local! {
    /// The pool of the step this thread runs, while it runs it.
    static CURRENT: Cell<Option<*const Shared>> = const { Cell::new(None) };
    /// Inside a task: a nested loop runs in order on this thread.
    static IN_TASK: Cell<bool> = const { Cell::new(false) };
}

/// Run `step` with the global rayon pool's other threads kept awake for its
/// loops. Called on a rayon worker (the backend's `run_step` is).
pub(super) fn run<R: Send>(step: impl FnOnce() -> R + Send) -> R {
    let helpers = rayon::current_num_threads().saturating_sub(1);
    if helpers == 0 || CURRENT.with(|c| c.get().is_some()) {
        return step();
    }
    let shared = Shared {
        word: AtomicU64::new(word(0, 0, 0)),
        finished: AtomicUsize::new(0),
        task: UnsafeCell::new(None),
        panicked: AtomicBool::new(false),
        stop: AtomicBool::new(false),
    };
    rayon::scope(|s| {
        for _ in 0..helpers {
            let shared = &shared;
            s.spawn(move |_| helper(shared));
        }
        // Helpers are told to stop however the step ends.
        struct Stop<'a>(&'a Shared);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.stop.store(true, Ordering::Release);
            }
        }
        let _stop = Stop(&shared);
        let prev = CURRENT.with(|c| c.replace(Some(&shared as *const Shared)));
        struct Restore(Option<*const Shared>);
        impl Drop for Restore {
            fn drop(&mut self) {
                CURRENT.with(|c| c.set(self.0));
            }
        }
        let _restore = Restore(prev);
        step()
    })
}

/// `f(t)` for every `t` in `0..n`, spread over the step's threads (rayon's
/// outside a step; in order inside a task).
pub(super) fn for_each(n: usize, f: impl Fn(usize) + Sync + Send) {
    if n == 0 {
        return;
    }
    if IN_TASK.with(|t| t.get()) {
        (0..n).for_each(f);
        return;
    }
    let Some(shared) = CURRENT.with(|c| c.get()) else {
        use rayon::prelude::*;
        (0..n).into_par_iter().for_each(f);
        return;
    };
    // SAFETY: `run` keeps the pool alive while CURRENT points at it.
    let shared = unsafe { &*shared };
    if n == 1 || n > MAX_TASKS {
        with_in_task(|| (0..n).for_each(&f));
        return;
    }
    let task: Task<'_> = &f;
    // SAFETY: the closure outlives the loop: this function returns only when
    // every task handed out has finished, and no thread reads the closure
    // without holding a claim on one of them (see `Shared`).
    let task: Task<'static> = unsafe { std::mem::transmute::<Task<'_>, Task<'static>>(task) };
    let (generation, ..) = parts(shared.word.load(Ordering::Relaxed));
    let generation = (generation + 1) & 0xffff;
    shared.finished.store(0, Ordering::Relaxed);
    // SAFETY: no thread holds a claim of a loop now (the previous one finished).
    unsafe { *shared.task.get() = Some(task) };
    shared.word.store(word(generation, n, 0), Ordering::Release);
    work(shared, generation);
    let mut spins = 0u32;
    while shared.finished.load(Ordering::Acquire) < n {
        spins += 1;
        pause(spins);
    }
    // SAFETY: every task has finished; nobody reads the closure any more.
    unsafe { *shared.task.get() = None };
    if shared.panicked.swap(false, Ordering::AcqRel) {
        panic!("a task of a parallel loop panicked");
    }
}

fn with_in_task<R>(f: impl FnOnce() -> R) -> R {
    let prev = IN_TASK.with(|t| t.replace(true));
    let r = f();
    IN_TASK.with(|t| t.set(prev));
    r
}

/// Take and run tasks of loop `generation` until none is left.
fn work(shared: &Shared, generation: u64) {
    loop {
        let w = shared.word.load(Ordering::Acquire);
        let (g, count, next) = parts(w);
        if g != generation || next >= count {
            return;
        }
        if shared.word.compare_exchange_weak(w, w + 1, Ordering::AcqRel, Ordering::Acquire).is_err() {
            continue;
        }
        // SAFETY: the claim holds the loop open, so its closure is set and alive.
        let task = unsafe { (*shared.task.get()).expect("a published loop has its task") };
        let ran = with_in_task(|| panic::catch_unwind(AssertUnwindSafe(|| task(next))));
        if ran.is_err() {
            shared.panicked.store(true, Ordering::Release);
        }
        shared.finished.fetch_add(1, Ordering::AcqRel);
    }
}

/// A helper thread: wait for each new loop and work on it, until the step ends.
fn helper(shared: &Shared) {
    // No loop has this generation (they are 16 bits), so a helper that
    // starts while the step's first loop runs (rayon wakes it a while after
    // the step began) works on that loop too, instead of waiting for the
    // next. A loop already over has no task left to claim.
    let mut seen = u64::MAX;
    let mut spins = 0u32;
    loop {
        let (g, ..) = parts(shared.word.load(Ordering::Acquire));
        if g != seen {
            seen = g;
            spins = 0;
            work(shared, g);
            continue;
        }
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        spins += 1;
        // The step's own rayon loops (a norm over many rows, the delta rule)
        // split work onto its thread's queue: a waiting helper takes it.
        if spins.is_multiple_of(RAYON_EVERY) && rayon::yield_now() == Some(rayon::Yield::Executed) {
            spins = 0;
            continue;
        }
        pause(spins);
    }
}

/// One wait of a thread that has looked `spins` times: a spin, or past
/// `SPINS` its core handed to the OS.
fn pause(spins: u32) {
    if spins < SPINS {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_of_every_loop_runs_once() {
        let counts: Vec<AtomicU32> = (0..1000).map(|_| AtomicU32::new(0)).collect();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        pool.install(|| {
            run(|| {
                for round in 0..2000usize {
                    let n = 1 + round % 997;
                    for_each(n, |t| {
                        counts[t].fetch_add(1, Ordering::Relaxed);
                    });
                }
            })
        });
        for (t, c) in counts.iter().enumerate() {
            let want = (0..2000usize).filter(|r| t < 1 + r % 997).count() as u32;
            assert_eq!(c.load(Ordering::Relaxed), want, "task {t}");
        }
    }

    /// A pool of two threads, so a step's loops have another thread to share with.
    fn two_threads() -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap()
    }

    /// Work long enough that another thread takes some of a loop's tasks.
    fn busy(iterations: u64) {
        let mut x = 0u64;
        for i in 0..iterations {
            x = std::hint::black_box(x.wrapping_add(i));
        }
    }

    /// The threads a loop's tasks ran on. A task notes its thread, then,
    /// until a second thread has taken a task or the deadline (10 s from the
    /// first note) has passed, yields: on a loaded machine the other thread
    /// may get no core for the whole of a short loop, so the work alone
    /// cannot show that it takes tasks; waiting for it can, and only a
    /// thread that never takes a task (the mechanism broken) runs into the
    /// deadline.
    struct Seen {
        threads: std::sync::Mutex<std::collections::HashSet<std::thread::ThreadId>>,
        deadline: std::sync::OnceLock<std::time::Instant>,
    }

    impl Seen {
        fn new() -> Seen {
            Seen { threads: Default::default(), deadline: std::sync::OnceLock::new() }
        }
        fn note(&self) {
            self.threads.lock().unwrap().insert(std::thread::current().id());
            let deadline =
                *self.deadline.get_or_init(|| std::time::Instant::now() + std::time::Duration::from_secs(10));
            while self.count() < 2 && std::time::Instant::now() < deadline {
                std::thread::yield_now();
            }
        }
        fn count(&self) -> usize {
            self.threads.lock().unwrap().len()
        }
    }

    /// The step's very first loop already has both threads: a helper that
    /// starts after the loop was published still joins it.
    #[test]
    fn a_step_uses_more_than_one_thread_and_nested_loops_run_in_order() {
        let pool = two_threads();
        let seen = Seen::new();
        pool.install(|| {
            run(|| {
                for_each(64, |_| seen.note());
                assert_eq!(seen.count(), 2, "the helper missed the step's first loop");
                for _ in 0..200 {
                    for_each(64, |_| {
                        seen.note();
                        busy(20_000);
                        let inner = AtomicU32::new(0);
                        for_each(5, |_| {
                            inner.fetch_add(1, Ordering::Relaxed);
                        });
                        assert_eq!(inner.load(Ordering::Relaxed), 5);
                    });
                }
            })
        });
        assert_eq!(seen.count(), 2);
    }

    #[test]
    fn a_panicking_task_fails_the_loop_not_the_pool() {
        let pool = two_threads();
        let r = pool.install(|| {
            panic::catch_unwind(AssertUnwindSafe(|| {
                run(|| {
                    for_each(100, |t| {
                        if t == 57 {
                            panic!("task 57");
                        }
                    })
                })
            }))
        });
        assert!(r.is_err());
        // The pool still works afterwards.
        let sum = AtomicU32::new(0);
        pool.install(|| {
            run(|| {
                for_each(10, |t| {
                    sum.fetch_add(t as u32, Ordering::Relaxed);
                })
            })
        });
        assert_eq!(sum.load(Ordering::Relaxed), 45);
    }

    #[test]
    fn a_rayon_loop_inside_a_step_still_spreads() {
        use rayon::prelude::*;
        let pool = two_threads();
        let seen = Seen::new();
        pool.install(|| {
            run(|| {
                (0..256).into_par_iter().for_each(|_| {
                    seen.note();
                    busy(50_000);
                });
            })
        });
        assert_eq!(seen.count(), 2, "the helper took none of the rayon loop");
    }

    #[test]
    fn outside_a_step_it_is_a_plain_parallel_loop() {
        let sum = AtomicU32::new(0);
        for_each(100, |t| {
            sum.fetch_add(t as u32, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 4950);
    }
}

//! The task queue of one thread and its loop.

use async_executor::{LocalExecutor, Task};
use std::cell::RefCell;
use std::future::Future;
use std::rc::Rc;

/// Tasks run between two waits on the ring: enough to amortize the wait, few enough
/// that I/O completions are collected often under load.
const TICKS_PER_TURN: usize = 64;

thread_local! {
    static EXECUTOR: RefCell<Option<Rc<LocalExecutor<'static>>>> = const { RefCell::new(None) };
}

/// Spawns a task on this thread's executor.
///
/// # Panics
///
/// Outside [`block_on`].
pub fn spawn<T: 'static>(future: impl Future<Output = T> + 'static) -> Task<T> {
    EXECUTOR.with(|e| {
        e.borrow()
            .as_ref()
            .expect("spawn outside the runtime")
            .spawn(future)
    })
}

/// Runs `future` and every task it spawns on this thread until `future` completes.
pub fn block_on<T: 'static>(future: impl Future<Output = T> + 'static) -> T {
    let executor = Rc::new(LocalExecutor::new());
    EXECUTOR.with(|e| *e.borrow_mut() = Some(executor.clone()));
    let main = executor.spawn(future);
    let result = loop {
        let mut ran_all = true;
        for _ in 0..TICKS_PER_TURN {
            if !executor.try_tick() {
                ran_all = false;
                break;
            }
        }
        if main.is_finished() {
            break futures_lite::future::block_on(main);
        }
        // Runnable tasks left: only collect completions; none: wait for I/O or a timer.
        super::reactor::with(|r| r.turn(!ran_all));
    };
    EXECUTOR.with(|e| *e.borrow_mut() = None);
    result
}

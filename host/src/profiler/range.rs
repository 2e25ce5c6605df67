//! [`RecordFunction`]: a user range entered and ended by hand (PyTorch's
//! `record_function` object used outside a `with`), which can leave its end
//! to a future (`_call_end_callbacks_on_future`).

use std::sync::Arc;

use super::{Recorder, current};
use crate::agent::Future;
use crate::{Error, Result};

/// PyTorch's refusal of a second `_call_end_callbacks_on_future`.
pub const END_CALLBACKS_ONCE: &str = "_call_end_callbacks_on_future can only be called once.";

/// An open user range of the enclosing profiling scope (none outside one):
/// it ends when dropped, unless its end was handed to a future.
#[must_use = "the range ends when it drops"]
pub struct RecordFunction {
    open: Option<(Arc<Recorder>, usize)>,
    /// Whether the range still ends on exit (PyTorch's
    /// `run_callbacks_on_exit`).
    ends_on_exit: bool,
}

impl RecordFunction {
    /// Opens the range `name` now (`record_function(name).__enter__()`).
    pub fn enter(name: &str) -> RecordFunction {
        RecordFunction {
            open: current().map(|r| {
                let index = r.open(name.to_string());
                (r, index)
            }),
            ends_on_exit: true,
        }
    }

    /// `_call_end_callbacks_on_future(fut)`: the range ends when `fut`
    /// completes rather than on exit; returns a future that completes with
    /// `fut`'s result once the range has ended.
    ///
    /// # Errors
    /// `RuntimeError` [`END_CALLBACKS_ONCE`] when called a second time.
    pub fn call_end_callbacks_on_future(&mut self, fut: &Future) -> Result<Future> {
        if !self.ends_on_exit {
            return Err(Error::runtime(END_CALLBACKS_ONCE));
        }
        self.ends_on_exit = false;
        let open = self.open.clone();
        let out = Future::new();
        let done = out.clone();
        fut.add_done_callback(move |f| {
            if let Some((recorder, index)) = &open {
                recorder.close(*index);
            }
            let result = f
                .try_value()
                .unwrap_or_else(|| Err(Error::runtime("a future completed without a result")));
            let _ = done.complete(result);
        });
        Ok(out)
    }
}

impl Drop for RecordFunction {
    fn drop(&mut self) {
        if let (true, Some((recorder, index))) = (self.ends_on_exit, &self.open) {
            recorder.close(*index);
        }
    }
}

//! [`FaultInjection`]: failing and delaying sends of chosen message kinds,
//! the equivalent of the seeds' `FaultyTensorPipeAgent`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::MessageKind;
use crate::error::{Error, Result};

/// Which sends to fail or delay. Cheap to clone; clones share the counters.
#[derive(Debug, Clone, Default)]
pub struct FaultInjection {
    fail: Arc<Mutex<HashMap<MessageKind, u32>>>,
    delay: HashMap<MessageKind, Duration>,
    fail_functions: Arc<Mutex<HashMap<String, u32>>>,
    /// What `fail_sends` was given, for introspection (the counters in
    /// `fail` run down).
    configured: Vec<(MessageKind, u32)>,
}

impl FaultInjection {
    /// No faults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes the first `n` sends of each of `kinds` fail.
    #[must_use]
    pub fn fail_sends(mut self, kinds: &[MessageKind], n: u32) -> Self {
        self.configured.retain(|(k, _)| !kinds.contains(k));
        self.configured.extend(kinds.iter().map(|k| (*k, n)));
        {
            let mut fail = self.fail.lock().unwrap_or_else(|p| p.into_inner());
            for k in kinds {
                fail.insert(*k, n);
            }
        }
        self
    }

    /// Makes the first `n` calls of `function` sent by this worker fail.
    #[must_use]
    pub fn fail_calls_to(self, function: &str, n: u32) -> Self {
        self.fail_functions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(function.into(), n);
        self
    }

    /// Delays every send of `kind` by `by`.
    #[must_use]
    pub fn delay(mut self, kind: MessageKind, by: Duration) -> Self {
        self.delay.insert(kind, by);
        self
    }

    /// The message kinds whose sends were set to fail
    /// (`messages_to_fail`), in the order given.
    pub fn messages_to_fail(&self) -> Vec<MessageKind> {
        self.configured.iter().map(|(k, _)| *k).collect()
    }

    /// How many sends of each failing kind fail (`num_fail_sends`): the
    /// largest count given to [`fail_sends`](Self::fail_sends), 0 if none.
    pub fn num_fail_sends(&self) -> u32 {
        self.configured.iter().map(|(_, n)| *n).max().unwrap_or(0)
    }

    /// Whether any fault is configured.
    pub fn is_empty(&self) -> bool {
        self.delay.is_empty()
            && self.fail.lock().map(|f| f.is_empty()).unwrap_or(false)
            && self
                .fail_functions
                .lock()
                .map(|f| f.is_empty())
                .unwrap_or(false)
    }

    /// Applies the faults for one send: waits the delay, then fails if the
    /// kind (or the called function) still has failures left.
    pub(crate) async fn apply(&self, kind: MessageKind, function: Option<&str>) -> Result<()> {
        if let Some(d) = self.delay.get(&kind) {
            tokio::time::sleep(*d).await;
        }
        if take_one(&self.fail, &kind) {
            return Err(Error::runtime(format!(
                "Send failed: injected fault for {kind:?} message"
            )));
        }
        if let Some(f) = function
            && take_one(&self.fail_functions, f)
        {
            return Err(Error::runtime(format!(
                "Send failed: injected fault for call to {f}"
            )));
        }
        Ok(())
    }
}

fn take_one<K, Q>(m: &Mutex<HashMap<K, u32>>, key: &Q) -> bool
where
    K: std::borrow::Borrow<Q> + std::hash::Hash + Eq,
    Q: std::hash::Hash + Eq + ?Sized,
{
    let mut m = m.lock().unwrap_or_else(|p| p.into_inner());
    match m.get_mut(key) {
        Some(n) if *n > 0 => {
            *n -= 1;
            true
        }
        _ => false,
    }
}

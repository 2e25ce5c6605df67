//! [`Profile`]: the events a profiling scope recorded, and their Chrome
//! trace.

use std::fmt::Write as _;

use super::Event;
use crate::error::{Error, Result};

/// The events of one profiling scope, in the order they started.
#[derive(Clone, Debug, Default)]
pub struct Profile {
    /// The events.
    pub events: Vec<Event>,
}

impl Profile {
    /// The events whose name contains `pattern`.
    pub fn find(&self, pattern: &str) -> Vec<&Event> {
        self.events
            .iter()
            .filter(|e| e.name.contains(pattern))
            .collect()
    }

    /// The profile as Chrome trace JSON (`chrome://tracing`, Perfetto):
    /// complete (`"ph": "X"`) events, `pid` the worker's rank, recorded
    /// input shapes as the `"Input Dims"` argument.
    pub fn to_chrome_trace(&self) -> String {
        let mut out = String::from("[");
        for (i, e) in self.events.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let dur = e.end_us.map_or(0, |end| end.saturating_sub(e.start_us));
            // Recorded shapes go where PyTorch's trace puts them.
            let input_dims = if e.input_shapes.is_empty() {
                String::new()
            } else {
                format!(", \"Input Dims\": {:?}", e.input_shapes)
            };
            let _ = write!(
                out,
                "{{\"name\": \"{}\", \"ph\": \"X\", \"ts\": {}, \"dur\": {dur}, \"pid\": {}, \"tid\": 0, \"args\": {{\"node_id\": {}{input_dims}}}}}",
                json_escape(&e.name),
                e.start_us,
                e.worker,
                e.worker
            );
        }
        out.push(']');
        out
    }

    /// Writes [`to_chrome_trace`](Self::to_chrome_trace) to `path`
    /// (PyTorch's `export_chrome_trace`).
    ///
    /// # Errors
    /// The file could not be written (the message names the path).
    pub fn export_chrome_trace(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_chrome_trace()).map_err(|e| {
            Error::runtime(format!(
                "could not write the chrome trace to {}: {e}",
                path.display()
            ))
        })
    }
}

fn json_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out
}

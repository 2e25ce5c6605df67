//! Progress events: what a worker does with a guest's progress report
//! ([`HostCall::Progress`](crate::abi::protocol::HostCall::Progress), the
//! guest SDK's `progress` module), and how `wasmrpc launch` reads them
//! back from its workers' output to draw progress bars.
//!
//! A worker started by `wasmrpc launch` (which sets [`EVENTS_ENV`]) writes
//! each report as one line on stderr: [`EVENT_PREFIX`] followed by the
//! [`ProgressEvent`] in JSON. Any other worker logs it as a plain line.
//! This module owns the line format and nothing else; drawing belongs to
//! the launcher.

use serde::{Deserialize, Serialize};

/// Set to `1` in a worker's environment to make it write progress events
/// as [`EVENT_PREFIX`] lines for its launcher.
pub const EVENTS_ENV: &str = "WASMRPC_PROGRESS_EVENTS";

/// The start of a progress event line.
pub const EVENT_PREFIX: &str = "@wasmrpc-progress ";

/// One progress report of a guest on a worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProgressEvent {
    /// The worker that reported.
    pub worker: String,
    /// The task's name (one bar per worker and name).
    pub bar: String,
    /// Steps done.
    pub position: u64,
    /// Steps in all (0: unknown).
    pub total: u64,
    /// A short status.
    pub message: String,
}

impl ProgressEvent {
    /// The event as one line, [`EVENT_PREFIX`] included.
    pub fn to_line(&self) -> String {
        // A struct of strings and integers always serialises.
        let json = serde_json::to_string(self).unwrap_or_default();
        format!("{EVENT_PREFIX}{json}")
    }

    /// The event in `line`, if it is an event line.
    pub fn parse(line: &str) -> Option<ProgressEvent> {
        serde_json::from_str(line.strip_prefix(EVENT_PREFIX)?).ok()
    }

    /// Reports the event: an event line on stderr under a launcher (see
    /// [`EVENTS_ENV`]), else an info log line.
    pub fn emit(&self) {
        if std::env::var(EVENTS_ENV).is_ok_and(|v| v == "1") {
            eprintln!("{}", self.to_line());
        } else {
            tracing::info!(
                target: "wasmrpc::progress",
                worker = %self.worker,
                "{} {}/{} {}",
                self.bar,
                self.position,
                self.total,
                self.message
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_line_parses_back_and_other_lines_do_not() {
        let event = ProgressEvent {
            worker: "worker0".into(),
            bar: "epoch".into(),
            position: 3,
            total: 10,
            message: "loss 0.25\ttab and \"quotes\"\nnewline".into(),
        };
        let line = event.to_line();
        assert!(!line.contains('\n'), "{line}");
        assert_eq!(ProgressEvent::parse(&line), Some(event));
        assert_eq!(ProgressEvent::parse("INFO worker0: shut down"), None);
        assert_eq!(ProgressEvent::parse("@wasmrpc-progress {not json"), None);
    }
}

//! The progress line on stderr: one line rewritten in place on a terminal,
//! one line per step otherwise (logs, CI).

use std::io::{IsTerminal, Write};
use std::sync::Mutex;
use std::time::Instant;

/// Shows what the run is doing and how long it has taken.
pub(crate) struct Progress {
    start: Instant,
    tty: bool,
    last: Mutex<String>,
}

impl Progress {
    /// Starts the clock.
    pub(crate) fn new() -> Self {
        Progress {
            start: Instant::now(),
            tty: std::io::stderr().is_terminal(),
            last: Mutex::new(String::new()),
        }
    }

    /// Seconds since the run started.
    pub(crate) fn elapsed_secs(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Shows `text` as the current step.
    pub(crate) fn set(&self, text: &str) {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if *last == text {
            return;
        }
        *last = text.to_string();
        let secs = self.start.elapsed().as_secs();
        let line = format!("[{:02}:{:02}] {text}", secs / 60, secs % 60);
        let mut err = std::io::stderr().lock();
        if self.tty {
            let _ = write!(err, "\r\x1b[2K{line}");
        } else {
            let _ = writeln!(err, "{line}");
        }
        let _ = err.flush();
    }

    /// Ends the progress line, so the table starts on a line of its own.
    pub(crate) fn finish(&self) {
        if self.tty {
            let mut err = std::io::stderr().lock();
            let _ = writeln!(err);
        }
    }
}

//! The workers' progress bars: the event lines their plugins' progress
//! reports become (`wasmrpc::progress`), drawn as one indicatif bar per
//! worker and task on a terminal, or as plain lines (about five per task)
//! otherwise.

use std::collections::HashMap;
use std::sync::Mutex;

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use wasmrpc::progress::ProgressEvent;

/// A bar's identity: the worker and the task.
type BarKey = (String, String);

/// Draws the workers' progress events: indicatif bars on a terminal, plain
/// lines otherwise.
pub(super) struct Progress {
    /// The bars, by worker and task; `None` when stderr is not a terminal.
    bars: Option<(MultiProgress, Mutex<HashMap<BarKey, ProgressBar>>)>,
    /// Plain mode: the last quarter of each task printed, so a task of
    /// many steps prints about five lines.
    printed: Mutex<HashMap<BarKey, u64>>,
}

impl Progress {
    pub(super) fn new(terminal: bool) -> Progress {
        Progress {
            bars: terminal.then(|| (MultiProgress::new(), Mutex::new(HashMap::new()))),
            printed: Mutex::new(HashMap::new()),
        }
    }

    /// Shows one event.
    pub(super) fn show(&self, event: &ProgressEvent) {
        let key = (event.worker.clone(), event.bar.clone());
        match &self.bars {
            Some((multi, bars)) => {
                let mut bars = bars.lock().unwrap_or_else(|p| p.into_inner());
                let bar = bars.entry(key).or_insert_with(|| {
                    let bar = multi.add(ProgressBar::new(event.total));
                    let style =
                        ProgressStyle::with_template("{prefix:>18} [{bar:30}] {pos}/{len} {msg}")
                            .map(|s| s.progress_chars("=> "))
                            .unwrap_or_else(|_| ProgressStyle::default_bar());
                    bar.set_style(style);
                    bar.set_prefix(format!("{} {}", event.worker, event.bar));
                    bar
                });
                if bar.is_finished() {
                    // A task that starts over (the next epoch's batches).
                    bar.reset();
                }
                bar.set_length(event.total);
                bar.set_position(event.position);
                bar.set_message(event.message.clone());
                if event.total > 0 && event.position >= event.total {
                    bar.finish();
                }
            }
            None => {
                let quarter = (event.position * 4)
                    .checked_div(event.total)
                    .unwrap_or(event.position);
                let mut printed = self.printed.lock().unwrap_or_else(|p| p.into_inner());
                let last = printed.get(&key).copied();
                let done = event.total > 0 && event.position >= event.total;
                if done || last.is_none_or(|l| quarter != l) {
                    printed.insert(key, if done { u64::MAX } else { quarter });
                    eprintln!(
                        "[{}] {} {}/{} {}",
                        event.worker, event.bar, event.position, event.total, event.message
                    );
                }
            }
        }
    }

    /// Prints a line above the bars.
    pub(super) fn println(&self, line: &str) {
        match &self.bars {
            Some((multi, _)) => {
                if multi.println(line).is_err() {
                    eprintln!("{line}");
                }
            }
            None => eprintln!("{line}"),
        }
    }

    /// Leaves finished bars on screen and stops drawing.
    pub(super) fn finish(&self) {
        if let Some((_, bars)) = &self.bars {
            for bar in bars.lock().unwrap_or_else(|p| p.into_inner()).values() {
                if !bar.is_finished() {
                    bar.abandon();
                }
            }
        }
    }
}

//! Log output on stderr, in text or JSON lines, that shares the terminal with
//! the loading progress bar.
//!
//! indicatif redraws its bar in place on stderr; a log line written in the
//! middle of that would be overwritten by the next redraw (or leave half a
//! bar above it). So while a bar is showing, each log line is written
//! through [`indicatif::ProgressBar::suspend`], which clears the bar, lets
//! the line out whole, and draws the bar again below it.

use std::io::{self, Write};
use std::sync::Mutex;

/// `--log-format`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per line (timestamp, level, fields), for log collectors.
    Json,
}

/// The bar showing now, if any.
static BAR: Mutex<Option<indicatif::ProgressBar>> = Mutex::new(None);

/// Shows `bar` until the returned guard is dropped; log lines go above it.
pub fn show_progress(bar: &indicatif::ProgressBar) -> BarGuard {
    *BAR.lock().unwrap_or_else(|e| e.into_inner()) = Some(bar.clone());
    BarGuard
}

/// Ends [`show_progress`] when dropped.
pub struct BarGuard;

impl Drop for BarGuard {
    fn drop(&mut self) {
        *BAR.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// One log event's bytes, written in one piece when the event is done.
pub struct LogLine(Vec<u8>);

impl Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for LogLine {
    fn drop(&mut self) {
        let bytes = std::mem::take(&mut self.0);
        let bar = BAR.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let write = || {
            // Nothing sensible is left to do if stderr itself fails.
            let _ = io::stderr().lock().write_all(&bytes);
        };
        match bar {
            Some(bar) => bar.suspend(write),
            None => write(),
        }
    }
}

/// Makes one [`LogLine`] per event (tracing-subscriber asks once per event).
pub fn make_line() -> LogLine {
    LogLine(Vec::new())
}

/// Installs the global subscriber.
pub fn init(filter: &str, format: LogFormat) {
    use std::io::IsTerminal;
    let env = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(env).with_writer(make_line);
    match format {
        LogFormat::Text => {
            builder.with_ansi(io::stderr().is_terminal()).with_target(false).init();
        }
        LogFormat::Json => {
            builder.json().flatten_event(true).with_current_span(false).init();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_waits_for_its_whole_event() {
        let mut line = make_line();
        line.write_all(b"half ").expect("buffered");
        line.write_all(b"line\n").expect("buffered");
        assert_eq!(line.0, b"half line\n");
        // Emptied on drop, so nothing is written twice.
        drop(line);
    }

    #[test]
    fn the_bar_is_registered_only_while_shown() {
        let bar = indicatif::ProgressBar::hidden();
        {
            let _g = show_progress(&bar);
            assert!(BAR.lock().expect("lock").is_some());
        }
        assert!(BAR.lock().expect("lock").is_none());
    }
}

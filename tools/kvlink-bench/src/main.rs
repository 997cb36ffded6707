//! kvlink-bench: moves KV-cache blocks between two kvlink engines and reports what the link
//! delivers for a model's layout.
//!
//! ```text
//! kvlink-bench                      # loopback: prefill and decode engines in this process
//! kvlink-bench loopback [options]
//! kvlink-bench serve --listen 0.0.0.0:7400 --advertise 10.0.0.5 [options]   # prefill side
//! kvlink-bench read --peer 10.0.0.5:7400 [options]                          # decode side
//! ```

mod args;
mod chart;
mod drive;
mod dump;
mod report;
mod tp;
mod workload;

use std::process::ExitCode;

use crate::args::{parse_args, USAGE};
use crate::drive::run;

fn main() -> ExitCode {
    let level = std::env::var("KVLINK_LOG")
        .ok()
        .and_then(|l| l.parse().ok())
        .unwrap_or(tracing::Level::WARN);
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .init();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("kvlink-bench: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvlink-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

//! kvlink-bench: moves KV-cache blocks between two kvlink engines and reports what the link
//! delivers for a model's layout.
//!
//! ```text
//! kvlink-bench                      # loopback: prefill and decode engines in this process
//! kvlink-bench loopback [options]
//! kvlink-bench serve --listen 0.0.0.0:7400 --advertise 10.0.0.5 [options]   # prefill side
//! kvlink-bench read --peer 10.0.0.5:7400 [options]                          # decode side
//! ```

// Modules, top to bottom (each uses only those below it): main (the modes) > sweep, dump >
// drive > tp > report > outcome, chart, workload, args.
mod args;
mod chart;
mod drive;
mod dump;
mod outcome;
mod report;
mod sweep;
mod tp;
mod workload;

use std::process::ExitCode;

use crate::args::{parse_args, Args, Mode, USAGE};
use crate::report::report;
use crate::workload::Rng;

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

/// The dense preset (llama-3-8b) with `args`' other options, through the same driver, for a
/// hybrid preset's report.
fn dense_beside(args: &Args) -> Result<(Args, outcome::Outcome), String> {
    let dense = Args {
        shape: kvlink::ModelShape::LLAMA3_8B,
        state: None,
        ..args.clone()
    };
    let o = tp::loopback_tp(&dense, &mut Rng::for_run(dense.seed))?;
    Ok((dense, o))
}

/// Runs the mode `args` chose.
fn run(args: Args) -> Result<(), String> {
    let mut rng = Rng::for_run(args.seed);
    match args.mode {
        Mode::Loopback => {
            let mut o = if args.tp_run() {
                tp::loopback_tp(&args, &mut rng)?
            } else {
                drive::loopback(&args, &mut rng)?
            };
            if args.state.is_some() {
                o.dense = Some(Box::new(dense_beside(&args)?));
            }
            report(&args, "loopback", &o);
        }
        Mode::Sweep => sweep::sweep(&args)?,
        Mode::Dump => dump::dump(&args)?,
        Mode::Serve => drive::serve(&args)?,
        Mode::Read => {
            let o = if args.tp_run() {
                let peers = args.peer.as_deref().expect("checked in parse_args");
                tp::read_tp(
                    &args,
                    peers.split(',').map(|p| p.trim().to_string()).collect(),
                    &mut rng,
                )?
            } else {
                drive::read(&args, &mut rng)?
            };
            report(&args, "read", &o);
        }
    }
    Ok(())
}

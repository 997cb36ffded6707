//! kvlink-soak: one engine of the fault soak and fleet run (tools/soak), a prefill or a decode
//! by what it is told: commands on stdin, events on stdout, one JSON object per line. It exits
//! when stdin closes, so an orchestrator that dies takes its workers with it.

mod args;
mod memory;
mod proto;
mod worker;

use std::io::BufRead;

use kvlink::Engine;

fn main() {
    // Warnings and errors on stderr (which the orchestrator keeps per worker).
    tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::WARN)
        .with_writer(std::io::stderr)
        .init();
    let opts = match args::parse(std::env::args().skip(1)) {
        Ok(Some(o)) => o,
        Ok(None) => {
            print!("{}", args::USAGE);
            return;
        }
        Err(e) => {
            eprintln!("kvlink-soak: {e}\n{}", args::USAGE);
            std::process::exit(2);
        }
    };
    if let Err(e) = start(opts) {
        eprintln!("kvlink-soak: {e}");
        std::process::exit(1);
    }
}

/// Starts the engine and its cache, says it is ready, and runs the worker.
fn start(o: args::Options) -> kvlink::Result<()> {
    let engine = Engine::start(o.config)?;
    let shape = memory::shape(o.layers, o.token_bytes);
    let region = engine.allocate_host(shape.region_bytes(o.blocks), false)?;
    let layout = memory::layout(&shape, &region, o.blocks, o.groups)?;
    engine.set_layout(layout.clone())?;
    worker::emit(&proto::Event::Ready {
        addr: engine.handshake_address().to_string(),
        engine: engine.engine_id().to_string(),
        pid: std::process::id(),
    });
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::stdin().lock().lines() {
            let Ok(l) = l else { break };
            if !l.trim().is_empty() && tx.send(proto::parse(&l)).is_err() {
                break;
            }
        }
    });
    worker::Worker::new(engine, region, layout).run(rx);
    Ok(())
}

//! What validating a peer's descriptor costs: a real one (Llama-3-8B layout, TCP) and the
//! hostile ones a raw-socket peer can send in a `Hello` (`hostile_descriptors` of the fuzz
//! targets), which must be refused in time linear in their size.

use criterion::{black_box, criterion_group, criterion_main, Criterion};

// The fuzz targets' descriptors (only those are used here).
#[allow(dead_code)]
#[path = "../tests/fuzz/targets.rs"]
mod fuzz;

use fuzz::{example_descriptor, hostile_descriptors};

fn bench_validate(c: &mut Criterion) {
    let mut g = c.benchmark_group("descriptor_validate");
    let ok = example_descriptor();
    g.bench_function("llama-3-8b, tcp (accepted)", |b| {
        b.iter(|| black_box(&ok).validate().unwrap())
    });
    for (what, d) in hostile_descriptors() {
        g.bench_function(format!("{what} (refused)"), |b| {
            b.iter(|| assert!(black_box(&d).validate().is_err()))
        });
    }
    g.finish();
}

criterion_group!(benches, bench_validate);
criterion_main!(benches);

//! Compiles `tests/transfer.c` with the system C compiler against `include/kvlink.h`, links it
//! with the library cargo built for this test run (static and shared), runs it and checks it
//! transferred blocks between two engines.
//!
//! Nothing is built here but the C program: cargo builds the package's library (all its crate
//! types: `libkvlink_c.a`, `libkvlink_c.so`) into `target/<profile>/deps/`, next to this test's
//! executable, before running it. `CC` overrides the compiler (default `cc`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What `rustc --print native-static-libs` lists for this crate on Linux.
const NATIVE_STATIC_LIBS: &[&str] = &[
    "-lgcc_s",
    "-lutil",
    "-lrt",
    "-lpthread",
    "-lm",
    "-ldl",
    "-lc",
];

const RUN_LIMIT: Duration = Duration::from_secs(120);

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Where cargo put the library built for this test run: the test executable's own directory,
/// `target/<profile>/deps/`. (The copies in `target/<profile>/` are only refreshed by
/// `cargo build`, so they may be stale during `cargo test`.)
fn library(file: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("path of the test executable");
    let dir = exe.parent().expect("the test executable has a directory");
    let path = dir.join(file);
    assert!(
        path.is_file(),
        "{} does not exist; cargo builds it before this test (crate-type in ffi/c/Cargo.toml)",
        path.display()
    );
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let source = manifest_dir().join("src/lib.rs");
    if let (Some(lib), Some(src)) = (modified(&path), modified(&source)) {
        assert!(
            lib >= src,
            "{} is older than {}: run the test through cargo, which rebuilds it",
            path.display(),
            source.display()
        );
    }
    path
}

fn out_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvlink-c");
    std::fs::create_dir_all(&dir).expect("creating the output directory");
    dir
}

/// Compiles transfer.c into `exe` with `link_args` after the source.
fn compile(exe: &Path, link_args: &[String]) {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let dir = manifest_dir();
    let mut cmd = Command::new(&cc);
    cmd.args([
        "-std=c11",
        "-Wall",
        "-Wextra",
        "-Wpedantic",
        "-Werror",
        "-g",
        "-I",
    ])
    .arg(dir.join("include"))
    .arg(dir.join("tests/transfer.c"))
    .arg("-o")
    .arg(exe)
    .args(link_args);
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running the C compiler {cc:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `exe` (killed after `RUN_LIMIT`) and checks it succeeded. `lib_dir`: where the shared
/// library must be loaded from. It is also put first on LD_LIBRARY_PATH, which cargo sets for
/// tests and which wins over the executable's rpath: it lists `target/<profile>/`, where a
/// stale copy from an earlier `cargo build` may lie.
fn run(exe: &Path, lib_dir: Option<&Path>) {
    let stdout_path = exe.with_extension("stdout");
    let stderr_path = exe.with_extension("stderr");
    let mut cmd = Command::new(exe);
    if let Some(dir) = lib_dir {
        let mut path = std::ffi::OsString::from(dir);
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
            path.push(":");
            path.push(old);
        }
        cmd.env("LD_LIBRARY_PATH", path);
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&stdout_path).expect("creating the stdout file"))
        .stderr(std::fs::File::create(&stderr_path).expect("creating the stderr file"))
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", exe.display()));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the C program") {
            break Some(status);
        }
        if start.elapsed() > RUN_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = std::fs::read_to_string(&stdout_path).unwrap_or_default();
    let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    let Some(status) = status else {
        panic!(
            "{} ran longer than {RUN_LIMIT:?} and was killed\nstdout:\n{stdout}\nstderr:\n{stderr}",
            exe.display()
        );
    };
    assert!(
        status.success() && stdout.contains("c transfer ok"),
        "{} failed ({status})\nstdout:\n{stdout}\nstderr:\n{stderr}",
        exe.display()
    );
}

#[test]
fn c_program_transfers_blocks_static() {
    let lib = library("libkvlink_c.a");
    let exe = out_dir().join("transfer-static");
    let mut args = vec![lib.display().to_string()];
    args.extend(NATIVE_STATIC_LIBS.iter().map(|s| s.to_string()));
    compile(&exe, &args);
    run(&exe, None);
}

#[test]
fn c_program_transfers_blocks_shared() {
    let lib = library("libkvlink_c.so");
    let lib_dir = lib.parent().expect("the library has a directory");
    let dir = lib_dir.display();
    let exe = out_dir().join("transfer-shared");
    compile(
        &exe,
        &[
            format!("-L{dir}"),
            "-lkvlink_c".into(),
            format!("-Wl,-rpath,{dir}"),
        ],
    );
    run(&exe, Some(lib_dir));
}

//! Checks that the checked-in `include/kvlink.h` is what cbindgen generates from `src/lib.rs`
//! with `cbindgen.toml`. `KVLINK_BLESS=1 cargo test -p kvlink-c --test header` rewrites it.

use std::path::Path;

#[test]
fn header_is_up_to_date() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml"))
        .unwrap_or_else(|e| panic!("reading ffi/c/cbindgen.toml: {e}"));
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .unwrap_or_else(|e| panic!("cbindgen failed on ffi/c/src/lib.rs: {e}"));
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let generated = String::from_utf8(generated).expect("cbindgen writes UTF-8");

    let path = dir.join("include/kvlink.h");
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    if generated == checked_in {
        return;
    }
    if std::env::var_os("KVLINK_BLESS").is_some_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().expect("include/ has a parent")).unwrap();
        std::fs::write(&path, &generated)
            .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        eprintln!("rewrote {}", path.display());
        return;
    }
    let first_difference = generated
        .lines()
        .zip(checked_in.lines().chain(std::iter::repeat("<end of file>")))
        .enumerate()
        .find(|(_, (g, c))| g != c)
        .map(|(i, (g, c))| {
            format!(
                "first difference at line {}:\n  checked in: {c}\n  generated:  {g}",
                i + 1
            )
        })
        .unwrap_or_else(|| "the checked-in header has extra lines at the end".into());
    panic!(
        "ffi/c/include/kvlink.h is stale: regenerate with \
         `KVLINK_BLESS=1 cargo test -p kvlink-c --test header`\n{first_difference}"
    );
}

#![no_main]
// See tests/fuzz/targets.rs, `descriptor`, for what this target checks.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink_fuzz::descriptor(data));

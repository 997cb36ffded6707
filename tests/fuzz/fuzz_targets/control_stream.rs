#![no_main]
// See tests/fuzz/targets.rs, `control_stream`, for what this target checks.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink_fuzz::control_stream(data));

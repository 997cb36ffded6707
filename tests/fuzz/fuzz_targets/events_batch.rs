#![no_main]
// See tests/fuzz/targets.rs, `events_batch`, for what this target checks.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink_fuzz::events_batch(data));

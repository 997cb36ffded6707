#![no_main]
// See tests/fuzz/targets.rs, `data_request`, for what this target checks.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink_fuzz::data_request(data));

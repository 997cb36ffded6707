#![no_main]
// See kvlink::internal::fuzz::control_stream for what this target checks.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink::internal::fuzz::control_stream(data));

#![no_main]
// See kvlink::internal::fuzz::data_request for what this target checks.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink::internal::fuzz::data_request(data));

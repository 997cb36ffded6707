#![no_main]
// See kvlink::internal::fuzz::events_batch for what this target checks.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink::internal::fuzz::events_batch(data));

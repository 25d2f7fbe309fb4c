//! The node daemon's config file: TOML parse, validation, and the values the
//! daemon derives from it.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = pagewire_node::check_config_text(text);
    }
});

//! Any bytes: the canonicaliser never panics, its output is its own fixed point, and
//! whatever it accepts serde_json reads as the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(canonical) = idem_core::canonical::canonicalize(data) else {
        return;
    };
    assert_eq!(
        idem_core::canonical::canonicalize(&canonical).as_deref(),
        Ok(&canonical[..]),
        "canonical output is a fixed point"
    );
    // serde_json stops at 128 levels where we allow scalars at 128: skip those.
    if let (Ok(original), Ok(ours)) = (
        serde_json::from_slice::<serde_json::Value>(data),
        serde_json::from_slice::<serde_json::Value>(&canonical),
    ) {
        assert_eq!(original, ours, "the same value");
    }
});

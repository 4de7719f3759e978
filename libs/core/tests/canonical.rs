//! The canonicaliser against an independent one, on generated documents and on the
//! nasty shapes a hostile client sends (the regression corpus of the fuzz target).
//!
//! The oracle is serde_json: its parsed `Value`, written back with members sorted by
//! UTF-16 code units and strings escaped by serde_json itself. The two agree wherever
//! both are defined: serde_json silently keeps the last of duplicate names (we refuse
//! them) and rounds numbers (we keep them as written), so generated documents use
//! integers and distinct names, and arbitrary token soups are compared as values.

use std::path::PathBuf;

use idem_core::canonical::{MAX_DEPTH, canonicalize};
use proptest::prelude::*;
use serde_json::Value;

/// The oracle: canonical JSON written from serde_json's value.
fn oracle(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut members: Vec<_> = map.iter().collect();
            members.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
            out.push('{');
            for (i, (name, value)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::to_string(name).unwrap());
                out.push(':');
                oracle(value, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                oracle(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&serde_json::to_string(scalar).unwrap()),
    }
}

fn ours(input: &str) -> String {
    String::from_utf8(canonicalize(input.as_bytes()).expect("accepted")).unwrap()
}

/// A JSON value with integer numbers and any characters in strings.
fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<String>().prop_map(Value::String),
    ];
    leaf.prop_recursive(6, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::btree_map(any::<String>(), inner, 0..8)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Writes `value` as JSON the way a client might: members in an order of its choosing,
/// whitespace anywhere, characters escaped or not.
fn render(value: &Value, choices: &mut impl Iterator<Item = u8>, out: &mut String) {
    fn pick(choices: &mut impl Iterator<Item = u8>) -> u8 {
        choices.next().unwrap_or(0)
    }
    let ws = |out: &mut String, c: u8| {
        out.push_str([" ", "", "\n\t", "\r\n ", ""][usize::from(c % 5)]);
    };
    match value {
        Value::Object(map) => {
            let mut members: Vec<_> = map.iter().collect();
            let rotate = if members.is_empty() {
                0
            } else {
                usize::from(pick(choices)) % members.len()
            };
            members.rotate_left(rotate);
            if pick(choices).is_multiple_of(2) {
                members.reverse();
            }
            out.push('{');
            for (i, (name, value)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(out, pick(choices));
                render_string(name, pick(choices), out);
                ws(out, pick(choices));
                out.push(':');
                ws(out, pick(choices));
                render(value, choices, out);
                ws(out, pick(choices));
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(out, pick(choices));
                render(item, choices, out);
            }
            out.push(']');
        }
        Value::String(s) => render_string(s, pick(choices), out),
        scalar => out.push_str(&serde_json::to_string(scalar).unwrap()),
    }
}

/// A string literal: plain, or with every character escaped as `\uXXXX` (surrogate
/// pairs above U+FFFF), or with the short escapes where they exist.
fn render_string(s: &str, style: u8, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match (style % 3, c) {
            (_, '"') => out.push_str("\\\""),
            (_, '\\') => out.push_str("\\\\"),
            (1, c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04X}"));
                }
            }
            (2, '/') => out.push_str("\\/"),
            (2, '\n') => out.push_str("\\n"),
            (_, c) if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            (_, c) => out.push(c),
        }
    }
    out.push('"');
}

proptest! {
    // Failures are reported with their minimal input; nothing is written to the tree.
    #![proptest_config(ProptestConfig {
        cases: 2000,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn agrees_with_serde_json_on_any_rendering(
        value in value(),
        choices in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        let mut text = String::new();
        render(&value, &mut choices.into_iter(), &mut text);
        let mut expected = String::new();
        oracle(&serde_json::from_str(&text).unwrap(), &mut expected);
        prop_assert_eq!(ours(&text), expected);
    }

    #[test]
    fn token_soup_is_refused_or_read_as_serde_json_reads_it(
        tokens in prop::collection::vec(prop::sample::select(vec![
            "{", "}", "[", "]", ":", ",", " ", "\"a\"", "\"b\"", "\"\\u0061\"", "\"\\ud800\"",
            "\"\\ud83d\\ude00\"", "\"\u{e9}\"", "1", "-0", "1.50", "1e5", "01", "1.", "true",
            "nul", "null", "\"\\x\"", "\"\n\"", "\"\\\\\"",
        ]), 0..24),
    ) {
        let text = tokens.concat();
        let theirs = serde_json::from_str::<Value>(&text);
        match canonicalize(text.as_bytes()) {
            Ok(canonical) => {
                match serde_json::from_slice::<Value>(&canonical) {
                    Ok(read) => prop_assert_eq!(Some(read), theirs.ok(), "{}", text),
                    // serde_json reads numbers as f64 and refuses `1e501`; we keep it.
                    Err(e) => prop_assert!(
                        theirs.is_err() && e.to_string().contains("number out of range"),
                        "{}: {}", text, e
                    ),
                }
                prop_assert_eq!(canonicalize(&canonical).unwrap(), canonical);
            }
            // Where serde_json accepts and we refuse, it is for duplicate names.
            Err(e) => if theirs.is_ok() {
                prop_assert!(e.message.contains("duplicate"), "{}: {}", text, e);
            },
        }
    }
}

/// Member names `"0000000"`, `"0000001"`, …: the object that took two cores for 14 s
/// when every name was compared with every earlier one.
fn many_members(count: usize) -> String {
    let mut s = String::from("{");
    for i in (0..count).rev() {
        if i + 1 < count {
            s.push(',');
        }
        s.push_str(&format!("\"{i:07}\":0"));
    }
    s.push('}');
    s
}

#[test]
fn a_megabyte_of_members_is_sorted_and_checked_for_repeats() {
    let text = many_members(86_000);
    assert!(text.len() > 1_000_000);
    let canonical = ours(&text);
    assert!(canonical.starts_with("{\"0000000\":0,\"0000001\":0,"));
    // One repeated name among them is still found.
    let repeated = text.replacen("\"0000001\"", "\"0085999\"", 1);
    let e = canonicalize(repeated.as_bytes()).unwrap_err();
    assert!(e.message.contains("\"0085999\""), "{e}");
}

#[test]
fn deep_nesting_with_a_long_string_inside() {
    // Each level has a second member that sorts after the deep one, so every level is
    // reordered: one copy of the payload per level in a per-level buffer scheme.
    let payload = "x".repeat(900_000);
    let mut text = format!("\"{payload}\"");
    for _ in 0..MAX_DEPTH {
        text = format!("{{\"z\":0,\"a\":{text}}}");
    }
    let canonical = ours(&text);
    assert!(canonical.starts_with("{\"a\":{\"a\":"));
    assert_eq!(canonical.len(), text.len());
    assert!(canonicalize(format!("[{text}]").as_bytes()).is_err());
}

#[test]
fn long_strings_with_many_escapes() {
    let text = format!("[\"{}\"]", "\\u00e9\\n\\\"\\ud83d\\ude00".repeat(40_000));
    let canonical = ours(&text);
    assert_eq!(
        canonical,
        format!("[\"{}\"]", "\u{e9}\\n\\\"\u{1f600}".repeat(40_000))
    );
}

#[test]
fn wide_arrays_and_many_small_objects() {
    let zeros = format!("[{}0]", "0,".repeat(400_000));
    assert_eq!(ours(&zeros), zeros);
    let objects = format!("[{}{{}}]", "{\"b\":1,\"a\":2},".repeat(50_000));
    assert!(ours(&objects).starts_with("[{\"a\":2,\"b\":1},"));
}

/// Every file of the fuzz corpus (nasty cases found or written by hand) goes through
/// the same checks as the fuzz target.
#[test]
fn the_fuzz_corpus_still_holds() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/canonical");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("the corpus is committed") {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        seen += 1;
        if let Ok(canonical) = canonicalize(&bytes) {
            assert_eq!(canonicalize(&canonical).unwrap(), canonical);
            if let Ok(original) = serde_json::from_slice::<Value>(&bytes) {
                assert_eq!(
                    serde_json::from_slice::<Value>(&canonical).unwrap(),
                    original
                );
            }
        }
    }
    assert!(
        seen >= 20,
        "the corpus in {} has {seen} files",
        dir.display()
    );
}

//! Stored response headers as JSON: `[[name, value], ...]`.
//!
//! Header values are bytes, not text. Each byte is stored as the character with the
//! same number (U+0000..U+00FF, i.e. Latin-1), which keeps every value exactly and
//! leaves the usual ASCII values readable in `psql`.

use serde_json::Value;

pub fn encode(headers: &[(String, Vec<u8>)]) -> Value {
    Value::Array(
        headers
            .iter()
            .map(|(name, value)| {
                let value: String = value.iter().map(|&b| char::from(b)).collect();
                Value::Array(vec![Value::String(name.clone()), Value::String(value)])
            })
            .collect(),
    )
}

/// The inverse of [`encode`]; `None` if the JSON is not of that shape.
pub fn decode(json: &Value) -> Option<Vec<(String, Vec<u8>)>> {
    json.as_array()?
        .iter()
        .map(|pair| match pair.as_array()?.as_slice() {
            [Value::String(name), Value::String(value)] => {
                let bytes = value
                    .chars()
                    .map(|c| u8::try_from(u32::from(c)).ok())
                    .collect::<Option<Vec<u8>>>()?;
                Some((name.clone(), bytes))
            }
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_byte() {
        let headers = vec![
            ("content-type".to_owned(), b"application/json".to_vec()),
            ("x-odd".to_owned(), (0u8..=255).collect()),
            ("x-empty".to_owned(), Vec::new()),
        ];
        let json = encode(&headers);
        assert_eq!(
            json[0],
            serde_json::json!(["content-type", "application/json"])
        );
        assert_eq!(decode(&json).unwrap(), headers);
    }

    #[test]
    fn refuses_other_shapes() {
        assert!(decode(&serde_json::json!({"a": "b"})).is_none());
        assert!(decode(&serde_json::json!([["a"]])).is_none());
        assert!(decode(&serde_json::json!([["a", "\u{100}"]])).is_none());
    }
}

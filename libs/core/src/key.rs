//! The `Idempotency-Key` header value: what a valid key is, and how a quoted
//! Structured-Field string (`"abc"`) is unquoted.

use std::fmt;

/// The longest key accepted, in bytes (keys are ASCII, so also in characters).
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key, exactly as it is scoped, stored and sent upstream.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why a key was refused. The message is safe to show to the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the Idempotency-Key is empty")]
    Empty,
    #[error("the Idempotency-Key is longer than {MAX_KEY_LEN} characters")]
    TooLong,
    #[error("the Idempotency-Key may hold only printable ASCII (0x21-0x7E) and no comma")]
    BadCharacter,
    #[error("the Idempotency-Key starts with a quote but is not a valid quoted string")]
    BadQuoting,
}

impl IdempotencyKey {
    /// Parses a raw header value. A value wrapped in double quotes is read as an
    /// RFC 8941 sf-string (`\"` and `\\` escapes) and its content is the key; either
    /// way the key must be 1..=255 printable ASCII characters without a comma.
    pub fn parse(raw: &[u8]) -> Result<Self, KeyError> {
        let key = match raw.first() {
            Some(b'"') => unquote(raw)?,
            _ => raw.to_vec(),
        };
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong);
        }
        if !key.iter().all(|&b| (0x21..=0x7e).contains(&b) && b != b',') {
            return Err(KeyError::BadCharacter);
        }
        // Every byte is ASCII, so this cannot fail.
        Ok(Self(
            String::from_utf8(key).map_err(|_| KeyError::BadCharacter)?,
        ))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn unquote(raw: &[u8]) -> Result<Vec<u8>, KeyError> {
    let inner = match raw {
        [b'"', inner @ .., b'"'] if raw.len() >= 2 => inner,
        _ => return Err(KeyError::BadQuoting),
    };
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return Err(KeyError::BadQuoting),
            },
            b'"' => return Err(KeyError::BadQuoting),
            _ => out.push(b),
        }
    }
    Ok(out)
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({:?})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<String, KeyError> {
        IdempotencyKey::parse(s.as_bytes()).map(|k| k.as_str().to_owned())
    }

    #[test]
    fn accepts_printable_ascii_up_to_255() {
        assert_eq!(parse("abc-123_X.Y:Z").unwrap(), "abc-123_X.Y:Z");
        assert_eq!(parse("!~").unwrap(), "!~");
        let longest = "k".repeat(MAX_KEY_LEN);
        assert_eq!(parse(&longest).unwrap(), longest);
    }

    #[test]
    fn rejects_empty_and_too_long() {
        assert_eq!(parse(""), Err(KeyError::Empty));
        assert_eq!(parse("\"\""), Err(KeyError::Empty));
        assert_eq!(parse(&"k".repeat(MAX_KEY_LEN + 1)), Err(KeyError::TooLong));
    }

    #[test]
    fn rejects_space_control_non_ascii_and_comma() {
        for bad in ["a b", "a\tb", "caf\u{e9}", "a,b", "a\u{7f}"] {
            assert_eq!(parse(bad), Err(KeyError::BadCharacter), "{bad:?}");
        }
        assert_eq!(
            IdempotencyKey::parse(b"a\x00b"),
            Err(KeyError::BadCharacter)
        );
    }

    #[test]
    fn unquotes_structured_field_strings() {
        assert_eq!(parse("\"abc\"").unwrap(), "abc");
        assert_eq!(parse(r#""a\"b""#).unwrap(), "a\"b");
        assert_eq!(parse(r#""a\\b""#).unwrap(), "a\\b");
        // The quoted form is held to the same rules once unquoted.
        assert_eq!(parse("\"a b\""), Err(KeyError::BadCharacter));
        assert_eq!(parse("\"a,b\""), Err(KeyError::BadCharacter));
    }

    #[test]
    fn rejects_malformed_quoting() {
        for bad in ["\"abc", "\"", r#""a\b""#, r#""a"b""#, r#""abc\""#] {
            assert_eq!(parse(bad), Err(KeyError::BadQuoting), "{bad:?}");
        }
    }

    #[test]
    fn a_quote_inside_an_unquoted_key_is_just_a_character() {
        assert_eq!(parse("ab\"").unwrap(), "ab\"");
    }
}

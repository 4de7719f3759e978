//! Canonical JSON, so that `{"a":1,"b":2}` and `{ "b": 2, "a": 1 }` are the same request.
//!
//! The output follows RFC 8785 (JCS) for structure and strings: object members sorted by
//! their names' UTF-16 code units, no insignificant whitespace, strings written with the
//! minimal escapes of ECMAScript's `JSON.stringify`. It departs from JCS on numbers on
//! purpose: a number is kept exactly as written, because re-serialising it through an
//! IEEE double would make `9007199254740993` and `9007199254740992` one fingerprint.
//!
//! Input that could mean two things is refused rather than guessed at: duplicate member
//! names, lone UTF-16 surrogates, and anything that is not strict RFC 8259 JSON.

use std::fmt;

/// Nesting deeper than this is refused, so a hostile body cannot exhaust the stack.
pub const MAX_DEPTH: usize = 128;

/// Why a body is not acceptable JSON. The message is safe to show to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonError {
    pub message: String,
    /// Byte offset in the input where the problem was found.
    pub offset: usize,
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at byte {}", self.message, self.offset)
    }
}

impl std::error::Error for JsonError {}

/// Parses `input` as strict JSON and returns its canonical form.
pub fn canonicalize(input: &[u8]) -> Result<Vec<u8>, JsonError> {
    let mut parser = Parser {
        input,
        pos: 0,
        out: Vec::with_capacity(input.len()),
    };
    parser.skip_whitespace();
    parser.value(0)?;
    parser.skip_whitespace();
    if parser.pos != input.len() {
        return Err(parser.error("unexpected data after the JSON value"));
    }
    Ok(parser.out)
}

struct Parser<'a> {
    input: &'a [u8],
    pos: usize,
    out: Vec<u8>,
}

impl Parser<'_> {
    fn error(&self, message: impl Into<String>) -> JsonError {
        JsonError {
            message: message.into(),
            offset: self.pos,
        }
    }

    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    fn expect(&mut self, byte: u8) -> Result<(), JsonError> {
        if self.peek() == Some(byte) {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.error(format!("expected '{}'", byte as char)))
        }
    }

    fn value(&mut self, depth: usize) -> Result<(), JsonError> {
        if depth > MAX_DEPTH {
            return Err(self.error(format!("nesting deeper than {MAX_DEPTH} levels")));
        }
        match self.peek() {
            Some(b'{') => self.object(depth),
            Some(b'[') => self.array(depth),
            Some(b'"') => {
                let s = self.string()?;
                write_string(&mut self.out, &s);
                Ok(())
            }
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            Some(_) => Err(self.error("expected a JSON value")),
            None => Err(self.error("unexpected end of input")),
        }
    }

    fn literal(&mut self, word: &[u8]) -> Result<(), JsonError> {
        if self.input[self.pos..].starts_with(word) {
            self.pos += word.len();
            self.out.extend_from_slice(word);
            Ok(())
        } else {
            Err(self.error("expected a JSON value"))
        }
    }

    fn object(&mut self, depth: usize) -> Result<(), JsonError> {
        self.expect(b'{')?;
        let mut members: Vec<(Vec<u16>, String, Vec<u8>)> = Vec::new();
        self.skip_whitespace();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            self.out.extend_from_slice(b"{}");
            return Ok(());
        }
        loop {
            self.skip_whitespace();
            if self.peek() != Some(b'"') {
                return Err(self.error("expected a member name"));
            }
            let name_at = self.pos;
            let name = self.string()?;
            let utf16: Vec<u16> = name.encode_utf16().collect();
            if members.iter().any(|(k, _, _)| *k == utf16) {
                return Err(JsonError {
                    message: format!("duplicate member name {name:?}"),
                    offset: name_at,
                });
            }
            self.skip_whitespace();
            self.expect(b':')?;
            self.skip_whitespace();
            // Serialise the member's value into a buffer of its own, to sort later.
            let outer = std::mem::take(&mut self.out);
            let result = self.value(depth + 1);
            let value = std::mem::replace(&mut self.out, outer);
            result?;
            members.push((utf16, name, value));
            self.skip_whitespace();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    break;
                }
                _ => return Err(self.error("expected ',' or '}'")),
            }
        }
        members.sort_by(|a, b| a.0.cmp(&b.0));
        self.out.push(b'{');
        for (i, (_, name, value)) in members.iter().enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            write_string(&mut self.out, name);
            self.out.push(b':');
            self.out.extend_from_slice(value);
        }
        self.out.push(b'}');
        Ok(())
    }

    fn array(&mut self, depth: usize) -> Result<(), JsonError> {
        self.expect(b'[')?;
        self.out.push(b'[');
        self.skip_whitespace();
        if self.peek() == Some(b']') {
            self.pos += 1;
            self.out.push(b']');
            return Ok(());
        }
        loop {
            self.skip_whitespace();
            self.value(depth + 1)?;
            self.skip_whitespace();
            match self.peek() {
                Some(b',') => {
                    self.pos += 1;
                    self.out.push(b',');
                }
                Some(b']') => {
                    self.pos += 1;
                    self.out.push(b']');
                    return Ok(());
                }
                _ => return Err(self.error("expected ',' or ']'")),
            }
        }
    }

    /// Reads a string token and returns its decoded content.
    fn string(&mut self) -> Result<String, JsonError> {
        self.expect(b'"')?;
        let mut s = String::new();
        loop {
            let start = self.pos;
            // Copy the longest run of plain characters at once.
            while let Some(b) = self.peek() {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.pos += 1;
            }
            if self.pos > start {
                let run =
                    std::str::from_utf8(&self.input[start..self.pos]).map_err(|e| JsonError {
                        message: "invalid UTF-8 in a string".into(),
                        offset: start + e.valid_up_to(),
                    })?;
                s.push_str(run);
            }
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(s);
                }
                Some(b'\\') => {
                    self.pos += 1;
                    self.escape(&mut s)?;
                }
                Some(_) => return Err(self.error("unescaped control character in a string")),
                None => return Err(self.error("unterminated string")),
            }
        }
    }

    fn escape(&mut self, s: &mut String) -> Result<(), JsonError> {
        let c = match self.peek() {
            Some(b'"') => '"',
            Some(b'\\') => '\\',
            Some(b'/') => '/',
            Some(b'b') => '\u{8}',
            Some(b'f') => '\u{c}',
            Some(b'n') => '\n',
            Some(b'r') => '\r',
            Some(b't') => '\t',
            Some(b'u') => {
                self.pos += 1;
                let at = self.pos - 2;
                let unit = self.hex4()?;
                let lone = || JsonError {
                    message: "lone UTF-16 surrogate in a string".into(),
                    offset: at,
                };
                let c = match unit {
                    0xD800..=0xDBFF => {
                        if !self.input[self.pos..].starts_with(b"\\u") {
                            return Err(lone());
                        }
                        self.pos += 2;
                        let low = self.hex4()?;
                        if !(0xDC00..=0xDFFF).contains(&low) {
                            return Err(lone());
                        }
                        let code = 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00);
                        char::from_u32(code).ok_or_else(lone)?
                    }
                    0xDC00..=0xDFFF => return Err(lone()),
                    _ => char::from_u32(unit).ok_or_else(lone)?,
                };
                s.push(c);
                return Ok(());
            }
            _ => return Err(self.error("invalid escape in a string")),
        };
        self.pos += 1;
        s.push(c);
        Ok(())
    }

    fn hex4(&mut self) -> Result<u32, JsonError> {
        let digits = self
            .input
            .get(self.pos..self.pos + 4)
            .ok_or_else(|| self.error("truncated \\u escape"))?;
        let mut value = 0u32;
        for &d in digits {
            let v = (d as char)
                .to_digit(16)
                .ok_or_else(|| self.error("invalid \\u escape"))?;
            value = value * 16 + v;
        }
        self.pos += 4;
        Ok(value)
    }

    /// Validates a number token against RFC 8259's grammar and copies it as written.
    fn number(&mut self) -> Result<(), JsonError> {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        match self.peek() {
            Some(b'0') => self.pos += 1,
            Some(b'1'..=b'9') => self.digits(),
            _ => return Err(self.error("invalid number")),
        }
        if self.peek() == Some(b'.') {
            self.pos += 1;
            if !matches!(self.peek(), Some(b'0'..=b'9')) {
                return Err(self.error("invalid number: digits expected after '.'"));
            }
            self.digits();
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            if !matches!(self.peek(), Some(b'0'..=b'9')) {
                return Err(self.error("invalid number: digits expected in the exponent"));
            }
            self.digits();
        }
        self.out.extend_from_slice(&self.input[start..self.pos]);
        Ok(())
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
    }
}

/// Writes `s` as a JSON string with the minimal escapes of RFC 8785 §3.2.2.2.
fn write_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    for c in s.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\u{8}' => out.extend_from_slice(b"\\b"),
            '\u{c}' => out.extend_from_slice(b"\\f"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            c if (c as u32) < 0x20 => {
                out.extend_from_slice(format!("\\u{:04x}", c as u32).as_bytes());
            }
            c => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> String {
        String::from_utf8(canonicalize(s.as_bytes()).unwrap()).unwrap()
    }

    fn refused(s: &[u8]) -> JsonError {
        canonicalize(s).expect_err("should be refused")
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        assert_eq!(canon(r#"{"a":1,"b":2}"#), r#"{"a":1,"b":2}"#);
        assert_eq!(
            canon("{ \"b\" : 2 ,\n\t\"a\" : 1 }\r\n"),
            r#"{"a":1,"b":2}"#
        );
        assert_eq!(
            canon(r#"{"z":{"y":[3, {"b":null,"a":true}],"x":false},"a":[]}"#),
            r#"{"a":[],"z":{"x":false,"y":[3,{"a":true,"b":null}]}}"#
        );
    }

    #[test]
    fn member_names_sort_by_utf16_code_units() {
        // RFC 8785 §3.2.3's example: UTF-16 order puts U+1F600 (a surrogate pair,
        // 0xD83D...) before U+FB33, unlike a sort by code points or UTF-8 bytes.
        let input = "{\"\\ufb33\":1,\"\\ud83d\\ude00\":2,\"\\u00e9\":3,\"a\":4,\"\\r\":5,\"1\":6,\"\\u0080\":7}";
        assert_eq!(
            canon(input),
            "{\"\\r\":5,\"1\":6,\"a\":4,\"\u{80}\":7,\"\u{e9}\":3,\"\u{1f600}\":2,\"\u{fb33}\":1}"
        );
    }

    #[test]
    fn unicode_escapes_and_raw_characters_are_the_same_string() {
        assert_eq!(canon(r#""caf\u00e9""#), canon("\"caf\u{e9}\""));
        assert_eq!(canon(r#""\ud83d\ude00""#), "\"\u{1f600}\"");
        assert_eq!(canon(r#""\/""#), r#""/""#);
        // Control characters keep the short escapes, others become lowercase \u00xx.
        assert_eq!(
            canon(r#""\u0008\u000C\n\u000d\t\u001F\u007f""#),
            "\"\\b\\f\\n\\r\\t\\u001f\u{7f}\""
        );
        assert_eq!(canon(r#""\"\\""#), r#""\"\\""#);
    }

    #[test]
    fn numbers_are_kept_as_written() {
        assert_eq!(canon("9007199254740993"), "9007199254740993");
        assert_ne!(canon("9007199254740993"), canon("9007199254740992"));
        assert_eq!(
            canon("[-0,1.50,1e+30,2E-7,0.1]"),
            "[-0,1.50,1e+30,2E-7,0.1]"
        );
        assert_eq!(
            canon("123456789012345678901234567890.000000000000000000001"),
            "123456789012345678901234567890.000000000000000000001"
        );
    }

    #[test]
    fn rejects_invalid_numbers() {
        for bad in [
            "01", "1.", ".5", "+1", "1e", "1e+", "-", "0x10", "NaN", "Infinity",
        ] {
            refused(bad.as_bytes());
        }
    }

    #[test]
    fn rejects_duplicate_member_names_even_when_spelled_differently() {
        let e = refused(br#"{"a":1,"a":2}"#);
        assert!(e.message.contains("duplicate"), "{e}");
        assert_eq!(e.offset, 7);
        refused(br#"{"a":1,"\u0061":2}"#);
        // Duplicates are checked per object, not across objects.
        assert_eq!(canon(r#"[{"a":1},{"a":2}]"#), r#"[{"a":1},{"a":2}]"#);
    }

    #[test]
    fn rejects_lone_surrogates() {
        for bad in [
            r#""\ud800""#,
            r#""\udc00""#,
            r#""\ud800x""#,
            r#""\ud800\u0041""#,
        ] {
            let e = refused(bad.as_bytes());
            assert!(e.message.contains("surrogate"), "{bad}: {e}");
        }
    }

    #[test]
    fn rejects_malformed_documents() {
        for bad in [
            &b""[..],
            b"{",
            b"{\"a\"}",
            b"{\"a\":1,}",
            b"[1,]",
            b"{a:1}",
            b"'a'",
            b"\"a",
            b"\"a\nb\"",
            b"\"\\x\"",
            b"tru",
            b"nul",
            b"{} {}",
            b"\xef\xbb\xbf{}",
            b"\"\xff\"",
        ] {
            refused(bad);
        }
    }

    #[test]
    fn rejects_nesting_past_the_limit_without_overflowing() {
        let deep = "[".repeat(100_000);
        refused(deep.as_bytes());
        let ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert_eq!(canon(&ok), ok);
    }

    #[test]
    fn literals_and_scalars() {
        assert_eq!(canon(" true "), "true");
        assert_eq!(canon("null"), "null");
        assert_eq!(canon("[false,\"\",{}]"), "[false,\"\",{}]");
    }
}

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
//!
//! # Cost
//! Linear in the input, plus a sort of each object's members (n log n), whatever the
//! shape: the document is parsed once into a flat arena of nodes, each object's members
//! are sorted (duplicates are then neighbours), and the canonical form is written once,
//! every byte of it exactly once. Nothing is re-scanned or copied per nesting level.
//!
//! # Why one file of ~500 lines (and its tests)
//! A parser and its writer over one arena of nodes: the arena's invariants (members
//! sorted once, numbers kept as written, nesting bounded) are set by the parser and
//! relied on by the writer, and are checked here and by the fuzzer in `fuzz/`.

use std::cmp::Ordering;
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
    if u32::try_from(input.len()).is_err() {
        return Err(JsonError {
            message: "document too large".into(),
            offset: 0,
        });
    }
    // JSON text is UTF-8 (RFC 8259 §8.1): checked once here, so every slice taken below
    // at an ASCII delimiter is a valid `str`.
    let text = std::str::from_utf8(input).map_err(|e| JsonError {
        message: "invalid UTF-8".into(),
        offset: e.valid_up_to(),
    })?;
    let mut parser = Parser {
        text,
        bytes: input,
        pos: 0,
        doc: Doc::default(),
        open_kids: Vec::new(),
        open_members: Vec::new(),
    };
    parser.skip_whitespace();
    let root = parser.value(0)?;
    parser.skip_whitespace();
    if parser.pos != input.len() {
        return Err(parser.error("unexpected data after the JSON value"));
    }
    let mut out = Vec::with_capacity(input.len());
    parser.doc.write(root, text, &mut out);
    Ok(out)
}

/// A parsed value. Ranges are `u32` offsets (the input is at most 4 GiB).
#[derive(Debug, Clone, Copy)]
enum Node {
    Literal(&'static [u8]),
    /// A number token, as written: a range of the input.
    Number(u32, u32),
    /// A decoded string: a range of [`Doc::strings`].
    Str(u32, u32),
    /// Elements: a range of [`Doc::kids`].
    Array(u32, u32),
    /// Members, sorted by name: a range of [`Doc::members`].
    Object(u32, u32),
}

#[derive(Debug, Clone, Copy)]
struct Member {
    /// The decoded name: a range of [`Doc::strings`].
    name: (u32, u32),
    /// Where the name starts in the input, for error messages.
    at: u32,
    value: u32,
}

/// The parsed document: every node, container children stored contiguously.
#[derive(Debug, Default)]
struct Doc {
    nodes: Vec<Node>,
    kids: Vec<u32>,
    members: Vec<Member>,
    strings: String,
}

impl Doc {
    fn push(&mut self, node: Node) -> u32 {
        self.nodes.push(node);
        (self.nodes.len() - 1) as u32
    }

    fn string(&self, (start, end): (u32, u32)) -> &str {
        &self.strings[start as usize..end as usize]
    }

    /// Writes the canonical form of `node`. Recursion is bounded by [`MAX_DEPTH`].
    fn write(&self, node: u32, input: &str, out: &mut Vec<u8>) {
        match self.nodes[node as usize] {
            Node::Literal(word) => out.extend_from_slice(word),
            Node::Number(start, end) => {
                out.extend_from_slice(&input.as_bytes()[start as usize..end as usize]);
            }
            Node::Str(start, end) => write_string(out, self.string((start, end))),
            Node::Array(start, end) => {
                out.push(b'[');
                for (i, &kid) in self.kids[start as usize..end as usize].iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    self.write(kid, input, out);
                }
                out.push(b']');
            }
            Node::Object(start, end) => {
                out.push(b'{');
                for (i, m) in self.members[start as usize..end as usize]
                    .iter()
                    .enumerate()
                {
                    if i > 0 {
                        out.push(b',');
                    }
                    write_string(out, self.string(m.name));
                    out.push(b':');
                    self.write(m.value, input, out);
                }
                out.push(b'}');
            }
        }
    }
}

struct Parser<'a> {
    text: &'a str,
    bytes: &'a [u8],
    pos: usize,
    doc: Doc,
    /// Children of the arrays being parsed, innermost last; moved into `doc.kids` (so
    /// that each array's children are contiguous) when the array closes.
    open_kids: Vec<u32>,
    /// Likewise for the members of the objects being parsed.
    open_members: Vec<Member>,
}

impl Parser<'_> {
    fn error(&self, message: impl Into<String>) -> JsonError {
        JsonError {
            message: message.into(),
            offset: self.pos,
        }
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
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

    fn value(&mut self, depth: usize) -> Result<u32, JsonError> {
        if depth > MAX_DEPTH {
            return Err(self.error(format!("nesting deeper than {MAX_DEPTH} levels")));
        }
        let node = match self.peek() {
            Some(b'{') => return self.object(depth),
            Some(b'[') => return self.array(depth),
            Some(b'"') => {
                let (start, end) = self.string()?;
                Node::Str(start, end)
            }
            Some(b'-' | b'0'..=b'9') => {
                let start = self.pos as u32;
                self.number()?;
                Node::Number(start, self.pos as u32)
            }
            Some(b't') => self.literal(b"true")?,
            Some(b'f') => self.literal(b"false")?,
            Some(b'n') => self.literal(b"null")?,
            Some(_) => return Err(self.error("expected a JSON value")),
            None => return Err(self.error("unexpected end of input")),
        };
        Ok(self.doc.push(node))
    }

    fn literal(&mut self, word: &'static [u8]) -> Result<Node, JsonError> {
        if self.bytes[self.pos..].starts_with(word) {
            self.pos += word.len();
            Ok(Node::Literal(word))
        } else {
            Err(self.error("expected a JSON value"))
        }
    }

    fn object(&mut self, depth: usize) -> Result<u32, JsonError> {
        self.expect(b'{')?;
        let open = self.open_members.len();
        self.skip_whitespace();
        if self.peek() == Some(b'}') {
            self.pos += 1;
        } else {
            loop {
                self.skip_whitespace();
                if self.peek() != Some(b'"') {
                    return Err(self.error("expected a member name"));
                }
                let at = self.pos as u32;
                let name = self.string()?;
                self.skip_whitespace();
                self.expect(b':')?;
                self.skip_whitespace();
                let value = self.value(depth + 1)?;
                self.open_members.push(Member { name, at, value });
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
        }
        let start = self.doc.members.len() as u32;
        self.doc.members.extend(self.open_members.drain(open..));
        let members = &mut self.doc.members[start as usize..];
        let strings = &self.doc.strings;
        let name = |m: &Member| &strings[m.name.0 as usize..m.name.1 as usize];
        // Stable, so members with one name stay in document order: the first repeat of
        // a name is the one reported, as a reader going left to right would find it.
        members.sort_by(|a, b| utf16_cmp(name(a), name(b)));
        if let Some(repeat) = members
            .windows(2)
            .filter(|pair| name(&pair[0]) == name(&pair[1]))
            .map(|pair| pair[1])
            .min_by_key(|m| m.at)
        {
            return Err(JsonError {
                message: format!("duplicate member name {:?}", name(&repeat)),
                offset: repeat.at as usize,
            });
        }
        let end = self.doc.members.len() as u32;
        Ok(self.doc.push(Node::Object(start, end)))
    }

    fn array(&mut self, depth: usize) -> Result<u32, JsonError> {
        self.expect(b'[')?;
        let open = self.open_kids.len();
        self.skip_whitespace();
        if self.peek() == Some(b']') {
            self.pos += 1;
        } else {
            loop {
                self.skip_whitespace();
                let kid = self.value(depth + 1)?;
                self.open_kids.push(kid);
                self.skip_whitespace();
                match self.peek() {
                    Some(b',') => self.pos += 1,
                    Some(b']') => {
                        self.pos += 1;
                        break;
                    }
                    _ => return Err(self.error("expected ',' or ']'")),
                }
            }
        }
        let start = self.doc.kids.len() as u32;
        self.doc.kids.extend(self.open_kids.drain(open..));
        let end = self.doc.kids.len() as u32;
        Ok(self.doc.push(Node::Array(start, end)))
    }

    /// Reads a string token, decodes it onto `doc.strings` and returns its range there.
    fn string(&mut self) -> Result<(u32, u32), JsonError> {
        self.expect(b'"')?;
        let start = self.doc.strings.len() as u32;
        loop {
            let run = self.pos;
            // Copy the longest run of plain characters at once.
            while let Some(b) = self.peek() {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.pos += 1;
            }
            // Both ends are at ASCII bytes (or the input's end): char boundaries.
            self.doc.strings.push_str(&self.text[run..self.pos]);
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    return Ok((start, self.doc.strings.len() as u32));
                }
                Some(b'\\') => {
                    self.pos += 1;
                    let c = self.escape()?;
                    self.doc.strings.push(c);
                }
                Some(_) => return Err(self.error("unescaped control character in a string")),
                None => return Err(self.error("unterminated string")),
            }
        }
    }

    fn escape(&mut self) -> Result<char, JsonError> {
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
                return match unit {
                    0xD800..=0xDBFF => {
                        if !self.bytes[self.pos..].starts_with(b"\\u") {
                            return Err(lone());
                        }
                        self.pos += 2;
                        let low = self.hex4()?;
                        if !(0xDC00..=0xDFFF).contains(&low) {
                            return Err(lone());
                        }
                        let code = 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00);
                        char::from_u32(code).ok_or_else(lone)
                    }
                    0xDC00..=0xDFFF => Err(lone()),
                    _ => char::from_u32(unit).ok_or_else(lone),
                };
            }
            _ => return Err(self.error("invalid escape in a string")),
        };
        self.pos += 1;
        Ok(c)
    }

    fn hex4(&mut self) -> Result<u32, JsonError> {
        let digits = self
            .bytes
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

    /// Validates a number token against RFC 8259's grammar (it is kept as written).
    fn number(&mut self) -> Result<(), JsonError> {
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
        Ok(())
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
    }
}

/// Orders two strings by their UTF-16 code units (RFC 8785 §3.2.3) without transcoding.
///
/// UTF-8 bytes sort like code points, and UTF-16 units sort like code points too, except
/// that a character above U+FFFF (a surrogate pair, 0xD800..) sorts before U+E000..U+FFFF.
/// So the strings' common byte prefix decides nothing, and the first characters that
/// differ decide everything: compared by their first UTF-16 unit, then by code point.
fn utf16_cmp(a: &str, b: &str) -> Ordering {
    let common = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    if common == a.len() || common == b.len() {
        return a.len().cmp(&b.len());
    }
    // The prefix is shared, so both strings have their character boundaries in the
    // same places up to it.
    let mut at = common;
    while !a.is_char_boundary(at) {
        at -= 1;
    }
    let first = |s: &str| s[at..].chars().next().map_or(0, u32::from);
    let (ca, cb) = (first(a), first(b));
    let unit = |c: u32| {
        if c >= 0x10000 {
            0xD800 + ((c - 0x10000) >> 10)
        } else {
            c
        }
    };
    (unit(ca), ca).cmp(&(unit(cb), cb))
}

/// Writes `s` as a JSON string with the minimal escapes of RFC 8785 §3.2.2.2.
fn write_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut run = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escaped: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x0c => b"\\f",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x00..=0x1f => {
                out.extend_from_slice(&bytes[run..i]);
                run = i + 1;
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.extend_from_slice(&[
                    b'\\',
                    b'u',
                    b'0',
                    b'0',
                    HEX[usize::from(b >> 4)],
                    HEX[usize::from(b & 0xf)],
                ]);
                continue;
            }
            // Everything else, multi-byte UTF-8 included, is copied as it is.
            _ => continue,
        };
        out.extend_from_slice(&bytes[run..i]);
        out.extend_from_slice(escaped);
        run = i + 1;
    }
    out.extend_from_slice(&bytes[run..]);
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
    fn utf16_order_agrees_with_transcoding() {
        let names = [
            "",
            "a",
            "ab",
            "b",
            "\u{7f}",
            "\u{80}",
            "\u{7ff}",
            "\u{800}",
            "\u{d7ff}",
            "\u{e000}",
            "\u{fb33}",
            "\u{ffff}",
            "\u{10000}",
            "\u{1f600}",
            "\u{10ffff}",
            "a\u{e000}",
            "a\u{10000}",
            "a\u{1f600}b",
            "a\u{1f601}",
        ];
        for a in names {
            for b in names {
                assert_eq!(
                    utf16_cmp(a, b),
                    a.encode_utf16().cmp(b.encode_utf16()),
                    "{a:?} vs {b:?}"
                );
            }
        }
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
        assert_eq!(canon(r#""a\u0000b""#), r#""a\u0000b""#);
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
        // The first repeat in document order is the one reported.
        let e = refused(br#"{"b":1,"a":2,"a":3,"b":4}"#);
        assert_eq!(
            (e.message.as_str(), e.offset),
            ("duplicate member name \"a\"", 13)
        );
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
            b"[1]\xff",
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
        let objects = format!("{}1{}", "{\"a\":".repeat(MAX_DEPTH), "}".repeat(MAX_DEPTH));
        assert_eq!(canon(&objects), objects);
        let too_deep = format!("[{objects}]");
        refused(too_deep.as_bytes());
    }

    #[test]
    fn literals_and_scalars() {
        assert_eq!(canon(" true "), "true");
        assert_eq!(canon("null"), "null");
        assert_eq!(canon("[false,\"\",{}]"), "[false,\"\",{}]");
    }
}

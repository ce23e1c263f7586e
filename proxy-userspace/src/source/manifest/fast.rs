//! A reader for the plain block YAML that `kubectl get -o yaml` and serde_yaml print, many times
//! faster than libyaml (whose scanner is most of a large manifest's start-up time).
//!
//! It reads a strict subset line by line: block mappings and sequences indented with spaces,
//! single-line plain and quoted scalars, literal block scalars (`|`, `|-`), empty flow
//! collections (`{}`, `[]`), comment lines and `---` between documents. Anything else (flow
//! collections with content, anchors, tags, multi-line flow scalars, comments after a value,
//! tabs, CRs, non-string keys...) makes [`read`] give up, and the caller reads the text
//! with serde_yaml as before: it is the oracle this reader is tested against, and it gives the
//! error messages. Refusing may come after values were handed out: the caller drops them.
//!
//! Scalars resolve as serde_yaml 0.9 resolves them into a `Value` (YAML 1.2's core schema:
//! `null`, `true`, `0x1f`, `1.5`, and `0123` as a string). What it reads is a [`Node`], which
//! borrows its strings from the text where it can.

use std::borrow::Cow;
use std::ops::Range;

use super::node::Node;

/// The text is outside what this reader takes: read it with serde_yaml.
#[derive(Debug)]
pub(super) struct Refused;

type Read<T> = Result<T, Refused>;

/// Where a value [`read`] hands out comes from: an item of a List (its index and the List's
/// kind), or else a whole document.
pub(super) type Item<'a> = Option<(usize, &'a str)>;

/// Reads `text`, handing each document's value to `found` with the document's index, except
/// that a List's items (a `kind` ending in "List" and `items` a block sequence) are handed out
/// one by one instead of the List. Refused when the text is not all in the subset.
pub(super) fn read<'a>(
    text: &'a str,
    found: &mut dyn FnMut(usize, Item<'_>, Node<'a>),
) -> Read<()> {
    if !plain_characters(text) {
        return Err(Refused);
    }
    for (index, range) in documents(text).into_iter().enumerate() {
        let document = &text[range];
        // Items are handed out as they are read, and in kubectl's output `kind` comes after
        // them: it is looked up first, then checked against what the reading finds.
        let kind = list_kind(document);
        let mut found_item =
            |i, value| found(index, Some((i, kind.as_deref().unwrap_or(""))), value);
        let mut list = kind.as_deref().map(|kind| List {
            kind,
            seen_kind: None,
            streamed: false,
            found: &mut found_item,
        });
        let value = Reader::new(document).document(list.as_mut())?;
        match list {
            Some(list) if list.seen_kind.as_deref() != Some(list.kind) => return Err(Refused),
            Some(list) if list.streamed => {}
            _ => found(index, None, value),
        }
    }
    Ok(())
}

/// The `kind` of a document's top-level mapping, as its line says, when it names a List.
fn list_kind(document: &str) -> Option<String> {
    let start = if document.starts_with("kind:") {
        0
    } else {
        document.find("\nkind:")? + 1
    };
    let end = document[start..]
        .find('\n')
        .map_or(document.len(), |i| start + i);
    let value = document[start + "kind:".len()..end].trim_matches(' ');
    plain_or_quoted_string(value).filter(|kind| kind.ends_with("List"))
}

/// No tab, CR, byte order mark or character YAML does not allow in a stream: those are left to
/// libyaml (tabs and CRs change how lines and indentation read).
fn plain_characters(text: &str) -> bool {
    let bytes = text.as_bytes();
    // Nearly all of a manifest is printable ASCII: a chunk of nothing else passes in a loop the
    // compiler vectorizes (byte by byte, this check was a tenth of a large manifest's reading).
    let ascii = |ok: bool, &b: &u8| ok & (matches!(b, 0x20..0x7f) | (b == b'\n'));
    bytes.chunks(CHUNK).enumerate().all(|(n, chunk)| {
        let from = n * CHUNK;
        chunk.iter().fold(true, ascii)
            || (from..from + chunk.len()).all(|i| plain_character(bytes, i))
    })
}

/// The bytes [`plain_characters`] passes a chunk at a time.
const CHUNK: usize = 32;

/// Whether byte `i` of `bytes` is one [`plain_characters`] allows, with the bytes after it.
fn plain_character(bytes: &[u8], i: usize) -> bool {
    match bytes[i] {
        b'\n' => true,
        0..0x20 | 0x7f => false,
        // U+0080-U+009F (C1 controls; U+0085 is a line break to libyaml).
        0xc2 => !matches!(bytes.get(i + 1), Some(0x80..=0x9f)),
        // U+FEFF (byte order mark), U+FFFE, U+FFFF.
        0xef => !matches!(
            (bytes.get(i + 1), bytes.get(i + 2)),
            (Some(0xbb), Some(0xbf)) | (Some(0xbf), Some(0xbe | 0xbf))
        ),
        // U+2028 and U+2029 are line breaks to libyaml.
        0xe2 => !matches!(
            (bytes.get(i + 1), bytes.get(i + 2)),
            (Some(0x80), Some(0xa8 | 0xa9))
        ),
        _ => true,
    }
}

/// The byte ranges of the text's documents, as serde_yaml counts them: one before the first `---`
/// if anything but comments is there, and one after each `---` line (and one for a text without
/// either).
fn documents(text: &str) -> Vec<Range<usize>> {
    let mut ranges = Vec::new();
    let mut start = 0;
    let mut explicit = false;
    let mut content = false;
    let mut pos = 0;
    while pos < text.len() {
        let end = text[pos..].find('\n').map_or(text.len(), |i| pos + i);
        let line = &text[pos..end];
        if is_marker(line) {
            if explicit || content {
                ranges.push(start..pos);
            }
            explicit = true;
            content = false;
            start = (end + 1).min(text.len());
        } else if !is_blank_or_comment(line) {
            content = true;
        }
        pos = end + 1;
    }
    if explicit || content || ranges.is_empty() {
        // A text with no document at all reads as one empty document, as in serde_yaml.
        ranges.push(start..text.len());
    }
    ranges
}

/// `---` alone on its line (what else may follow it is left to libyaml: see [`Reader::line`]).
fn is_marker(line: &str) -> bool {
    line.strip_prefix("---")
        .is_some_and(|rest| rest.bytes().all(|b| b == b' '))
}

fn is_blank_or_comment(line: &str) -> bool {
    let content = line.trim_start_matches(' ');
    content.is_empty() || content.starts_with('#')
}

/// A List document being read: its items go to `found` one by one.
struct List<'a, 'k, 'f> {
    /// The kind its line says (see [`list_kind`]).
    kind: &'k str,
    /// The kind the reading found.
    seen_kind: Option<String>,
    /// Whether its `items` were a block sequence, handed out.
    streamed: bool,
    found: &'f mut dyn FnMut(usize, Node<'a>),
}

/// One line: its indentation and what follows it (without the line break).
#[derive(Clone, Copy)]
struct Line<'a> {
    indent: usize,
    content: &'a str,
}

impl Line<'_> {
    fn is_entry(&self) -> bool {
        let bytes = self.content.as_bytes();
        bytes.first() == Some(&b'-') && matches!(bytes.get(1), None | Some(b' '))
    }
}

struct Reader<'a> {
    text: &'a str,
    /// Where the next line not read yet starts.
    pos: usize,
    /// The line [`Reader::line`] found last, and where it starts (it is asked for often).
    peeked: Option<(usize, Line<'a>)>,
}

impl<'a> Reader<'a> {
    fn new(text: &'a str) -> Self {
        Self {
            text,
            pos: 0,
            peeked: None,
        }
    }

    /// The next line with content (blank and comment lines skipped), not consumed; None at the
    /// end. A line libyaml would read as a marker or directive is refused.
    fn line(&mut self) -> Read<Option<Line<'a>>> {
        if let Some((pos, line)) = self.peeked
            && pos == self.pos
        {
            return Ok(Some(line));
        }
        while self.pos < self.text.len() {
            let end = self.line_end(self.pos);
            let line = &self.text[self.pos..end];
            if is_blank_or_comment(line) {
                self.pos = (end + 1).min(self.text.len());
                continue;
            }
            // (The first byte alone first: most lines start with a space.)
            if line.starts_with(['-', '.', '%'])
                && (line.starts_with("---") || line.starts_with("...") || line.starts_with('%'))
            {
                return Err(Refused);
            }
            let content = line.trim_start_matches(' ');
            let line = Line {
                indent: line.len() - content.len(),
                content: content.trim_end_matches(' '),
            };
            self.peeked = Some((self.pos, line));
            return Ok(Some(line));
        }
        Ok(None)
    }

    fn line_end(&self, from: usize) -> usize {
        self.text[from..]
            .find('\n')
            .map_or(self.text.len(), |i| from + i)
    }

    /// Consumes the line [`Reader::line`] returned.
    fn next_line(&mut self) {
        let end = match self.peeked {
            Some((pos, line)) if pos == self.pos => {
                line.content.as_ptr() as usize - self.text.as_ptr() as usize + line.content.len()
            }
            _ => self.pos,
        };
        self.pos = (self.line_end(end) + 1).min(self.text.len());
    }

    /// A document (this reader's whole text): its top node, a mapping at column 0, or null when
    /// it has none. `list`: the document is a List, whose items go there.
    fn document(&mut self, list: Option<&mut List<'a, '_, '_>>) -> Read<Node<'a>> {
        let Some(line) = self.line()? else {
            return Ok(Node::Null);
        };
        if line.indent != 0 || line.is_entry() {
            return Err(Refused);
        }
        self.next_line();
        let value = self.mapping(0, split_key(line.content).ok_or(Refused)?, list)?;
        if self.line()?.is_some() {
            return Err(Refused);
        }
        Ok(value)
    }

    /// The value of a List's `items:` with nothing after its colon: each entry handed to the
    /// List when it is a block sequence (null is returned), else the value.
    fn list_items(&mut self, list: &mut List<'a, '_, '_>) -> Read<Node<'a>> {
        let indent = match self.line()? {
            Some(line) if line.is_entry() => line.indent,
            _ => return self.block_value(0),
        };
        let mut i = 0;
        while let Some(line) = self.line()? {
            if line.indent != indent || !line.is_entry() {
                break;
            }
            let value = self.entry(indent)?;
            (list.found)(i, value);
            i += 1;
        }
        if self.line()?.is_some_and(|l| l.indent > 0) {
            return Err(Refused);
        }
        list.streamed = true;
        Ok(Node::Null)
    }

    /// A block mapping at `indent` whose first entry's line, already consumed, gave `first`.
    /// `list`: see [`Reader::document`].
    fn mapping(
        &mut self,
        indent: usize,
        first: KeyLine<'a>,
        mut list: Option<&mut List<'a, '_, '_>>,
    ) -> Read<Node<'a>> {
        let mut entries = Vec::new();
        let mut entry = first;
        loop {
            let (key, rest) = entry;
            let value = match (list.as_deref_mut(), rest) {
                (Some(list), None) if key == "items" => self.list_items(list)?,
                (list, Some(rest)) => {
                    if let Some(list) = list.filter(|_| key == "kind") {
                        list.seen_kind = plain_or_quoted_string(rest);
                    }
                    self.inline_value(indent, rest)?
                }
                (_, None) => self.block_value(indent)?,
            };
            entries.push((Node::String(key), value));
            match self.line()? {
                Some(line) if line.indent == indent && !line.is_entry() => {
                    self.next_line();
                    entry = split_key(line.content).ok_or(Refused)?;
                }
                Some(line) if line.indent >= indent => return Err(Refused),
                // A duplicate key is serde_yaml's to report.
                _ if has_duplicate_keys(&entries) => return Err(Refused),
                _ => return Ok(Node::Mapping(entries)),
            }
        }
    }

    /// The value of a mapping key (at `indent`) with nothing after its colon: a block on the next
    /// lines (a sequence may start at the key's own indentation), or null.
    fn block_value(&mut self, indent: usize) -> Read<Node<'a>> {
        match self.line()? {
            Some(line) if line.indent == indent && line.is_entry() => self.sequence(indent),
            Some(line) if line.indent > indent => {
                if line.is_entry() {
                    self.sequence(line.indent)
                } else {
                    self.next_line();
                    let first = split_key(line.content).ok_or(Refused)?;
                    self.mapping(line.indent, first, None)
                }
            }
            _ => Ok(Node::Null),
        }
    }

    /// A block sequence whose entries are at `indent`.
    fn sequence(&mut self, indent: usize) -> Read<Node<'a>> {
        let mut values = Vec::new();
        while let Some(line) = self.line()? {
            if line.indent != indent || !line.is_entry() {
                if line.indent > indent {
                    return Err(Refused);
                }
                break;
            }
            values.push(self.entry(indent)?);
        }
        Ok(Node::Sequence(values))
    }

    /// The sequence entry at the next line, whose `-` is at `indent`: a scalar, an empty
    /// collection, or a mapping starting on the same line.
    fn entry(&mut self, indent: usize) -> Read<Node<'a>> {
        let line = self.line()?.ok_or(Refused)?;
        let after = line.content.strip_prefix("- ").ok_or(Refused)?;
        let content = after.trim_start_matches(' ');
        let column = indent + 2 + (after.len() - content.len());
        self.next_line();
        self.entry_node(indent, column, content)
    }

    /// What follows an entry's `-` (at `indent`): `content`, at `column`, the rest of its line.
    fn entry_node(&mut self, indent: usize, column: usize, content: &'a str) -> Read<Node<'a>> {
        if let Some(first) = split_key(content) {
            return self.mapping(column, first, None);
        }
        if content.starts_with('|') {
            // A block scalar as an entry: rare, and its indentation rules differ.
            return Err(Refused);
        }
        self.inline_value(indent, content)
    }

    /// A value on its key's line (the key at `indent`): a scalar, `{}`, `[]` or a literal block
    /// (`|` or `|-`, its lines following).
    fn inline_value(&mut self, indent: usize, text: &'a str) -> Read<Node<'a>> {
        // (The first byte alone first: comparing with each of these is a call each.)
        let value = match text {
            _ if !text.starts_with(['{', '[', '|']) => self.scalar(text)?,
            "{}" => Node::Mapping(Vec::new()),
            "[]" => Node::Sequence(Vec::new()),
            "|" | "|-" => {
                let literal = self.literal(indent, text == "|-")?;
                return Ok(Node::String(Cow::Owned(literal)));
            }
            _ => return Err(Refused),
        };
        // Nothing may be nested under a value given on its key's line.
        if self.line()?.is_some_and(|l| l.indent > indent) {
            return Err(Refused);
        }
        Ok(value)
    }

    fn scalar(&self, text: &'a str) -> Read<Node<'a>> {
        match scalar(text).ok_or(Refused)? {
            (quoted, true) => Ok(Node::String(quoted)),
            (plain, false) => Ok(resolve(&plain).ok_or(Refused)?.node(plain)),
        }
    }

    /// A literal block scalar's lines, those after its key's line (at `indent`): kept as they
    /// are (line breaks included) but for the indentation of the first, then clipped to one
    /// final line break (or none with `strip`). An empty one, or one whose leading blank lines
    /// are longer than its indentation, is refused (libyaml's rules there are subtle).
    fn literal(&mut self, indent: usize, strip: bool) -> Read<String> {
        let mut text = String::new();
        let mut column = None;
        let mut leading_blank = (0, 0);
        while self.pos < self.text.len() {
            let end = self.line_end(self.pos);
            let line = &self.text[self.pos..end];
            let content = line.trim_start_matches(' ');
            let spaces = line.len() - content.len();
            match column {
                None if content.is_empty() => {
                    leading_blank = (leading_blank.0 + 1, leading_blank.1.max(spaces));
                }
                None => {
                    if spaces <= indent || leading_blank.1 > spaces {
                        return Err(Refused);
                    }
                    column = Some(spaces);
                    text.extend(std::iter::repeat_n('\n', leading_blank.0));
                    text.push_str(&line[spaces..]);
                    text.push_str(&self.text[end..(end + 1).min(self.text.len())]);
                }
                Some(column) if content.is_empty() || spaces >= column => {
                    text.push_str(line.get(column..).unwrap_or(""));
                    text.push_str(&self.text[end..(end + 1).min(self.text.len())]);
                }
                Some(_) => break,
            }
            self.pos = (end + 1).min(self.text.len());
        }
        if column.is_none() {
            return Err(Refused);
        }
        // Trailing line breaks are chomped: all of them (`|-`) or all but one (`|`; none where
        // the text ends without one).
        let kept = text.trim_end_matches('\n').len();
        text.truncate(if strip {
            kept
        } else {
            (kept + 1).min(text.len())
        });
        Ok(text)
    }
}

/// A mapping entry's key and what follows its colon on its line (None when nothing does).
type KeyLine<'a> = (Cow<'a, str>, Option<&'a str>);

/// Whether two of a mapping's keys (strings) are the same: pair by pair in the small mappings
/// objects have, sorted in a large one.
fn has_duplicate_keys(entries: &[(Node<'_>, Node<'_>)]) -> bool {
    if entries.len() <= 16 {
        let seen_before = |i: usize| entries[..i].iter().any(|(key, _)| *key == entries[i].0);
        return (1..entries.len()).any(seen_before);
    }
    let mut keys: Vec<_> = entries.iter().map(|(key, _)| key.as_str()).collect();
    keys.sort_unstable();
    keys.windows(2).any(|pair| pair[0] == pair[1])
}

/// A `key:` line's [`KeyLine`], or None when the content is not one this reader takes. Keys are
/// strings: plain ones that would read as another type (`true:`, `80:`) are refused.
fn split_key(content: &str) -> Option<KeyLine<'_>> {
    let (key, after) = if content.starts_with(['\'', '"']) {
        let (key, len) = quoted(content)?;
        (key, content[len..].strip_prefix(':')?)
    } else {
        let colon =
            colon_space(content).or_else(|| content.ends_with(':').then(|| content.len() - 1))?;
        // Spaces before the colon are not part of the key.
        let key = content[..colon].trim_end_matches(' ');
        if !plain_ok(key) || resolve(key)? != Plain::String {
            return None;
        }
        (Cow::Borrowed(key), &content[colon + 1..])
    };
    if after.is_empty() {
        return Some((key, None));
    }
    let rest = after.strip_prefix(' ')?.trim_start_matches(' ');
    if rest.starts_with('#') {
        return None;
    }
    Some((key, (!rest.is_empty()).then_some(rest)))
}

/// A scalar value's text: plain (as written) or quoted (unescaped), and whether it was quoted.
fn scalar(text: &str) -> Option<(Cow<'_, str>, bool)> {
    if text.starts_with(['\'', '"']) {
        let (value, len) = quoted(text)?;
        // Only spaces may follow (a comment is left to libyaml).
        text[len..]
            .trim_start_matches(' ')
            .is_empty()
            .then_some((value, true))
    } else {
        (plain_ok(text) && colon_space(text).is_none()).then_some((Cow::Borrowed(text), false))
    }
}

/// A plain scalar on one line that reads as itself: not starting with an indicator, holding no
/// comment, not ending with a colon.
fn plain_ok(text: &str) -> bool {
    let Some(&first) = text.as_bytes().first() else {
        return false;
    };
    let indicator = matches!(
        first,
        b'-' | b'?'
            | b':'
            | b','
            | b'['
            | b']'
            | b'{'
            | b'}'
            | b'#'
            | b'&'
            | b'*'
            | b'!'
            | b'|'
            | b'>'
            | b'\''
            | b'"'
            | b'%'
            | b'@'
            | b'`'
    );
    // `-5` and `-x` are plain; `- x` is an entry.
    let allowed_dash = first == b'-' && text.len() > 1 && text.as_bytes()[1] != b' ';
    let comment = text.contains('#') && text.contains(" #");
    (!indicator || allowed_dash) && !comment && !text.ends_with(':')
}

/// Where `text` first has a colon followed by a space (`str::find` with a two-byte pattern
/// costs more on short lines than this loop).
fn colon_space(text: &str) -> Option<usize> {
    text.as_bytes().windows(2).position(|pair| pair == b": ")
}

/// A quoted scalar at the start of `text` (closed on the same line): its value and its length
/// in `text`, quotes included. Double-quoted escapes other than the common ones are refused.
fn quoted(text: &str) -> Option<(Cow<'_, str>, usize)> {
    let quote = text.as_bytes()[0];
    let body = &text[1..];
    if quote == b'\'' {
        let mut value = String::new();
        let mut rest = body;
        loop {
            let close = rest.find('\'')?;
            value.push_str(&rest[..close]);
            if rest[close + 1..].starts_with('\'') {
                value.push('\'');
                rest = &rest[close + 2..];
            } else {
                let len = text.len() - rest.len() + close + 1;
                if value.len() == len - 2 {
                    return Some((Cow::Borrowed(&text[1..len - 1]), len));
                }
                return Some((Cow::Owned(value), len));
            }
        }
    }
    let close = body.find(['"', '\\'])?;
    if body.as_bytes()[close] == b'"' {
        return Some((Cow::Borrowed(&body[..close]), close + 2));
    }
    let mut value = String::from(&body[..close]);
    let mut chars = body[close..].char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((Cow::Owned(value), close + i + 2)),
            '\\' => {
                let (_, e) = chars.next()?;
                let hex = |chars: &mut std::str::CharIndices<'_>, digits: usize| {
                    let mut n = 0u32;
                    for _ in 0..digits {
                        n = n * 16 + chars.next()?.1.to_digit(16)?;
                    }
                    char::from_u32(n)
                };
                value.push(match e {
                    '\\' => '\\',
                    '"' => '"',
                    '/' => '/',
                    'n' => '\n',
                    't' => '\t',
                    'r' => '\r',
                    '0' => '\0',
                    'a' => '\x07',
                    'b' => '\x08',
                    'e' => '\x1b',
                    'f' => '\x0c',
                    'v' => '\x0b',
                    'x' => hex(&mut chars, 2)?,
                    'u' => hex(&mut chars, 4)?,
                    'U' => hex(&mut chars, 8)?,
                    _ => return None,
                });
            }
            c => value.push(c),
        }
    }
    None
}

/// A key or value of a `kind:` line, as a string when it is one.
fn plain_or_quoted_string(text: &str) -> Option<String> {
    match scalar(text)? {
        (value, true) => Some(value.into_owned()),
        (value, false) => (resolve(&value)? == Plain::String).then(|| value.into_owned()),
    }
}

/// What a plain scalar reads as, before anything is built.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Plain {
    Null,
    Bool(bool),
    Unsigned(u64),
    Negative(i64),
    Float(f64),
    String,
}

impl Plain {
    fn node(self, text: Cow<'_, str>) -> Node<'_> {
        match self {
            Plain::Null => Node::Null,
            Plain::Bool(b) => Node::Bool(b),
            Plain::Unsigned(n) => Node::Unsigned(n),
            Plain::Negative(n) => Node::integer(n),
            Plain::Float(f) => Node::Float(f),
            Plain::String => Node::String(text),
        }
    }
}

/// What a plain scalar reads as in serde_yaml 0.9: null, a boolean, an integer, a finite float,
/// or else a string. None for integers outside 64 bits (left to serde_yaml).
fn resolve(text: &str) -> Option<Plain> {
    // (The first byte alone first: comparing with each word is a call each.)
    if text.starts_with(['~', 'n', 'N', 't', 'T', 'f', 'F']) {
        match text {
            "~" | "null" | "Null" | "NULL" => return Some(Plain::Null),
            "true" | "True" | "TRUE" => return Some(Plain::Bool(true)),
            "false" | "False" | "FALSE" => return Some(Plain::Bool(false)),
            _ => {}
        }
    }
    // Numbers start with a digit, a sign or a dot (words such as `inf` are not finite), hold
    // nothing but digits, hexadecimal ones, `x`, `o`, signs, the letters of `.inf` and `.nan`
    // and at most one dot: addresses, times and names are strings at a glance.
    let numeric = |b: &u8| {
        b.is_ascii_hexdigit()
            || matches!(
                b,
                b'x' | b'o' | b'.' | b'+' | b'-' | b'i' | b'I' | b'n' | b'N'
            )
    };
    if !text.starts_with(|c: char| c.is_ascii_digit() || matches!(c, '+' | '-' | '.'))
        || !text.as_bytes().iter().all(numeric)
        || text.bytes().filter(|&b| b == b'.').count() > 1
    {
        return Some(Plain::String);
    }
    if let Some(n) = unsigned::<u64>(text) {
        return Some(Plain::Unsigned(n));
    }
    if let Some(n) = negative::<i64>(text) {
        return Some(Plain::Negative(n));
    }
    if unsigned::<u128>(text).is_some() || negative::<i128>(text).is_some() {
        return None;
    }
    if !leading_zero_digits(text)
        && let Some(f) = float(text)
    {
        return Some(Plain::Float(f));
    }
    Some(Plain::String)
}

/// Integer types a plain scalar may be read as.
trait Radix: Sized {
    fn from_radix(text: &str, radix: u32) -> Option<Self>;
}

macro_rules! radix {
    ($($t:ty),*) => {$(
        impl Radix for $t {
            fn from_radix(text: &str, radix: u32) -> Option<Self> {
                <$t>::from_str_radix(text, radix).ok()
            }
        }
    )*};
}
radix!(u64, i64, u128, i128);

const PREFIXES: [(&str, u32); 3] = [("0x", 16), ("0o", 8), ("0b", 2)];

/// `12`, `+12`, `0x1f`, `+0o17`, `0b11`: not `012` (a string in YAML 1.2).
fn unsigned<T: Radix>(text: &str) -> Option<T> {
    let digits = text.strip_prefix('+').unwrap_or(text);
    for (prefix, radix) in PREFIXES {
        if let Some(rest) = digits.strip_prefix(prefix) {
            if rest.starts_with(['+', '-']) {
                return None;
            }
            if let Some(n) = T::from_radix(rest, radix) {
                return Some(n);
            }
        }
    }
    if digits.starts_with(['+', '-']) || leading_zero_digits(text) {
        return None;
    }
    T::from_radix(digits, 10)
}

/// `-12`, `-0x1f`, `-0o17`, `-0b11`: not `-012`.
fn negative<T: Radix>(text: &str) -> Option<T> {
    for (prefix, radix) in PREFIXES {
        if let Some(rest) = text.strip_prefix('-').and_then(|t| t.strip_prefix(prefix))
            && let Some(n) = T::from_radix(&format!("-{rest}"), radix)
        {
            return Some(n);
        }
    }
    if leading_zero_digits(text) {
        return None;
    }
    T::from_radix(text, 10)
}

/// `1.5`, `-2e3`, `.5`, `.inf`, `-.Inf`, `.nan`: finite floats and YAML's spelled infinities.
fn float(text: &str) -> Option<f64> {
    let unsigned = match text.strip_prefix('+') {
        Some(rest) if rest.starts_with(['+', '-']) => return None,
        Some(rest) => rest,
        None => text,
    };
    match (unsigned, text) {
        (".inf" | ".Inf" | ".INF", _) => return Some(f64::INFINITY),
        (_, "-.inf" | "-.Inf" | "-.INF") => return Some(f64::NEG_INFINITY),
        (_, ".nan" | ".NaN" | ".NAN") => return Some(f64::NAN),
        _ => {}
    }
    unsigned.parse::<f64>().ok().filter(|f| f.is_finite())
}

/// Digits with a leading zero (`007`, `-01`): a string, not a number, in YAML 1.2.
fn leading_zero_digits(text: &str) -> bool {
    let digits = text.strip_prefix(['-', '+']).unwrap_or(text);
    digits.len() > 1 && digits.starts_with('0') && digits[1..].bytes().all(|b| b.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use std::fmt::Debug;

    use k8s_openapi::api::{
        core::v1::{Node as KubeNode, Service},
        discovery::v1::EndpointSlice,
        networking::v1::ServiceCIDR,
    };
    use serde::{Deserialize, de::DeserializeOwned};
    use serde_yaml::Value;

    use super::*;

    /// What serde_yaml reads from `text`, document by document.
    fn serde_documents(text: &str) -> Result<Vec<Value>, serde_yaml::Error> {
        serde_yaml::Deserializer::from_str(text)
            .map(Value::deserialize)
            .collect()
    }

    /// What [`read`] hands out: (document, (item, List kind), value), or None when refused.
    type Values = Vec<(usize, Option<(usize, String)>, Value)>;

    fn values(text: &str) -> Option<Values> {
        let mut values = Vec::new();
        read(text, &mut |document, item, value| {
            let item = item.map(|(i, kind)| (i, kind.to_owned()));
            values.push((document, item, value.into_value()));
        })
        .ok()?;
        Some(values)
    }

    /// Checks that what this reader reads from `text` is what serde_yaml reads, when it takes the
    /// text at all (it may refuse anything, but never read anything differently): every
    /// document, whole or item by item, the same values. Returns whether it took the text.
    fn reads_as_serde_yaml(text: &str) -> bool {
        let Some(values) = values(text) else {
            return false;
        };
        let documents = serde_documents(text)
            .unwrap_or_else(|e| panic!("taken, but serde_yaml fails ({e}):\n{text}"));
        let mut values = values.into_iter().peekable();
        for (index, expected) in documents.iter().enumerate() {
            let mut mine = Vec::new();
            while let Some(value) = values.next_if(|(document, _, _)| *document == index) {
                mine.push(value);
            }
            let (items, expected) = match &mine[..] {
                [(_, None, value)] => (vec![value], vec![expected]),
                [(_, Some((_, kind)), _), ..] => {
                    assert_eq!(expected["kind"].as_str(), Some(kind.as_str()), "{text}");
                    let items = mine.iter().enumerate().map(|(i, (_, item, value))| {
                        assert_eq!(item.as_ref().map(|(n, _)| *n), Some(i), "{text}");
                        value
                    });
                    let expected = expected["items"].as_sequence().expect("a List's items");
                    (items.collect(), expected.iter().collect())
                }
                _ => panic!("document {index} handed out as {mine:?}:\n{text}"),
            };
            assert_eq!(items.len(), expected.len(), "items of:\n{text}");
            for (value, expected) in items.into_iter().zip(expected) {
                if value != expected {
                    let ours = serde_yaml::to_string(value).unwrap();
                    let theirs = serde_yaml::to_string(expected).unwrap();
                    let diff: Vec<_> = ours
                        .lines()
                        .zip(theirs.lines())
                        .filter(|(a, b)| a != b)
                        .collect();
                    panic!("a value differs: {diff:?}\n{text}");
                }
            }
        }
        assert!(
            values.next().is_none(),
            "more documents than serde_yaml's:\n{text}"
        );
        true
    }

    /// Block YAML as `kubectl get -o yaml` prints it, with what its objects may hold.
    const KUBECTL: &str = "\
apiVersion: v1
items:
- apiVersion: v1
  kind: Service
  metadata:
    annotations:
      kubectl.kubernetes.io/last-applied-configuration: |
        {\"apiVersion\":\"v1\",\"kind\":\"Service\",\"metadata\":{\"name\":\"web\"}}

          more indented, after a blank line
        # not a comment
      note: |-
        stripped
      quoted: 'it''s'
      escaped: \"tab\\tquote\\\" \\u00e9\"
    creationTimestamp: 2025-01-01T00:00:00Z
    labels:
      app: web
      'quoted key': x
      \"double\": y
    name: web
    namespace: demo
    resourceVersion: \"1234\"
    uid: 6c1b3f0e-0000-4000-8000-000000000001
  spec:
    clusterIP: 10.96.0.1
    clusterIPs:
    - 10.96.0.1
    - fd00:10:96::1
    externalTrafficPolicy: ~
    healthCheckNodePort: 0x7530
    ipFamilies: []
    ports:
    -   name: http
        port: 80
        protocol: TCP
        targetPort: 8080
    - name: dns
      port: 53
      targetPort: dns
    publishNotReadyAddresses: false
    selector: {}
    sessionAffinityConfig:
      clientIP:
        timeoutSeconds: 10800
    weight: 1.5
    negative: -3
    octal: 0o17
    zero-padded: 0080
    empty:
  status:
    loadBalancer: {}

# a comment between items
- addressType: IPv4
  apiVersion: discovery.k8s.io/v1
  endpoints:
  - addresses:
    - 10.244.1.11
    conditions:
      ready: true
      serving: True
      terminating: FALSE
    nodeName: node-1
  kind: EndpointSlice
  metadata:
    labels:
      kubernetes.io/service-name: web
    name: web-1
    namespace: demo
  ports:
  - name: http
    port: 8080
    protocol: TCP
kind: List
metadata:
  resourceVersion: \"\"
";

    #[test]
    fn kubectl_output_is_read_as_serde_yaml_reads_it() {
        assert!(reads_as_serde_yaml(KUBECTL));
        let items = values(KUBECTL).unwrap();
        assert!(matches!(
            &items[..],
            [(0, Some((0, _)), _), (0, Some((1, _)), _)]
        ));
        // Documents of single objects, with comments and `---` around them.
        let documents = format!(
            "# leading comment\n---\n{}\n---\n# only a comment\n---   \n{}",
            "kind: Service\nmetadata:\n  name: a\n",
            "kind: Service\nmetadata:\n  name: b\nspec:\n  ports:\n  - port: 80\n"
        );
        assert!(reads_as_serde_yaml(&documents));
        assert_eq!(values(&documents).unwrap().len(), 3);
        // Indented items, a List whose items are not a block sequence, an empty text.
        let indented = "kind: ServiceList\nitems:\n  - metadata:\n      name: a\n  - kind: x\n";
        for text in [
            indented,
            "kind: List\nitems: []\n",
            "kind: List\nitems:\n",
            "",
            "\n# c\n",
            // No line break at the end, after each kind of value; literal blocks' edges.
            "a: |\n  x",
            "a: |-\n  x\n\n",
            "a: |\n  x\n\n  \n",
            "a: |\n\n  x\n   \n  y\nb: 1",
            "a:\n  - x",
            "a: 'q'",
            "a: {}",
            "a:",
            "kind: List\nitems:\n- a: 1\n  b: |\n    z\n# end",
            "a : 1\n'b': 2\n\"c\":  3   \n",
        ] {
            assert!(reads_as_serde_yaml(text), "{text}");
        }
    }

    #[test]
    fn what_it_does_not_take_is_left_to_serde_yaml() {
        for text in [
            "a: {b: 1}\n",
            "a: [1]\n",
            "a: &x 1\nb: *x\n",
            "a: !!str 1\n",
            "a: 1 # comment\n",
            "a: >\n  folded\n",
            "a: |+\n  kept\n",
            "a: \"multi\n  line\"\n",
            "a: plain\n  continued\n",
            "a: 1\r\nb: 2\r\n",
            "a:\t1\n",
            "? a\n: 1\n",
            "80: port\n",
            "a: 1\na: 2\n",
            "- a\n- b\n",
            "just a string\n",
            "%YAML 1.2\n---\na: 1\n",
            "--- a: 1\n",
            "a: 1\n...\n",
            "\u{feff}a: 1\n",
            "a: 99999999999999999999999\n",
            "a: \"\\N\"\n",
            "a:\n  - - nested\n",
            "a:\n- |\n  literal entry\n",
            "a: |\nb: 1\n",
        ] {
            assert!(values(text).is_none(), "taken:\n{text}");
        }
        // A duplicate key in a large mapping (its keys are sorted to be compared), at either end.
        let keys: Vec<String> = (0..20).map(|i| format!("k{i}: {i}\n")).collect();
        assert!(values(&keys.concat()).is_some());
        for (at, copy) in [(0, 19), (19, 0), (5, 12)] {
            let mut keys = keys.clone();
            keys[at] = keys[copy].replace(": ", ": x");
            assert!(
                values(&keys.concat()).is_none(),
                "taken:\n{}",
                keys.concat()
            );
        }
    }

    /// Characters libyaml reads differently are found wherever they stand, a chunk's edges
    /// included (where a multi-byte one may straddle two chunks); others pass.
    #[test]
    fn characters_left_to_libyaml_are_found_anywhere() {
        let refused = [
            "\t", "\r", "\u{7f}", "\u{85}", "\u{9f}", "\u{feff}", "\u{fffe}", "\u{ffff}",
            "\u{2028}", "\u{2029}",
        ];
        let passed = [
            "\n",
            "é",
            "\u{a0}",
            "\u{2027}",
            "\u{202a}",
            "\u{fefe}",
            "日本",
            "\u{1f600}",
        ];
        for at in 0..3 * CHUNK {
            let around = |c: &str| format!("{}{c}{}", "a".repeat(at), "b".repeat(2 * CHUNK));
            for c in refused {
                assert!(!plain_characters(&around(c)), "{c:?} at {at} passed");
            }
            for c in passed {
                assert!(plain_characters(&around(c)), "{c:?} at {at} refused");
            }
        }
    }

    #[test]
    fn plain_scalars_resolve_as_in_serde_yaml() {
        let alphabet = [
            '0', '1', '9', '+', '-', '.', 'x', 'o', 'b', 'e', 'E', 'a', 'f', 'i', 'n', 'N', '_',
            '~', ':',
        ];
        let mut scalars: Vec<String> = [
            "null",
            "Null",
            "NULL",
            "nULL",
            "true",
            "True",
            "TRUE",
            "tRUE",
            "false",
            "yes",
            "no",
            "on",
            ".inf",
            "+.inf",
            "-.Inf",
            ".NaN",
            "-.nan",
            "inf",
            "infinity",
            "nan",
            "1e3",
            "1E-3",
            "+12",
            "-0",
            "0",
            "00",
            "-012",
            "0x1F",
            "-0x1f",
            "+0x1f",
            "0x-1",
            "0o17",
            "0o8",
            "0b101",
            "-0b1",
            "1_000",
            "10.96.0.1",
            "1.",
            ".5",
            "-.5",
            "2025-01-01",
            "18446744073709551615",
            "18446744073709551616",
            "-9223372036854775808",
            "-9223372036854775809",
            "6c1b3f0e-0000",
            "1:2",
            "0.0.0.0/0",
        ]
        .map(str::to_owned)
        .to_vec();
        for a in alphabet {
            scalars.push(a.to_string());
            for b in alphabet {
                scalars.push(format!("{a}{b}"));
                for c in alphabet {
                    scalars.push(format!("{a}{b}{c}"));
                }
            }
        }
        let mut compared = 0;
        for scalar in &scalars {
            if !plain_ok(scalar) {
                continue;
            }
            let expected: Value = match serde_yaml::from_str::<Value>(&format!("k: {scalar}\n")) {
                Ok(v) => v["k"].clone(),
                Err(_) => continue,
            };
            match resolve(scalar) {
                Some(plain) => {
                    let value = plain.node(Cow::Borrowed(scalar)).into_value();
                    let same = match (&value, &expected) {
                        (Value::Number(a), Value::Number(b)) if a.is_nan() => b.is_nan(),
                        _ => value == expected,
                    };
                    assert!(same, "{scalar}: {value:?}, serde_yaml {expected:?}");
                    compared += 1;
                }
                // Only integers beyond 64 bits are left to serde_yaml.
                None => assert!(scalar.len() >= 19, "{scalar} refused"),
            }
        }
        assert!(compared > 3000, "{compared}");
    }

    /// A small deterministic generator (xorshift), so that a failure repeats.
    struct Random(u64);

    impl Random {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n as u64) as usize
        }
    }

    /// One random edit of a line: what a hand edit or a broken generator does.
    fn mutate(text: &str, random: &mut Random) -> String {
        let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
        let at = random.below(lines.len());
        let count = lines.len();
        let line = &mut lines[at];
        let pieces = [
            " ", "-", "- ", ":", ": ", "#", " #", "'", "\"", "|", "|-", "{}", "[]", "{", "[", "0",
            "a", ".", "\\", "~", "&", "*", "!", ">", "---", "0x1", "\\u0041", "''", "key: v",
        ];
        match random.below(7) {
            0 => {
                let pos = random.below(line.len() + 1);
                line.insert_str(pos, pieces[random.below(pieces.len())]);
            }
            1 if !line.is_empty() => {
                line.remove(random.below(line.len()));
            }
            2 => line.push_str(pieces[random.below(pieces.len())]),
            3 => line.insert_str(0, &" ".repeat(1 + random.below(2))),
            4 if line.starts_with(' ') => {
                line.remove(0);
            }
            5 => {
                let copy = line.clone();
                lines.insert(at, copy);
            }
            6 if at + 1 < count => lines.swap(at, at + 1),
            _ => {
                lines.remove(at);
            }
        }
        let mut text = lines.join("\n");
        text.push('\n');
        text
    }

    /// Edits tried (about 1 ms each in a debug build); 100k pass with several seeds.
    const ITERATIONS: usize = 4000;

    #[test]
    fn edited_manifests_are_read_as_serde_yaml_reads_them_or_refused() {
        let mut random = Random(0x9e37_79b9_7f4a_7c15);
        let (mut taken, mut tries, mut deserialized) = (0, 0, 0);
        // The same objects as `---` separated documents.
        let documents = KUBECTL
            .replace("apiVersion: v1\nitems:\n- ", "")
            .replace("kind: List\nmetadata:\n  resourceVersion: \"\"\n", "")
            .replace("\n- ", "\n---\n")
            .replace("\n  ", "\n");
        assert!(reads_as_serde_yaml(&documents));
        assert_eq!(values(&documents).map(|values| values.len()), Some(2));
        for i in 0..ITERATIONS {
            let mut text = if i % 4 == 0 {
                documents.clone()
            } else {
                KUBECTL.to_owned()
            };
            for _ in 0..1 + random.below(3) {
                text = mutate(&text, &mut random);
            }
            if random.below(8) == 0 {
                text.pop();
            }
            tries += 1;
            if reads_as_serde_yaml(&text) {
                taken += 1;
                let mut nodes = Vec::new();
                read_ok(&text, &mut |_, _, node| nodes.push(node));
                for node in &nodes {
                    deserialized += [
                        deserializes_as_its_value::<Service>(node),
                        deserializes_as_its_value::<EndpointSlice>(node),
                        deserializes_as_its_value::<KubeNode>(node),
                        deserializes_as_its_value::<ServiceCIDR>(node),
                    ]
                    .iter()
                    .filter(|&&ok| ok)
                    .count();
                }
                // And the objects and errors made of what it read are those made of
                // serde_yaml's documents (one text in 4: this costs more).
                if i % 4 == 1 {
                    let whole = super::super::tests::parse_whole(&text);
                    assert_eq!(super::super::parse(&text), whole, "{text}");
                }
            }
        }
        // Most single edits keep the text in the subset, and most objects in them still
        // deserialize: the comparisons are not vacuous.
        assert!(taken * 5 > tries, "{taken} of {tries} taken");
        assert!(
            deserialized > taken,
            "{deserialized} objects of {taken} texts"
        );
    }

    fn read_ok<'a>(text: &'a str, found: &mut dyn FnMut(usize, Item<'_>, Node<'a>)) {
        read(text, found).unwrap_or_else(|_| panic!("refused:\n{text}"));
    }

    /// Deserializing `node` as a `T` succeeds only where deserializing the same node as a
    /// serde_yaml `Value` does, and makes the same object; whether it succeeded.
    fn deserializes_as_its_value<T: DeserializeOwned + PartialEq + Debug>(node: &Node) -> bool {
        let from_value = T::deserialize(node.clone().into_value());
        match T::deserialize(node) {
            Ok(object) => {
                assert_eq!(Some(&object), from_value.as_ref().ok(), "{node:?}");
                true
            }
            Err(_) => false,
        }
    }

    #[test]
    fn objects_deserialize_from_nodes_as_from_values() {
        let mut nodes = Vec::new();
        read_ok(KUBECTL, &mut |_, _, node| nodes.push(node));
        let [service, slice] = &nodes[..] else {
            panic!("{nodes:?}");
        };
        assert!(deserializes_as_its_value::<Service>(service));
        assert!(deserializes_as_its_value::<EndpointSlice>(slice));
        // Every kind of scalar where each kind of field is: a string, a number, a bool, a
        // map, a list, null.
        let scalars = [
            "x", "'8'", "80", "-1", "-0", "0x1f", "1.5", "true", "null", "{}", "[]",
        ];
        for scalar in scalars {
            for field in [
                "metadata:\n  name",
                "metadata:\n  labels",
                "metadata:\n  labels:\n    a",
                "spec:\n  ports",
                "spec:\n  ports:\n  - port",
                "spec:\n  ports:\n  - targetPort",
                "spec:\n  publishNotReadyAddresses",
                "spec:\n  clusterIPs",
                "spec:\n  clusterIPs:\n  - ",
                "spec",
                "status",
            ] {
                let text = format!("kind: Service\n{field}: {scalar}\n");
                let text = text.replace(" : ", "").replace(":  ", ": ");
                let mut nodes = Vec::new();
                if read(&text, &mut |_, _, node| nodes.push(node)).is_ok() {
                    deserializes_as_its_value::<Service>(&nodes[0]);
                }
            }
        }
    }
}

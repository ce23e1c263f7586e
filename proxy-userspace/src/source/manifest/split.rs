//! Where the documents of a YAML text begin and end, and the items of its `kind: List`
//! documents, found with libyaml's event parser (the parser serde_yaml itself runs) without
//! building anything.
//!
//! Why: serde_yaml reads a whole document's events into memory before deserializing any of it,
//! and a List as `kubectl get -o yaml` prints it is one document. With tens of thousands of
//! Services that is hundreds of MiB, allocated in small pieces among the objects the agent
//! keeps, so the process stays that large after they are freed. Read item by item instead, one
//! item is in memory at a time.
//!
//! Each piece is then read on its own by serde_yaml, which must give what reading the whole text
//! gives. That holds for block-style Lists without anchors, aliases, tags or directives (each
//! item is then self-contained, and indenting its first line as deep as the item starts keeps
//! its layout), whose top-level keys are plain distinct strings: anything else is left to the
//! whole-document path ([`split`] returns None, or the document stays one piece).
use std::{borrow::Cow, mem::MaybeUninit, ops::Range};

#[expect(
    clippy::unsafe_removed_from_name,
    reason = "libyaml's C API, translated: `sys` as in serde_yaml, whose parser this is"
)]
use unsafe_libyaml as sys;

/// One document of the text.
#[derive(Debug, PartialEq)]
pub(super) enum Piece {
    /// Read as one value.
    Document(Range<usize>),
    /// A List: each item read on its own, and the other top-level values too (read only to
    /// report what the whole document would report, such as a duplicate key in its metadata).
    List {
        kind: String,
        items: Vec<Span>,
        others: Vec<Span>,
    },
}

/// A node of the text: its bytes, and the column it starts at.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Span {
    pub range: Range<usize>,
    pub column: usize,
}

impl Span {
    /// The node as a document of its own: its first line indented as it was.
    pub fn text<'a>(&self, text: &'a str) -> Cow<'a, str> {
        let node = &text[self.range.clone()];
        if self.column == 0 {
            Cow::Borrowed(node)
        } else {
            Cow::Owned(format!("{:1$}{node}", "", self.column))
        }
    }
}

/// Deeper nesting is left to the whole-document path, whose depth limit counts from the
/// document (an item is two levels less deep on its own).
const MAX_DEPTH: usize = 100;

/// The documents of `text`, or None when the text is not YAML, or uses what pieces cannot be
/// read apart with (anchors, aliases, tags, directives, a byte order mark): the caller then
/// reads it whole, as serde_yaml does.
pub(super) fn split(text: &str) -> Option<Vec<Piece>> {
    if text.starts_with('\u{feff}') {
        return None;
    }
    let mut parser = Parser::new(text)?;
    let mut pieces = Vec::new();
    let mut doc = Doc::default();
    let mut depth = 0;
    loop {
        let event = parser.next()?;
        let e = event.get();
        // SAFETY (the union reads below): each reads the variant its event type says it holds.
        match e.type_ {
            sys::YAML_STREAM_START_EVENT => {}
            sys::YAML_STREAM_END_EVENT => return Some(pieces),
            sys::YAML_DOCUMENT_START_EVENT => {
                let start = unsafe { e.data.document_start };
                if !start.version_directive.is_null()
                    || start.tag_directives.start != start.tag_directives.end
                {
                    return None;
                }
                doc = Doc {
                    start: e.start_mark.index as usize,
                    ..Doc::default()
                };
            }
            sys::YAML_DOCUMENT_END_EVENT => {
                pieces.push(std::mem::take(&mut doc).finish(e.end_mark.index as usize));
            }
            sys::YAML_ALIAS_EVENT => return None,
            sys::YAML_SCALAR_EVENT => {
                let scalar = unsafe { e.data.scalar };
                if !scalar.anchor.is_null() || !scalar.tag.is_null() {
                    return None;
                }
                // SAFETY: libyaml's value holds `length` bytes until the event is deleted.
                let value =
                    unsafe { std::slice::from_raw_parts(scalar.value, scalar.length as usize) };
                let plain = scalar.style == sys::YAML_PLAIN_SCALAR_STYLE;
                doc.scalar(depth, e, value, plain);
            }
            sys::YAML_SEQUENCE_START_EVENT | sys::YAML_MAPPING_START_EVENT => {
                let (anchor, tag, block) = if e.type_ == sys::YAML_SEQUENCE_START_EVENT {
                    let s = unsafe { e.data.sequence_start };
                    (s.anchor, s.tag, s.style == sys::YAML_BLOCK_SEQUENCE_STYLE)
                } else {
                    let m = unsafe { e.data.mapping_start };
                    (m.anchor, m.tag, m.style == sys::YAML_BLOCK_MAPPING_STYLE)
                };
                if !anchor.is_null() || !tag.is_null() || depth >= MAX_DEPTH {
                    return None;
                }
                let mapping = e.type_ == sys::YAML_MAPPING_START_EVENT;
                doc.start(depth, e, mapping, block);
                depth += 1;
            }
            sys::YAML_SEQUENCE_END_EVENT | sys::YAML_MAPPING_END_EVENT => {
                depth -= 1;
                doc.end(depth, e);
            }
            _ => return None,
        }
    }
}

/// What is known of the document being read. Depth 0 is its root node, 1 the root mapping's
/// keys and values, 2 the items of its `items`.
#[derive(Default)]
struct Doc {
    start: usize,
    /// Still a List that can be read item by item.
    list: bool,
    /// At depth 1, the next node is a key.
    at_key: bool,
    keys: Vec<String>,
    /// The key of the value being read at depth 1.
    key: Option<String>,
    /// Where that value starts.
    value_start: Option<(usize, usize)>,
    kind: Option<String>,
    items: Option<Vec<Span>>,
    /// Where the item being read starts.
    item_start: Option<(usize, usize)>,
    others: Vec<Span>,
}

impl Doc {
    fn in_items(&self) -> bool {
        self.key.as_deref() == Some("items")
    }

    fn scalar(&mut self, depth: usize, e: &sys::yaml_event_t, value: &[u8], plain: bool) {
        match depth {
            0 => self.list = false,
            1 if self.list && self.at_key => self.key(value, plain),
            1 if self.list => {
                // A scalar value: it starts and ends here.
                self.value_start = Some(mark(&e.start_mark));
                if self.key.as_deref() == Some("kind") {
                    self.kind = std::str::from_utf8(value).ok().map(str::to_owned);
                }
                self.value_end(e.end_mark.index as usize);
            }
            // An item that is not a mapping.
            2 if self.list && self.in_items() => self.list = false,
            _ => {}
        }
    }

    fn key(&mut self, value: &[u8], plain: bool) {
        self.at_key = false;
        match std::str::from_utf8(value) {
            Ok(key) if is_string_key(key, plain) && !self.keys.iter().any(|k| k == key) => {
                self.keys.push(key.to_owned());
                self.key = Some(key.to_owned());
            }
            _ => self.list = false,
        }
    }

    fn start(&mut self, depth: usize, e: &sys::yaml_event_t, mapping: bool, block: bool) {
        match depth {
            0 => {
                self.list = mapping && block;
                self.at_key = true;
            }
            // A key that is a collection.
            1 if self.list && self.at_key => self.list = false,
            1 if self.list => {
                self.value_start = Some(mark(&e.start_mark));
                if self.in_items() {
                    if !mapping && block {
                        self.items = Some(Vec::new());
                    } else {
                        self.list = false;
                    }
                }
            }
            2 if self.list && self.in_items() => {
                if mapping && block {
                    self.item_start = Some(mark(&e.start_mark));
                } else {
                    self.list = false;
                }
            }
            _ => {}
        }
    }

    /// A collection that started at `depth` ended.
    fn end(&mut self, depth: usize, e: &sys::yaml_event_t) {
        match depth {
            1 if self.list => self.value_end(e.end_mark.index as usize),
            2 if self.list && self.in_items() => {
                if let (Some((start, column)), Some(items)) =
                    (self.item_start.take(), &mut self.items)
                {
                    items.push(Span {
                        range: start..e.end_mark.index as usize,
                        column,
                    });
                }
            }
            _ => {}
        }
    }

    fn value_end(&mut self, end: usize) {
        if let Some((start, column)) = self.value_start.take()
            && !self.in_items()
        {
            self.others.push(Span {
                range: start..end,
                column,
            });
        }
        self.key = None;
        self.at_key = true;
    }

    fn finish(self, end: usize) -> Piece {
        match (self.list, self.kind, self.items) {
            (true, Some(kind), Some(items)) if kind.ends_with("List") => Piece::List {
                kind,
                items,
                others: self.others,
            },
            _ => Piece::Document(self.start..end),
        }
    }
}

fn mark(mark: &sys::yaml_mark_t) -> (usize, usize) {
    (mark.index as usize, mark.column as usize)
}

/// A key that serde_yaml reads as this very string, so that comparing texts finds duplicate
/// keys as it does: quoted, or plain and neither null, a boolean nor a number.
fn is_string_key(key: &str, plain: bool) -> bool {
    !plain
        || (key.starts_with(|c: char| c.is_ascii_alphabetic())
            && !matches!(
                key,
                "null" | "Null" | "NULL" | "true" | "True" | "TRUE" | "false" | "False" | "FALSE"
            ))
}

/// libyaml's parser over a string, deleted on drop. Boxed: libyaml keeps a pointer to it.
struct Parser {
    sys: Box<MaybeUninit<sys::yaml_parser_t>>,
}

impl Parser {
    fn new(text: &str) -> Option<Self> {
        let mut sys = Box::new(MaybeUninit::<sys::yaml_parser_t>::uninit());
        let parser = sys.as_mut_ptr();
        // SAFETY: `parser` points at memory for a parser, initialized here before any other
        // use; the input outlives the parser (both live within `split`).
        unsafe {
            if sys::yaml_parser_initialize(parser).fail {
                return None;
            }
            sys::yaml_parser_set_encoding(parser, sys::YAML_UTF8_ENCODING);
            sys::yaml_parser_set_input_string(parser, text.as_ptr(), text.len() as u64);
        }
        Some(Self { sys })
    }

    /// The next event, or None on a syntax error.
    fn next(&mut self) -> Option<Event> {
        let mut event = MaybeUninit::<sys::yaml_event_t>::uninit();
        // SAFETY: the parser was initialized in `new`; on success the event is initialized
        // (and deleted by Event's drop), on failure libyaml leaves nothing to delete.
        unsafe {
            // After a failure the caller stops: no event is asked of a failed parser.
            if sys::yaml_parser_parse(self.sys.as_mut_ptr(), event.as_mut_ptr()).fail {
                return None;
            }
        }
        Some(Event(event))
    }
}

impl Drop for Parser {
    fn drop(&mut self) {
        // SAFETY: initialized in `new` (a Parser exists only then), deleted once.
        unsafe { sys::yaml_parser_delete(self.sys.as_mut_ptr()) }
    }
}

/// A parsed event, deleted on drop.
struct Event(MaybeUninit<sys::yaml_event_t>);

impl Event {
    fn get(&self) -> &sys::yaml_event_t {
        // SAFETY: an Event is made only from an event libyaml initialized.
        unsafe { self.0.assume_init_ref() }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: initialized (see `get`), deleted once.
        unsafe { sys::yaml_event_delete(self.0.as_mut_ptr()) }
    }
}

//! What the fast reader ([`super::fast`]) reads a document into: a YAML node whose strings are
//! borrowed from the text where they can be, and whose mappings are lists of entries. Objects
//! deserialize from it as they do from a serde_yaml [`Value`] (the same visits for the same
//! nodes), without the `Value`'s copy of every key and scalar and the hashing of its mappings:
//! building and dropping `Value`s was most of a large manifest's reading.
//!
//! Its errors are not serde_yaml's: a caller that gets one deserializes [`Node::into_value`]
//! instead, which fails as serde_yaml fails (or, should this deserializer ever be stricter than
//! serde_yaml's, succeeds as it does).

use std::borrow::Cow;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_yaml::{Mapping, Value};

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Node<'a> {
    Null,
    Bool(bool),
    /// An integer that reads as a positive serde_yaml number (zero included).
    Unsigned(u64),
    /// A negative integer.
    Negative(i64),
    Float(f64),
    String(Cow<'a, str>),
    Sequence(Vec<Node<'a>>),
    /// A block mapping's entries in their order. The keys are [`Node::String`]s and distinct
    /// (the reader refuses anything else).
    Mapping(Vec<(Node<'a>, Node<'a>)>),
}

impl<'a> Node<'a> {
    /// An integer as serde_yaml's `Value::from(i64)` holds it.
    pub(super) fn integer(n: i64) -> Self {
        match u64::try_from(n) {
            Ok(n) => Node::Unsigned(n),
            Err(_) => Node::Negative(n),
        }
    }

    /// The value of mapping key `key`.
    pub(super) fn get(&self, key: &str) -> Option<&Node<'a>> {
        match self {
            Node::Mapping(entries) => entries
                .iter()
                .find(|(k, _)| k.as_str() == Some(key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    pub(super) fn as_str(&self) -> Option<&str> {
        match self {
            Node::String(s) => Some(s),
            _ => None,
        }
    }

    /// The same node as serde_yaml's `Value`.
    pub(super) fn into_value(self) -> Value {
        match self {
            Node::Null => Value::Null,
            Node::Bool(b) => Value::Bool(b),
            Node::Unsigned(n) => Value::from(n),
            Node::Negative(n) => Value::from(n),
            Node::Float(f) => Value::from(f),
            Node::String(s) => Value::String(s.into_owned()),
            Node::Sequence(items) => {
                Value::Sequence(items.into_iter().map(Node::into_value).collect())
            }
            Node::Mapping(entries) => Value::Mapping(
                entries
                    .into_iter()
                    .map(|(k, v)| (k.into_value(), v.into_value()))
                    .collect::<Mapping>(),
            ),
        }
    }
}

/// This deserializer's error: only that one happened (see the module's comment).
#[derive(Debug)]
pub(super) struct Mismatch;

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("does not deserialize as read")
    }
}

impl std::error::Error for Mismatch {}

impl de::Error for Mismatch {
    fn custom<T: std::fmt::Display>(_: T) -> Self {
        Mismatch
    }
}

type Result<T> = std::result::Result<T, Mismatch>;

/// The numeric requests, each answered as serde_yaml answers them (a number's own visit, else a
/// failure).
macro_rules! numbers {
    ($($method:ident)*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
            self.deserialize_number(visitor)
        }
    )*};
}

// Each method visits what serde_yaml's `impl Deserializer for &Value` (serde_yaml 0.9,
// value/de.rs) visits for the same node, and fails where it fails.
impl<'de> Deserializer<'de> for &'de Node<'_> {
    type Error = Mismatch;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        match self {
            Node::Null => visitor.visit_unit(),
            Node::Bool(b) => visitor.visit_bool(*b),
            Node::Unsigned(n) => visitor.visit_u64(*n),
            Node::Negative(n) => visitor.visit_i64(*n),
            Node::Float(f) => visitor.visit_f64(*f),
            Node::String(s) => visitor.visit_str(s),
            Node::Sequence(items) => visit_sequence(items, visitor),
            Node::Mapping(entries) => visit_mapping(entries, visitor),
        }
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        match self {
            Node::Bool(b) => visitor.visit_bool(*b),
            _ => Err(Mismatch),
        }
    }

    numbers! {
        deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64 deserialize_i128
        deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64 deserialize_u128
        deserialize_f32 deserialize_f64
    }

    fn deserialize_char<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.deserialize_str(visitor)
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        match self {
            Node::String(s) => visitor.visit_str(s),
            _ => Err(Mismatch),
        }
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.deserialize_str(visitor)
    }

    fn deserialize_bytes<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        match self {
            Node::String(s) => visitor.visit_str(s),
            Node::Sequence(items) => visit_sequence(items, visitor),
            _ => Err(Mismatch),
        }
    }

    fn deserialize_byte_buf<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.deserialize_bytes(visitor)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        match self {
            Node::Null => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_unit<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        match self {
            Node::Null => visitor.visit_unit(),
            _ => Err(Mismatch),
        }
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value> {
        self.deserialize_unit(visitor)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        match self {
            Node::Sequence(items) => visit_sequence(items, visitor),
            Node::Null => visit_sequence(&[], visitor),
            _ => Err(Mismatch),
        }
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, _len: usize, visitor: V) -> Result<V::Value> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        match self {
            Node::Mapping(entries) => visit_mapping(entries, visitor),
            Node::Null => visit_mapping(&[], visitor),
            _ => Err(Mismatch),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value> {
        self.deserialize_map(visitor)
    }

    /// Enums (none in the objects read here as far as serde goes: k8s-openapi's are strings)
    /// are left to serde_yaml.
    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value> {
        Err(Mismatch)
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        self.deserialize_str(visitor)
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        visitor.visit_unit()
    }
}

impl<'de> Node<'_> {
    fn deserialize_number<V: Visitor<'de>>(&'de self, visitor: V) -> Result<V::Value> {
        match self {
            Node::Unsigned(_) | Node::Negative(_) | Node::Float(_) => self.deserialize_any(visitor),
            _ => Err(Mismatch),
        }
    }
}

/// serde_yaml fails a sequence or mapping whose visitor did not take every element.
fn visit_sequence<'de, V: Visitor<'de>>(items: &'de [Node<'_>], visitor: V) -> Result<V::Value> {
    let mut access = Elements(items.iter());
    let value = visitor.visit_seq(&mut access)?;
    match access.0.len() {
        0 => Ok(value),
        _ => Err(Mismatch),
    }
}

fn visit_mapping<'de, V: Visitor<'de>>(
    entries: &'de [(Node<'_>, Node<'_>)],
    visitor: V,
) -> Result<V::Value> {
    let mut access = Entries {
        entries: entries.iter(),
        value: None,
    };
    let value = visitor.visit_map(&mut access)?;
    match access.entries.len() {
        0 => Ok(value),
        _ => Err(Mismatch),
    }
}

struct Elements<'de, 'a>(std::slice::Iter<'de, Node<'a>>);

impl<'de> SeqAccess<'de> for Elements<'de, '_> {
    type Error = Mismatch;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>> {
        self.0.next().map(|node| seed.deserialize(node)).transpose()
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

struct Entries<'de, 'a> {
    entries: std::slice::Iter<'de, (Node<'a>, Node<'a>)>,
    /// The value of the key handed out last.
    value: Option<&'de Node<'a>>,
}

impl<'de> MapAccess<'de> for Entries<'de, '_> {
    type Error = Mismatch;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>> {
        let Some((key, value)) = self.entries.next() else {
            return Ok(None);
        };
        self.value = Some(value);
        seed.deserialize(key).map(Some)
    }

    fn next_value_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<T::Value> {
        seed.deserialize(self.value.take().ok_or(Mismatch)?)
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.entries.len())
    }
}

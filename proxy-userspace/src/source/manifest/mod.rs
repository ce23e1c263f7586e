//! Manifest files: ordinary Kubernetes YAML (or JSON), as written by hand or printed by
//! `kubectl get -o yaml`.
//!
//! A file may hold several documents (`---`), `kind: List` objects with `items` (also
//! ServiceList, EndpointSliceList...), or JSON values. Services, EndpointSlices, Nodes (this
//! node's gives its zone and addresses) and ServiceCIDRs are kept, other kinds are counted and
//! skipped. One broken object does not spoil the rest; only a file that is not YAML at all is
//! rejected as a whole, because then nothing in it can be trusted.

use std::fmt;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::{
    core::v1::{Node, Service},
    networking::v1::ServiceCIDR,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_yaml::Value;

use crate::model::NamespacedName;

mod fast;
mod node;
mod split;
use split::Piece;

/// Where objects without `metadata.namespace` go, as with `kubectl apply`.
pub const DEFAULT_NAMESPACE: &str = "default";

#[derive(Clone, Debug, PartialEq)]
#[expect(
    clippy::large_enum_variant,
    reason = "824 against 432 bytes, next to the heap data both hold; boxing would not pay"
)]
pub enum Object {
    Service(Service),
    EndpointSlice(EndpointSlice),
    /// Nodes: this node's gives its zone (for topology hints) and addresses, as its Node
    /// object does from the API server.
    Node(Node),
    /// The cluster's Service IP ranges: traffic to an unallocated cluster IP in them is dropped
    /// (the nftables mode, as kube-proxy's).
    ServiceCidr(ServiceCIDR),
}

impl Object {
    pub fn kind(&self) -> &'static str {
        match self {
            Object::Service(_) => "Service",
            Object::EndpointSlice(_) => "EndpointSlice",
            Object::Node(_) => "Node",
            Object::ServiceCidr(_) => "ServiceCIDR",
        }
    }

    /// The object's namespace and name; the namespace defaults to "default".
    pub fn key(&self) -> NamespacedName {
        let meta = self.metadata();
        NamespacedName::new(
            meta.namespace
                .as_deref()
                .filter(|ns| !ns.is_empty())
                .unwrap_or(DEFAULT_NAMESPACE),
            meta.name.clone().unwrap_or_default(),
        )
    }

    pub fn metadata(&self) -> &ObjectMeta {
        match self {
            Object::Service(svc) => &svc.metadata,
            Object::EndpointSlice(slice) => &slice.metadata,
            Object::Node(node) => &node.metadata,
            Object::ServiceCidr(cidr) => &cidr.metadata,
        }
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        match self {
            Object::Service(svc) => &mut svc.metadata,
            Object::EndpointSlice(slice) => &mut slice.metadata,
            Object::Node(node) => &mut node.metadata,
            Object::ServiceCidr(cidr) => &mut cidr.metadata,
        }
    }
}

impl fmt::Display for Object {
    /// "Service demo/web", as in error messages.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.kind(), self.key())
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Manifest {
    /// In file order, namespaces filled in.
    pub objects: Vec<Object>,
    /// Documents that are not usable; the objects above are unaffected.
    pub errors: Vec<ManifestError>,
    /// Objects of other kinds (Deployments...), which are not ours to program.
    pub ignored: usize,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    /// The text is not YAML (or JSON): nothing in it should be applied.
    #[error("not valid YAML: {0}")]
    Syntax(String),
    /// One document, or one item of a list, is not a usable object.
    #[error("{}", describe_object_error(.document, .path, .object, .message))]
    Object {
        /// 1-based, counting `---` separated documents (or JSON values).
        document: usize,
        /// Inside the document, such as "items[3]"; empty for the document itself.
        path: String,
        /// "Service demo/web", when the kind and name could be read.
        object: Option<String>,
        message: String,
    },
}

fn describe_object_error(
    document: &usize,
    path: &str,
    object: &Option<String>,
    message: &str,
) -> String {
    let mut text = format!("document {document}");
    if !path.is_empty() {
        text.push_str(", ");
        text.push_str(path);
    }
    if let Some(object) = object {
        text.push_str(&format!(" ({object})"));
    }
    format!("{text}: {message}")
}

/// Parses a manifest. Errs only when the text as a whole cannot be read.
pub fn parse(text: &str) -> Result<Manifest, ManifestError> {
    let (objects, Parsed { errors, ignored }) = parse_each(text, |object| object)?;
    Ok(Manifest {
        objects,
        errors,
        ignored,
    })
}

/// What [`parse_each`] found besides the objects.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Parsed {
    /// Documents that are not usable, as in [`Manifest::errors`].
    pub errors: Vec<ManifestError>,
    /// Objects of other kinds, as in [`Manifest::ignored`].
    pub ignored: usize,
}

/// [`parse`], handing each object to `each` as soon as it is read and keeping what it returns
/// (in file order) instead of the objects: one YAML document, or one item of a List, is held at
/// a time (a JSON text is read whole), so a caller that keeps less than the whole object needs
/// far less memory. `each` may see an object more than once (when the fast reader gives up on a
/// text, it is read again): only what it returns counts.
pub fn parse_each<T>(
    text: &str,
    each: impl FnMut(Object) -> T,
) -> Result<(Vec<T>, Parsed), ManifestError> {
    let mut parser = Parser {
        text,
        from_yaml: true,
        each,
        kept: Vec::new(),
        parsed: Parsed::default(),
    };
    // JSON is read as JSON first: it may be indented with tabs, which YAML forbids. A text that
    // is not one JSON stream as a whole is read as YAML (a flow mapping looks like JSON).
    if looks_like_json(text) {
        let json: Result<Vec<serde_json::Value>, _> = serde_json::Deserializer::from_str(text)
            .into_iter()
            .collect();
        if let Ok(json) = json {
            parser.from_yaml = false;
            for (index, value) in json.into_iter().enumerate() {
                let value = serde_yaml::to_value(value)
                    .map_err(|e| ManifestError::Syntax(e.to_string()))?;
                parser.add(index, "", value, None);
            }
            return Ok((parser.kept, parser.parsed));
        }
    }
    // The plain block YAML kubectl prints is read by `fast`, many times faster than libyaml.
    // Where it gives up, what it read is dropped and the text read again by libyaml. (Reading
    // on a thread of its own, beside this one making the objects, took twice as long: the one
    // malloc arena the agent keeps (main.rs) is then fought over by both.)
    let read = fast::read(text, &mut |document, item, value| {
        parser.add_read(document, item, value)
    });
    if read.is_ok() {
        return Ok((parser.kept, parser.parsed));
    }
    parser.kept.clear();
    parser.parsed = Parsed::default();
    // Else piece by piece where the text allows it (see `split`), else document by document.
    // Only Lists gain from it (other documents are read one at a time anyway), and finding the
    // pieces reads the text once more: a text without "List" is not looked at twice.
    let pieces = if text.contains("List") {
        split::split(text)
    } else {
        None
    };
    match pieces {
        Some(pieces) => parser.add_pieces(&pieces)?,
        None => parser.add_documents()?,
    }
    Ok((parser.kept, parser.parsed))
}

fn looks_like_json(text: &str) -> bool {
    text.trim_start().starts_with(['{', '['])
}

struct Parser<'a, F, K> {
    text: &'a str,
    /// False when the text was read as a JSON stream.
    from_yaml: bool,
    each: F,
    /// What `each` returned, in file order.
    kept: Vec<K>,
    parsed: Parsed,
}

impl<F: FnMut(Object) -> K, K> Parser<'_, F, K> {
    /// Reads the text document by document (serde_yaml holds one whole document at a time).
    fn add_documents(&mut self) -> Result<(), ManifestError> {
        for (index, document) in serde_yaml::Deserializer::from_str(self.text).enumerate() {
            let value =
                Value::deserialize(document).map_err(|e| ManifestError::Syntax(e.to_string()))?;
            self.add(index, "", value, None);
        }
        Ok(())
    }

    /// Reads the text piece by piece: what [`Parser::add_documents`] does, holding one item of
    /// a List at a time.
    fn add_pieces(&mut self, pieces: &[Piece]) -> Result<(), ManifestError> {
        for (index, piece) in pieces.iter().enumerate() {
            match piece {
                Piece::Document(range) => {
                    let value = self.read_piece(&self.text[range.clone()])?;
                    self.add(index, "", value, None);
                }
                Piece::List {
                    kind,
                    items,
                    others,
                } => {
                    for other in others {
                        self.read_piece(&other.text(self.text))?;
                    }
                    let item_kind = kind.strip_suffix("List").filter(|k| !k.is_empty());
                    for (i, item) in items.iter().enumerate() {
                        let value = self.read_piece(&item.text(self.text))?;
                        self.add(index, &format!("items[{i}]"), value, item_kind);
                    }
                }
            }
        }
        Ok(())
    }

    /// One piece as a value. A piece that does not read (a duplicate key, say) fails the whole
    /// text, with the message reading it whole gives.
    fn read_piece(&self, piece: &str) -> Result<Value, ManifestError> {
        serde_yaml::from_str(piece).map_err(|piece_error| {
            let whole_error = serde_yaml::Deserializer::from_str(self.text)
                .find_map(|document| Value::deserialize(document).err());
            ManifestError::Syntax(match whole_error {
                Some(e) => e.to_string(),
                // Not expected: `split` only cuts texts whose pieces read as the whole does.
                None => format!("{piece_error} (in a part of the manifest read on its own)"),
            })
        })
    }

    /// Adds what the fast reader read: document `document`, or its List's item `item` (the
    /// item's index and the List's kind). An object of a kind kept is deserialized from the
    /// node itself; anything else, and an object that does not deserialize so, is added as a
    /// `Value` (which gives serde_yaml's errors).
    fn add_read(&mut self, document: usize, item: fast::Item<'_>, node: node::Node<'_>) {
        let item_kind = item
            .and_then(|(_, list_kind)| list_kind.strip_suffix("List").filter(|k| !k.is_empty()));
        if let node::Node::Mapping(_) = node {
            let kind = node.get("kind").and_then(node::Node::as_str).or(item_kind);
            let object = match kind {
                Some("Service") => Service::deserialize(&node).map(Object::Service),
                Some("EndpointSlice") => {
                    EndpointSlice::deserialize(&node).map(Object::EndpointSlice)
                }
                Some("Node") => Node::deserialize(&node).map(Object::Node),
                Some("ServiceCIDR") => ServiceCIDR::deserialize(&node).map(Object::ServiceCidr),
                _ => Err(node::Mismatch),
            };
            if let Ok(object) = object {
                return self.keep(object);
            }
        }
        let path = item.map_or_else(String::new, |(i, _)| format!("items[{i}]"));
        self.add(document, &path, node.into_value(), item_kind);
    }

    /// Adds document `index` (or the item at `path` inside it). Items of a typed list such as
    /// ServiceList may omit their kind, as the API server's list responses do: `item_kind`.
    fn add(&mut self, index: usize, path: &str, mut value: Value, item_kind: Option<&str>) {
        let error = |object: Option<String>, message: String| ManifestError::Object {
            document: index + 1,
            path: path.to_owned(),
            object,
            message,
        };
        // An empty document, as a trailing `---` makes.
        if value.is_null() {
            return;
        }
        if !value.is_mapping() {
            let message = "not a Kubernetes object (expected a mapping with apiVersion and kind)";
            self.parsed.errors.push(error(None, message.to_owned()));
            return;
        }
        let kind = value.get("kind").and_then(Value::as_str).or(item_kind);
        let Some(kind) = kind.map(str::to_owned) else {
            let message = "has no kind";
            self.parsed.errors.push(error(None, message.to_owned()));
            return;
        };
        let object = match kind.as_str() {
            "Service" => self.deserialize(index, path, value, &kind, Object::Service),
            "EndpointSlice" => self.deserialize(index, path, value, &kind, Object::EndpointSlice),
            "Node" => self.deserialize(index, path, value, &kind, Object::Node),
            "ServiceCIDR" => self.deserialize(index, path, value, &kind, Object::ServiceCidr),
            // `kubectl get -o yaml` prints a List; typed lists (ServiceList...) look the same.
            list if list.ends_with("List") => {
                let items = value.as_mapping_mut().and_then(|m| m.remove("items"));
                match items {
                    None | Some(Value::Null) => {}
                    Some(Value::Sequence(items)) => {
                        // Item by item, each dropped once read.
                        for (i, item) in items.into_iter().enumerate() {
                            let item_path = if path.is_empty() {
                                format!("items[{i}]")
                            } else {
                                format!("{path}.items[{i}]")
                            };
                            let item_kind = list.strip_suffix("List").filter(|k| !k.is_empty());
                            self.add(index, &item_path, item, item_kind);
                        }
                    }
                    Some(_) => {
                        let message = "items is not a list".to_owned();
                        self.parsed.errors.push(error(Some(kind), message));
                    }
                }
                return;
            }
            _ => {
                self.parsed.ignored += 1;
                return;
            }
        };
        match object {
            Ok(object) => self.keep(object),
            Err((object, message)) => self.parsed.errors.push(error(Some(object), message)),
        }
    }

    /// Hands a valid object to `each`, in the default namespace if it names none.
    fn keep(&mut self, mut object: Object) {
        let meta = object.metadata_mut();
        if meta.namespace.as_deref().is_none_or(str::is_empty) {
            meta.namespace = Some(DEFAULT_NAMESPACE.to_owned());
        }
        let kept = (self.each)(object);
        self.kept.push(kept);
    }

    /// Deserializes one object; on failure returns its "Kind ns/name" and what is wrong.
    fn deserialize<T: DeserializeOwned>(
        &self,
        index: usize,
        path: &str,
        value: Value,
        kind: &str,
        wrap: fn(T) -> Object,
    ) -> Result<Object, (String, String)> {
        match T::deserialize(&value) {
            Ok(object) => Ok(wrap(object)),
            Err(e) => {
                let message = self
                    .located::<T>(index, path)
                    .or_else(|| error_with_field::<T>(&value))
                    .unwrap_or_else(|| e.to_string());
                Err((describe(&value, kind), message))
            }
        }
    }

    /// The error of deserializing document `index` straight from the text, which says at which
    /// line. Only whole YAML documents can be found again this way.
    fn located<T: DeserializeOwned>(&self, index: usize, path: &str) -> Option<String> {
        if !self.from_yaml || !path.is_empty() {
            return None;
        }
        let document = serde_yaml::Deserializer::from_str(self.text).nth(index)?;
        T::deserialize(document).err().map(|e| e.to_string())
    }
}

/// Errors from a Value name no field; reading the value back from text gives the field's path.
/// The line is that of the re-printed text, which means nothing to the user, so it is cut off.
fn error_with_field<T: DeserializeOwned>(value: &Value) -> Option<String> {
    let text = serde_yaml::to_string(value).ok()?;
    let error = serde_yaml::from_str::<T>(&text).err()?;
    let message = error.to_string();
    let Some(location) = error.location() else {
        return Some(message);
    };
    let suffix = format!(" at line {} column {}", location.line(), location.column());
    Some(message.strip_suffix(&suffix).unwrap_or(&message).to_owned())
}

/// "Service demo/web" from an object that may not deserialize.
fn describe(value: &Value, kind: &str) -> String {
    let meta = value.get("metadata");
    let field = |name: &str| meta.and_then(|m| m.get(name)).and_then(Value::as_str);
    let namespace = field("namespace")
        .filter(|ns| !ns.is_empty())
        .unwrap_or(DEFAULT_NAMESPACE);
    let name = field("name").unwrap_or("<no name>");
    format!("{kind} {namespace}/{name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(manifest: &Manifest) -> Vec<String> {
        manifest.objects.iter().map(ToString::to_string).collect()
    }

    fn errors(manifest: &Manifest) -> Vec<String> {
        manifest.errors.iter().map(ToString::to_string).collect()
    }

    /// The manifest read document by document, as serde_yaml reads it: what reading it piece by
    /// piece must give.
    pub(super) fn parse_whole(text: &str) -> Result<Manifest, ManifestError> {
        let mut parser = Parser {
            text,
            from_yaml: true,
            each: |object| object,
            kept: Vec::new(),
            parsed: Parsed::default(),
        };
        parser.add_documents()?;
        Ok(Manifest {
            objects: parser.kept,
            errors: parser.parsed.errors,
            ignored: parser.parsed.ignored,
        })
    }

    /// Whether `text` is read with at least one List item by item.
    fn split_into_items(text: &str) -> bool {
        split::split(text).is_some_and(|pieces| {
            pieces
                .iter()
                .any(|piece| matches!(piece, Piece::List { items, .. } if !items.is_empty()))
        })
    }

    const KUBECTL_ITEM: &str = "\
- apiVersion: v1
  kind: Service
  metadata:
    annotations:
      note: |
        a literal
        block
      folded: >-
        folded
        text
    labels: {app: NAME, 'quoted key': \"x\"}
    name: NAME
    namespace: demo
  spec:
    clusterIP: 10.96.0.1 # a comment
    description: a plain scalar
      continued on the next line
    ports:
    - name: http
      port: 80
      targetPort: 8080

# a comment between items, at column 0
- addressType: IPv4
  apiVersion: discovery.k8s.io/v1
  endpoints:
  - addresses:
    - 10.244.1.11
    conditions: {ready: true}
  kind: EndpointSlice
  metadata:
    labels:
      kubernetes.io/service-name: NAME
    name: NAME-1
  ports:
  - {name: http, port: 8080}
";

    fn kubectl_list(names: &[&str]) -> String {
        let items: String = names
            .iter()
            .map(|name| KUBECTL_ITEM.replace("NAME", name))
            .collect();
        format!("apiVersion: v1\nitems:\n{items}kind: List\nmetadata:\n  resourceVersion: \"\"\n")
    }

    #[test]
    fn lists_are_read_item_by_item() {
        let text = kubectl_list(&["a", "b", "c"]);
        assert!(split_into_items(&text));
        let manifest = parse(&text).unwrap();
        assert_eq!(manifest.objects.len(), 6);
        assert!(manifest.errors.is_empty(), "{:?}", manifest.errors);
        assert_eq!(manifest, parse_whole(&text).unwrap());
        let Object::Service(svc) = &manifest.objects[2] else {
            panic!("{}", manifest.objects[2]);
        };
        let annotations = svc.metadata.annotations.as_ref().unwrap();
        assert_eq!(annotations["note"], "a literal\nblock\n");
        assert_eq!(annotations["folded"], "folded text");

        // Many items come out in file order, errors too.
        let names: Vec<String> = (0..300).map(|i| format!("s{i}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let text = kubectl_list(&names).replace("port: 80\n", "port: eighty\n");
        let manifest = parse(&text).unwrap();
        assert_eq!(manifest, parse_whole(&text).unwrap());
        assert_eq!((manifest.objects.len(), manifest.errors.len()), (300, 300));
        assert_eq!(
            manifest.objects[299].to_string(),
            "EndpointSlice default/s299-1"
        );
    }

    #[test]
    fn pieces_read_as_the_whole_text() {
        let list = kubectl_list(&["a", "b"]);
        let example = include_str!("../../../../examples/services.yaml");
        let split_cases = [
            example.to_owned(),
            list.clone(),
            list.replace('\n', "\r\n"),
            // Indented items, the kind first and quoted, a typed list with kind-less items,
            // a List inside a List.
            list.lines()
                .map(|line| match line {
                    "apiVersion: v1" | "items:" | "kind: List" | "metadata:" => format!("{line}\n"),
                    line if line.starts_with("  resourceVersion") => format!("{line}\n"),
                    line => format!("  {line}\n"),
                })
                .collect(),
            format!("kind: \"List\"\n{}", list.replace("kind: List\n", "")),
            "kind: ServiceList\nitems:\n- metadata: {name: a}\n  spec: {clusterIP: 10.96.0.1}\n"
                .to_owned(),
            "items:\n- kind: List\n  items:\n  - {kind: Service, metadata: {name: a}}\nkind: List\n"
                .to_owned(),
            // Several documents; invalid items; an empty document; an end marker.
            format!(
                "{example}---\n{list}...\n---\n---\nkind: Service\nmetadata: {{name: x}}\n---\n\
                 kind: List\nitems:\n- kind: Service\n  metadata: {{name: bad}}\n  spec: {{ports: [{{port: x}}]}}\n\
                 - just a string\n- kind: Secret\n"
            ),
            // A duplicate key in an item, in the List's metadata: the whole text fails.
            list.replacen("    name: a\n", "    name: a\n    name: b\n", 1),
            list.replace("  resourceVersion: \"\"\n", "  resourceVersion: \"\"\n  resourceVersion: \"\"\n"),
            // A syntax error inside an item.
            list.replacen("    name: a\n", "    name: [a\n", 1),
        ];
        for text in &split_cases {
            assert_eq!(parse(text), parse_whole(text), "{text}");
        }
        assert!(split_into_items(&split_cases[0]));
        assert!(split_into_items(&split_cases[2]));
        assert!(split_into_items(&split_cases[3]));
        assert!(split_into_items(&split_cases[4]));
        assert!(split_into_items(&split_cases[5]));

        // Read whole: lists with anchors, tags, directives, flow items, items that are not
        // mappings, a duplicate or non-string top-level key, deep nesting, a byte order mark.
        let deep = format!("{}1{}", "[".repeat(120), "]".repeat(120));
        let whole_cases = [
            list.replacen("  spec:\n", "  spec: &spec\n", 1),
            format!("{list}---\nkind: List\nitems:\n- *x\n"),
            list.replacen("- apiVersion: v1\n", "- !svc\n  apiVersion: v1\n", 1),
            format!("%YAML 1.1\n---\n{list}"),
            "kind: List\nitems: [{kind: Service, metadata: {name: a}}]\n".to_owned(),
            "kind: List\nitems:\n- just a string\n".to_owned(),
            format!("{list}kind: List\n"),
            format!("1: x\n{list}"),
            format!("kind: List\nitems:\n- kind: Service\n  spec: {deep}\n"),
            format!("\u{feff}{list}"),
        ];
        for text in &whole_cases {
            assert_eq!(parse(text), parse_whole(text), "{text}");
            assert!(!split_into_items(text), "{text}");
        }
    }

    #[test]
    fn multi_document_yaml() {
        let manifest = parse(
            "
# leading comment
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
endpoints: [{addresses: [10.244.1.11]}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
---
",
        )
        .unwrap();
        assert_eq!(
            keys(&manifest),
            ["Service demo/web", "EndpointSlice default/web-abc"]
        );
        assert_eq!(manifest.ignored, 1);
        assert!(manifest.errors.is_empty());
        // The default namespace is written into the object, not only into its key.
        assert_eq!(
            manifest.objects[1].metadata().namespace.as_deref(),
            Some("default")
        );
        assert_eq!(manifest.objects[0].kind(), "Service");
    }

    #[test]
    fn lists() {
        let manifest = parse(
            "
apiVersion: v1
kind: List
metadata: {resourceVersion: ''}
items:
- apiVersion: v1
  kind: Service
  metadata: {name: a, namespace: demo}
- apiVersion: v1
  kind: ConfigMap
  metadata: {name: c}
---
apiVersion: v1
kind: ServiceList
items:
- metadata: {name: b}
  spec: {clusterIP: 10.96.0.2}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSliceList
items: []
",
        )
        .unwrap();
        // ServiceList items may omit kind, as in the API server's own list responses.
        assert_eq!(keys(&manifest), ["Service demo/a", "Service default/b"]);
        assert_eq!(manifest.ignored, 1);
        assert!(manifest.errors.is_empty());
        // The same in the block style the fast reader takes, with items that are not objects:
        // null (skipped, as an empty document is), a string (an error).
        let text = "kind: ServiceList\nitems:\n- null\n- x\n- metadata:\n    name: b\n";
        let manifest = parse(text).unwrap();
        assert_eq!(keys(&manifest), ["Service default/b"]);
        assert_eq!(errors(&manifest).len(), 1, "{:?}", manifest.errors);
        assert_eq!(Ok(manifest), tests::parse_whole(text));
    }

    #[test]
    fn json() {
        let manifest = parse(
            "{\n\t\"apiVersion\": \"v1\",\n\t\"kind\": \"List\",\n\t\"items\": [\n\t\t{\"apiVersion\": \"v1\", \"kind\": \"Service\", \"metadata\": {\"name\": \"web\", \"namespace\": \"demo\"}, \"spec\": {\"clusterIP\": \"10.96.0.10\", \"ports\": [{\"port\": 80}]}}\n\t]\n}\n{\"kind\": \"Service\", \"metadata\": {\"name\": \"second\"}}",
        )
        .unwrap();
        assert_eq!(
            keys(&manifest),
            ["Service demo/web", "Service default/second"]
        );
        assert!(manifest.errors.is_empty());
        // A YAML flow mapping is not JSON but is still read.
        let manifest = parse("{kind: Service, metadata: {name: flow}}").unwrap();
        assert_eq!(keys(&manifest), ["Service default/flow"]);
    }

    #[test]
    fn bad_documents_do_not_spoil_the_rest() {
        let text = "\
apiVersion: v1
kind: Service
metadata: {name: bad-port, namespace: demo}
spec:
  ports:
  - port: eighty
---
apiVersion: v1
kind: Service
metadata: {name: good, namespace: demo}
---
- just
- a list
---
metadata: {name: kindless}
---
apiVersion: discovery.k8s.io/v1beta1
kind: EndpointSlice
metadata: {name: old-api}
---
kind: List
items:
- kind: EndpointSlice
  metadata: {name: in-list}
  addressType: [IPv4]
";
        let manifest = parse(text).unwrap();
        assert_eq!(keys(&manifest), ["Service demo/good"]);
        let errors = errors(&manifest);
        assert_eq!(
            errors,
            [
                r#"document 1 (Service demo/bad-port): spec.ports[0].port: invalid type: string "eighty", expected i32 at line 6 column 11"#,
                "document 3: not a Kubernetes object (expected a mapping with apiVersion and kind)",
                "document 4: has no kind",
                r#"document 5 (EndpointSlice default/old-api): invalid value: string "discovery.k8s.io/v1beta1", expected discovery.k8s.io/v1 at line 17 column 1"#,
                "document 6, items[0] (EndpointSlice default/in-list): addressType: invalid type: sequence, expected a string",
            ]
        );
    }

    #[test]
    fn syntax_errors_reject_the_whole_file() {
        let err = parse("kind: Service\nmetadata: {name: web\n---\nkind: Service\n").unwrap_err();
        assert!(matches!(err, ManifestError::Syntax(_)), "{err}");
        assert!(err.to_string().contains("line"), "{err}");
        let err = parse("kind: Service\n  bad: indent\n").unwrap_err();
        assert!(matches!(err, ManifestError::Syntax(_)), "{err}");
    }

    #[test]
    fn empty_files() {
        for text in ["", "\n", "# nothing yet\n", "---\n", "---\n---\n"] {
            let manifest = parse(text).unwrap();
            assert_eq!(manifest, Manifest::default(), "{text:?}");
        }
    }

    #[test]
    fn unset_endpoint_conditions_read_as_kube_proxy_does() {
        let manifest = parse(
            "
kind: Service
metadata: {name: web}
spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
---
kind: EndpointSlice
metadata: {name: web-1, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{port: 8080}]
endpoints:
- addresses: [10.244.1.11]
- addresses: [10.244.1.12]
  conditions: {ready: false}
",
        )
        .unwrap();
        let mut tracker = crate::model::ChangeTracker::new();
        for object in &manifest.objects {
            match object {
                Object::Service(svc) => tracker.update_service(svc).unwrap(),
                Object::EndpointSlice(slice) => {
                    tracker.update_slice(slice).unwrap();
                }
                Object::Node(_) | Object::ServiceCidr(_) => {}
            }
        }
        let mut state = crate::model::DesiredState::default();
        tracker.apply(&mut state);
        let conditions: Vec<_> = state
            .endpoints()
            .flat_map(|(_, eps)| eps)
            .map(|ep| (ep.ready, ep.serving, ep.terminating))
            .collect();
        // Unset: ready and serving true, terminating false.
        assert_eq!(conditions, [(true, true, false), (false, true, false)]);
    }

    #[test]
    fn the_example_manifest_is_valid() {
        let manifest = parse(include_str!("../../../../examples/services.yaml")).unwrap();
        assert!(manifest.errors.is_empty(), "{:#?}", manifest.errors);
        assert_eq!(manifest.ignored, 0);
        let mut tracker = crate::model::ChangeTracker::new();
        for object in &manifest.objects {
            match object {
                Object::Service(svc) => tracker.update_service(svc).unwrap(),
                Object::EndpointSlice(slice) => {
                    assert_eq!(tracker.update_slice(slice).unwrap(), []);
                }
                Object::Node(_) | Object::ServiceCidr(_) => {}
            }
        }
        let mut state = crate::model::DesiredState::default();
        let changed: Vec<String> = tracker
            .apply(&mut state)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            changed,
            [
                "demo/dns-like:dns",
                "demo/front:dns",
                "demo/front:http",
                "demo/front-local",
                "demo/remote",
                "demo/web:http"
            ]
        );
        let endpoints: Vec<String> = state
            .endpoints()
            .map(|(spn, eps)| {
                let eps: Vec<String> = eps
                    .iter()
                    .map(|ep| format!("{}:{}", ep.ip, ep.port))
                    .collect();
                format!(
                    "{spn} {:?} -> {}",
                    state.port(spn).unwrap().cluster_ips,
                    eps.join(",")
                )
            })
            .collect();
        assert_eq!(
            endpoints,
            [
                "demo/dns-like:dns [10.96.0.20] -> 10.244.1.11:8080,10.244.2.11:8080",
                "demo/front:dns [10.96.0.40] -> 10.244.1.12:8080,10.244.2.11:8080",
                "demo/front:http [10.96.0.40] -> 10.244.1.12:8080,10.244.2.11:8080",
                "demo/front-local [10.96.0.41] -> 10.244.1.13:8080",
                "demo/remote [10.96.0.30] -> 10.244.2.11:8080",
                "demo/web:http [10.96.0.10] -> 10.244.1.11:8080,10.244.1.12:8080,10.244.1.13:8080",
            ]
        );
    }

    #[test]
    fn parse_each_streams_in_file_order() {
        let text = "
kind: Service
metadata: {name: a}
---
kind: List
items:
- {kind: EndpointSlice, metadata: {name: b}, addressType: IPv4}
- {kind: Service, metadata: {name: c}}
- {kind: Service, metadata: {name: bad}, spec: {ports: [{port: x}]}}
---
kind: ConfigMap
---
kind: ServiceList
items: [{metadata: {name: d}}]
";
        let (seen, parsed) = parse_each(text, |object| object.to_string()).unwrap();
        assert_eq!(
            seen,
            [
                "Service default/a",
                "EndpointSlice default/b",
                "Service default/c",
                "Service default/d"
            ]
        );
        assert_eq!(parsed.ignored, 1);
        assert_eq!(parsed.errors.len(), 1);
        let manifest = parse(text).unwrap();
        assert_eq!(keys(&manifest), seen);
        assert_eq!((manifest.errors, manifest.ignored), (parsed.errors, 1));

        // A broken document fails the whole text, even after objects were handed out.
        let broken = format!("{text}---\nkind: [Service\n");
        let mut count = 0;
        let err = parse_each(&broken, |_| count += 1).unwrap_err();
        assert!(matches!(err, ManifestError::Syntax(_)), "{err}");
        assert_eq!(count, 4);
        // Objects the fast reader handed out before it gave up are seen again, and kept once.
        let late_flow = text.replace("kind: ConfigMap", "kind: ConfigMap\ndata: {a: b}");
        let late_flow = format!("kind: Service\nmetadata:\n  name: z\n---\n{late_flow}");
        let mut count = 0;
        let (kept, _) = parse_each(&late_flow, |object| {
            count += 1;
            object.to_string()
        })
        .unwrap();
        assert_eq!(kept.len(), 5);
        assert!(count > 5, "{count}");
    }

    #[test]
    fn tagged_lists_are_read() {
        // The items of a tagged List are read as before (the tag is ignored); a tagged items
        // value is not a list.
        let manifest = parse(
            "!list {kind: List, items: [{kind: Service, metadata: {name: a}}]}\n---\n\
             {kind: List, items: !seq [{kind: Service, metadata: {name: b}}]}",
        )
        .unwrap();
        assert_eq!(keys(&manifest), ["Service default/a"]);
        assert_eq!(
            errors(&manifest),
            ["document 2 (List): items is not a list"]
        );
    }
}

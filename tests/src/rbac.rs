//! Evaluating a ClusterRole's rules, for the deployment manifest's tests
//! (`tests/tests/deploy.rs`): what the agent's ServiceAccount may do.
use std::path::Path;

use anyhow::{Context, bail};
use serde_yaml::Value;

/// Whether any rule of `cluster_role` grants `verb` on `resource` of API `group` (`""` is the
/// core group). Matches as the API server's RBAC authorizer does for resource requests:
/// `"*"` in `apiGroups`, `resources` or `verbs` matches anything. Rules with
/// `nonResourceURLs` only, `resourceNames` (a request for a whole collection, like list or
/// watch, never matches a rule limited to names) and aggregation are not evaluated: such
/// rules grant nothing here.
pub fn rbac_allows(cluster_role: &Value, verb: &str, group: &str, resource: &str) -> bool {
    let Some(rules) = cluster_role.get("rules").and_then(Value::as_sequence) else {
        return false;
    };
    rules.iter().any(|rule| {
        let restricted_to_names = rule
            .get("resourceNames")
            .and_then(Value::as_sequence)
            .is_some_and(|names| !names.is_empty());
        !restricted_to_names
            && matches(rule, "apiGroups", group)
            && matches(rule, "resources", resource)
            && matches(rule, "verbs", verb)
    })
}

/// Whether the rule's list `field` holds `want` or `"*"`.
fn matches(rule: &Value, field: &str, want: &str) -> bool {
    rule.get(field)
        .and_then(Value::as_sequence)
        .is_some_and(|items| {
            items
                .iter()
                .filter_map(Value::as_str)
                .any(|item| item == "*" || item == want)
        })
}

/// The single ClusterRole document of the multi-document YAML file at `path`.
pub fn load_cluster_role(path: impl AsRef<Path>) -> anyhow::Result<Value> {
    load_document(path, "ClusterRole")
}

/// The single document of `kind` in the multi-document YAML file at `path`.
pub fn load_document(path: impl AsRef<Path>, kind: &str) -> anyhow::Result<Value> {
    let path = path.as_ref();
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut found = Vec::new();
    for (i, document) in yaml_documents(&text).iter().enumerate() {
        let value: Value = serde_yaml::from_str(document)
            .with_context(|| format!("{}: document {}", path.display(), i + 1))?;
        if value.get("kind").and_then(Value::as_str) == Some(kind) {
            found.push(value);
        }
    }
    match found.len() {
        1 => Ok(found.pop().unwrap()),
        n => bail!("{}: {n} {kind} documents, expected 1", path.display()),
    }
}

/// The documents of a YAML stream, as text. (`serde_yaml::Deserializer` iterates documents,
/// but reading one into a Value needs the `serde::Deserialize` trait, and this crate does not
/// depend on serde directly.) A line that starts with `---` followed by a space or nothing
/// starts a document and a line `...` ends one, as in the YAML spec; lines before the first
/// marker are the first document. Documents with only comments or blanks are dropped.
pub fn yaml_documents(text: &str) -> Vec<String> {
    let mut documents = vec![String::new()];
    for line in text.lines() {
        let line_start = line
            .strip_prefix("---")
            .filter(|rest| rest.is_empty() || rest.starts_with(' ') || rest.starts_with('\t'));
        if let Some(rest) = line_start {
            // Content after the marker (`--- # comment`, `--- {a: 1}`) belongs to the new one.
            let rest = rest.trim_start();
            documents.push(if rest.is_empty() {
                String::new()
            } else {
                format!("{rest}\n")
            });
        } else if line.trim_end() == "..." {
            documents.push(String::new());
        } else {
            let current = documents.last_mut().unwrap();
            current.push_str(line);
            current.push('\n');
        }
    }
    documents.retain(|d| {
        d.lines()
            .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
    });
    documents
}

//! The deployment manifest (deploy/kube-proxy-ebpf.yaml): valid for the Kubernetes API, and
//! its ClusterRole grants the agent exactly what it uses.
use std::{
    io::ErrorKind,
    path::{Path, PathBuf},
    process::Command,
};

use proxy_tests::rbac::{load_cluster_role, rbac_allows, yaml_documents};
use serde_yaml::Value;

/// The Kubernetes version the manifest is validated against.
const KUBERNETES_VERSION: &str = "1.34.0";

/// What the agent calls: list+watch of Services, EndpointSlices, (its own) Node and
/// ServiceCIDRs, and the Events it posts (created, and patched when one repeats).
const WATCHED: &[(&str, &str)] = &[
    ("", "services"),
    ("discovery.k8s.io", "endpointslices"),
    ("", "nodes"),
    ("networking.k8s.io", "servicecidrs"),
];
const VERBS: &[&str] = &["list", "watch"];
const POSTED: (&str, &str) = ("events.k8s.io", "events");
const POST_VERBS: &[&str] = &["create", "patch"];

fn manifest() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kube-proxy-ebpf.yaml")
}

#[test]
fn manifest_validates_against_the_kubernetes_schema() {
    let path = manifest();
    let output = Command::new("kubernetes-validate")
        .args(["--strict", "--kubernetes-version", KUBERNETES_VERSION])
        .arg(&path)
        .output();
    let output = match output {
        Ok(output) => output,
        Err(e) if e.kind() == ErrorKind::NotFound => panic!(
            "kubernetes-validate is not installed (or not on PATH): run `cargo xtask setup` \
             (it is the PyPI package kubernetes-validate)"
        ),
        Err(e) => panic!("running kubernetes-validate: {e}"),
    };
    assert!(
        output.status.success(),
        "kubernetes-validate --strict --kubernetes-version {KUBERNETES_VERSION} {} failed \
         ({}):\n{}{}",
        path.display(),
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
}

#[test]
fn cluster_role_allows_list_and_watch_of_what_the_agent_watches() {
    let role = load_cluster_role(manifest()).unwrap();
    for &(group, resource) in WATCHED {
        for &verb in VERBS {
            assert!(
                rbac_allows(&role, verb, group, resource),
                "{verb} {resource} (group {group:?}) is not allowed"
            );
        }
    }
    for &verb in POST_VERBS {
        assert!(
            rbac_allows(&role, verb, POSTED.0, POSTED.1),
            "{verb} events"
        );
    }
}

#[test]
fn cluster_role_denies_everything_else() {
    let role = load_cluster_role(manifest()).unwrap();
    for (verb, group, resource) in [
        ("create", "", "services"),
        ("get", "", "services"),
        ("update", "", "services"),
        ("delete", "discovery.k8s.io", "endpointslices"),
        ("patch", "", "nodes"),
        ("update", "", "nodes/status"),
        ("get", "", "secrets"),
        ("list", "", "secrets"),
        ("list", "", "endpoints"),
        ("list", "", "endpointslices"), // the right resource in the wrong group
        ("list", "discovery.k8s.io", "services"),
        ("watch", "", "pods"),
        ("create", "", "events"),
        ("list", "events.k8s.io", "events"),
        ("delete", "events.k8s.io", "events"),
    ] {
        assert!(
            !rbac_allows(&role, verb, group, resource),
            "{verb} {resource} (group {group:?}) is allowed"
        );
    }

    // Every (group, resource, verb) any rule names is one the agent needs: no wildcards, no
    // other resource or verb, nothing limited to names, no non-resource URLs.
    let rules = role["rules"]
        .as_sequence()
        .expect("the ClusterRole has rules");
    let mut extra = Vec::new();
    for rule in rules {
        for field in ["resourceNames", "nonResourceURLs"] {
            if rule.get(field).is_some() {
                extra.push(format!("{field} in {rule:?}"));
            }
        }
        for group in strings(rule, "apiGroups") {
            for resource in strings(rule, "resources") {
                for verb in strings(rule, "verbs") {
                    let watched = WATCHED.contains(&(group, resource)) && VERBS.contains(&verb);
                    let posted = POSTED == (group, resource) && POST_VERBS.contains(&verb);
                    if !(watched || posted) {
                        extra.push(format!("{verb} {resource} (group {group:?})"));
                    }
                }
            }
        }
    }
    assert!(extra.is_empty(), "the ClusterRole grants more: {extra:#?}");
    assert!(
        role.get("aggregationRule").is_none(),
        "aggregated ClusterRole"
    );
}

/// The role is what the DaemonSet's pods get: bound to the ServiceAccount they run as.
#[test]
fn cluster_role_is_bound_to_the_daemonsets_service_account() {
    let text = std::fs::read_to_string(manifest()).unwrap();
    let documents: Vec<Value> = yaml_documents(&text)
        .iter()
        .map(|d| serde_yaml::from_str(d).unwrap())
        .collect();
    let find = |kind: &str| {
        let found: Vec<&Value> = documents.iter().filter(|d| d["kind"] == kind).collect();
        assert_eq!(found.len(), 1, "expected one {kind}");
        found[0]
    };
    let (account, binding, daemonset) = (
        find("ServiceAccount"),
        find("ClusterRoleBinding"),
        find("DaemonSet"),
    );
    let role = load_cluster_role(manifest()).unwrap();
    let (name, namespace) = (
        account["metadata"]["name"].as_str().unwrap(),
        account["metadata"]["namespace"].as_str().unwrap(),
    );
    assert_eq!(binding["roleRef"]["kind"], "ClusterRole");
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    let subjects = binding["subjects"].as_sequence().unwrap();
    assert!(
        subjects.iter().any(|s| s["kind"] == "ServiceAccount"
            && s["name"] == name
            && s["namespace"] == namespace),
        "the binding's subjects {subjects:?} do not include {namespace}/{name}"
    );
    assert_eq!(daemonset["metadata"]["namespace"], namespace);
    assert_eq!(
        daemonset["spec"]["template"]["spec"]["serviceAccountName"],
        name
    );
}

/// `rbac_allows` itself, on rules the manifest does not have: wildcards and names.
#[test]
fn rbac_allows_evaluates_wildcards_and_names() {
    let role: Value = serde_yaml::from_str(
        r#"
        kind: ClusterRole
        rules:
          - apiGroups: ["*"]
            resources: ["pods"]
            verbs: ["get"]
          - apiGroups: [""]
            resources: ["*"]
            verbs: ["list"]
          - apiGroups: ["apps"]
            resources: ["deployments"]
            verbs: ["*"]
          - apiGroups: [""]
            resources: ["secrets"]
            resourceNames: ["one"]
            verbs: ["watch"]
          - nonResourceURLs: ["/healthz"]
            verbs: ["get"]
        "#,
    )
    .unwrap();
    assert!(rbac_allows(&role, "get", "", "pods"));
    assert!(rbac_allows(&role, "get", "batch", "pods"));
    assert!(!rbac_allows(&role, "list", "batch", "pods"));
    assert!(rbac_allows(&role, "list", "", "configmaps"));
    assert!(!rbac_allows(&role, "list", "apps", "configmaps"));
    assert!(rbac_allows(&role, "delete", "apps", "deployments"));
    assert!(!rbac_allows(&role, "delete", "apps", "daemonsets"));
    assert!(!rbac_allows(&role, "watch", "", "secrets"));
    assert!(!rbac_allows(&role, "get", "", "/healthz"));
    assert!(!rbac_allows(
        &serde_yaml::from_str("kind: ClusterRole").unwrap(),
        "get",
        "",
        "pods"
    ));
}

#[test]
fn yaml_documents_splits_on_markers_only() {
    let docs = yaml_documents(
        "# header\n---\na: 1\n--- # two\nb: |\n  ---x\n  text\n...\nc: 3\n---\n# only a comment\n",
    );
    assert_eq!(docs, ["a: 1\n", "# two\nb: |\n  ---x\n  text\n", "c: 3\n"]);
}

fn strings<'a>(rule: &'a Value, field: &str) -> Vec<&'a str> {
    rule.get(field)
        .and_then(Value::as_sequence)
        .map(|items| items.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

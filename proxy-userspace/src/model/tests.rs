//! The tracker fed through the API reduction: what reaches the desired state.
use std::{
    net::IpAddr,
    sync::Arc,
    time::{Duration, SystemTime},
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use super::*;
use crate::kubernetes::*;
use crate::one_or_many::OneOrMany;

fn service(yaml: &str) -> Service {
    serde_yaml::from_str(yaml).expect("test Service must deserialize")
}

fn slice(yaml: &str) -> EndpointSlice {
    serde_yaml::from_str(yaml).expect("test EndpointSlice must deserialize")
}

impl ChangeTracker {
    fn upsert_node_zone(&mut self, name: &str, zone: Option<&str>) {
        let info = NodeInfo {
            zone: zone.map(String::from),
            addresses: Vec::new(),
        };
        self.upsert_node(name, &info);
    }
}

fn nn(ns: &str, name: &str) -> NamespacedName {
    NamespacedName::new(ns, name)
}

fn spn(name: &str, port: &str, protocol: Protocol) -> ServicePortName {
    ServicePortName::new(nn("default", name), port, protocol)
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

const WEB: &str = "
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.10
  ports:
  - {name: http, port: 80, targetPort: http}
  - {name: metrics, port: 9090, protocol: TCP, targetPort: 9091}
";

/// A slice of default/`service` with port "http" 8080/TCP; `endpoints` is YAML for its
/// endpoints list.
fn slice_of(service: &str, name: &str, address_type: &str, endpoints: &str) -> EndpointSlice {
    slice(&format!(
        "
metadata:
  name: {name}
  namespace: default
  labels: {{kubernetes.io/service-name: {service}}}
addressType: {address_type}
ports:
- {{name: http, port: 8080, protocol: TCP}}
endpoints: {endpoints}
"
    ))
}

fn web_slice(name: &str, ips: &[&str]) -> EndpointSlice {
    let endpoints: Vec<String> = ips
        .iter()
        .map(|ip| format!("{{addresses: [\"{ip}\"]}}"))
        .collect();
    slice_of("web", name, "IPv4", &format!("[{}]", endpoints.join(", ")))
}

fn applied(tracker: &mut ChangeTracker, state: &mut DesiredState) -> Vec<String> {
    tracker
        .apply(state)
        .iter()
        .map(ToString::to_string)
        .collect()
}

fn endpoint_ips(state: &DesiredState, spn: &ServicePortName) -> Vec<String> {
    state
        .endpoints_of(spn)
        .iter()
        .map(|ep| format!("{}:{}", ep.ip, ep.port))
        .collect()
}

/// `web_slice` with a last-change-trigger-time annotation.
fn triggered_slice(name: &str, ips: &[&str], at: SystemTime) -> EndpointSlice {
    let mut slice = web_slice(name, ips);
    let at = k8s_openapi::jiff::Timestamp::try_from(at).unwrap();
    slice.metadata.annotations =
        Some([(LAST_CHANGE_TRIGGER_TIME.to_string(), at.to_string())].into());
    slice
}

#[test]
fn trigger_times_of_applied_slice_changes_are_handed_out_once() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    let now = SystemTime::now();
    let later = now + Duration::from_secs(1);
    // Before the tracker started (a slice listed at start): not counted.
    let old = now - Duration::from_secs(3600);
    tracker
        .update_slice(&triggered_slice("web-1", &["10.244.1.11"], old))
        .unwrap();
    tracker.apply(&mut state);
    assert!(tracker.take_trigger_times().is_empty());

    tracker
        .update_slice(&triggered_slice("web-1", &["10.244.1.12"], now))
        .unwrap();
    tracker
        .update_slice(&triggered_slice("web-2", &["10.244.1.13"], later))
        .unwrap();
    // Not applied yet: kept for the sync that will take the change.
    assert!(tracker.take_trigger_times().is_empty());
    tracker.apply(&mut state);
    let mut taken = tracker.take_trigger_times();
    taken.sort();
    // The annotation has second precision here (RFC 3339 as the controller writes it).
    let secs = |t: &SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs();
    assert_eq!(
        taken.iter().map(secs).collect::<Vec<_>>(),
        [secs(&now), secs(&later)]
    );
    assert!(tracker.take_trigger_times().is_empty(), "handed out twice");

    // A change undone before it was applied programs nothing: no latency to report.
    tracker
        .update_slice(&triggered_slice("web-2", &["10.244.1.14"], later))
        .unwrap();
    tracker
        .update_slice(&triggered_slice("web-2", &["10.244.1.13"], later))
        .unwrap();
    tracker.apply(&mut state);
    assert!(tracker.take_trigger_times().is_empty());
    // A slice without the annotation (or with a malformed one) has none.
    let mut bad = web_slice("web-2", &["10.244.1.15"]);
    bad.metadata.annotations = Some(
        [(
            LAST_CHANGE_TRIGGER_TIME.to_string(),
            "yesterday".to_string(),
        )]
        .into(),
    );
    tracker.update_slice(&bad).unwrap();
    tracker.apply(&mut state);
    assert!(tracker.take_trigger_times().is_empty());
}

#[test]
fn display() {
    assert_eq!(
        spn("web", "http", Protocol::Tcp).to_string(),
        "default/web:http"
    );
    assert_eq!(spn("web", "", Protocol::Udp).to_string(), "default/web");
    assert_eq!(Protocol::Sctp.to_string(), "SCTP");
    assert_eq!(Protocol::Udp.number(), 17);
}

#[test]
fn add_update_delete_service() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    tracker.update_service(&service(WEB)).unwrap();
    assert!(tracker.has_pending());
    assert_eq!(
        applied(&mut tracker, &mut state),
        ["default/web:http", "default/web:metrics"]
    );
    assert!(!tracker.has_pending());
    let http = &state.services[&spn("web", "http", Protocol::Tcp)];
    assert_eq!(*http.cluster_ips, [ip("10.96.0.10")]);
    assert_eq!(http.port, 80);
    assert_eq!(http.target_port, TargetPort::Name("http".into()));
    assert_eq!(http.session_affinity_timeout, None);
    let metrics = &state.services[&spn("web", "metrics", Protocol::Tcp)];
    assert_eq!(metrics.target_port, TargetPort::Number(9091));

    // Changing one port reports only that port.
    tracker
        .update_service(&service(&WEB.replace("port: 9090", "port: 9100")))
        .unwrap();
    assert_eq!(applied(&mut tracker, &mut state), ["default/web:metrics"]);
    assert_eq!(
        state.services[&spn("web", "metrics", Protocol::Tcp)].port,
        9100
    );

    tracker.delete_service(&nn("default", "web"));
    assert_eq!(
        applied(&mut tracker, &mut state),
        ["default/web:http", "default/web:metrics"]
    );
    assert_eq!(state, DesiredState::default());
    // Deleting what is not there is no change.
    tracker.delete_service(&nn("default", "web"));
    assert!(!tracker.has_pending());
}

/// kube-proxy's change counts: every Service event, pending until applied; EndpointSlices
/// only where proxied (kube-proxy's informers never see the others).
#[test]
fn change_counts() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    tracker.update_service(&service(WEB)).unwrap();
    tracker
        .update_service(&service(&WEB.replace("port: 9090", "port: 9100")))
        .unwrap();
    tracker
        .update_slice(&web_slice("web-1", &["10.244.1.11"]))
        .unwrap();
    assert_eq!(tracker.change_counts(), [(2, 1), (1, 1)]);
    tracker.apply(&mut state);
    assert_eq!(tracker.change_counts(), [(2, 0), (1, 0)]);
    let mut headless = web_slice("web-2", &["10.244.1.12"]);
    let labels = headless.metadata.labels.get_or_insert_default();
    labels.insert(HEADLESS_LABEL.into(), String::new());
    tracker.update_slice(&headless).unwrap();
    tracker.delete_slice(&nn("default", "never-seen"));
    assert_eq!(tracker.change_counts(), [(2, 0), (1, 0)]);
    tracker.delete_slice(&nn("default", "web-1"));
    assert_eq!(tracker.change_counts(), [(2, 0), (2, 1)]);
}

#[test]
fn service_fields() {
    let svc = service(
        "
metadata: {name: lb, namespace: default}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.5
  clusterIPs: [10.96.0.5, 'fd00::5']
  externalIPs: [192.0.2.50]
  externalTrafficPolicy: Local
  internalTrafficPolicy: Local
  sessionAffinity: ClientIP
  ports:
  - {port: 53, protocol: UDP, nodePort: 30053}
status:
  loadBalancer:
    ingress:
    - {ip: 203.0.113.7}
    - {hostname: lb.example.com}
    - {ip: 203.0.113.8, ipMode: VIP}
    - {ip: 203.0.113.9, ipMode: Proxy}
",
    );
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    tracker.update_service(&svc).unwrap();
    tracker.apply(&mut state);
    let port = &state.services[&spn("lb", "", Protocol::Udp)];
    assert_eq!(*port.cluster_ips, [ip("10.96.0.5"), ip("fd00::5")]);
    assert_eq!(port.target_port, TargetPort::Number(53));
    assert_eq!(port.node_port, Some(30053));
    assert_eq!(*port.external_ips, [ip("192.0.2.50")]);
    // An ingress the load balancer proxies (ipMode Proxy, KEP-1860) is not the node's to
    // serve: its traffic arrives addressed to the node, as kube-proxy and Cilium leave it.
    assert_eq!(
        *port.load_balancer_ips,
        [ip("203.0.113.7"), ip("203.0.113.8")]
    );
    assert_eq!(
        port.session_affinity_timeout,
        std::num::NonZeroU32::new(DEFAULT_AFFINITY_TIMEOUT)
    );
    assert!(port.external_traffic_local);
    assert!(port.internal_traffic_local);

    // externalTrafficPolicy means nothing for a service nothing outside can reach.
    let cluster_only = service(
        "
metadata: {name: internal, namespace: default}
spec: {clusterIP: 10.96.0.6, externalTrafficPolicy: Local, ports: [{port: 80}]}
",
    );
    tracker.update_service(&cluster_only).unwrap();
    tracker.apply(&mut state);
    assert!(!state.services[&spn("internal", "", Protocol::Tcp)].external_traffic_local);
}

#[test]
fn cancelling_changes_are_dropped() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    tracker.update_service(&service(WEB)).unwrap();
    tracker
        .update_slice(&web_slice("web-1", &["10.244.1.11"]))
        .unwrap();
    tracker.apply(&mut state);

    // A -> B -> A.
    tracker
        .update_service(&service(&WEB.replace("10.96.0.10", "10.96.0.11")))
        .unwrap();
    tracker
        .update_slice(&web_slice("web-1", &["10.244.1.12"]))
        .unwrap();
    assert!(tracker.has_pending());
    tracker.update_service(&service(WEB)).unwrap();
    tracker
        .update_slice(&web_slice("web-1", &["10.244.1.11"]))
        .unwrap();
    assert!(!tracker.has_pending());
    assert!(tracker.apply(&mut state).is_empty());

    // Add then delete before any apply.
    tracker
        .update_slice(&web_slice("web-2", &["10.244.1.13"]))
        .unwrap();
    tracker.delete_slice(&nn("default", "web-2"));
    assert!(!tracker.has_pending());

    // An endpoint moving between slices changes no port.
    tracker
        .update_slice(&web_slice("web-2", &["10.244.1.11"]))
        .unwrap();
    tracker.delete_slice(&nn("default", "web-1"));
    assert!(tracker.has_pending());
    assert!(tracker.apply(&mut state).is_empty());
    assert_eq!(
        endpoint_ips(&state, &spn("web", "http", Protocol::Tcp)),
        ["10.244.1.11:8080"]
    );
}

#[test]
fn services_that_are_not_proxied() {
    let cases = [
        ("headless", "spec: {clusterIP: None, ports: [{port: 80}]}"),
        ("no-ip", "spec: {ports: [{port: 80}]}"),
        (
            "alias",
            "spec: {type: ExternalName, externalName: example.com, ports: [{port: 80}]}",
        ),
        (
            "other-proxy",
            "  labels: {service.kubernetes.io/service-proxy-name: foo}\nspec: {clusterIP: 10.96.0.9, ports: [{port: 80}]}",
        ),
    ];
    for (name, rest) in cases {
        let svc = service(&format!(
            "metadata:\n  name: {name}\n  namespace: default\n{rest}"
        ));
        assert!(service_skip_reason(&svc).is_some(), "{name}");
        let mut tracker = ChangeTracker::new();
        tracker.update_service(&svc).unwrap();
        assert!(!tracker.has_pending(), "{name} must not be proxied");
    }

    // A proxied service that becomes headless is removed.
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    tracker.update_service(&service(WEB)).unwrap();
    tracker.apply(&mut state);
    tracker
        .update_service(&service(&WEB.replace("10.96.0.10", "None")))
        .unwrap();
    assert_eq!(applied(&mut tracker, &mut state).len(), 2);
    assert!(state.services.is_empty());
}

#[test]
fn slices_are_merged_and_deduplicated() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    tracker.update_service(&service(WEB)).unwrap();
    tracker.apply(&mut state);
    tracker
        .update_slice(&web_slice("web-1", &["10.244.1.12", "10.244.1.11"]))
        .unwrap();
    tracker
        .update_slice(&web_slice("web-2", &["10.244.1.11", "10.244.2.11"]))
        .unwrap();
    assert_eq!(applied(&mut tracker, &mut state), ["default/web:http"]);
    let http = spn("web", "http", Protocol::Tcp);
    assert_eq!(
        endpoint_ips(&state, &http),
        ["10.244.1.11:8080", "10.244.1.12:8080", "10.244.2.11:8080"]
    );
    assert_eq!(state.ready_endpoints(&http).count(), 3);
    // "metrics" has no slice port of that name, so no endpoints.
    assert!(
        state
            .endpoints_of(&spn("web", "metrics", Protocol::Tcp))
            .is_empty()
    );

    // Removing one copy of the duplicate keeps the endpoint.
    tracker
        .update_slice(&web_slice("web-1", &["10.244.1.12"]))
        .unwrap();
    assert!(tracker.apply(&mut state).is_empty());
    tracker.delete_slice(&nn("default", "web-2"));
    assert_eq!(applied(&mut tracker, &mut state), ["default/web:http"]);
    assert_eq!(endpoint_ips(&state, &http), ["10.244.1.12:8080"]);
}

#[test]
fn duplicate_prefers_the_ready_copy() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    tracker.update_service(&service(WEB)).unwrap();
    let not_ready = "[{addresses: [10.244.1.11], conditions: {ready: false}}]";
    tracker
        .update_slice(&slice_of("web", "web-1", "IPv4", not_ready))
        .unwrap();
    tracker
        .update_slice(&web_slice("web-2", &["10.244.1.11"]))
        .unwrap();
    tracker.apply(&mut state);
    let eps = state.endpoints_of(&spn("web", "http", Protocol::Tcp));
    assert_eq!(eps.len(), 1);
    assert!(eps[0].ready);
}

#[test]
fn slices_before_their_service() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    tracker
        .update_slice(&web_slice("web-1", &["10.244.1.11"]))
        .unwrap();
    assert!(tracker.apply(&mut state).is_empty());
    assert!(state.endpoints.is_empty());
    tracker.update_service(&service(WEB)).unwrap();
    assert_eq!(
        applied(&mut tracker, &mut state),
        ["default/web:http", "default/web:metrics"]
    );
    assert_eq!(
        endpoint_ips(&state, &spn("web", "http", Protocol::Tcp)),
        ["10.244.1.11:8080"]
    );
    // Deleting the service removes its endpoints from the state but not from the tracker.
    tracker.delete_service(&nn("default", "web"));
    tracker.apply(&mut state);
    assert_eq!(state, DesiredState::default());
    tracker.update_service(&service(WEB)).unwrap();
    tracker.apply(&mut state);
    assert_eq!(state.endpoints.len(), 1);
}

#[test]
fn slice_changes_owner() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    tracker.update_service(&service(WEB)).unwrap();
    tracker
        .update_service(&service(
            &WEB.replace("name: web", "name: api")
                .replace("10.96.0.10", "10.96.0.11"),
        ))
        .unwrap();
    tracker
        .update_slice(&web_slice("shared", &["10.244.1.11"]))
        .unwrap();
    tracker.apply(&mut state);
    assert_eq!(state.endpoints.len(), 1);

    let relabelled = slice_of("api", "shared", "IPv4", "[{addresses: [10.244.1.11]}]");
    tracker.update_slice(&relabelled).unwrap();
    assert_eq!(
        applied(&mut tracker, &mut state),
        ["default/api:http", "default/web:http"]
    );
    assert_eq!(
        endpoint_ips(&state, &spn("api", "http", Protocol::Tcp)),
        ["10.244.1.11:8080"]
    );
    assert!(
        state
            .endpoints_of(&spn("web", "http", Protocol::Tcp))
            .is_empty()
    );

    // Deleting it now affects the new owner only.
    tracker.delete_slice(&nn("default", "shared"));
    assert_eq!(applied(&mut tracker, &mut state), ["default/api:http"]);
    assert!(state.endpoints.is_empty());
}

#[test]
fn unnamed_slice_ports_match_only_the_unnamed_service_port() {
    // As kube-proxy: slice ports match service ports by name, and "" (or no name) is a name.
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    let single = "
metadata: {name: single, namespace: default}
spec: {clusterIP: 10.96.0.30, ports: [{port: 80, targetPort: 8080}]}
";
    tracker.update_service(&service(single)).unwrap();
    tracker.update_service(&service(WEB)).unwrap();
    for owner in ["single", "web"] {
        tracker
            .update_slice(&slice(&format!(
                "
metadata: {{name: {owner}-1, namespace: default, labels: {{kubernetes.io/service-name: {owner}}}}}
addressType: IPv4
ports:
- {{port: 8080}}
- {{name: '', port: 8081, protocol: UDP}}
- {{name: http, port: 8082}}
endpoints: [{{addresses: [10.244.1.11]}}]
"
            )))
            .unwrap();
    }
    tracker.apply(&mut state);
    assert_eq!(
        endpoint_ips(&state, &spn("single", "", Protocol::Tcp)),
        ["10.244.1.11:8080"]
    );
    // The unnamed slice ports lend no endpoints to the named ports of "web".
    assert_eq!(
        endpoint_ips(&state, &spn("web", "http", Protocol::Tcp)),
        ["10.244.1.11:8082"]
    );
    assert_eq!(state.endpoints.len(), 2, "{:?}", state.endpoints.keys());
}

#[test]
fn named_ports_resolve_per_slice() {
    // Two pod versions name the same port differently numbered: each slice carries its own.
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    tracker
        .update_service(&service(
            "
metadata: {name: dns, namespace: default}
spec:
  clusterIP: 10.96.0.20
  ports:
  - {name: dns, port: 53, protocol: UDP, targetPort: dns}
  - {name: dns-tcp, port: 53, protocol: TCP, targetPort: dns-tcp}
",
        ))
        .unwrap();
    for (name, ip, port) in [("v1", "10.244.1.11", 5353), ("v2", "10.244.1.12", 8053)] {
        tracker
            .update_slice(&slice(&format!(
                "
metadata: {{name: dns-{name}, namespace: default, labels: {{kubernetes.io/service-name: dns}}}}
addressType: IPv4
ports:
- {{name: dns, port: {port}, protocol: UDP}}
- {{name: dns-tcp, port: {port}, protocol: TCP}}
- {{name: dns, port: 1, protocol: TCP}}
endpoints: [{{addresses: [{ip}]}}]
"
            )))
            .unwrap();
    }
    tracker.apply(&mut state);
    let udp = spn("dns", "dns", Protocol::Udp);
    assert_eq!(
        endpoint_ips(&state, &udp),
        ["10.244.1.11:5353", "10.244.1.12:8053"]
    );
    // The TCP port named "dns" matches no service port (wrong protocol) and is ignored.
    assert_eq!(
        endpoint_ips(&state, &spn("dns", "dns-tcp", Protocol::Tcp)),
        ["10.244.1.11:5353", "10.244.1.12:8053"]
    );
    assert_eq!(state.endpoints.len(), 2);
}

#[test]
fn invalid_objects_keep_the_previous_version() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    tracker.update_service(&service(WEB)).unwrap();
    tracker
        .update_slice(&web_slice("web-1", &["10.244.1.11"]))
        .unwrap();
    tracker.apply(&mut state);
    let before = state.clone();

    let bad_services = [
        (
            WEB.replace("port: 9090", "port: 0"),
            r#"Service default/web: spec.ports[1] ("metrics"): port 0 is not in 1..=65535"#,
        ),
        (
            WEB.replace("10.96.0.10", "10.96.0.300"),
            r#"Service default/web: spec.clusterIP: "10.96.0.300" is not an IP address"#,
        ),
        (
            WEB.replace("protocol: TCP", "protocol: tcp"),
            r#"Service default/web: spec.ports[1] ("metrics"): protocol "tcp" is not TCP, UDP or SCTP"#,
        ),
        (
            WEB.replace("targetPort: 9091", "targetPort: '9091'"),
            r#"Service default/web: spec.ports[1] ("metrics"): targetPort "9091" is a string; write the number without quotes, or use a port name"#,
        ),
        (
            WEB.replace("name: web, ", ""),
            "Service default/<no name>: metadata.name is missing",
        ),
        (
            WEB.replace(", namespace: default", ""),
            "Service /web: metadata.namespace is missing",
        ),
    ];
    for (yaml, message) in bad_services {
        let err = tracker.update_service(&service(&yaml)).unwrap_err();
        assert_eq!(err.to_string(), message);
    }

    let good = "
metadata:
  name: web-1
  namespace: default
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints: [{addresses: ['10.244.1.11']}]
";
    let bad_slices = [
        (
            good.replace("port: 8080", "port: 70000"),
            "EndpointSlice default/web-1: ports[0]: port 70000 is not in 1..=65535",
        ),
        (
            good.replace("kubernetes.io/service-name", "app"),
            "EndpointSlice default/web-1: metadata.labels has no kubernetes.io/service-name, so it belongs to no Service",
        ),
        (
            good.replace("IPv4", "IPv5"),
            r#"EndpointSlice default/web-1: addressType "IPv5" is not IPv4, IPv6 or FQDN"#,
        ),
    ];
    for (yaml, message) in bad_slices {
        let err = tracker.update_slice(&slice(&yaml)).unwrap_err();
        assert_eq!(err.to_string(), message);
    }
    assert!(!tracker.has_pending());
    assert!(tracker.apply(&mut state).is_empty());
    assert_eq!(state, before);
}

#[test]
fn a_bad_endpoint_skips_only_itself() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    tracker.update_service(&service(WEB)).unwrap();
    tracker.apply(&mut state);
    let endpoints = |extra: &str| {
        format!(
            "[{{addresses: [10.244.1.11]}}, {{addresses: ['10.244.1.x']}}, {{addresses: ['fd00::1']}}, {{addresses: []}}{extra}]"
        )
    };
    let bad = slice_of("web", "web-1", "IPv4", &endpoints(""));
    let skipped: Vec<String> = tracker
        .update_slice(&bad)
        .unwrap()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        skipped,
        [
            r#"EndpointSlice default/web-1: endpoints[1].addresses[0]: "10.244.1.x" is not an IP address; this endpoint is skipped"#,
            "EndpointSlice default/web-1: endpoints[2].addresses[0]: fd00::1 does not match addressType IPv4; this endpoint is skipped",
            "EndpointSlice default/web-1: endpoints[3]: addresses is empty; this endpoint is skipped",
        ]
    );
    assert_eq!(applied(&mut tracker, &mut state), ["default/web:http"]);
    let http = spn("web", "http", Protocol::Tcp);
    assert_eq!(endpoint_ips(&state, &http), ["10.244.1.11:8080"]);

    // Reported once: the same slice again (a re-list, a resync) reports nothing, and neither
    // does a change that adds no new problem.
    assert!(tracker.update_slice(&bad).unwrap().is_empty());
    assert!(tracker.apply(&mut state).is_empty());
    let grown = slice_of(
        "web",
        "web-1",
        "IPv4",
        &endpoints(", {addresses: [10.244.1.12]}"),
    );
    assert!(tracker.update_slice(&grown).unwrap().is_empty());
    assert_eq!(applied(&mut tracker, &mut state), ["default/web:http"]);
    assert_eq!(
        endpoint_ips(&state, &http),
        ["10.244.1.11:8080", "10.244.1.12:8080"]
    );

    // A slice deleted and added again is new: its problems are reported again.
    tracker.delete_slice(&nn("default", "web-1"));
    assert_eq!(tracker.update_slice(&bad).unwrap().len(), 3);
}

#[test]
fn condition_defaults() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    tracker.update_service(&service(WEB)).unwrap();
    tracker
        .update_slice(&slice(
            "
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- addresses: [10.244.1.11]
  nodeName: node1
  zone: zone-a
- addresses: [10.244.1.12]
  conditions: {ready: false}
- addresses: [10.244.1.13]
  conditions: {ready: false, serving: true, terminating: true}
- addresses: [10.244.1.14]
  conditions: {serving: false}
",
        ))
        .unwrap();
    tracker.apply(&mut state);
    let http = spn("web", "http", Protocol::Tcp);
    let eps = state.endpoints_of(&http);
    assert_eq!(
        eps[0],
        Endpoint {
            ip: ip("10.244.1.11"),
            port: 8080,
            ready: true,
            serving: true,
            terminating: false,
            placement: Placement::shared(Some("node1"), None),
        }
    );
    // As kube-proxy reads them: an unset serving is true whatever ready says.
    assert_eq!(
        (eps[1].ready, eps[1].serving, eps[1].terminating),
        (false, true, false)
    );
    assert_eq!(
        (eps[2].ready, eps[2].serving, eps[2].terminating),
        (false, true, true)
    );
    assert_eq!(
        (eps[3].ready, eps[3].serving, eps[3].terminating),
        (true, false, false)
    );
    let ready: Vec<_> = state.ready_endpoints(&http).map(|ep| ep.ip).collect();
    assert_eq!(ready, [ip("10.244.1.11"), ip("10.244.1.14")]);
}

#[test]
fn ipv6_slices_are_kept_and_fqdn_ignored() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    tracker.update_service(&service(WEB)).unwrap();
    tracker
        .update_slice(&web_slice("web-v4", &["10.244.1.11"]))
        .unwrap();
    let v6 = slice_of(
        "web",
        "web-v6",
        "IPv6",
        "[{addresses: ['fd00:10:244:1::11']}]",
    );
    tracker.update_slice(&v6).unwrap();
    let fqdn = slice_of(
        "web",
        "web-fqdn",
        "FQDN",
        "[{addresses: [web.example.com]}]",
    );
    tracker.update_slice(&fqdn).unwrap();
    tracker.apply(&mut state);
    assert_eq!(
        endpoint_ips(&state, &spn("web", "http", Protocol::Tcp)),
        ["10.244.1.11:8080", "fd00:10:244:1::11:8080"]
    );
}

#[test]
fn headless_slices_are_ignored() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    tracker.update_service(&service(WEB)).unwrap();
    tracker
        .update_slice(&web_slice("web-1", &["10.244.1.11"]))
        .unwrap();
    tracker.apply(&mut state);
    let headless = slice(
        "
metadata:
  name: web-1
  namespace: default
  labels: {kubernetes.io/service-name: web, service.kubernetes.io/headless: ''}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints: [{addresses: [10.244.1.11]}]
",
    );
    tracker.update_slice(&headless).unwrap();
    assert_eq!(applied(&mut tracker, &mut state), ["default/web:http"]);
    assert!(state.endpoints.is_empty());
}

#[test]
fn apply_repairs_a_fresh_state() {
    // apply diffs against the state it is given, so a rebuilt state gets everything changed.
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    tracker.update_service(&service(WEB)).unwrap();
    tracker.apply(&mut state);
    state.services.insert(
        spn("web", "stale", Protocol::Tcp),
        state.services[&spn("web", "http", Protocol::Tcp)].clone(),
    );
    tracker
        .update_service(&service(&WEB.replace("port: 9090", "port: 9100")))
        .unwrap();
    assert_eq!(
        applied(&mut tracker, &mut state),
        ["default/web:metrics", "default/web:stale"]
    );
    assert_eq!(state.services.len(), 2);
}

#[test]
fn cluster_endpoints_fall_back_to_terminating_and_follow_the_internal_policy() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::new("node1");
    tracker.update_service(&service(WEB)).unwrap();
    let web_slice = |conditions: [&str; 3]| {
        slice(&format!(
            "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: default
  labels: {{kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints:
- {{addresses: [10.244.1.11], nodeName: node1, conditions: {}}}
- {{addresses: [10.244.2.11], nodeName: node2, conditions: {}}}
- {{addresses: [10.244.2.12], nodeName: node2, conditions: {}}}
",
            conditions[0], conditions[1], conditions[2]
        ))
    };
    let http = spn("web", "http", Protocol::Tcp);
    let ips = |state: &DesiredState| -> Vec<String> {
        state
            .cluster_endpoints(&http)
            .iter()
            .map(|ep| ep.ip.to_string())
            .collect()
    };
    const READY: &str = "{ready: true}";
    const TERMINATING: &str = "{ready: false, serving: true, terminating: true}";
    const GONE: &str = "{ready: false, serving: false, terminating: true}";
    // Ready endpoints win over terminating ones.
    tracker
        .update_slice(&web_slice([TERMINATING, READY, GONE]))
        .unwrap();
    tracker.apply(&mut state);
    assert_eq!(ips(&state), ["10.244.2.11"]);
    // None ready: the serving terminating ones.
    tracker
        .update_slice(&web_slice([TERMINATING, GONE, TERMINATING]))
        .unwrap();
    tracker.apply(&mut state);
    assert_eq!(ips(&state), ["10.244.1.11", "10.244.2.12"]);
    // internalTrafficPolicy: Local: this node's only, with the same fallback.
    let local = |state: &mut DesiredState| {
        Arc::make_mut(state.services.get_mut(&http).unwrap()).internal_traffic_local = true;
    };
    local(&mut state);
    assert_eq!(ips(&state), ["10.244.1.11"]);
    tracker
        .update_slice(&web_slice([GONE, READY, READY]))
        .unwrap();
    tracker.apply(&mut state);
    local(&mut state);
    assert!(ips(&state).is_empty(), "no usable local endpoint");
}

#[test]
fn updates_keep_only_what_reaches_the_state() {
    // A source compares updates to see whether an object changed: a label, an annotation or
    // a pod reference does not count; a port or a condition does.
    let base = ReducedService::parse(&service(WEB)).unwrap();
    let labelled = WEB.replace(
        "name: web, namespace: default",
        "name: web, namespace: default, labels: {app: web}, annotations: {a: b}",
    );
    assert_eq!(ReducedService::parse(&service(&labelled)).unwrap(), base);
    let moved = WEB.replace("port: 9090", "port: 9100");
    assert_ne!(ReducedService::parse(&service(&moved)).unwrap(), base);
    let headless = ReducedService::parse(&service(&WEB.replace("10.96.0.10", "None"))).unwrap();
    assert_eq!(
        headless.skip_reason,
        Some("it is headless (clusterIP: None)")
    );
    assert_ne!(headless, base);

    let endpoints = |extra: &str| format!("[{{addresses: [10.244.1.11], nodeName: node1{extra}}}]");
    let base = ReducedSlice::parse(&slice_of("web", "web-1", "IPv4", &endpoints(""))).unwrap();
    let pod = ", targetRef: {kind: Pod, name: web-abc}, hostname: web-abc";
    let same = slice_of("web", "web-1", "IPv4", &endpoints(pod));
    assert_eq!(ReducedSlice::parse(&same).unwrap(), base);
    let not_ready = endpoints(", conditions: {ready: false}");
    let changed = slice_of("web", "web-1", "IPv4", &not_ready);
    assert_ne!(ReducedSlice::parse(&changed).unwrap(), base);

    // Applying an update is the same as applying the object.
    let mut by_object = ChangeTracker::new();
    let mut by_update = ChangeTracker::new();
    by_object.update_service(&service(WEB)).unwrap();
    by_object.update_slice(&changed).unwrap();
    by_update.upsert_service(&ReducedService::parse(&service(WEB)).unwrap());
    by_update.upsert_slice(&ReducedSlice::parse(&changed).unwrap());
    let (mut a, mut b) = (DesiredState::default(), DesiredState::default());
    assert_eq!(by_object.apply(&mut a), by_update.apply(&mut b));
    assert_eq!(a, b);
}

#[test]
fn names_are_shared_not_copied() {
    // The state's copies of a service's names and of an endpoint's node name point at the
    // tracker's strings: a large cluster holds each name once. Endpoints on one node with the
    // same hints share one placement, in any slice.
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    tracker.update_service(&service(WEB)).unwrap();
    for (name, a, b) in [("web-1", 11, 12), ("web-2", 13, 14)] {
        let endpoints = format!(
            "[{{addresses: [10.244.1.{a}], nodeName: node1}}, \
             {{addresses: [10.244.1.{b}], nodeName: node1, hints: {{forZones: [{{name: a}}]}}}}]"
        );
        let slice = slice_of("web", name, "IPv4", &endpoints);
        tracker.update_slice(&slice).unwrap();
    }
    tracker.apply(&mut state);
    let (_, merged) = state.endpoints.first_key_value().unwrap();
    let placements: Vec<_> = merged
        .iter()
        .map(|ep| ep.placement.clone().unwrap())
        .collect();
    assert_eq!(placements.len(), 4);
    assert!(Arc::ptr_eq(&placements[0], &placements[2]));
    assert!(Arc::ptr_eq(&placements[1], &placements[3]));
    assert!(!Arc::ptr_eq(&placements[0], &placements[1]));
    let (spn, port) = state.services.first_key_value().unwrap();
    let (ep_spn, eps) = state.endpoints.first_key_value().unwrap();
    assert!(Arc::ptr_eq(&spn.service.name, &ep_spn.service.name));
    // A slice names its Service with the tracker's copy of the name, not its label's, and
    // holds its one port in place.
    let record = tracker.slice_record(&NamespacedName::new("default", "web-1"));
    let record = record.unwrap();
    assert!(Arc::ptr_eq(&record.service_name, &spn.service.name));
    assert!(matches!(record.ports, OneOrMany::One(_)));
    assert_eq!(std::mem::size_of::<ServicePortName>(), 8);
    assert_eq!(port.port, 80);
    // Its one cluster IP in place, and the port with the Arc's two counts still within one of
    // malloc's 128-byte chunks (120 bytes usable): 16 bytes more a port past it.
    assert!(matches!(port.cluster_ips, OneOrMany::One(_)));
    assert!(std::mem::size_of::<ServicePort>() + 16 <= 120);
    let again = state.clone();
    let placement = eps[0].placement.as_ref().unwrap();
    let copy = again.endpoints[ep_spn][0].placement.as_ref().unwrap();
    assert!(Arc::ptr_eq(placement, copy));
    assert_eq!(eps[0].node_name(), Some("node1"));
    assert_eq!(std::mem::size_of::<Endpoint>(), 32);
}

#[test]
fn the_first_apply_leaves_the_tables_no_growth_room() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    for i in 0..100 {
        let web = WEB.replace("name: web", &format!("name: web{i}"));
        tracker.update_service(&service(&web)).unwrap();
        let slice = slice_of(&format!("web{i}"), &format!("web{i}-1"), "IPv4", "[]");
        tracker.update_slice(&slice).unwrap();
    }
    assert!(tracker.spare_room() > 0);
    tracker.apply(&mut state);
    assert_eq!(state.port_count(), 200);
    assert_eq!(tracker.spare_room(), 0);
}

#[test]
fn a_ports_endpoints_are_shared_with_its_slice_not_copied() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    tracker.update_service(&service(WEB)).unwrap();
    let web_1 = |addresses: &str| {
        slice_of(
            "web",
            "web-1",
            "IPv4",
            &format!("[{{addresses: [{addresses}]}}]"),
        )
    };
    tracker.update_slice(&web_1("10.244.1.11")).unwrap();
    tracker.apply(&mut state);
    let web = spn("web", "http", Protocol::Tcp);
    let held = |state: &DesiredState| Arc::strong_count(&state.endpoints[&web]);
    assert_eq!(
        held(&state),
        2,
        "the tracker's slice and the state hold one copy"
    );

    // The same version again, or a change and back: still one copy.
    tracker.update_slice(&web_1("10.244.1.11")).unwrap();
    assert_eq!(held(&state), 2);
    tracker.update_slice(&web_1("10.244.1.12")).unwrap();
    tracker.update_slice(&web_1("10.244.1.11")).unwrap();
    assert_eq!(held(&state), 2);
    // A change applied, then back.
    tracker.update_slice(&web_1("10.244.1.12")).unwrap();
    tracker.apply(&mut state);
    tracker.update_slice(&web_1("10.244.1.11")).unwrap();
    tracker.apply(&mut state);
    assert_eq!(held(&state), 2);

    // Two slices: the port's endpoints are both slices', merged in order.
    let web_2 = slice_of("web", "web-2", "IPv4", "[{addresses: [10.244.1.10]}]");
    tracker.update_slice(&web_2).unwrap();
    tracker.apply(&mut state);
    let ips: Vec<String> = state
        .endpoints_of(&web)
        .iter()
        .map(|ep| ep.ip.to_string())
        .collect();
    assert_eq!(ips, ["10.244.1.10", "10.244.1.11"]);
    assert_eq!(held(&state), 1);
}

#[test]
fn nothing_is_kept_of_deleted_services_and_slices() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    let web_1 = |service: &str| slice_of(service, "web-1", "IPv4", "[{addresses: [10.244.1.11]}]");
    // Service first, then its slice; deleted in the same order, and the other way round.
    for slice_first in [false, true] {
        tracker.update_service(&service(WEB)).unwrap();
        tracker.update_slice(&web_1("web")).unwrap();
        tracker.apply(&mut state);
        if slice_first {
            tracker.delete_slice(&nn("default", "web-1"));
        }
        tracker.delete_service(&nn("default", "web"));
        tracker.delete_slice(&nn("default", "web-1"));
        tracker.apply(&mut state);
        assert_eq!(tracker.entries(), 0);
    }
    // A slice relabelled to another service leaves nothing under its first one.
    tracker.update_slice(&web_1("web")).unwrap();
    tracker.update_slice(&web_1("other")).unwrap();
    tracker.delete_slice(&nn("default", "web-1"));
    assert_eq!(tracker.entries(), 0);
    assert_eq!(state.port_count(), 0);
}

#[test]
fn shared_names_are_kept_once_and_dropped_unused() {
    let used = shared("test-node-used");
    assert!(Arc::ptr_eq(&used, &shared("test-node-used")));
    let unused = Arc::downgrade(&shared("test-node-unused"));
    for i in 0..5000 {
        shared(&format!("test-node-filler-{i}"));
    }
    assert!(unused.upgrade().is_none(), "an unused name is dropped");
    assert!(Arc::ptr_eq(&used, &shared("test-node-used")));
}

#[test]
fn a_fresh_state_is_built_as_incrementally() {
    let build = |seeded: bool| {
        let mut tracker = ChangeTracker::new();
        for i in 0..50 {
            let svc = WEB
                .replace("name: web", &format!("name: web{i}"))
                .replace("10.96.0.10", &format!("10.96.1.{i}"));
            tracker.update_service(&service(&svc)).unwrap();
            let endpoints = format!("[{{addresses: [10.244.1.{i}], nodeName: node{i}}}]");
            let slice = slice_of(&format!("web{i}"), &format!("web{i}-1"), "IPv4", &endpoints);
            tracker.update_slice(&slice).unwrap();
        }
        let mut state = DesiredState::default();
        // Another service's entry: the state is not fresh, so it is updated port by port.
        let seed = spn("seed", "", Protocol::Tcp);
        if seeded {
            state.endpoints.insert(seed.clone(), Arc::from([]));
        }
        let changed = tracker.apply(&mut state);
        state.endpoints.remove(&seed);
        (state, changed)
    };
    let (fresh, changed) = build(false);
    assert_eq!((fresh.services.len(), fresh.endpoints.len()), (100, 50));
    assert_eq!(changed.len(), 100);
    assert_eq!((fresh, changed), build(true));
}

/// Objects created before the API server tightened validation may hold `172.30.0.041`;
/// kube-proxy reads it as 172.30.0.41, and so the Service and its endpoints are served here
/// instead of refused (CIDRs likewise: `addr.rs`).
#[test]
fn addresses_with_leading_zeros_are_read_as_kube_proxy_reads_them() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::default();
    let web = WEB.replace("clusterIP: 10.96.0.10", "clusterIP: 10.96.000.010");
    tracker.update_service(&service(&web)).unwrap();
    tracker
        .update_slice(&web_slice("web-1", &["10.244.01.011"]))
        .unwrap();
    tracker.apply(&mut state);
    let http = spn("web", "http", Protocol::Tcp);
    assert_eq!(*state.services[&http].cluster_ips, [ip("10.96.0.10")]);
    assert_eq!(endpoint_ips(&state, &http), ["10.244.1.11:8080"]);
}

/// Topology-aware routing, as kube-proxy's `CategorizeEndpoints` reads hints: the ready
/// endpoints hinted for this node, else for this node's zone, when every ready one carries
/// hints of that kind and some are for here; never for internalTrafficPolicy Local or the
/// terminating fallback. The node's zone is its Node object's label; a change of it is a
/// change of every port.
#[test]
fn topology_hints_keep_traffic_in_the_node_or_zone() {
    let mut tracker = ChangeTracker::new();
    let mut state = DesiredState::new("node1");
    tracker.update_service(&service(WEB)).unwrap();
    let http = spn("web", "http", Protocol::Tcp);
    let set = |tracker: &mut ChangeTracker, endpoints: &str| {
        tracker
            .update_slice(&slice_of("web", "web-1", "IPv4", endpoints))
            .unwrap();
    };
    let cluster = |state: &DesiredState| -> Vec<String> {
        state
            .cluster_endpoints(&http)
            .iter()
            .map(|ep| ep.ip.to_string())
            .collect()
    };
    let zoned = "
- {addresses: [10.244.1.11], nodeName: node1, hints: {forZones: [{name: zone-a}]}}
- {addresses: [10.244.2.11], nodeName: node2, hints: {forZones: [{name: zone-b}]}}
- {addresses: [10.244.3.11], nodeName: node3, hints: {forZones: [{name: zone-a}, {name: zone-c}]}}";
    set(&mut tracker, zoned);
    tracker.apply(&mut state);
    let all = ["10.244.1.11", "10.244.2.11", "10.244.3.11"];
    assert_eq!(cluster(&state), all, "the node's zone is not known yet");
    tracker.upsert_node_zone("node2", Some("zone-b"));
    assert!(tracker.has_pending());
    assert!(
        applied(&mut tracker, &mut state).is_empty(),
        "another node's zone"
    );
    tracker.upsert_node_zone("node1", Some("zone-a"));
    assert_eq!(
        applied(&mut tracker, &mut state),
        ["default/web:http", "default/web:metrics"]
    );
    assert_eq!(cluster(&state), ["10.244.1.11", "10.244.3.11"]);
    // internalTrafficPolicy Local has no use for hints.
    Arc::make_mut(state.services.get_mut(&http).unwrap()).internal_traffic_local = true;
    assert_eq!(cluster(&state), ["10.244.1.11"]);
    Arc::make_mut(state.services.get_mut(&http).unwrap()).internal_traffic_local = false;
    // No endpoint for this zone, or one without hints: hints are ignored.
    tracker.upsert_node_zone("node1", Some("zone-d"));
    tracker.apply(&mut state);
    assert_eq!(cluster(&state), all);
    tracker.upsert_node_zone("node1", Some("zone-a"));
    set(
        &mut tracker,
        "
- {addresses: [10.244.1.11], hints: {forZones: [{name: zone-a}]}}
- {addresses: [10.244.2.11]}",
    );
    tracker.apply(&mut state);
    assert_eq!(cluster(&state), ["10.244.1.11", "10.244.2.11"]);
    // Node hints (PreferSameNode) come first.
    set(
        &mut tracker,
        "
- {addresses: [10.244.1.11], hints: {forZones: [{name: zone-a}], forNodes: [{name: node9}]}}
- {addresses: [10.244.1.12], hints: {forZones: [{name: zone-a}], forNodes: [{name: node1}]}}
- {addresses: [10.244.2.11], hints: {forZones: [{name: zone-b}], forNodes: [{name: node2}]}}",
    );
    tracker.apply(&mut state);
    assert_eq!(cluster(&state), ["10.244.1.12"]);
    // Only terminating endpoints: the fallback takes them all.
    set(
        &mut tracker,
        "
- {addresses: [10.244.1.11], conditions: {ready: false, serving: true, terminating: true}, hints: {forZones: [{name: zone-a}]}}
- {addresses: [10.244.2.11], conditions: {ready: false, serving: true, terminating: true}, hints: {forZones: [{name: zone-b}]}}",
    );
    tracker.apply(&mut state);
    assert_eq!(cluster(&state), ["10.244.1.11", "10.244.2.11"]);
    // The node's Node gone: its zone with it.
    tracker.delete_node("node1");
    set(&mut tracker, zoned);
    tracker.apply(&mut state);
    assert_eq!(cluster(&state), all);
}

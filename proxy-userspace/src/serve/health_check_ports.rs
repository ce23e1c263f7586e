//! kube-proxy's per-Service health checks (`pkg/proxy/healthcheck/service_health.go`): for
//! every Service of type LoadBalancer with `externalTrafficPolicy: Local`, an HTTP server on its
//! `spec.healthCheckNodePort` tells the cloud load balancer whether to send this node traffic.
//!
//! Any path answers 200 when this node has at least one ready endpoint of the Service and the
//! agent itself is healthy, else 503, with kube-proxy's JSON body (the number of local
//! endpoints and the agent's health). kube-proxy counts only *ready* local endpoints, by
//! distinct address across the Service's ports: a node whose endpoints are all terminating
//! fails the check (so the load balancer drains it) even though those endpoints still serve
//! the node's traffic (the KEP-1669 fallback). The agent's health is `/livez`'s: a change
//! stuck unsynced for too long; a node being deleted does not count (kube-proxy's
//! `Health().Healthy` ignores node eligibility too).
//!
//! The agent feeds [`health_checks`] of the desired state after each successful sync (as
//! kube-proxy calls `SyncServices`/`SyncEndpoints` after writing its rules); [`run`] reconciles
//! the listeners with it: a Service that goes away or changes port has its listener closed
//! first, then missing ones are opened, so a port handed from one Service to another in one
//! sync is free when the new owner binds it; the others are left alone, their open
//! connections included. A port that cannot be bound is logged once (per Service and port)
//! and retried at every sync, as kube-proxy retries it; it never stops the agent.
//!
//! The count also goes in an `X-Load-Balancing-Endpoint-Weight` header (kube-proxy's, since
//! 1.28), for load balancers that weigh nodes by it.
//!
//! Listeners bind `[::]`, both families (0.0.0.0 where the node has no IPv6): every address of
//! the node, as kube-proxy does when `--nodeport-addresses` matches all of them. With a
//! narrower `--nodeport-addresses` kube-proxy binds only the selected addresses; here they stay
//! on all of them (not done yet).
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use tokio::{net::TcpListener, sync::watch, task::JoinHandle};

use crate::{
    model::{DesiredState, NamespacedName},
    serve::healthz::ProxyHealth,
    serve::http::{self, Response},
};

/// Where the listeners bind: all of the node's addresses, of both families.
pub const BIND_IP: IpAddr = IpAddr::V6(Ipv6Addr::UNSPECIFIED);

/// A listener on `addr`; on `[::]` where the kernel has no IPv6, on 0.0.0.0.
async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    match TcpListener::bind(addr).await {
        Err(e) if addr.ip() == BIND_IP && e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
            TcpListener::bind((Ipv4Addr::UNSPECIFIED, addr.port())).await
        }
        bound => bound,
    }
}

/// What one Service's health check serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    /// `spec.healthCheckNodePort`.
    pub port: u16,
    /// This node's ready endpoints of the Service, by distinct address.
    pub local_endpoints: usize,
}

/// The health checks to serve, by Service.
pub type HealthChecks = BTreeMap<NamespacedName, HealthCheck>;

/// The health checks `state` asks for: every Service whose ports carry a health check node port
/// (the model sets it only for LoadBalancer Services with `externalTrafficPolicy: Local`), with
/// its ready endpoints on `state.node_name`.
pub fn health_checks(state: &DesiredState) -> HealthChecks {
    let mut found: BTreeMap<&NamespacedName, (u16, BTreeSet<IpAddr>)> = BTreeMap::new();
    for (spn, port) in state.ports() {
        let Some(hc_port) = port.health_check_node_port.map(u16::from) else {
            continue;
        };
        // A Service-wide field, so every port of the Service carries the same number.
        let (_, ips) = found
            .entry(&spn.service)
            .or_insert_with(|| (hc_port, BTreeSet::new()));
        // By address, as kube-proxy: a pod serving two ports of the Service is one endpoint.
        ips.extend(
            state
                .endpoints_of(spn)
                .iter()
                .filter(|ep| ep.ready && ep.node_name() == Some(state.node_name()))
                .map(|ep| ep.ip),
        );
    }
    found
        .into_iter()
        .map(|(name, (port, ips))| {
            let check = HealthCheck {
                port,
                local_endpoints: ips.len(),
            };
            (name.clone(), check)
        })
        .collect()
}

/// kube-proxy's answer for `service`: 200 only with local endpoints and a healthy proxy.
pub fn response(service: &NamespacedName, local_endpoints: usize, proxy_healthy: bool) -> Response {
    let status = if local_endpoints > 0 && proxy_healthy {
        "200 OK"
    } else {
        "503 Service Unavailable"
    };
    // kube-proxy's layout, tab-indented, byte for byte (some checkers match the body).
    let body = format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {local_endpoints},\n\t\"serviceProxyHealthy\": {proxy_healthy}\n}}",
        json_string(&service.namespace),
        json_string(&service.name),
    );
    Response {
        status,
        content_type: "application/json",
        // Cloud load balancers that weigh nodes read it (kube-proxy sends it since 1.28).
        headers: vec![(
            "X-Load-Balancing-Endpoint-Weight",
            local_endpoints.to_string(),
        )],
        body,
    }
}

fn json_string(s: &str) -> String {
    serde_json::Value::from(s).to_string()
}

/// Serves the health checks the watched value holds, reconciling the listeners each time it is
/// replaced (every successful sync, so failed binds are retried), until the sender is dropped.
pub async fn run(health: Arc<ProxyHealth>, mut checks: watch::Receiver<HealthChecks>) {
    let mut server = ServiceHealthServer::new(BIND_IP, health);
    while checks.changed().await.is_ok() {
        // A copy: holding the borrow across the awaits below would block the sender (the sync).
        let wanted = checks.borrow_and_update().clone();
        server.sync(&wanted).await;
    }
}

/// The open health check listeners. Dropping it closes them.
pub struct ServiceHealthServer {
    bind_ip: IpAddr,
    health: Arc<ProxyHealth>,
    open: HashMap<NamespacedName, Listener>,
    /// Services whose port could not be bound, and that port: logged once, retried each sync.
    failed: HashMap<NamespacedName, u16>,
}

struct Listener {
    port: u16,
    /// Read by the handler at each request; updated in place at each sync.
    local_endpoints: Arc<AtomicUsize>,
    /// Runs [`http::serve`]; owns the socket.
    task: JoinHandle<()>,
}

impl ServiceHealthServer {
    pub fn new(bind_ip: IpAddr, health: Arc<ProxyHealth>) -> Self {
        Self {
            bind_ip,
            health,
            open: HashMap::new(),
            failed: HashMap::new(),
        }
    }

    /// Makes the listeners match `wanted`: closes those of Services gone or moved to another
    /// port (before opening any, so a port may change hands in one sync), opens the missing
    /// ones, and updates every endpoint count.
    pub async fn sync(&mut self, wanted: &HealthChecks) {
        let stale: Vec<NamespacedName> = self
            .open
            .iter()
            .filter(|(name, l)| wanted.get(*name).is_none_or(|c| c.port != l.port))
            .map(|(name, _)| name.clone())
            .collect();
        for name in stale {
            let listener = self.open.remove(&name).expect("listed above");
            tracing::info!(service = %name, port = listener.port, "closing the health check");
            listener.task.abort();
            // Returns once the task's future, and with it the socket, is dropped: the port is
            // free for whoever binds it next.
            let _ = listener.task.await;
        }
        // A failure is reported again only for a different port (or after the Service left).
        self.failed
            .retain(|name, port| wanted.get(name).is_some_and(|c| c.port == *port));

        for (name, check) in wanted {
            if let Some(listener) = self.open.get(name) {
                listener
                    .local_endpoints
                    .store(check.local_endpoints, Ordering::Relaxed);
                continue;
            }
            let addr = SocketAddr::new(self.bind_ip, check.port);
            match bind(addr).await {
                Ok(socket) => {
                    let retried = self.failed.remove(name).is_some();
                    tracing::info!(service = %name, port = check.port, retried, "serving the health check");
                    self.open
                        .insert(name.clone(), self.serve(name, check, socket));
                }
                Err(e) => {
                    if self.failed.insert(name.clone(), check.port) == Some(check.port) {
                        tracing::debug!(service = %name, port = check.port, "health check port still unavailable: {e}");
                    } else {
                        tracing::error!(
                            service = %name,
                            port = check.port,
                            "cannot serve the health check on {addr} (retried at every sync): {e}"
                        );
                        let note = format!(
                            "failed to start healthcheck \"{name}\" on port {}: {e}",
                            check.port
                        );
                        crate::events::record(
                            crate::events::Regarding::Service(name),
                            true,
                            "FailedToStartServiceHealthcheck",
                            "Listen",
                            Some(note),
                        );
                    }
                }
            }
        }
    }

    fn serve(&self, name: &NamespacedName, check: &HealthCheck, socket: TcpListener) -> Listener {
        let local_endpoints = Arc::new(AtomicUsize::new(check.local_endpoints));
        let handler = {
            let (name, count, health) =
                (name.clone(), local_endpoints.clone(), self.health.clone());
            // Any path: kube-proxy's health check server has no routes.
            Arc::new(move |_path: &str| {
                let proxy_healthy = health.status(true).healthy;
                response(&name, count.load(Ordering::Relaxed), proxy_healthy)
            })
        };
        let (name, port) = (name.clone(), check.port);
        let task = tokio::spawn(async move {
            if let Err(e) = http::serve(socket, handler).await {
                tracing::error!(service = %name, port, "the health check server stopped: {e:#}");
            }
        });
        Listener {
            port: check.port,
            local_endpoints,
            task,
        }
    }
}

impl Drop for ServiceHealthServer {
    fn drop(&mut self) {
        for listener in self.open.values() {
            listener.task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::model::{Endpoint, Placement, Protocol, ServicePort, ServicePortName, TargetPort};

    fn nn(name: &str) -> NamespacedName {
        NamespacedName::new("shop", name)
    }

    fn port(health_check_node_port: Option<u16>) -> ServicePort {
        ServicePort {
            cluster_ips: ["10.96.0.1".parse().unwrap()].into(),
            port: 80,
            protocol: Protocol::Tcp,
            target_port: TargetPort::Number(8080),
            node_port: Some(30080),
            external_ips: Box::default(),
            load_balancer_ips: Box::default(),
            session_affinity_timeout: None,
            external_traffic_local: health_check_node_port.is_some(),
            internal_traffic_local: false,
            lb_algorithm: None,
            source_ranges: Box::default(),
            health_check_node_port: health_check_node_port.and_then(std::num::NonZeroU16::new),
        }
    }

    fn ep(ip: &str, port: u16, node: &str, ready: bool, terminating: bool) -> Endpoint {
        Endpoint {
            ip: ip.parse().unwrap(),
            port,
            ready,
            serving: ready || terminating,
            terminating,
            placement: Placement::shared(Some(node), None),
        }
    }

    #[test]
    fn counts_ready_local_endpoints_by_address() {
        let mut state = DesiredState::new("node1");
        let http = ServicePortName::new(nn("web"), "http", Protocol::Tcp);
        let https = ServicePortName::new(nn("web"), "https", Protocol::Tcp);
        state.insert_port(http.clone(), port(Some(32000)));
        state.insert_port(https.clone(), port(Some(32000)));
        state.set_endpoints(
            http,
            vec![
                ep("10.244.1.11", 8080, "node1", true, false),
                ep("10.244.1.12", 8080, "node1", true, false),
                // Not counted: on another node, not ready, terminating (even if serving).
                ep("10.244.2.11", 8080, "node2", true, false),
                ep("10.244.1.13", 8080, "node1", false, false),
                ep("10.244.1.14", 8080, "node1", false, true),
            ],
        );
        // The same pod on a second port is still one endpoint.
        state.set_endpoints(
            https,
            vec![
                ep("10.244.1.11", 8443, "node1", true, false),
                ep("10.244.1.15", 8443, "node1", true, false),
            ],
        );
        // No health check node port: no health check (ClusterIP, eTP Cluster...).
        let plain = ServicePortName::new(nn("plain"), "", Protocol::Tcp);
        state.insert_port(plain.clone(), port(None));
        state.set_endpoints(plain, vec![ep("10.244.1.11", 80, "node1", true, false)]);
        // Only terminating endpoints here: zero, so the load balancer drains this node.
        let draining = ServicePortName::new(nn("draining"), "", Protocol::Udp);
        state.insert_port(draining.clone(), port(Some(32001)));
        state.set_endpoints(draining, vec![ep("10.244.1.16", 53, "node1", false, true)]);
        // No endpoints at all.
        let empty = ServicePortName::new(nn("empty"), "", Protocol::Tcp);
        state.insert_port(empty, port(Some(32002)));

        let checks = health_checks(&state);
        let expected: HealthChecks = [
            ("draining", 32001, 0),
            ("empty", 32002, 0),
            ("web", 32000, 3),
        ]
        .into_iter()
        .map(|(name, port, n)| {
            let check = HealthCheck {
                port,
                local_endpoints: n,
            };
            (nn(name), check)
        })
        .collect();
        assert_eq!(checks, expected);
    }

    /// The model keeps spec.healthCheckNodePort only where kube-proxy uses it.
    #[test]
    fn health_check_node_port_is_read_for_local_load_balancers_only() {
        let hc_port = |type_: &str, policy: &str, value: &str| {
            let svc: k8s_openapi::api::core::v1::Service = serde_yaml::from_str(&format!(
                "
metadata: {{name: lb, namespace: shop}}
spec:
  type: {type_}
  clusterIP: 10.96.0.5
  externalTrafficPolicy: {policy}
  healthCheckNodePort: {value}
  ports: [{{name: a, port: 80, nodePort: 30080}}, {{name: b, port: 443, nodePort: 30443}}]
"
            ))
            .unwrap();
            let mut tracker = crate::model::ChangeTracker::new();
            tracker.update_service(&svc).map_err(|e| e.to_string())?;
            let mut state = DesiredState::default();
            tracker.apply(&mut state);
            let ports: BTreeSet<Option<u16>> = state
                .ports()
                .map(|(_, port)| port)
                .map(|p| p.health_check_node_port.map(u16::from))
                .collect();
            assert_eq!(ports.len(), 1, "every port carries the Service's value");
            Ok::<_, String>(ports.into_iter().next().unwrap())
        };
        assert_eq!(hc_port("LoadBalancer", "Local", "32000"), Ok(Some(32000)));
        assert_eq!(hc_port("LoadBalancer", "Local", "0"), Ok(None));
        // Ignored (kube-proxy's NeedsHealthCheck), even when out of range.
        assert_eq!(hc_port("LoadBalancer", "Cluster", "32000"), Ok(None));
        assert_eq!(hc_port("NodePort", "Local", "32000"), Ok(None));
        assert_eq!(hc_port("NodePort", "Local", "70000"), Ok(None));
        let err = hc_port("LoadBalancer", "Local", "70000").unwrap_err();
        assert!(
            err.contains("spec.healthCheckNodePort 70000 is not in 1..=65535"),
            "{err}"
        );
        assert!(hc_port("LoadBalancer", "Local", "-1").is_err());
    }

    #[test]
    fn status_and_body_as_kube_proxy() {
        let r = response(&nn("web"), 2, true);
        assert_eq!(r.status, "200 OK");
        assert_eq!(r.content_type, "application/json");
        assert_eq!(
            r.body,
            "{\n\t\"service\": {\n\t\t\"namespace\": \"shop\",\n\t\t\"name\": \"web\"\n\t},\n\t\"localEndpoints\": 2,\n\t\"serviceProxyHealthy\": true\n}"
        );
        let json: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(json["service"]["name"], "web");
        assert_eq!(json["localEndpoints"], 2);

        let none = response(&nn("web"), 0, true);
        assert_eq!(none.status, "503 Service Unavailable");
        assert!(none.body.contains("\"localEndpoints\": 0"), "{}", none.body);
        // Endpoints, but the proxy is stuck: its rules may be stale, so 503 too.
        let stuck = response(&nn("web"), 2, false);
        assert_eq!(stuck.status, "503 Service Unavailable");
        assert!(stuck.body.contains("\"serviceProxyHealthy\": false"));
    }

    const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

    /// Ports free right now on 127.0.0.1.
    fn free_ports(n: usize) -> Vec<u16> {
        let held: Vec<std::net::TcpListener> = (0..n)
            .map(|_| std::net::TcpListener::bind((LOCALHOST, 0)).unwrap())
            .collect();
        held.iter()
            .map(|l| l.local_addr().unwrap().port())
            .collect()
    }

    fn checks(list: &[(&str, u16, usize)]) -> HealthChecks {
        list.iter()
            .map(|&(name, port, n)| {
                let check = HealthCheck {
                    port,
                    local_endpoints: n,
                };
                (nn(name), check)
            })
            .collect()
    }

    /// Sends a GET on an open connection: the status code and the whole response.
    async fn ask(mut conn: tokio::net::TcpStream) -> (u16, String) {
        conn.write_all(b"GET /any/path HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        tokio::time::timeout(Duration::from_secs(5), conn.read_to_string(&mut out))
            .await
            .expect("an answer")
            .unwrap();
        let code = out.split_whitespace().nth(1).unwrap().parse().unwrap();
        (code, out)
    }

    async fn get(port: u16) -> Option<(u16, String)> {
        let conn = tokio::net::TcpStream::connect((LOCALHOST, port))
            .await
            .ok()?;
        Some(ask(conn).await)
    }

    #[tokio::test]
    async fn listeners_follow_services_and_ports() {
        let health = Arc::new(ProxyHealth::new(Duration::from_secs(60)));
        let mut server = ServiceHealthServer::new(LOCALHOST, health);
        let [p1, p2, p3, p4] = free_ports(4)[..] else {
            unreachable!()
        };

        server.sync(&checks(&[("a", p1, 1), ("b", p2, 0)])).await;
        let (code, a) = get(p1).await.expect("a listens");
        assert_eq!(code, 200, "{a}");
        assert!(a.contains("Content-Type: application/json\r\n"), "{a}");
        assert!(a.contains("X-Content-Type-Options: nosniff\r\n"), "{a}");
        assert!(a.contains("X-Load-Balancing-Endpoint-Weight: 1\r\n"), "{a}");
        assert!(a.contains("\"name\": \"a\"") && a.contains("\"localEndpoints\": 1"));
        let (code, b) = get(p2).await.expect("b listens");
        assert_eq!(code, 503);
        assert!(b.contains("X-Load-Balancing-Endpoint-Weight: 0\r\n"), "{b}");

        // A connection to b, open across the next sync, is still answered: b is left alone.
        let to_b = tokio::net::TcpStream::connect((LOCALHOST, p2))
            .await
            .unwrap();
        // a moves to p3, b gains an endpoint, c arrives on p4.
        server
            .sync(&checks(&[("a", p3, 1), ("b", p2, 2), ("c", p4, 0)]))
            .await;
        assert!(get(p1).await.is_none(), "a's old port is closed");
        assert_eq!(get(p3).await.expect("a moved").0, 200);
        let (code, b) = ask(to_b).await;
        assert_eq!(code, 200, "{b}");
        assert!(b.contains("\"localEndpoints\": 2"), "{b}");
        assert_eq!(get(p4).await.expect("c listens").0, 503);

        // Two Services swap ports in one sync: both are closed before either is bound.
        server.sync(&checks(&[("a", p4, 1), ("c", p3, 0)])).await;
        assert!(get(p2).await.is_none(), "b is gone");
        let (_, a) = get(p4).await.expect("a on c's old port");
        assert!(a.contains("\"name\": \"a\""), "{a}");
        let (_, c) = get(p3).await.expect("c on a's old port");
        assert!(c.contains("\"name\": \"c\""), "{c}");

        server.sync(&HealthChecks::new()).await;
        assert!(get(p3).await.is_none() && get(p4).await.is_none());
    }

    #[tokio::test]
    async fn a_taken_port_is_retried_at_each_sync() {
        let health = Arc::new(ProxyHealth::new(Duration::from_secs(60)));
        let mut server = ServiceHealthServer::new(LOCALHOST, health);
        let [free] = free_ports(1)[..] else {
            unreachable!()
        };
        let squatter = std::net::TcpListener::bind((LOCALHOST, 0)).unwrap();
        let taken = squatter.local_addr().unwrap().port();

        let wanted = checks(&[("a", taken, 1), ("b", free, 1)]);
        server.sync(&wanted).await;
        assert_eq!(server.failed, HashMap::from([(nn("a"), taken)]));
        assert_eq!(get(free).await.expect("b is served regardless").0, 200);

        // Still taken: still failed (and not logged again); then the port frees up.
        server.sync(&wanted).await;
        assert_eq!(server.failed.len(), 1);
        drop(squatter);
        server.sync(&wanted).await;
        assert!(server.failed.is_empty());
        let (code, a) = get(taken).await.expect("a is served once the port is free");
        assert_eq!(code, 200, "{a}");

        // A failure is forgotten with its Service.
        let other = std::net::TcpListener::bind((LOCALHOST, 0)).unwrap();
        let port = other.local_addr().unwrap().port();
        server.sync(&checks(&[("c", port, 0)])).await;
        assert_eq!(server.failed.len(), 1);
        server.sync(&HealthChecks::new()).await;
        assert!(server.failed.is_empty());
    }

    #[tokio::test]
    async fn an_unhealthy_proxy_fails_every_check() {
        let health = Arc::new(ProxyHealth::new(Duration::from_millis(1)));
        let mut server = ServiceHealthServer::new(LOCALHOST, health.clone());
        let [p] = free_ports(1)[..] else {
            unreachable!()
        };
        server.sync(&checks(&[("a", p, 3)])).await;
        assert_eq!(get(p).await.unwrap().0, 200);
        // A change waits for a sync longer than the timeout.
        health.queued();
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (code, body) = get(p).await.unwrap();
        assert_eq!(code, 503, "{body}");
        assert!(
            body.contains("\"localEndpoints\": 3")
                && body.contains("\"serviceProxyHealthy\": false")
        );
        health.updated();
        assert_eq!(get(p).await.unwrap().0, 200);
    }

    #[tokio::test]
    async fn run_follows_the_watched_value() {
        let health = Arc::new(ProxyHealth::new(Duration::from_secs(60)));
        let [p] = free_ports(1)[..] else {
            unreachable!()
        };
        let (tx, rx) = watch::channel(HealthChecks::new());
        // `run` binds [::]; the test reaches it on 127.0.0.1 (both families).
        let task = tokio::spawn(run(health, rx));
        tx.send_replace(checks(&[("a", p, 1)]));
        let mut answer = None;
        for _ in 0..500 {
            answer = get(p).await;
            if answer.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(answer.expect("served after the first value").0, 200);
        // The sender gone (the agent stopping): `run` returns and its listeners close.
        drop(tx);
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
        // Dropping aborts the listeners' tasks; they close as the runtime gets to them.
        for _ in 0..500 {
            if get(p).await.is_none() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the listener outlived the server");
    }
}

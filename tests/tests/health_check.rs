//! kube-proxy's health check node port for a LoadBalancer Service with externalTrafficPolicy
//! Local, end to end: the agent in node1 on a manifest, asked from outside the cluster (the
//! `ext` namespace) on node1's address, as a cloud load balancer's health checker does, while
//! the manifest's endpoints and Service change.
use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use proxy_tests::{
    NODE1_IP, Sandbox,
    agent::{AgentRun, edit_manifest, remove_endpoint, set_conditions},
    patience, privileged,
};
use proxy_userspace::source::manifest::Object;

const HC_PORT: u16 = 32100;
const MOVED_HC_PORT: u16 = 32101;

/// `lb`: be1 and be2 on node1, be4 on node2; `plain`: the same, but externalTrafficPolicy
/// Cluster, so no health check even though it names a port; `taken`: be3, its health check
/// port held by another process at first.
const MANIFEST: &str = "
apiVersion: v1
kind: Service
metadata: {name: lb, namespace: demo}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.50
  externalTrafficPolicy: Local
  healthCheckNodePort: 32100
  ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: lb-1, namespace: demo, labels: {kubernetes.io/service-name: lb}}
addressType: IPv4
endpoints:
- {addresses: [10.244.1.11], nodeName: node1}
- {addresses: [10.244.1.12], nodeName: node1}
- {addresses: [10.244.2.11], nodeName: node2}
ports: [{name: http, port: 8080, protocol: TCP}]
---
apiVersion: v1
kind: Service
metadata: {name: plain, namespace: demo}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.51
  externalTrafficPolicy: Cluster
  healthCheckNodePort: 32102
  ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30081}]
---
apiVersion: v1
kind: Service
metadata: {name: taken, namespace: demo}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.52
  externalTrafficPolicy: Local
  healthCheckNodePort: 32103
  ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080, nodePort: 30082}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: taken-1, namespace: demo, labels: {kubernetes.io/service-name: taken}}
addressType: IPv4
endpoints:
- {addresses: [10.244.1.13], nodeName: node1}
ports: [{name: http, port: 8080, protocol: TCP}]
";

const TAKEN_HC_PORT: u16 = 32103;

/// What a health check got: the status code, the raw header block and the body; or the error
/// of the connection (refused, for a closed port).
#[derive(Debug)]
struct Answer {
    code: u16,
    headers: String,
    body: serde_json::Value,
}

/// GET / from the `ext` namespace to node1:`port`.
fn check(sandbox: &Sandbox, port: u16) -> std::io::Result<Answer> {
    let to = SocketAddr::from((NODE1_IP, port));
    let response = sandbox.ext.run(move || -> std::io::Result<String> {
        let mut conn = TcpStream::connect_timeout(&to, Duration::from_secs(2))?;
        conn.set_read_timeout(Some(Duration::from_secs(2)))?;
        conn.write_all(b"GET / HTTP/1.1\r\nHost: lb-checker\r\nConnection: close\r\n\r\n")?;
        let mut out = String::new();
        conn.read_to_string(&mut out)?;
        Ok(out)
    })?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok(Answer {
        code,
        headers: head.to_owned(),
        body: serde_json::from_str(body).unwrap_or(serde_json::Value::Null),
    })
}

/// Asks node1:`port` until `ok` holds for the outcome (10 s at most).
fn wait_for(
    sandbox: &Sandbox,
    agent: &AgentRun,
    port: u16,
    what: &str,
    ok: impl Fn(&std::io::Result<Answer>) -> bool,
) -> Result<std::io::Result<Answer>> {
    let deadline = Instant::now() + patience(Duration::from_secs(10));
    loop {
        let outcome = check(sandbox, port);
        if ok(&outcome) {
            return Ok(outcome);
        }
        if Instant::now() > deadline {
            anyhow::bail!(
                "timed out waiting for {what}; last: {outcome:?}; agent log:\n{}",
                agent.log_text()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn answered(code: u16, local: u64) -> impl Fn(&std::io::Result<Answer>) -> bool {
    move |outcome| {
        outcome
            .as_ref()
            .is_ok_and(|a| a.code == code && a.body["localEndpoints"] == local)
    }
}

fn refused(outcome: &std::io::Result<Answer>) -> bool {
    outcome
        .as_ref()
        .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
}

#[test]
fn health_check_node_port_follows_local_endpoints() -> Result<()> {
    if !privileged("health_check_node_port_follows_local_endpoints") {
        return Ok(());
    }
    let mut sandbox = Sandbox::build().context("building the sandbox")?;
    // Another process on node1 holds `taken`'s port (sockets stay in the namespace).
    let squatter = sandbox
        .node1
        .run(|| std::net::TcpListener::bind(("0.0.0.0", TAKEN_HC_PORT)))?;
    let agent = AgentRun::start(&mut sandbox, "node1", MANIFEST, 3).context("the agent")?;

    // Two ready endpoints on node1 (be4 on node2 does not count).
    let ok = wait_for(&sandbox, &agent, HC_PORT, "200 with 2", answered(200, 2))??;
    assert_eq!(
        ok.body,
        serde_json::json!({
            "service": {"namespace": "demo", "name": "lb"},
            "localEndpoints": 2,
            "serviceProxyHealthy": true,
        })
    );
    for header in [
        "Content-Type: application/json",
        "X-Content-Type-Options: nosniff",
    ] {
        assert!(ok.headers.contains(header), "{header}:\n{}", ok.headers);
    }
    // externalTrafficPolicy Cluster: its healthCheckNodePort is ignored, as kube-proxy does.
    assert!(
        refused(&check(&sandbox, 32102)),
        "{:?}",
        check(&sandbox, 32102)
    );

    // A terminating endpoint does not count, even while it still serves.
    edit_manifest(&agent.manifest, |objects| {
        set_conditions(objects, "lb", "10.244.1.11", false, true, true)
    })?;
    wait_for(&sandbox, &agent, HC_PORT, "200 with 1", answered(200, 1))??;

    // `taken` could not bind: said once (with the Service and the port) over two syncs, and
    // the agent serves the rest regardless.
    let complaints = || {
        agent
            .log_text()
            .lines()
            .filter(|l| l.contains("cannot serve the health check") && l.contains("demo/taken"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let said = complaints();
    assert!(
        said.len() == 1 && said[0].contains(&TAKEN_HC_PORT.to_string()),
        "{said:?}\n{}",
        agent.log_text()
    );
    // Retried at the next sync once the port is free.
    drop(squatter);

    // No local endpoint left (be4 on node2 still is one): 503, so the load balancer skips node1.
    edit_manifest(&agent.manifest, |objects| {
        remove_endpoint(objects, "lb", "10.244.1.11");
        remove_endpoint(objects, "lb", "10.244.1.12");
    })?;
    let unavailable = wait_for(&sandbox, &agent, HC_PORT, "503 with 0", answered(503, 0))??;
    assert_eq!(unavailable.body["serviceProxyHealthy"], true);
    wait_for(
        &sandbox,
        &agent,
        TAKEN_HC_PORT,
        "taken served",
        answered(200, 1),
    )??;
    assert_eq!(complaints().len(), 1, "{}", agent.log_text());

    // The port moves: the old one closes, the new one answers.
    edit_manifest(&agent.manifest, |objects| {
        for object in objects {
            if let Object::Service(svc) = object
                && svc.metadata.name.as_deref() == Some("lb")
            {
                svc.spec.as_mut().unwrap().health_check_node_port = Some(MOVED_HC_PORT.into());
            }
        }
    })?;
    wait_for(
        &sandbox,
        &agent,
        MOVED_HC_PORT,
        "the new port",
        answered(503, 0),
    )??;
    assert!(
        refused(&check(&sandbox, HC_PORT)),
        "the old port still answers"
    );

    // The Service is deleted: nothing listens any more.
    edit_manifest(&agent.manifest, |objects| {
        objects.retain(|o| !(matches!(o, Object::Service(_)) && &*o.key().name == "lb"))
    })?;
    wait_for(&sandbox, &agent, MOVED_HC_PORT, "the port closing", refused)?.expect_err("refused");
    Ok(())
}

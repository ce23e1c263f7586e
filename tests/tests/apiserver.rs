//! The stand-in API server, spoken to over raw HTTP/1.1, and its JSON read back with the
//! k8s-openapi types (through `proxy_userspace::source::manifest::parse`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use proxy_tests::apiserver::{ApiServer, USER, endpoint_slice, node, service};
use proxy_userspace::source::manifest::{self, Object};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(5);

struct Response {
    code: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

/// One client connection, kept alive across requests.
struct Conn {
    reader: BufReader<TcpStream>,
}

impl Conn {
    fn open(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_read_timeout(Some(TIMEOUT)).unwrap();
        Conn {
            reader: BufReader::new(stream),
        }
    }

    fn send(&mut self, method: &str, target: &str) {
        let request = format!(
            "{method} {target} HTTP/1.1\r\nHost: kubernetes\r\nAccept: application/json\r\nUser-Agent: raw-test\r\n\r\n"
        );
        self.reader
            .get_mut()
            .write_all(request.as_bytes())
            .expect("send");
    }

    fn head(&mut self) -> (u16, Vec<(String, String)>) {
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("status line");
        let code = line
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {line:?}"));
        let mut headers = Vec::new();
        loop {
            line.clear();
            self.reader.read_line(&mut line).expect("header");
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            let (name, value) = header.split_once(':').expect("header line");
            headers.push((name.trim().to_owned(), value.trim().to_owned()));
        }
        (code, headers)
    }

    fn request(&mut self, method: &str, target: &str) -> Response {
        self.send(method, target);
        let (code, headers) = self.head();
        let length: usize = headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
            .map(|(_, v)| v.parse().unwrap())
            .expect("Content-Length");
        let mut body = vec![0; length];
        self.reader.read_exact(&mut body).expect("body");
        Response {
            code,
            headers,
            body: String::from_utf8(body).unwrap(),
        }
    }

    /// Starts a watch; the response must be a chunked stream.
    fn watch(mut self, target: &str) -> Watch {
        self.send("GET", target);
        let (code, headers) = self.head();
        assert_eq!(code, 200, "watch {target}");
        let header = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.clone())
        };
        assert_eq!(header("Transfer-Encoding").as_deref(), Some("chunked"));
        assert_eq!(header("Content-Type").as_deref(), Some("application/json"));
        Watch {
            reader: self.reader,
            pending: Vec::new(),
            ended: false,
        }
    }
}

fn get(addr: SocketAddr, target: &str) -> Response {
    Conn::open(addr).request("GET", target)
}

fn watch(addr: SocketAddr, target: &str) -> Watch {
    Conn::open(addr).watch(target)
}

struct Watch {
    reader: BufReader<TcpStream>,
    pending: Vec<u8>,
    ended: bool,
}

impl Watch {
    /// The next event, or None when the stream ended (terminating chunk, or EOF).
    fn next(&mut self) -> Option<Value> {
        loop {
            if let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=end).collect();
                return Some(serde_json::from_slice(&line).expect("event JSON"));
            }
            if self.ended {
                return None;
            }
            let mut size = String::new();
            if self.reader.read_line(&mut size).expect("chunk size") == 0 {
                self.ended = true;
                continue;
            }
            let size = usize::from_str_radix(size.trim(), 16).expect("hex chunk size");
            if size == 0 {
                let mut crlf = String::new();
                self.reader.read_line(&mut crlf).unwrap();
                self.ended = true;
                continue;
            }
            let mut data = vec![0; size + 2];
            self.reader.read_exact(&mut data).expect("chunk");
            assert_eq!(&data[size..], b"\r\n");
            self.pending.extend_from_slice(&data[..size]);
        }
    }

    fn expect(&mut self, kind: &str) -> Value {
        let event = self
            .next()
            .unwrap_or_else(|| panic!("stream ended, expected {kind}"));
        assert_eq!(event["type"], kind, "{event}");
        event["object"].clone()
    }

    /// No event arrives within `wait` (the read times out).
    fn assert_quiet(&mut self, wait: Duration) {
        assert!(self.pending.is_empty());
        self.reader.get_ref().set_read_timeout(Some(wait)).unwrap();
        let mut buf = [0u8; 1];
        let result = self.reader.read(&mut buf);
        assert!(
            matches!(&result, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut),
            "expected no data, got {result:?}"
        );
        self.reader
            .get_ref()
            .set_read_timeout(Some(TIMEOUT))
            .unwrap();
    }
}

fn eventually(mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + TIMEOUT;
    while !condition() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

fn rv(object: &Value) -> u64 {
    object["metadata"]["resourceVersion"]
        .as_str()
        .expect("resourceVersion string")
        .parse()
        .unwrap()
}

fn names(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap().to_owned())
        .collect()
}

fn web(ns: &str, name: &str, ip: &str) -> Value {
    service(ns, name, ip, &[("http", 80, "TCP", 8080)])
}

fn typed(text: &str) -> Vec<Object> {
    let parsed = manifest::parse(text).expect("manifest parse");
    assert!(parsed.errors.is_empty(), "{:?}", parsed.errors);
    parsed.objects
}

#[test]
fn lists_in_the_api_shape_read_by_k8s_openapi() {
    let api = ApiServer::start().unwrap();
    let addr = api.addr();
    let rv_svc = api.apply(service(
        "demo",
        "web",
        "10.96.0.10",
        &[("http", 80, "TCP", 8080), ("dns", 53, "UDP", 5353)],
    ));
    api.apply(web("other", "db", "10.96.0.11"));
    api.apply(endpoint_slice(
        "demo",
        "web-abc12",
        "web",
        &[
            ("10.244.1.11", true, Some("node1")),
            ("10.244.2.11", false, None),
        ],
        &[("http", 8080, "TCP")],
    ));
    api.apply(node("node1", "192.0.2.11"));

    let list = get(addr, "/api/v1/services").json();
    assert_eq!(list["kind"], "ServiceList");
    assert_eq!(list["apiVersion"], "v1");
    assert_eq!(
        list["metadata"]["resourceVersion"],
        api.resource_version().to_string()
    );
    // etcd key order: namespace, then name.
    assert_eq!(names(&list), ["web", "db"]);
    let item = &list["items"][0];
    assert!(
        item.get("kind").is_none() && item.get("apiVersion").is_none(),
        "{item}"
    );
    assert_eq!(rv(item), rv_svc);
    assert_eq!(item["metadata"]["uid"].as_str().unwrap().len(), 36);
    assert!(
        item["metadata"]["creationTimestamp"]
            .as_str()
            .unwrap()
            .ends_with('Z')
    );

    let objects = typed(&list.to_string());
    let Object::Service(svc) = &objects[0] else {
        panic!("{objects:?}")
    };
    let spec = svc.spec.as_ref().unwrap();
    assert_eq!(spec.cluster_ip.as_deref(), Some("10.96.0.10"));
    let ports = spec.ports.as_ref().unwrap();
    assert_eq!(ports[1].protocol.as_deref(), Some("UDP"));
    assert_eq!(ports[1].port, 53);
    assert_eq!(
        svc.metadata.resource_version.as_deref(),
        Some(rv_svc.to_string().as_str())
    );

    // Namespaced list.
    let list = get(addr, "/api/v1/namespaces/other/services").json();
    assert_eq!(names(&list), ["db"]);

    let slices = get(addr, "/apis/discovery.k8s.io/v1/endpointslices").json();
    assert_eq!(slices["kind"], "EndpointSliceList");
    assert_eq!(slices["apiVersion"], "discovery.k8s.io/v1");
    let objects = typed(&slices.to_string());
    let Object::EndpointSlice(slice) = &objects[0] else {
        panic!("{objects:?}")
    };
    assert_eq!(slice.address_type, "IPv4");
    let endpoints = slice.endpoints.as_deref().unwrap_or_default();
    assert_eq!(endpoints.len(), 2);
    assert_eq!(endpoints[0].node_name.as_deref(), Some("node1"));
    assert_eq!(endpoints[1].conditions.as_ref().unwrap().ready, Some(false));
    assert_eq!(
        slice.metadata.labels.as_ref().unwrap()["kubernetes.io/service-name"],
        "web"
    );
    let ns_slices = get(
        addr,
        "/apis/discovery.k8s.io/v1/namespaces/other/endpointslices",
    )
    .json();
    assert_eq!(ns_slices["items"], json!([]));

    let nodes = get(addr, "/api/v1/nodes").json();
    assert_eq!(nodes["kind"], "NodeList");
    assert_eq!(names(&nodes), ["node1"]);
    assert!(nodes["items"][0]["metadata"].get("namespace").is_none());

    // GET of one object carries kind and apiVersion.
    let one = get(addr, "/api/v1/nodes/node1");
    assert_eq!(one.code, 200);
    let one = one.json();
    assert_eq!(one["kind"], "Node");
    assert_eq!(
        one["status"]["addresses"][0],
        json!({"type": "InternalIP", "address": "192.0.2.11"})
    );
    let svc = get(addr, "/api/v1/namespaces/demo/services/web").json();
    assert_eq!(typed(&svc.to_string()).len(), 1);
    let missing = get(addr, "/api/v1/nodes/nope");
    assert_eq!(missing.code, 404);
    assert_eq!(
        missing.json(),
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "nodes \"nope\" not found", "reason": "NotFound",
            "details": {"name": "nope", "kind": "nodes"}, "code": 404})
    );

    // A watch's objects read as typed objects too.
    let mut w = watch(
        addr,
        "/apis/discovery.k8s.io/v1/endpointslices?watch=true&resourceVersion=0",
    );
    let added = w.expect("ADDED");
    assert_eq!(added["kind"], "EndpointSlice");
    assert!(matches!(
        &typed(&added.to_string())[..],
        [Object::EndpointSlice(_)]
    ));
}

#[test]
fn apply_stamps_metadata_and_skips_no_op_updates() {
    let api = ApiServer::start().unwrap();
    let first = api.apply(web("demo", "web", "10.96.0.10"));
    let created = api.get("Service", Some("demo"), "web").unwrap();
    // Same content again: no new version.
    assert_eq!(api.apply(web("demo", "web", "10.96.0.10")), first);
    let second = api.apply(web("demo", "web", "10.96.0.20"));
    assert!(second > first);
    let updated = api.get("services", Some("demo"), "web").unwrap();
    assert_eq!(updated["metadata"]["uid"], created["metadata"]["uid"]);
    assert_eq!(
        updated["metadata"]["creationTimestamp"],
        created["metadata"]["creationTimestamp"]
    );
    assert_eq!(rv(&updated), second);
    // Another object: a different uid, the global counter goes on.
    let other = api.apply(web("demo", "db", "10.96.0.11"));
    assert_eq!(other, second + 1);
    assert_ne!(
        api.get("Service", Some("demo"), "db").unwrap()["metadata"]["uid"],
        created["metadata"]["uid"]
    );
    // No namespace means "default".
    api.apply(web("", "plain", "10.96.0.12"));
    assert!(api.get("Service", None, "plain").is_some());
    assert!(api.delete("Service", None, "plain"));
    assert!(!api.delete("Service", None, "plain"));
    assert_eq!(api.resource_version(), other + 2);
}

#[test]
fn selectors() {
    let api = ApiServer::start().unwrap();
    let addr = api.addr();
    let labelled = |name: &str, labels: Value| {
        let mut svc = web("demo", name, "10.96.0.1");
        svc["metadata"]["labels"] = labels;
        api.apply(svc);
    };
    labelled("a", json!({"app": "a", "tier": "front"}));
    labelled(
        "b",
        json!({"app": "b", "service.kubernetes.io/headless": ""}),
    );
    labelled("c", json!({}));
    let list = |query: &str| names(&get(addr, &format!("/api/v1/services?{query}")).json());
    assert_eq!(list("fieldSelector=metadata.name%3Db"), ["b"]);
    assert_eq!(list("fieldSelector=metadata.name!%3Db"), ["a", "c"]);
    assert_eq!(
        list("fieldSelector=metadata.namespace%3D%3Ddemo,metadata.name%3Da"),
        ["a"]
    );
    assert_eq!(list("labelSelector=app"), ["a", "b"]);
    assert_eq!(
        list("labelSelector=%21service.kubernetes.io%2Fheadless"),
        ["a", "c"]
    );
    assert_eq!(list("labelSelector=app%3Da"), ["a"]);
    assert_eq!(list("labelSelector=app!%3Da"), ["b", "c"]);
    assert_eq!(list("labelSelector=app%3D%3Db,app"), ["b"]);
    assert_eq!(
        list("labelSelector=app+in+(a,b),tier+notin+(back)"),
        ["a", "b"]
    );
    assert_eq!(list("labelSelector=!app,!tier"), ["c"]);
    let bad = get(
        addr,
        "/api/v1/services?fieldSelector=spec.clusterIP%3D1.2.3.4",
    );
    assert_eq!(bad.code, 400);
    assert_eq!(
        bad.json()["message"],
        "field label not supported: spec.clusterIP"
    );
    assert_eq!(get(addr, "/api/v1/services?labelSelector=a+b").code, 400);
}

#[test]
fn watch_replays_history_then_streams_live_events() {
    let api = ApiServer::start().unwrap();
    let addr = api.addr();
    let rv1 = api.apply(web("demo", "one", "10.96.0.1"));
    let list = get(addr, "/api/v1/namespaces/demo/services").json();
    let listed = rv(&list);
    assert_eq!(listed, rv1);
    let rv2 = api.apply(web("demo", "two", "10.96.0.2"));

    let mut w = watch(
        addr,
        &format!(
            "/api/v1/namespaces/demo/services?watch=1&resourceVersion={listed}&timeoutSeconds=30&allowWatchBookmarks=true"
        ),
    );
    assert!(api.wait_for_watchers("services", 1, TIMEOUT));
    // Replayed from the history: only what came after the listed version.
    let two = w.expect("ADDED");
    assert_eq!(two["metadata"]["name"], "two");
    assert_eq!(two["kind"], "Service");
    assert_eq!(two["apiVersion"], "v1");
    assert_eq!(rv(&two), rv2);

    // Live; other namespaces and resources are not ours.
    api.apply(web("elsewhere", "x", "10.96.0.9"));
    api.apply(node("node1", "192.0.2.11"));
    let rv3 = api.apply(web("demo", "one", "10.96.0.100"));
    let modified = w.expect("MODIFIED");
    assert_eq!(modified["spec"]["clusterIP"], "10.96.0.100");
    assert_eq!(rv(&modified), rv3);
    assert!(api.delete("Service", Some("demo"), "two"));
    let deleted = w.expect("DELETED");
    assert_eq!(deleted["metadata"]["name"], "two");
    assert_eq!(rv(&deleted), api.resource_version());
    w.assert_quiet(Duration::from_millis(300));

    // A watch without resourceVersion begins with the current objects as ADDED.
    let mut all = watch(addr, "/api/v1/services?watch=true");
    let mut initial: Vec<String> = (0..2)
        .map(|_| {
            all.expect("ADDED")["metadata"]["name"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    initial.sort();
    assert_eq!(initial, ["one", "x"]);
    all.assert_quiet(Duration::from_millis(200));

    // Label selector transitions, as the watch cache reports them.
    let mut front = watch(
        addr,
        "/api/v1/services?watch=true&labelSelector=tier%3Dfront",
    );
    let mut svc = web("demo", "one", "10.96.0.100");
    svc["metadata"]["labels"] = json!({"tier": "front"});
    api.apply(svc.clone());
    assert_eq!(front.expect("ADDED")["metadata"]["name"], "one");
    svc["spec"]["sessionAffinity"] = json!("ClientIP");
    api.apply(svc.clone());
    front.expect("MODIFIED");
    svc["metadata"]["labels"] = json!({"tier": "back"});
    let left = api.apply(svc);
    let gone = front.expect("DELETED");
    assert_eq!(gone["metadata"]["labels"]["tier"], "front");
    assert_eq!(rv(&gone), left);
}

#[test]
fn bookmarks_only_for_watches_that_allow_them() {
    let api = ApiServer::start().unwrap();
    let addr = api.addr();
    let start = api.apply(node("node1", "192.0.2.11"));
    let mut with = watch(
        addr,
        &format!("/api/v1/nodes?watch=true&resourceVersion={start}&allowWatchBookmarks=true"),
    );
    let mut without = watch(
        addr,
        &format!("/api/v1/nodes?watch=true&resourceVersion={start}"),
    );
    assert!(api.wait_for_watchers("nodes", 2, TIMEOUT));
    api.apply(web("demo", "web", "10.96.0.1")); // moves the resourceVersion on
    api.bookmark();
    let bookmark = with.expect("BOOKMARK");
    assert_eq!(
        bookmark,
        json!({"kind": "Node", "apiVersion": "v1",
            "metadata": {"resourceVersion": api.resource_version().to_string(), "creationTimestamp": null}})
    );
    api.apply(node("node2", "192.0.2.12"));
    assert_eq!(without.expect("ADDED")["metadata"]["name"], "node2");
    assert_eq!(with.expect("ADDED")["metadata"]["name"], "node2");
}

#[test]
fn compaction_ends_watches_and_old_versions_get_410() {
    let api = ApiServer::start().unwrap();
    let addr = api.addr();
    api.apply(web("demo", "web", "10.96.0.1"));
    let listed = rv(&get(addr, "/api/v1/services").json());
    let mut w = watch(
        addr,
        &format!("/api/v1/services?watch=true&resourceVersion={listed}"),
    );
    assert!(api.wait_for_watchers("services", 1, TIMEOUT));
    api.compact();
    assert!(w.next().is_none(), "the watch ends cleanly");
    assert!(eventually(|| api.watchers("services") == 0));

    let compacted = api.resource_version();
    let mut w = watch(
        addr,
        &format!("/api/v1/services?watch=true&resourceVersion={listed}"),
    );
    let error = w.expect("ERROR");
    assert_eq!(
        error,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("too old resource version: {listed} ({compacted})"),
            "reason": "Expired", "code": 410})
    );
    assert!(w.next().is_none());

    // Re-list, then watch from there.
    let relisted = get(addr, "/api/v1/services").json();
    assert_eq!(rv(&relisted), compacted);
    assert_eq!(names(&relisted), ["web"]);
    let mut w = watch(
        addr,
        &format!("/api/v1/services?watch=true&resourceVersion={compacted}"),
    );
    api.delete("Service", Some("demo"), "web");
    w.expect("DELETED");

    // An exact list before the compaction point is gone too; at or after it, served.
    let exact = get(
        addr,
        &format!("/api/v1/services?resourceVersion={listed}&resourceVersionMatch=Exact"),
    );
    assert_eq!(exact.code, 410);
    let exact = get(
        addr,
        &format!("/api/v1/services?resourceVersion={compacted}&resourceVersionMatch=Exact"),
    );
    assert_eq!(names(&exact.json()), ["web"]);
}

#[test]
fn forbidden_resources_get_the_rbac_status() {
    let api = ApiServer::start().unwrap();
    let addr = api.addr();
    api.apply(node("node1", "192.0.2.11"));
    api.forbid("services", true);
    api.forbid("endpointslices", true);
    api.forbid("Node", true);
    let status = |message: String, details: Value| {
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": "Forbidden", "details": details, "code": 403})
    };
    let list = get(addr, "/api/v1/services?limit=500");
    assert_eq!(list.code, 403);
    assert_eq!(
        list.json(),
        status(
            format!(
                "services is forbidden: User \"{USER}\" cannot list resource \"services\" in API group \"\" at the cluster scope"
            ),
            json!({"kind": "services"})
        )
    );
    let watch = get(
        addr,
        "/apis/discovery.k8s.io/v1/namespaces/demo/endpointslices?watch=true&resourceVersion=5",
    );
    assert_eq!(watch.code, 403);
    assert_eq!(
        watch.json(),
        status(
            format!(
                "endpointslices.discovery.k8s.io is forbidden: User \"{USER}\" cannot watch resource \"endpointslices\" in API group \"discovery.k8s.io\" in the namespace \"demo\""
            ),
            json!({"group": "discovery.k8s.io", "kind": "endpointslices"})
        )
    );
    let one = get(addr, "/api/v1/nodes/node1");
    assert_eq!(one.code, 403);
    assert_eq!(
        one.json(),
        status(
            format!(
                "nodes \"node1\" is forbidden: User \"{USER}\" cannot get resource \"nodes\" in API group \"\" at the cluster scope"
            ),
            json!({"kind": "nodes", "name": "node1"})
        )
    );
    api.forbid("services", false);
    assert_eq!(get(addr, "/api/v1/services").code, 200);

    // The requests, as an RBAC check sees them.
    let requests = api.requests();
    let seen: Vec<(&str, &str, &str, Option<&str>)> = requests
        .iter()
        .map(|r| {
            (
                r.verb.as_str(),
                r.group.as_str(),
                r.resource.as_str(),
                r.namespace.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("list", "", "services", None),
            ("watch", "discovery.k8s.io", "endpointslices", Some("demo")),
            ("get", "", "nodes", None),
            ("list", "", "services", None),
        ]
    );
    assert_eq!(requests[0].param("limit").as_deref(), Some("500"));
    assert_eq!(requests[2].name.as_deref(), Some("node1"));
}

#[test]
fn keep_alive_and_errors_on_one_connection() {
    let api = ApiServer::start().unwrap();
    api.apply(web("demo", "web", "10.96.0.1"));
    let mut conn = Conn::open(api.addr());
    let first = conn.request("GET", "/api/v1/services");
    assert_eq!(first.code, 200);
    assert_eq!(first.header("Content-Type"), Some("application/json"));
    assert!(first.header("Connection").is_none());
    let unknown = conn.request("GET", "/api/v1/pods");
    assert_eq!(unknown.code, 404);
    assert_eq!(
        unknown.json(),
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "the server could not find the requested resource", "reason": "NotFound",
            "details": {}, "code": 404})
    );
    assert_eq!(conn.request("GET", "/apis/apps/v1/deployments").code, 404);
    assert_eq!(
        conn.request("GET", "/api/v1/namespaces/demo/nodes").code,
        404
    );
    assert_eq!(
        conn.request("DELETE", "/api/v1/namespaces/demo/services/web")
            .code,
        405
    );
    assert_eq!(conn.request("GET", "/version").json()["major"], "1");
    let again = conn.request("GET", "/api/v1/namespaces/demo/services/web");
    assert_eq!(again.json()["metadata"]["name"], "web");
    // The connection can end a watch too, after which it is closed.
    let mut w = conn.watch("/api/v1/services?watch=true&timeoutSeconds=1");
    w.expect("ADDED");
    let started = Instant::now();
    assert!(w.next().is_none());
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(
        w.reader.read(&mut [0u8; 1]).unwrap(),
        0,
        "closed after the watch"
    );
}

#[test]
fn pagination_serves_a_consistent_snapshot() {
    let api = ApiServer::start().unwrap();
    let addr = api.addr();
    for i in 0..1203 {
        api.apply(web("demo", &format!("svc-{i:04}"), "10.96.0.1"));
    }
    let first = get(addr, "/api/v1/services?&limit=500").json();
    assert_eq!(first["items"].as_array().unwrap().len(), 500);
    let at = rv(&first);
    assert_eq!(first["metadata"]["remainingItemCount"], 703);
    // Writes between pages do not show in the later pages.
    api.delete("Service", Some("demo"), "svc-0700");
    api.apply(web("demo", "svc-0999", "10.96.9.9"));
    api.apply(web("demo", "zzz-new", "10.96.0.2"));
    let mut all = names(&first);
    let mut token = first["metadata"]["continue"].as_str().unwrap().to_owned();
    let mut pages = 1;
    loop {
        let page = get(
            addr,
            &format!("/api/v1/services?limit=500&continue={token}"),
        )
        .json();
        pages += 1;
        assert_eq!(rv(&page), at);
        all.extend(names(&page));
        let items = page["items"].as_array().unwrap();
        if let Some(i) = items.iter().find(|i| i["metadata"]["name"] == "svc-0999") {
            assert_eq!(i["spec"]["clusterIP"], "10.96.0.1");
        }
        match page["metadata"]["continue"].as_str() {
            Some(next) => token = next.to_owned(),
            None => break,
        }
    }
    assert_eq!(pages, 3);
    let expected: Vec<String> = (0..1203).map(|i| format!("svc-{i:04}")).collect();
    assert_eq!(all, expected);

    // With a selector, pages fill up to the limit; remainingItemCount is left out.
    let page = get(
        addr,
        "/api/v1/services?limit=2&fieldSelector=metadata.name!%3Dsvc-0000",
    )
    .json();
    assert_eq!(names(&page), ["svc-0001", "svc-0002"]);
    assert!(page["metadata"].get("remainingItemCount").is_none());
    assert!(page["metadata"]["continue"].is_string());
    // resourceVersion=0 is served from the cache: everything at once.
    let cached = get(
        addr,
        "/api/v1/services?limit=500&resourceVersion=0&resourceVersionMatch=NotOlderThan",
    )
    .json();
    assert_eq!(cached["items"].as_array().unwrap().len(), 1203);
    assert!(cached["metadata"].get("continue").is_none());
    // Invalid combinations, as the API server validates ListOptions.
    let invalid = get(
        addr,
        &format!(
            "/api/v1/services?limit=500&continue={token}&resourceVersionMatch=NotOlderThan&resourceVersion=0"
        ),
    );
    assert_eq!(invalid.code, 422);
    assert_eq!(invalid.json()["reason"], "Invalid");
    assert_eq!(
        get(addr, "/api/v1/services?resourceVersionMatch=Exact").code,
        422
    );
    assert_eq!(get(addr, "/api/v1/services?continue=zz").code, 400);
    // A continue token from before a compaction has expired.
    api.compact();
    let expired = get(
        addr,
        &format!("/api/v1/services?limit=500&continue={token}"),
    );
    assert_eq!(expired.code, 410);
    assert_eq!(expired.json()["reason"], "Expired");
}

#[test]
fn streaming_list_ends_initial_events_with_a_bookmark() {
    let api = ApiServer::start().unwrap();
    let addr = api.addr();
    api.apply(web("demo", "a", "10.96.0.1"));
    api.apply(web("demo", "b", "10.96.0.2"));
    let mut w = watch(
        addr,
        "/api/v1/services?watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true&resourceVersion=0",
    );
    w.expect("ADDED");
    w.expect("ADDED");
    let end = w.expect("BOOKMARK");
    assert_eq!(
        end["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );
    assert_eq!(rv(&end), api.resource_version());
    api.apply(web("demo", "c", "10.96.0.3"));
    w.expect("ADDED");

    let invalid = get(
        addr,
        "/api/v1/services?watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan",
    );
    assert_eq!(invalid.code, 422);
    assert_eq!(
        get(
            addr,
            "/api/v1/services?watch=true&resourceVersionMatch=NotOlderThan&resourceVersion=1"
        )
        .code,
        422
    );
}

#[test]
fn down_closes_everything_and_up_serves_again() {
    let api = ApiServer::start().unwrap();
    let addr = api.addr();
    api.apply(web("demo", "web", "10.96.0.1"));
    let mut w = watch(addr, "/api/v1/services?watch=true&resourceVersion=1");
    w.expect("ADDED");
    let mut idle = Conn::open(addr);
    assert_eq!(idle.request("GET", "/api/v1/services").code, 200);

    api.set_down(true);
    assert!(w.next().is_none());
    // The idle kept-alive connection was closed.
    let mut buf = [0u8; 1];
    assert!(matches!(idle.reader.read(&mut buf), Ok(0) | Err(_)));
    // New connections are closed at once.
    let mut fresh = TcpStream::connect(addr).unwrap();
    fresh.set_read_timeout(Some(TIMEOUT)).unwrap();
    let _ = fresh.write_all(b"GET /api/v1/services HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(matches!(fresh.read(&mut buf), Ok(0) | Err(_)));
    assert!(eventually(|| api.watchers("services") == 0));

    api.set_down(false);
    assert_eq!(get(addr, "/api/v1/services").code, 200);
    let mut w = watch(addr, "/api/v1/services?watch=true");
    w.expect("ADDED");
}

#[test]
fn watchers_are_counted_until_the_client_goes_away() {
    let api = ApiServer::start().unwrap();
    let w1 = watch(api.addr(), "/api/v1/services?watch=true");
    let w2 = watch(api.addr(), "/api/v1/services?watch=true");
    assert!(api.wait_for_watchers("services", 2, TIMEOUT));
    assert_eq!(api.watchers("nodes"), 0);
    assert!(!api.wait_for_watchers("nodes", 1, Duration::from_millis(50)));
    drop(w1);
    drop(w2);
    // Noticed without any event to write.
    assert!(eventually(|| api.watchers("services") == 0));
}

#[test]
fn kubeconfig_points_at_the_server() {
    let api = ApiServer::start().unwrap();
    let dir = std::env::temp_dir().join(format!("apiserver-kubeconfig-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("config");
    api.kubeconfig(&path).unwrap();
    let config: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(config["current-context"], "standin");
    assert_eq!(
        config["clusters"][0]["cluster"]["server"].as_str(),
        Some(format!("http://{}", api.addr()).as_str())
    );
    assert_eq!(config["contexts"][0]["context"]["user"], "standin");
    assert!(config["users"][0]["user"].as_mapping().unwrap().is_empty());
}

#[test]
fn dropping_the_server_ends_watches() {
    let api = ApiServer::start().unwrap();
    let addr = api.addr();
    let mut w = watch(addr, "/api/v1/services?watch=true");
    assert!(api.wait_for_watchers("services", 1, TIMEOUT));
    let started = Instant::now();
    drop(api);
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(w.next().is_none());
    assert!(TcpStream::connect(addr).is_err());
}

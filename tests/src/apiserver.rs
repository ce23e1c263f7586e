//! A small stand-in for kube-apiserver (DESIGN.md, "Test tiers" item 4): enough of the real
//! list/watch protocol over plain HTTP/1.1 for kube-rs clients and watchers, with objects in
//! the JSON the API returns. Point a client at it with [`ApiServer::kubeconfig`].
//!
//! Covered, as the real API server does it:
//! - Resources `services` and `endpointslices` (namespaced, also listed across namespaces),
//!   `nodes` and `servicecidrs` (cluster-scoped): list, watch, and GET of one object by name.
//! - One global resourceVersion counter, as etcd has: every write bumps it and stamps
//!   `metadata.resourceVersion`; creation sets `uid` and `creationTimestamp`, which updates keep.
//!   An update that changes nothing is a no-op (no new version, no event), as in the API.
//! - Lists: `{kind: ServiceList, apiVersion, metadata: {resourceVersion}, items}` with items in
//!   etcd key order (namespace, name) and without kind/apiVersion, as built-in types are listed.
//!   `limit`/`continue` pagination with every page served from the snapshot of the first page
//!   (`remainingItemCount` when there is no selector); a continue token older than the
//!   compaction point gets 410. `resourceVersion=0` is served "from the cache": the whole list,
//!   `limit` ignored, as the watch cache has long done. `resourceVersionMatch=Exact` serves the
//!   snapshot at that version (410 when compacted).
//! - Selectors: `fieldSelector` on `metadata.name` / `metadata.namespace` (`=`, `==`, `!=`; any
//!   other field is 400 "field label not supported"); `labelSelector` with `k`, `!k`, `k=v`,
//!   `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, comma-joined.
//! - Watches: 200, `Transfer-Encoding: chunked`, one `{"type":..,"object":..}` JSON line per
//!   event. Without a resourceVersion (or with `0`) the stream starts with synthetic ADDED
//!   events for the current objects; with `resourceVersion=N` it replays every event after N,
//!   then goes live. Selector transitions are handled as the watch cache does (an object that
//!   stops matching arrives as DELETED). `sendInitialEvents=true` (streaming lists) ends the
//!   initial ADDED events with a BOOKMARK annotated `k8s.io/initial-events-end: "true"`.
//!   BOOKMARKs (`allowWatchBookmarks=true`) are sent on [`ApiServer::bookmark`]. A version older
//!   than the compaction point gets one ERROR event with the 410 Expired Status, then the end
//!   of the stream. `timeoutSeconds` ends the stream (default 1800 s).
//! - Errors as Status objects: 403 Forbidden ([`ApiServer::forbid`]), 404 for unknown paths and
//!   objects, 405 for anything but GET (and Events' writes), 400/422 for bad parameters,
//!   including the ListOptions rules a client most easily breaks (`resourceVersionMatch`
//!   without `resourceVersion` or with `continue`, or on a watch without `sendInitialEvents`;
//!   `sendInitialEvents` without `resourceVersionMatch=NotOlderThan` and
//!   `allowWatchBookmarks=true`).
//! - HTTP/1.1 keep-alive for ordinary responses (`Content-Length`); a connection is closed
//!   after a watch ends. `GET /version`, `/healthz`, `/livez`, `/readyz` answer too.
//!
//! - Events (events.k8s.io/v1) can be created (POST) and merge-patched (PATCH) over HTTP, and
//!   are read back with [`ApiServer::events`]; they are not listed or watched.
//!
//! Not covered: TLS and authentication (the kubeconfig has a user without credentials; RBAC is
//! only what [`ApiServer::forbid`] switches off, and [`ApiServer::requests`] records the verbs
//! used), other writes over HTTP (objects change only through [`ApiServer::apply`] /
//! [`ApiServer::delete`], which replace whole objects, without validation, defaulting,
//! managedFields, generation, finalizers or owner references), protobuf, table output, other
//! resources and discovery (`/api`, `/apis`), `watch` path prefixes, periodic bookmarks,
//! resource versions newer than the current one (treated as current rather than waited for),
//! field selectors on other fields, and the "inconsistent continue" token. Timing (latency,
//! throttling, priority and fairness) is nothing like a real server's. [`ApiServer::compact`]
//! also bumps the resource version by one, as writes to other resources would, so that even a
//! client that had seen everything gets 410 on its next watch. [`ApiServer::set_down`] accepts
//! and at once closes new connections (the client sees a reset, not a refusal), so that the
//! listener, which may have been bound in another network namespace, can serve again.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

/// The user named in Forbidden messages: the agent's service account.
pub const USER: &str = "system:serviceaccount:kube-system:kube-proxy-ebpf";

/// A watch without `timeoutSeconds` ends after this (the real server picks 30 to 60 minutes).
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);
/// How often an idle watch checks whether the client went away.
const LIVENESS_CHECK: Duration = Duration::from_millis(200);
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
const MAX_HEAD: usize = 64 * 1024;
/// The largest request body read (Events are a few hundred bytes).
const MAX_BODY: usize = 1024 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Resource {
    Services,
    EndpointSlices,
    Nodes,
    ServiceCidrs,
}

impl Resource {
    const ALL: [Resource; 4] = [
        Self::Services,
        Self::EndpointSlices,
        Self::Nodes,
        Self::ServiceCidrs,
    ];

    fn index(self) -> usize {
        self as usize
    }

    fn plural(self) -> &'static str {
        match self {
            Self::Services => "services",
            Self::EndpointSlices => "endpointslices",
            Self::Nodes => "nodes",
            Self::ServiceCidrs => "servicecidrs",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Self::Services => "Service",
            Self::EndpointSlices => "EndpointSlice",
            Self::Nodes => "Node",
            Self::ServiceCidrs => "ServiceCIDR",
        }
    }

    fn group(self) -> &'static str {
        match self {
            Self::EndpointSlices => "discovery.k8s.io",
            Self::ServiceCidrs => "networking.k8s.io",
            _ => "",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Self::EndpointSlices => "discovery.k8s.io/v1",
            Self::ServiceCidrs => "networking.k8s.io/v1",
            _ => "v1",
        }
    }

    fn namespaced(self) -> bool {
        !matches!(self, Self::Nodes | Self::ServiceCidrs)
    }

    /// By kind ("Service") or resource ("services").
    fn lookup(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|r| r.kind() == name || r.plural() == name)
    }

    fn from_path(group: &str, version: &str, plural: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|r| r.group() == group && version == "v1" && r.plural() == plural)
    }

    /// "services", "endpointslices.discovery.k8s.io": how Status messages name the resource.
    fn qualified(self) -> String {
        match self.group() {
            "" => self.plural().to_owned(),
            group => format!("{}.{group}", self.plural()),
        }
    }

    /// `details` of a Status about this resource, as the API server fills it.
    fn details(self, name: Option<&str>) -> Value {
        let mut details = json!({"kind": self.plural()});
        if !self.group().is_empty() {
            details["group"] = json!(self.group());
        }
        if let Some(name) = name {
            details["name"] = json!(name);
        }
        details
    }
}

/// (namespace, name); the namespace is empty for nodes. Sorted like etcd keys.
type Key = (String, String);
type Objects = BTreeMap<Key, Arc<Value>>;

const ADDED: &str = "ADDED";
const MODIFIED: &str = "MODIFIED";
const DELETED: &str = "DELETED";

struct Event {
    rv: u64,
    resource: Resource,
    kind: &'static str,
    /// For DELETED, the last state of the object with the deletion's resourceVersion.
    object: Arc<Value>,
    prev: Option<Arc<Value>>,
}

#[derive(Default)]
struct Store {
    current: Objects,
    /// The state at the compaction point, from which older snapshots are rebuilt.
    base: Objects,
}

/// One request as received, for RBAC checks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    pub path: String,
    /// Raw (still percent-encoded) query string, without the `?`.
    pub query: String,
    /// RBAC verb: get, list, watch (create, update, patch, delete... for other methods).
    pub verb: String,
    /// API group, empty for the core group.
    pub group: String,
    /// Empty for non-resource paths such as `/version`.
    pub resource: String,
    pub namespace: Option<String>,
    pub name: Option<String>,
}

impl Request {
    /// A decoded query parameter.
    pub fn param(&self, key: &str) -> Option<String> {
        parse_query(&self.query)
            .into_iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
    }
}

struct State {
    rv: u64,
    /// Watches and exact lists from before this version get 410.
    compacted: u64,
    stores: [Store; 4],
    /// Every event after `compacted`, in resourceVersion order.
    history: Vec<Event>,
    /// Bumped by `bookmark()`.
    bookmarks: u64,
    /// Bumped to end every open watch.
    epoch: u64,
    down: bool,
    stopped: bool,
    forbidden: HashSet<Resource>,
    requests: Vec<Request>,
    /// Events posted (events.k8s.io/v1), with the patches made to them merged in.
    posted_events: Vec<Value>,
    watchers: [usize; 4],
    conns: HashMap<u64, TcpStream>,
    next_conn: u64,
    next_uid: u64,
}

impl State {
    /// History events after `rv`.
    fn events_after(&self, rv: u64) -> &[Event] {
        let start = self.history.partition_point(|e| e.rv <= rv);
        &self.history[start..]
    }

    /// The objects of `resource` as they were at version `at` (>= the compaction point).
    fn objects_at(&self, resource: Resource, at: u64) -> Cow<'_, Objects> {
        let store = &self.stores[resource.index()];
        if !self.events_after(at).iter().any(|e| e.resource == resource) {
            return Cow::Borrowed(&store.current);
        }
        let mut objects = store.base.clone();
        for event in self.history.iter().take_while(|e| e.rv <= at) {
            if event.resource != resource {
                continue;
            }
            let key = object_key(&event.object);
            if event.kind == DELETED {
                objects.remove(&key);
            } else {
                objects.insert(key, event.object.clone());
            }
        }
        Cow::Owned(objects)
    }
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    uid_seed: u32,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The stand-in API server. Stops (closing every connection) when dropped.
pub struct ApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    /// The listening socket again, to wake the accept loop on drop.
    listener_ctl: TcpStream,
    accept: Option<JoinHandle<()>>,
}

impl ApiServer {
    /// Listens on 127.0.0.1 (an ephemeral port) of the current network namespace.
    pub fn start() -> io::Result<Self> {
        Self::start_with_listener(TcpListener::bind("127.0.0.1:0")?)
    }

    /// Serves on a listener bound by the caller (for instance inside another network namespace).
    pub fn start_with_listener(listener: TcpListener) -> io::Result<Self> {
        let addr = listener.local_addr()?;
        listener.set_nonblocking(false)?;
        let listener_ctl = TcpStream::from(OwnedFd::from(listener.try_clone()?));
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .subsec_nanos();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                rv: 1,
                compacted: 0,
                stores: Default::default(),
                history: Vec::new(),
                bookmarks: 0,
                epoch: 0,
                down: false,
                stopped: false,
                forbidden: HashSet::new(),
                requests: Vec::new(),
                posted_events: Vec::new(),
                watchers: [0; 4],
                conns: HashMap::new(),
                next_conn: 0,
                next_uid: 0,
            }),
            changed: Condvar::new(),
            uid_seed: nanos ^ std::process::id().rotate_left(16),
        });
        let accept_shared = shared.clone();
        let accept = thread::Builder::new()
            .name("apiserver-accept".into())
            .spawn(move || accept_loop(accept_shared, listener))?;
        Ok(Self {
            shared,
            addr,
            listener_ctl,
            accept: Some(accept),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes a kubeconfig for this server: one cluster, one user without credentials, one
    /// context (namespace default), made current.
    pub fn kubeconfig(&self, path: impl AsRef<Path>) -> io::Result<()> {
        let text = format!(
            "apiVersion: v1
kind: Config
clusters:
- name: standin
  cluster:
    server: {}
users:
- name: standin
  user: {{}}
contexts:
- name: standin
  context:
    cluster: standin
    user: standin
    namespace: default
current-context: standin
preferences: {{}}
",
            self.url()
        );
        std::fs::write(path, text)
    }

    /// Creates or replaces the object (found by its kind, namespace and name; the namespace
    /// defaults to "default"), as a PUT would: server-managed metadata (uid, creationTimestamp,
    /// resourceVersion) is set, the rest taken as given. Returns the object's resourceVersion;
    /// a replacement that changes nothing keeps the old one and makes no event.
    ///
    /// Panics on a kind other than Service, EndpointSlice or Node, or a missing name.
    pub fn apply(&self, mut object: Value) -> u64 {
        let kind = object.get("kind").and_then(Value::as_str).unwrap_or("");
        let resource = Resource::lookup(kind).unwrap_or_else(|| {
            panic!("apply: unsupported kind {kind:?} (Service, EndpointSlice or Node)")
        });
        let map = object.as_object_mut().expect("apply: not a JSON object");
        map.insert("apiVersion".into(), json!(resource.api_version()));
        map.insert("kind".into(), json!(resource.kind()));
        let meta = map
            .entry("metadata")
            .or_insert_with(|| json!({}))
            .as_object_mut()
            .expect("apply: metadata is not an object");
        let name = meta
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .expect("apply: no metadata.name")
            .to_owned();
        let namespace = if resource.namespaced() {
            let ns = meta
                .get("namespace")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .unwrap_or("default")
                .to_owned();
            meta.insert("namespace".into(), json!(ns));
            ns
        } else {
            meta.remove("namespace");
            String::new()
        };
        let key = (namespace, name);

        let mut st = self.shared.lock();
        let old = st.stores[resource.index()].current.get(&key).cloned();
        let meta = object["metadata"].as_object_mut().expect("checked above");
        let kind = match &old {
            Some(old) => {
                for field in ["uid", "creationTimestamp", "resourceVersion"] {
                    match old["metadata"].get(field) {
                        Some(v) => meta.insert(field.into(), v.clone()),
                        None => meta.remove(field),
                    };
                }
                if object == **old {
                    return resource_version(old);
                }
                MODIFIED
            }
            None => {
                st.next_uid += 1;
                meta.insert("uid".into(), json!(uid(self.shared.uid_seed, st.next_uid)));
                meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
                ADDED
            }
        };
        st.rv += 1;
        let rv = st.rv;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let object = Arc::new(object);
        st.stores[resource.index()]
            .current
            .insert(key, object.clone());
        st.history.push(Event {
            rv,
            resource,
            kind,
            object,
            prev: old,
        });
        drop(st);
        self.shared.changed.notify_all();
        rv
    }

    /// Deletes an object (kind "Service" or resource "services"...; namespace None means
    /// "default" for namespaced kinds). Returns whether it existed.
    pub fn delete(&self, kind: &str, namespace: Option<&str>, name: &str) -> bool {
        let resource =
            Resource::lookup(kind).unwrap_or_else(|| panic!("delete: unsupported kind {kind:?}"));
        let key = key_for(resource, namespace, name);
        let mut st = self.shared.lock();
        let Some(old) = st.stores[resource.index()].current.remove(&key) else {
            return false;
        };
        st.rv += 1;
        let rv = st.rv;
        let mut object = (*old).clone();
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        st.history.push(Event {
            rv,
            resource,
            kind: DELETED,
            object: Arc::new(object),
            prev: Some(old),
        });
        drop(st);
        self.shared.changed.notify_all();
        true
    }

    /// The stored object, as a GET returns it.
    pub fn get(&self, kind: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let resource =
            Resource::lookup(kind).unwrap_or_else(|| panic!("get: unsupported kind {kind:?}"));
        let key = key_for(resource, namespace, name);
        let st = self.shared.lock();
        st.stores[resource.index()]
            .current
            .get(&key)
            .map(|o| (**o).clone())
    }

    /// The current (global) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().rv
    }

    /// Sends a BOOKMARK at the current resourceVersion to every watch that allows bookmarks.
    pub fn bookmark(&self) {
        self.shared.lock().bookmarks += 1;
        self.shared.changed.notify_all();
    }

    /// Compacts the history: every resourceVersion up to now becomes too old (the version is
    /// bumped by one, as a write elsewhere would), and every open watch is ended, so clients
    /// re-watch, get 410 Expired and must list again.
    pub fn compact(&self) {
        let mut st = self.shared.lock();
        st.rv += 1;
        st.compacted = st.rv;
        st.history.clear();
        for store in &mut st.stores {
            store.base = store.current.clone();
        }
        st.epoch += 1;
        drop(st);
        self.shared.changed.notify_all();
    }

    /// Down: every connection is closed and new ones are closed as soon as accepted, as if the
    /// server were unreachable. Up again: served as before, on the same address.
    pub fn set_down(&self, down: bool) {
        let mut st = self.shared.lock();
        st.down = down;
        if down {
            st.epoch += 1;
            for conn in st.conns.values() {
                let _ = conn.shutdown(Shutdown::Both);
            }
        }
        drop(st);
        self.shared.changed.notify_all();
    }

    /// While forbidden, get/list/watch of `resource` ("services", or the kind "Service") get
    /// 403 with the Status the RBAC authorizer produces for [`USER`].
    pub fn forbid(&self, resource: &str, forbidden: bool) {
        let resource = Resource::lookup(resource)
            .unwrap_or_else(|| panic!("forbid: unsupported resource {resource:?}"));
        let mut st = self.shared.lock();
        if forbidden {
            st.forbidden.insert(resource);
        } else {
            st.forbidden.remove(&resource);
        }
    }

    /// The Events posted so far (events.k8s.io/v1, as created, with later merge patches
    /// applied), in order.
    pub fn events(&self) -> Vec<Value> {
        self.shared.lock().posted_events.clone()
    }

    /// Every request received so far, in order.
    pub fn requests(&self) -> Vec<Request> {
        self.shared.lock().requests.clone()
    }

    /// Open watches of `resource` ("services" or "Service"...).
    pub fn watchers(&self, resource: &str) -> usize {
        let resource = Resource::lookup(resource)
            .unwrap_or_else(|| panic!("watchers: unsupported resource {resource:?}"));
        self.shared.lock().watchers[resource.index()]
    }

    /// Waits until at least `n` watches of `resource` are open; false on timeout. A watch
    /// counts from the moment every later write is sure to reach it.
    pub fn wait_for_watchers(&self, resource: &str, n: usize, timeout: Duration) -> bool {
        let resource = Resource::lookup(resource)
            .unwrap_or_else(|| panic!("wait_for_watchers: unsupported resource {resource:?}"));
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.lock();
        loop {
            if st.watchers[resource.index()] >= n {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.stopped = true;
        st.epoch += 1;
        for conn in st.conns.values() {
            let _ = conn.shutdown(Shutdown::Both);
        }
        drop(st);
        self.shared.changed.notify_all();
        // shutdown(2) on a listening socket makes a blocked accept(2) fail (Linux).
        let _ = self.listener_ctl.shutdown(Shutdown::Both);
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

fn key_for(resource: Resource, namespace: Option<&str>, name: &str) -> Key {
    let ns = if resource.namespaced() {
        namespace.filter(|n| !n.is_empty()).unwrap_or("default")
    } else {
        ""
    };
    (ns.to_owned(), name.to_owned())
}

fn object_key(object: &Value) -> Key {
    let meta = &object["metadata"];
    let field = |f: &str| meta[f].as_str().unwrap_or("").to_owned();
    (field("namespace"), field("name"))
}

fn resource_version(object: &Value) -> u64 {
    object["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|rv| rv.parse().ok())
        .unwrap_or(0)
}

fn uid(seed: u32, n: u64) -> String {
    format!(
        "{seed:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        (n >> 48) & 0xffff,
        (n >> 36) & 0xfff,
        (n >> 24) & 0xfff,
        n & 0xff_ffff
    )
}

/// UTC now as RFC 3339 with seconds, as metav1.Time serializes.
fn now_rfc3339() -> String {
    proxy_userspace::serve::healthz::rfc3339(SystemTime::now())
}

// ---------------------------------------------------------------------------------------------
// HTTP

fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    for conn in listener.incoming() {
        let mut st = shared.lock();
        if st.stopped {
            return;
        }
        let stream = match conn {
            Ok(stream) => stream,
            Err(_) => {
                drop(st);
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if st.down {
            // Unreachable: the client sees the connection reset.
            let _ = stream.shutdown(Shutdown::Both);
            continue;
        }
        let Ok(registered) = stream.try_clone() else {
            continue;
        };
        st.next_conn += 1;
        let id = st.next_conn;
        st.conns.insert(id, registered);
        drop(st);
        let conn_shared = shared.clone();
        let spawned = thread::Builder::new()
            .name("apiserver-conn".into())
            .spawn(move || {
                let _ = serve_connection(&conn_shared, stream);
                conn_shared.lock().conns.remove(&id);
            });
        if spawned.is_err() {
            shared.lock().conns.remove(&id);
        }
    }
}

struct Head {
    method: String,
    target: String,
    keep_alive: bool,
    body: Vec<u8>,
}

/// Reads a request head and its body. None at a clean end of the connection.
fn read_head(reader: &mut BufReader<TcpStream>) -> io::Result<Option<Head>> {
    let mut line = String::new();
    let mut total = 0;
    // Tolerate empty lines before a request (RFC 9112 2.2).
    loop {
        line.clear();
        let n = reader.read_line(&mut line)?;
        if n == 0 {
            return Ok(None);
        }
        total += n;
        if !line.trim().is_empty() {
            break;
        }
        if total > MAX_HEAD {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "head too long"));
        }
    }
    let mut parts = line.split_whitespace();
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "bad request line",
        ));
    };
    let (method, target) = (method.to_owned(), target.to_owned());
    let mut keep_alive = version == "HTTP/1.1";
    let mut content_length = 0usize;
    loop {
        line.clear();
        let n = reader.read_line(&mut line)?;
        total += n;
        if n == 0 || total > MAX_HEAD {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "bad head"));
        }
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        let Some((name, value)) = header.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match name.trim().to_ascii_lowercase().as_str() {
            "content-length" => {
                content_length = value.parse().map_err(|_| {
                    io::Error::new(io::ErrorKind::InvalidData, "bad content-length")
                })?;
            }
            "connection" => {
                let value = value.to_ascii_lowercase();
                if value.contains("close") {
                    keep_alive = false;
                } else if value.contains("keep-alive") {
                    keep_alive = true;
                }
            }
            "transfer-encoding" => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "chunked request bodies are not supported",
                ));
            }
            _ => {}
        }
    }
    if content_length > MAX_BODY {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "body too long"));
    }
    let mut body = vec![0; content_length];
    reader.read_exact(&mut body)?;
    Ok(Some(Head {
        method,
        target,
        keep_alive,
        body,
    }))
}

fn serve_connection(shared: &Shared, stream: TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    while let Some(head) = read_head(&mut reader)? {
        let close = handle(shared, &head, &stream)?;
        if close || !head.keep_alive {
            break;
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
    Ok(())
}

struct Reply {
    code: u16,
    body: Vec<u8>,
}

impl Reply {
    fn json(code: u16, value: &Value) -> Self {
        Reply {
            code,
            body: serde_json::to_vec(value).expect("JSON values serialize"),
        }
    }

    fn status(code: u16, reason: &str, message: &str, details: Value) -> Self {
        Self::json(code, &status(code, reason, message, details))
    }

    fn write(&self, mut out: &TcpStream, keep_alive: bool) -> io::Result<()> {
        let mut head = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: application/json\r\nCache-Control: no-cache, private\r\nContent-Length: {}\r\n",
            self.code,
            phrase(self.code),
            self.body.len()
        );
        if !keep_alive {
            head.push_str("Connection: close\r\n");
        }
        head.push_str("\r\n");
        let mut buf = head.into_bytes();
        buf.extend_from_slice(&self.body);
        out.write_all(&buf)
    }
}

fn phrase(code: u16) -> &'static str {
    match code {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        410 => "Gone",
        422 => "Unprocessable Entity",
        _ => "Error",
    }
}

/// A failure Status, as the API server serializes metav1.Status.
fn status(code: u16, reason: &str, message: &str, details: Value) -> Value {
    let mut status = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    });
    if !details.is_null() {
        status["details"] = details;
    }
    status
}

fn expired(message: &str) -> Value {
    status(410, "Expired", message, Value::Null)
}

/// 422 for a broken ListOptions rule, worded as the API server's validation.
fn invalid_options(field: &str, message: &str) -> Reply {
    Reply::status(
        422,
        "Invalid",
        &format!("ListOptions.meta.k8s.io \"\" is invalid: {field}: Forbidden: {message}"),
        json!({"group": "meta.k8s.io", "kind": "ListOptions", "causes": [
            {"reason": "FieldValueForbidden", "message": format!("Forbidden: {message}"), "field": field}
        ]}),
    )
}

fn bad_request(message: &str) -> Reply {
    Reply::status(400, "BadRequest", message, Value::Null)
}

struct Query(Vec<(String, String)>);

impl Query {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Non-empty value.
    fn value(&self, key: &str) -> Option<&str> {
        self.get(key).filter(|v| !v.is_empty())
    }

    /// As the API server decodes booleans: absent, "0" and "false" are false, all else true.
    fn flag(&self, key: &str) -> Option<bool> {
        self.get(key)
            .map(|v| v != "0" && !v.eq_ignore_ascii_case("false"))
    }
}

fn parse_query(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let hex = |b: u8| (b as char).to_digit(16);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(hi), Some(lo)) => {
                    out.push((hi * 16 + lo) as u8);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// (group, version, namespace, resource, name) of an API path.
type ApiPath = (String, String, Option<String>, String, Option<String>);

fn parse_api_path(path: &str) -> Option<ApiPath> {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segments.as_slice() {
        ["api", version, rest @ ..] => ("", *version, rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return None,
    };
    let s = |x: &str| x.to_owned();
    let (namespace, resource, name) = match rest {
        ["namespaces", ns, resource] => (Some(s(ns)), s(resource), None),
        ["namespaces", ns, resource, name] => (Some(s(ns)), s(resource), Some(s(name))),
        [resource] => (None, s(resource), None),
        [resource, name] => (None, s(resource), Some(s(name))),
        _ => return None,
    };
    if resource.is_empty() || name.as_deref() == Some("") {
        return None;
    }
    Some((s(group), s(version), namespace, resource, name))
}

/// An Event created (POST, no name) or merge-patched (PATCH, by name), as stored.
fn post_event(shared: &Shared, method: &str, name: Option<&str>, body: &[u8]) -> Reply {
    let Ok(Value::Object(object)) = serde_json::from_slice::<Value>(body) else {
        return bad_request("the body is not a JSON object");
    };
    let mut st = shared.lock();
    match (method, name) {
        ("POST", None) => {
            let object = Value::Object(object);
            st.posted_events.push(object.clone());
            Reply::json(201, &object)
        }
        ("PATCH", Some(name)) => {
            let stored = st
                .posted_events
                .iter_mut()
                .find(|e| e["metadata"]["name"] == name);
            let Some(Value::Object(stored)) = stored else {
                let message = format!("events.events.k8s.io \"{name}\" not found");
                return Reply::status(404, "NotFound", &message, json!({}));
            };
            stored.extend(object);
            Reply::json(200, &Value::Object(stored.clone()))
        }
        _ => {
            let message = "the server does not allow this method on the requested resource";
            Reply::status(405, "MethodNotAllowed", message, json!({}))
        }
    }
}

/// Serves one request; returns true when the connection must be closed.
fn handle(shared: &Shared, head: &Head, stream: &TcpStream) -> io::Result<bool> {
    let (path, raw_query) = head
        .target
        .split_once('?')
        .unwrap_or((head.target.as_str(), ""));
    let query = Query(parse_query(raw_query));
    let api = parse_api_path(path);
    let watch = query.flag("watch") == Some(true);
    let verb = match (head.method.as_str(), &api) {
        ("GET", Some((.., Some(_)))) => "get".to_owned(),
        ("GET", Some(_)) if watch => "watch".to_owned(),
        ("GET", Some(_)) => "list".to_owned(),
        ("GET", None) => "get".to_owned(),
        ("POST", _) => "create".to_owned(),
        ("PUT", _) => "update".to_owned(),
        ("PATCH", _) => "patch".to_owned(),
        ("DELETE", Some((.., Some(_)))) => "delete".to_owned(),
        ("DELETE", _) => "deletecollection".to_owned(),
        (other, _) => other.to_ascii_lowercase(),
    };
    let request = Request {
        method: head.method.clone(),
        path: path.to_owned(),
        query: raw_query.to_owned(),
        verb: verb.clone(),
        group: api.as_ref().map(|a| a.0.clone()).unwrap_or_default(),
        resource: api.as_ref().map(|a| a.3.clone()).unwrap_or_default(),
        namespace: api.as_ref().and_then(|a| a.2.clone()),
        name: api.as_ref().and_then(|a| a.4.clone()),
    };
    let forbidden = {
        let mut st = shared.lock();
        st.requests.push(request);
        st.forbidden.clone()
    };
    let keep = head.keep_alive;
    let not_found = || {
        Reply::status(
            404,
            "NotFound",
            "the server could not find the requested resource",
            json!({}),
        )
    };
    if let Some(("events.k8s.io", "v1", Some(_), "events", name)) = api.as_ref().map(|a| {
        (
            a.0.as_str(),
            a.1.as_str(),
            a.2.as_deref(),
            a.3.as_str(),
            a.4.as_deref(),
        )
    }) {
        let reply = post_event(shared, &head.method, name, &head.body);
        reply.write(stream, keep)?;
        return Ok(false);
    }
    if head.method != "GET" {
        let message = "the server does not allow this method on the requested resource";
        Reply::status(405, "MethodNotAllowed", message, json!({})).write(stream, keep)?;
        return Ok(false);
    }
    let Some((group, version, namespace, plural, name)) = api else {
        let reply = match path {
            "/version" => Reply::json(
                200,
                &json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0-standin",
                    "gitCommit": "", "gitTreeState": "clean", "buildDate": "",
                    "goVersion": "", "compiler": "gc", "platform": "linux/amd64"}),
            ),
            "/healthz" | "/livez" | "/readyz" => Reply {
                code: 200,
                body: b"ok".to_vec(),
            },
            _ => not_found(),
        };
        reply.write(stream, keep)?;
        return Ok(false);
    };
    let resource = match Resource::from_path(&group, &version, &plural) {
        Some(r) if namespace.is_none() || r.namespaced() => r,
        _ => {
            not_found().write(stream, keep)?;
            return Ok(false);
        }
    };
    if forbidden.contains(&resource) {
        let scope = match &namespace {
            Some(ns) => format!("in the namespace \"{ns}\""),
            None => "at the cluster scope".to_owned(),
        };
        let subject = match &name {
            Some(name) => format!("{} \"{name}\"", resource.qualified()),
            None => resource.qualified(),
        };
        let message = format!(
            "{subject} is forbidden: User \"{USER}\" cannot {verb} resource \"{plural}\" in API group \"{group}\" {scope}"
        );
        let details = resource.details(name.as_deref());
        Reply::status(403, "Forbidden", &message, details).write(stream, keep)?;
        return Ok(false);
    }
    if let Some(name) = name {
        let key = match (&namespace, resource.namespaced()) {
            (Some(ns), true) => (ns.clone(), name.clone()),
            (None, false) => (String::new(), name.clone()),
            // A namespaced resource by name needs its namespace.
            _ => {
                not_found().write(stream, keep)?;
                return Ok(false);
            }
        };
        let object = shared.lock().stores[resource.index()]
            .current
            .get(&key)
            .cloned();
        let reply = match object {
            Some(object) => Reply::json(200, &object),
            None => Reply::status(
                404,
                "NotFound",
                &format!("{} \"{name}\" not found", resource.qualified()),
                resource.details(Some(&name)),
            ),
        };
        reply.write(stream, keep)?;
        return Ok(false);
    }
    let filter = match Filter::parse(namespace, &query) {
        Ok(filter) => filter,
        Err(reply) => {
            reply.write(stream, keep)?;
            return Ok(false);
        }
    };
    if watch {
        match serve_watch(shared, stream, resource, &filter, &query) {
            Ok(()) => {}
            Err(WatchError::Reply(reply)) => reply.write(stream, false)?,
            Err(WatchError::Io(e)) => return Err(e),
        }
        return Ok(true);
    }
    list(shared, resource, &filter, &query).write(stream, keep)?;
    Ok(false)
}

// ---------------------------------------------------------------------------------------------
// Selectors

enum FieldOp {
    Eq,
    Ne,
}

enum LabelReq {
    Exists(String),
    NotExists(String),
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

struct Filter {
    namespace: Option<String>,
    fields: Vec<(String, FieldOp, String)>,
    labels: Vec<LabelReq>,
}

impl Filter {
    fn parse(namespace: Option<String>, query: &Query) -> Result<Self, Reply> {
        let mut fields = Vec::new();
        for term in query.get("fieldSelector").unwrap_or("").split(',') {
            let term = term.trim();
            if term.is_empty() {
                continue;
            }
            let (field, op, value) = if let Some((f, v)) = term.split_once("!=") {
                (f, FieldOp::Ne, v)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, FieldOp::Eq, v)
            } else if let Some((f, v)) = term.split_once('=') {
                (f, FieldOp::Eq, v)
            } else {
                return Err(bad_request(&format!(
                    "invalid selector: '{term}'; can't understand '{term}'"
                )));
            };
            let field = field.trim();
            if field != "metadata.name" && field != "metadata.namespace" {
                return Err(bad_request(&format!("field label not supported: {field}")));
            }
            fields.push((field.to_owned(), op, value.trim().to_owned()));
        }
        let mut labels = Vec::new();
        for term in split_top_level(query.get("labelSelector").unwrap_or("")) {
            let term = term.trim();
            if term.is_empty() {
                continue;
            }
            let invalid = || {
                bad_request(&format!(
                    "unable to parse requirement: found '{term}', expected: a valid label selector"
                ))
            };
            let set = |rest: &str| -> Option<Vec<String>> {
                let inner = rest.trim().strip_prefix('(')?.strip_suffix(')')?;
                Some(inner.split(',').map(|v| v.trim().to_owned()).collect())
            };
            let req = if let Some(key) = term.strip_prefix('!') {
                LabelReq::NotExists(key.trim().to_owned())
            } else if let Some((k, rest)) = term.split_once(" notin ") {
                LabelReq::NotIn(k.trim().to_owned(), set(rest).ok_or_else(invalid)?)
            } else if let Some((k, rest)) = term.split_once(" in ") {
                LabelReq::In(k.trim().to_owned(), set(rest).ok_or_else(invalid)?)
            } else if let Some((k, v)) = term.split_once("!=") {
                LabelReq::Ne(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, v)) = term.split_once("==") {
                LabelReq::Eq(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, v)) = term.split_once('=') {
                LabelReq::Eq(k.trim().to_owned(), v.trim().to_owned())
            } else {
                LabelReq::Exists(term.to_owned())
            };
            let key = match &req {
                LabelReq::Exists(k)
                | LabelReq::NotExists(k)
                | LabelReq::Eq(k, _)
                | LabelReq::Ne(k, _)
                | LabelReq::In(k, _)
                | LabelReq::NotIn(k, _) => k,
            };
            if key.is_empty() || key.contains(char::is_whitespace) || key.contains(['(', ')']) {
                return Err(invalid());
            }
            labels.push(req);
        }
        Ok(Filter {
            namespace,
            fields,
            labels,
        })
    }

    fn has_selectors(&self) -> bool {
        !self.fields.is_empty() || !self.labels.is_empty()
    }

    fn matches(&self, object: &Value) -> bool {
        let meta = &object["metadata"];
        let namespace = meta["namespace"].as_str().unwrap_or("");
        if self.namespace.as_deref().is_some_and(|ns| ns != namespace) {
            return false;
        }
        let fields_ok = self.fields.iter().all(|(field, op, want)| {
            let have = match field.as_str() {
                "metadata.name" => meta["name"].as_str().unwrap_or(""),
                _ => namespace,
            };
            matches!(op, FieldOp::Eq) == (have == want)
        });
        let label = |k: &str| meta["labels"].get(k).and_then(Value::as_str);
        fields_ok
            && self.labels.iter().all(|req| match req {
                LabelReq::Exists(k) => label(k).is_some(),
                LabelReq::NotExists(k) => label(k).is_none(),
                LabelReq::Eq(k, v) => label(k) == Some(v),
                LabelReq::Ne(k, v) => label(k) != Some(v),
                LabelReq::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
                LabelReq::NotIn(k, vs) => label(k).is_none_or(|l| vs.iter().all(|v| v != l)),
            })
    }
}

/// Splits on commas outside parentheses (`a in (x,y),b`).
fn split_top_level(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

// ---------------------------------------------------------------------------------------------
// List

fn list(shared: &Shared, resource: Resource, filter: &Filter, query: &Query) -> Reply {
    let rv_param = query.value("resourceVersion");
    let rv_match = query.value("resourceVersionMatch");
    let continue_token = query.value("continue");
    if rv_match.is_some() && rv_param.is_none() {
        return invalid_options(
            "resourceVersionMatch",
            "resourceVersionMatch is forbidden unless resourceVersion is provided",
        );
    }
    if rv_match.is_some() && continue_token.is_some() {
        return invalid_options(
            "resourceVersionMatch",
            "resourceVersionMatch is forbidden when continue is provided",
        );
    }
    let limit = match query.value("limit").map(str::parse::<usize>) {
        None => None,
        Some(Ok(0)) => None,
        Some(Ok(n)) => Some(n),
        Some(Err(_)) => return bad_request("limit: invalid value"),
    };
    let rv = match rv_param.map(str::parse::<u64>) {
        None => None,
        Some(Ok(rv)) => Some(rv),
        Some(Err(_)) => {
            return bad_request(&format!(
                "invalid resource version: {}",
                rv_param.unwrap_or("")
            ));
        }
    };

    let st = shared.lock();
    let (at, start) = if let Some(token) = continue_token {
        if rv.is_some_and(|rv| rv != 0) {
            return bad_request("specifying resource version is not allowed when using continue");
        }
        let Some((at, key)) = decode_continue(token) else {
            return bad_request("continue key is not valid: illegal base64 data");
        };
        if at < st.compacted {
            return Reply::json(
                410,
                &expired(
                    "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
                ),
            );
        }
        (at, Some(key))
    } else if rv_match == Some("Exact") {
        let at = rv.unwrap_or(0);
        if at < st.compacted {
            let message = format!("too old resource version: {at} ({})", st.compacted);
            return Reply::json(410, &expired(&message));
        }
        (at.min(st.rv), None)
    } else {
        (st.rv, None)
    };
    // resourceVersion=0 is served from the (watch) cache, which ignores limit.
    let limit = if continue_token.is_none() && rv == Some(0) {
        None
    } else {
        limit
    };
    let objects = st.objects_at(resource, at);
    let range = match &start {
        Some(key) => {
            objects.range::<Key, _>((std::ops::Bound::Excluded(key), std::ops::Bound::Unbounded))
        }
        None => objects.range::<Key, _>(..),
    };
    let mut items = Vec::new();
    let mut last = None;
    let mut scanned = 0;
    for (key, object) in range {
        if limit.is_some_and(|l| items.len() >= l) {
            break;
        }
        scanned += 1;
        last = Some(key);
        if filter.matches(object) {
            items.push(object.clone());
        }
    }
    let remaining = objects.len()
        - start
            .as_ref()
            .map_or(0, |k| objects.range::<Key, _>(..=k).count())
        - scanned;
    let mut metadata = json!({"resourceVersion": at.to_string()});
    if remaining > 0
        && let Some(last) = last
    {
        metadata["continue"] = json!(encode_continue(at, last));
        if !filter.has_selectors() {
            metadata["remainingItemCount"] = json!(remaining);
        }
    }
    drop(st);

    let mut body = Vec::with_capacity(256 + items.len() * 512);
    let head =
        json!({"kind": format!("{}List", resource.kind()), "apiVersion": resource.api_version()});
    body.extend_from_slice(
        format!(
            "{{\"kind\":{},\"apiVersion\":{},\"metadata\":{},\"items\":[",
            head["kind"], head["apiVersion"], metadata
        )
        .as_bytes(),
    );
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        write_list_item(&mut body, item);
    }
    body.extend_from_slice(b"]}");
    Reply { code: 200, body }
}

/// An object as a list item: built-in types are listed without kind and apiVersion.
fn write_list_item(out: &mut Vec<u8>, object: &Value) {
    let Some(map) = object.as_object() else {
        serde_json::to_writer(&mut *out, object).expect("JSON values serialize");
        return;
    };
    out.push(b'{');
    let mut first = true;
    for (k, v) in map {
        if k == "kind" || k == "apiVersion" {
            continue;
        }
        if !first {
            out.push(b',');
        }
        first = false;
        serde_json::to_writer(&mut *out, k).expect("strings serialize");
        out.push(b':');
        serde_json::to_writer(&mut *out, v).expect("JSON values serialize");
    }
    out.push(b'}');
}

/// An opaque token: hex of "rv\0namespace\0name" (the last key returned).
fn encode_continue(rv: u64, (ns, name): &Key) -> String {
    format!("{rv}\0{ns}\0{name}")
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn decode_continue(token: &str) -> Option<(u64, Key)> {
    if !token.len().is_multiple_of(2) || !token.is_ascii() {
        return None;
    }
    let bytes = (0..token.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&token[i..i + 2], 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    let text = String::from_utf8(bytes).ok()?;
    let mut parts = text.split('\0');
    let rv = parts.next()?.parse().ok()?;
    let key = (parts.next()?.to_owned(), parts.next()?.to_owned());
    parts.next().is_none().then_some((rv, key))
}

// ---------------------------------------------------------------------------------------------
// Watch

enum WatchError {
    /// Refused before the stream started.
    Reply(Reply),
    Io(io::Error),
}

impl From<io::Error> for WatchError {
    fn from(e: io::Error) -> Self {
        WatchError::Io(e)
    }
}

/// Decrements the watcher count when the watch ends, however it ends.
struct WatcherGuard<'a>(&'a Shared, Resource);

impl Drop for WatcherGuard<'_> {
    fn drop(&mut self) {
        self.0.lock().watchers[self.1.index()] -= 1;
        self.0.changed.notify_all();
    }
}

struct Chunks<'a> {
    out: BufWriter<&'a TcpStream>,
}

impl Chunks<'_> {
    fn event(&mut self, kind: &str, object: &Value) -> io::Result<()> {
        let mut line = format!("{{\"type\":\"{kind}\",\"object\":").into_bytes();
        serde_json::to_writer(&mut line, object).expect("JSON values serialize");
        line.extend_from_slice(b"}\n");
        write!(self.out, "{:x}\r\n", line.len())?;
        self.out.write_all(&line)?;
        self.out.write_all(b"\r\n")
    }

    fn finish(mut self) -> io::Result<()> {
        self.out.write_all(b"0\r\n\r\n")?;
        self.out.flush()
    }
}

/// The object of a BOOKMARK: only type information and the resourceVersion, with the zero
/// `creationTimestamp` Go serializes as null.
fn bookmark_object(resource: Resource, rv: u64, initial_events_end: bool) -> Value {
    let mut metadata = json!({"resourceVersion": rv.to_string(), "creationTimestamp": null});
    if initial_events_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    json!({"kind": resource.kind(), "apiVersion": resource.api_version(), "metadata": metadata})
}

/// The event a watch with `filter` gets for a history event, as the watch cache decides.
fn convert(event: &Event, filter: &Filter) -> Option<(&'static str, Arc<Value>)> {
    let current = event.kind != DELETED && filter.matches(&event.object);
    let previous = event.prev.as_ref().is_some_and(|p| filter.matches(p));
    match (current, previous) {
        (true, false) => Some((ADDED, event.object.clone())),
        (true, true) => Some((MODIFIED, event.object.clone())),
        (false, true) if event.kind == DELETED => Some((DELETED, event.object.clone())),
        (false, true) => {
            // Left the selection: the previous state, at this event's version.
            let mut object = (**event.prev.as_ref().expect("previous matched")).clone();
            object["metadata"]["resourceVersion"] = json!(event.rv.to_string());
            Some((DELETED, Arc::new(object)))
        }
        (false, false) => None,
    }
}

fn peer_closed(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return true;
    }
    let result = stream.peek(&mut [0u8; 1]);
    let _ = stream.set_nonblocking(false);
    match result {
        Ok(n) => n == 0,
        Err(e) => e.kind() != io::ErrorKind::WouldBlock,
    }
}

fn serve_watch(
    shared: &Shared,
    stream: &TcpStream,
    resource: Resource,
    filter: &Filter,
    query: &Query,
) -> Result<(), WatchError> {
    let send_initial = query.flag("sendInitialEvents");
    let bookmarks = query.flag("allowWatchBookmarks") == Some(true);
    let rv_match = query.value("resourceVersionMatch");
    if send_initial.is_none() && rv_match.is_some() {
        return Err(WatchError::Reply(invalid_options(
            "resourceVersionMatch",
            "resourceVersionMatch is forbidden for watch",
        )));
    }
    if send_initial.is_some() && rv_match != Some("NotOlderThan") {
        return Err(WatchError::Reply(invalid_options(
            "resourceVersionMatch",
            "sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
        )));
    }
    if send_initial == Some(true) && !bookmarks {
        return Err(WatchError::Reply(invalid_options(
            "allowWatchBookmarks",
            "sendInitialEvents requires setting allowWatchBookmarks to true",
        )));
    }
    let rv = match query.value("resourceVersion").map(str::parse::<u64>) {
        None => None,
        Some(Ok(rv)) => Some(rv),
        Some(Err(_)) => {
            let message = format!(
                "invalid resource version: {}",
                query.value("resourceVersion").unwrap_or("")
            );
            return Err(WatchError::Reply(bad_request(&message)));
        }
    };
    let timeout = query
        .value("timeoutSeconds")
        .and_then(|t| t.parse().ok())
        .map_or(DEFAULT_WATCH_TIMEOUT, Duration::from_secs);
    let deadline = Instant::now() + timeout;
    let initial_events = send_initial.unwrap_or(matches!(rv, None | Some(0)));

    let mut st = shared.lock();
    let too_old = match rv {
        Some(rv) if rv != 0 && !initial_events && rv < st.compacted => Some(st.compacted),
        _ => None,
    };
    let mut cursor = match rv {
        Some(rv) if rv != 0 && !initial_events => rv,
        _ => st.rv,
    };
    let initial: Vec<Arc<Value>> = if initial_events && too_old.is_none() {
        st.stores[resource.index()]
            .current
            .values()
            .filter(|o| filter.matches(o))
            .cloned()
            .collect()
    } else {
        Vec::new()
    };
    let epoch = st.epoch;
    let mut seen_bookmarks = st.bookmarks;
    let _guard = if too_old.is_none() {
        st.watchers[resource.index()] += 1;
        Some(WatcherGuard(shared, resource))
    } else {
        None
    };
    drop(st);
    shared.changed.notify_all();

    let mut out = BufWriter::with_capacity(64 * 1024, stream);
    out.write_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nCache-Control: no-cache, private\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
    )?;
    let mut chunks = Chunks { out };
    if let Some(compacted) = too_old {
        let message = format!(
            "too old resource version: {} ({compacted})",
            rv.unwrap_or(0)
        );
        chunks.event("ERROR", &expired(&message))?;
        return Ok(chunks.finish()?);
    }
    for object in &initial {
        chunks.event(ADDED, object)?;
    }
    if send_initial == Some(true) {
        chunks.event("BOOKMARK", &bookmark_object(resource, cursor, true))?;
    }
    chunks.out.flush()?;
    drop(initial);

    loop {
        let mut events = Vec::new();
        let mut bookmark = None;
        let mut st = shared.lock();
        loop {
            if st.epoch != epoch || st.stopped {
                drop(st);
                return Ok(chunks.finish()?);
            }
            let now = Instant::now();
            if now >= deadline {
                drop(st);
                return Ok(chunks.finish()?);
            }
            for event in st.events_after(cursor) {
                if event.resource == resource
                    && let Some(converted) = convert(event, filter)
                {
                    events.push(converted);
                }
            }
            cursor = cursor.max(st.rv);
            if bookmarks && st.bookmarks != seen_bookmarks {
                seen_bookmarks = st.bookmarks;
                bookmark = Some(cursor);
            }
            if !events.is_empty() || bookmark.is_some() {
                break;
            }
            let wait = (deadline - now).min(LIVENESS_CHECK);
            let (guard, result) = shared
                .changed
                .wait_timeout(st, wait)
                .unwrap_or_else(PoisonError::into_inner);
            st = guard;
            if result.timed_out() {
                drop(st);
                if peer_closed(stream) {
                    return Ok(());
                }
                st = shared.lock();
            }
        }
        drop(st);
        for (kind, object) in &events {
            chunks.event(kind, object)?;
        }
        if let Some(rv) = bookmark {
            chunks.event("BOOKMARK", &bookmark_object(resource, rv, false))?;
        }
        chunks.out.flush()?;
    }
}

// ---------------------------------------------------------------------------------------------
// Objects in the shape the API returns them (server-managed metadata is added by `apply`).

/// A ClusterIP Service (`cluster_ip` "None" for a headless one), as the API server stores it
/// after defaulting. Ports: (name, port, protocol, targetPort); an empty name is left out.
pub fn service(ns: &str, name: &str, cluster_ip: &str, ports: &[(&str, u16, &str, u16)]) -> Value {
    let ports: Vec<Value> = ports
        .iter()
        .map(|&(port_name, port, protocol, target_port)| {
            let mut p = json!({"port": port, "protocol": protocol, "targetPort": target_port});
            if !port_name.is_empty() {
                p["name"] = json!(port_name);
            }
            p
        })
        .collect();
    let mut spec = json!({
        "clusterIP": cluster_ip,
        "clusterIPs": [cluster_ip],
        "internalTrafficPolicy": "Cluster",
        "ipFamilies": ["IPv4"],
        "ipFamilyPolicy": "SingleStack",
        "selector": {"app": name},
        "sessionAffinity": "None",
        "type": "ClusterIP",
    });
    if !ports.is_empty() {
        spec["ports"] = json!(ports);
    }
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
        "status": {"loadBalancer": {}},
    })
}

/// An IPv4 EndpointSlice of `service` as the EndpointSlice controller writes it. Endpoints:
/// (ip, ready, nodeName); serving follows ready, terminating is false. Ports:
/// (name, port, protocol). Empty lists are `null`, as the API returns them.
pub fn endpoint_slice(
    ns: &str,
    name: &str,
    service: &str,
    endpoints: &[(&str, bool, Option<&str>)],
    ports: &[(&str, u16, &str)],
) -> Value {
    let endpoints: Vec<Value> = endpoints
        .iter()
        .map(|&(ip, ready, node)| {
            let mut e = json!({
                "addresses": [ip],
                "conditions": {"ready": ready, "serving": ready, "terminating": false},
            });
            if let Some(node) = node {
                e["nodeName"] = json!(node);
            }
            e
        })
        .collect();
    let ports: Vec<Value> = ports
        .iter()
        .map(|&(port_name, port, protocol)| {
            json!({"name": port_name, "port": port, "protocol": protocol})
        })
        .collect();
    let or_null = |v: Vec<Value>| if v.is_empty() { Value::Null } else { json!(v) };
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": ns,
            "generateName": format!("{service}-"),
            "labels": {
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                "kubernetes.io/service-name": service,
            },
            // The controller stamps the time of the change that made this version.
            "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": now_rfc3339()},
        },
        "addressType": "IPv4",
        "endpoints": or_null(endpoints),
        "ports": or_null(ports),
    })
}

/// A Ready Linux node with its InternalIP and Hostname addresses.
pub fn node(name: &str, internal_ip: &str) -> Value {
    let now = now_rfc3339();
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "beta.kubernetes.io/arch": "amd64",
                "beta.kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
            },
        },
        "spec": {},
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": internal_ip},
                {"type": "Hostname", "address": name},
            ],
            "conditions": [{
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "kubelet is posting ready status",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "architecture": "amd64",
                "bootID": "",
                "containerRuntimeVersion": "containerd://1.7.24",
                "kernelVersion": "6.1.0",
                "kubeProxyVersion": "",
                "kubeletVersion": "v1.33.0",
                "machineID": "",
                "operatingSystem": "linux",
                "osImage": "Debian GNU/Linux 12 (bookworm)",
                "systemUUID": "",
            },
        },
    })
}

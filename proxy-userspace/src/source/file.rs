//! The manifest-file source: Services and EndpointSlices from a YAML file, reloaded on change.
//!
//! Each load is compared with the previous one and only the difference reaches the change
//! tracker, so editing one object touches one service. The file's directory is watched rather
//! than the file, because editors and Kubernetes ConfigMap volumes replace files by renaming
//! over them (ConfigMap volumes swap a `..data` symlink), which leaves an inode watch on the old
//! file. Reading follows symlinks, but only changes in the file's own directory are seen: a link
//! into another directory (other than a ConfigMap's `..data`) is not watched there. A file that
//! cannot be read or parsed after the first load changes nothing: the last good state stays
//! programmed until the file is fixed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use notify::event::{AccessKind, AccessMode, EventKind};
use notify::{RecursiveMode, Watcher};
use tokio::sync::{mpsc, oneshot};
use tokio::time::{Instant, timeout_at};

use crate::kubernetes::{InvalidObject, NodeInfo, service_cidrs_of};
use crate::model::{ChangeTracker, Cidr, NamespacedName, ReducedService, ReducedSlice};
use crate::source::manifest::{self, ManifestError, Object};
use crate::sync::SyncHandle;

/// How long the directory must stay quiet before a reload: one save is often several events
/// (truncate, writes, close, rename).
const DEBOUNCE: Duration = Duration::from_millis(100);
/// A reload happens this long after the first event at the latest, even if writes keep coming.
const MAX_DEBOUNCE: Duration = Duration::from_secs(1);
/// The entry a ConfigMap volume swaps to publish new content.
const CONFIGMAP_DATA: &str = "..data";

/// Loads `path` into `tracker`, requests a sync, and reports `synced` once the first load is
/// applied; then reloads whenever the file changes. Returns only on error: the first load failing,
/// or the watcher or the tracker breaking.
pub async fn run(
    path: PathBuf,
    tracker: Arc<Mutex<ChangeTracker>>,
    sync: SyncHandle,
    synced: oneshot::Sender<()>,
) -> anyhow::Result<()> {
    let Some(file_name) = path.file_name().map(OsStr::to_owned) else {
        bail!("the manifest path {} does not name a file", path.display());
    };
    // Watch before the first read, so that a change made during it is not missed.
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |event| {
        // The receiver only goes away when this source stops.
        let _ = events_tx.send(event);
    })
    .context("creating a watcher for the manifest file")?;
    let dir = watched_dir(&path);
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .with_context(|| format!("watching {} for changes to the manifest", dir.display()))?;

    let mut source = FileSource::new(path);
    let text = tokio::fs::read_to_string(&source.path).await.with_context(|| {
        format!(
            "cannot read the manifest {}: create it (examples/services.yaml shows the format) or give the agent the right path",
            source.path.display()
        )
    })?;
    let load = read(&text).with_context(|| {
        format!(
            "the manifest {} is unreadable, so nothing was programmed; fix it and start again",
            source.path.display()
        )
    })?;
    // The text is not needed any more (and may be large): free it before the tracker grows.
    drop(text);
    source.apply(load, &tracker)?;
    // Even an empty first load must reach the dataplane: it clears what an earlier run left.
    sync.request();
    // The receiver may have stopped waiting; the source keeps running either way.
    let _ = synced.send(());

    loop {
        let event = events
            .recv()
            .await
            .ok_or_else(|| anyhow!("the manifest watcher stopped"))?;
        if !concerns(&event, &file_name) {
            continue;
        }
        settle(&mut events).await;
        if source.reload(&tracker).await? {
            sync.request();
        }
    }
}

/// The directory holding `path` ("." for a bare file name).
pub(crate) fn watched_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
        _ => PathBuf::from("."),
    }
}

/// Whether a directory event may have changed the manifest.
pub(crate) fn concerns(event: &notify::Result<notify::Event>, file_name: &OsStr) -> bool {
    let event = match event {
        Ok(event) => event,
        Err(e) => {
            // Possibly missed events (a full inotify queue): reloading is always safe.
            tracing::warn!("file watcher: {e}; reading the file again to be safe");
            return true;
        }
    };
    match event.kind {
        // Opening and reading the file (as we do) change nothing; closing a written one does.
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => {}
        EventKind::Access(_) => return false,
        _ => {}
    }
    // An event without paths is a request to rescan.
    event.paths.is_empty()
        || event.paths.iter().any(|p| {
            p.file_name()
                .is_some_and(|name| name == file_name || name == CONFIGMAP_DATA)
        })
}

/// Waits until no event has arrived for DEBOUNCE, or MAX_DEBOUNCE has passed.
pub(crate) async fn settle(events: &mut mpsc::UnboundedReceiver<notify::Result<notify::Event>>) {
    let latest = Instant::now() + MAX_DEBOUNCE;
    loop {
        let quiet = (Instant::now() + DEBOUNCE).min(latest);
        match timeout_at(quiet, events.recv()).await {
            Ok(Some(_)) => continue,
            Ok(None) | Err(_) => return,
        }
    }
}

/// An object's kind and namespace/name.
type ObjectKey = (&'static str, NamespacedName);

/// What the tracker needs of one object of the file (not the object itself: only what reaches
/// the desired state), kept until the next load to see what changed.
#[derive(Clone, Debug, PartialEq)]
enum Entry {
    Service(Result<ReducedService, InvalidObject>),
    Slice(Result<ReducedSlice, InvalidObject>),
    /// A Node: its name, zone label and addresses.
    Node(NamespacedName, NodeInfo),
    /// A ServiceCIDR: its name and ranges.
    ServiceCidr(NamespacedName, Vec<Cidr>),
}

impl Entry {
    fn new(object: &Object) -> Self {
        match object {
            Object::Service(svc) => Entry::Service(ReducedService::parse(svc)),
            Object::EndpointSlice(slice) => Entry::Slice(ReducedSlice::parse(slice)),
            Object::Node(node) => Entry::Node(object.key(), NodeInfo::of(node)),
            Object::ServiceCidr(cidr) => Entry::ServiceCidr(object.key(), service_cidrs_of(cidr)),
        }
    }

    /// The object's namespace/name (the parsed form's, so the key shares its strings).
    fn key(&self) -> &NamespacedName {
        match self {
            Entry::Service(Ok(update)) => &update.key,
            Entry::Slice(Ok(update)) => &update.key,
            Entry::Service(Err(invalid)) | Entry::Slice(Err(invalid)) => &invalid.key,
            Entry::Node(key, _) | Entry::ServiceCidr(key, _) => key,
        }
    }
}

/// One load of the file, read but not applied yet.
#[derive(Debug)]
struct Load {
    entries: BTreeMap<ObjectKey, Entry>,
    /// Objects defined more than once, to be reported: as with `kubectl apply`, the later
    /// definition wins.
    duplicates: Vec<ObjectKey>,
    /// Unusable documents, each to be reported.
    errors: Vec<ManifestError>,
    /// Objects of other kinds.
    ignored: usize,
}

/// Reads a manifest into what the tracker needs. Each object is reduced to its [`Entry`] as soon
/// as it is parsed, so the objects themselves are never all held at once. Errs when the text as
/// a whole is unreadable.
fn read(text: &str) -> Result<Load, ManifestError> {
    let (mut entries, parsed) = manifest::parse_each(text, |object| {
        let entry = Entry::new(&object);
        ((object.kind(), entry.key().clone()), entry)
    })?;
    // Sorted first, so that the map is built with full nodes (inserting one by one would leave
    // them about half full: a few MiB with tens of thousands of objects). The sort is stable and
    // the map keeps the last of equal keys: the later definition wins.
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    let duplicates = entries
        .windows(2)
        .filter(|pair| pair[0].0 == pair[1].0)
        .map(|pair| pair[0].0.clone())
        .collect();
    Ok(Load {
        entries: BTreeMap::from_iter(entries),
        duplicates,
        errors: parsed.errors,
        ignored: parsed.ignored,
    })
}

/// "Service demo/web", as in the log lines about an object.
fn describe(key: &ObjectKey) -> String {
    format!("{} {}", key.0, key.1)
}

/// What one load did, for the log line and for tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct LoadStats {
    objects: usize,
    /// Objects added, changed or removed since the previous load.
    changed: usize,
    /// Unusable documents, invalid objects and skipped endpoints, each logged.
    errors: usize,
}

pub(crate) struct FileSource {
    path: PathBuf,
    /// The objects of the last load the tracker does not hold as they were read, and what was
    /// reported of them: invalid ones (the tracker kept their previous valid version; they are
    /// not retried until they change) and Services it does not proxy. Only these: the tracker
    /// says whether it holds any other object as it is now.
    reported: HashMap<ObjectKey, Reported>,
}

/// What was reported of an object (see [`FileSource::reported`]).
#[derive(Debug, PartialEq)]
enum Reported {
    Invalid(InvalidObject),
    NotProxied(&'static str),
}

impl FileSource {
    fn new(path: PathBuf) -> Self {
        Self {
            path,
            reported: HashMap::new(),
        }
    }

    /// Reads the file again. A file that cannot be read or parsed is logged and changes nothing.
    /// Returns whether the tracker has changes to sync.
    async fn reload(&mut self, tracker: &Mutex<ChangeTracker>) -> anyhow::Result<bool> {
        let path = self.path.display();
        let text = match tokio::fs::read_to_string(&self.path).await {
            Ok(text) => text,
            Err(e) => {
                tracing::warn!(
                    "cannot read the manifest {path}: {e}; keeping the services loaded before"
                );
                return Ok(false);
            }
        };
        let load = match read(&text) {
            Ok(load) => load,
            Err(e) => {
                tracing::warn!(
                    "the manifest {path} is unreadable ({e}); keeping the services loaded before"
                );
                return Ok(false);
            }
        };
        drop(text);
        self.apply(load, tracker)?;
        Ok(lock(tracker)?.has_pending())
    }

    /// Feeds the tracker the difference between `load` and the previous load. An object counts
    /// as changed when what the tracker is given of it changed (a new annotation does not
    /// count, a new endpoint does).
    fn apply(&mut self, load: Load, tracker: &Mutex<ChangeTracker>) -> anyhow::Result<LoadStats> {
        let path = self.path.display();
        let mut errors = load.errors.len();
        for error in &load.errors {
            tracing::warn!("{path}: {error}; skipped");
        }
        for key in &load.duplicates {
            tracing::warn!(
                "{path}: {} is defined twice; using the last definition",
                describe(key)
            );
        }
        let mut changed = 0;
        let mut tracker = lock(tracker)?;
        let mut reported = HashMap::new();
        for (key, entry) in &load.entries {
            // Reported once, until it changes.
            let mut report = |what: Reported| {
                let new = self.reported.get(key) != Some(&what);
                reported.insert(key.clone(), what);
                new
            };
            let (new, invalid) = match entry {
                Entry::Service(Ok(update)) => {
                    let reason = update.skip_reason;
                    let new_reason = reason.is_some_and(|r| report(Reported::NotProxied(r)));
                    if new_reason {
                        let reason = reason.unwrap_or_default();
                        tracing::info!("{path}: {} is not proxied: {reason}", describe(key));
                    }
                    let new = !tracker.holds_service(update);
                    if new {
                        tracker.upsert_service(update);
                    }
                    (new || new_reason, None)
                }
                Entry::Slice(Ok(update)) => {
                    let new = !tracker.holds_slice(update);
                    if new {
                        let skipped = tracker.upsert_slice(update);
                        errors += skipped.len();
                        for endpoint in skipped {
                            tracing::warn!("{path}: {endpoint}");
                        }
                    }
                    (new, None)
                }
                Entry::Node(key, info) => {
                    let new = !tracker.holds_node(&key.name, info);
                    if new {
                        tracker.upsert_node(&key.name, info);
                    }
                    (new, None)
                }
                Entry::ServiceCidr(key, cidrs) => {
                    let new = !tracker.holds_service_cidr(&key.name, cidrs);
                    if new {
                        tracker.upsert_service_cidr(&key.name, cidrs.clone());
                    }
                    (new, None)
                }
                Entry::Service(Err(invalid)) | Entry::Slice(Err(invalid)) => {
                    (report(Reported::Invalid(invalid.clone())), Some(invalid))
                }
            };
            if !new {
                continue;
            }
            changed += 1;
            if let Some(invalid) = invalid {
                errors += 1;
                tracing::warn!("{path}: {invalid}; this version is not applied");
            }
        }
        // What the tracker holds that the file no longer has.
        let names = |kind: &str| -> HashSet<&str> {
            (load.entries.keys())
                .filter(|(k, _)| *k == kind)
                .map(|(_, key)| &*key.name)
                .collect()
        };
        let (nodes, cidrs) = (names("Node"), names("ServiceCIDR"));
        let gone = |kind: &'static str, key: &NamespacedName| {
            !load.entries.contains_key(&(kind, key.clone()))
        };
        let services = tracker.service_keys();
        let slices = tracker.slice_keys();
        // Reported objects gone that the tracker does not hold (not proxied, or never valid);
        // those it holds are counted with its deletions below.
        let gone_reported: Vec<&ObjectKey> = (self.reported.keys())
            .filter(|key| !load.entries.contains_key(*key))
            .collect();
        if !gone_reported.is_empty() {
            let held = |keys: &[NamespacedName]| -> HashSet<NamespacedName> {
                keys.iter().cloned().collect()
            };
            let (held_services, held_slices) = (held(&services), held(&slices));
            changed += (gone_reported.into_iter())
                .filter(|(kind, key)| match *kind {
                    "Service" => !held_services.contains(key),
                    _ => !held_slices.contains(key),
                })
                .count();
        }
        for key in services {
            if gone("Service", &key) {
                tracker.delete_service(&key);
                changed += 1;
            }
        }
        for key in slices {
            if gone("EndpointSlice", &key) {
                tracker.delete_slice(&key);
                changed += 1;
            }
        }
        for key in tracker.node_keys() {
            if !nodes.contains(&*key.name) {
                tracker.delete_node(&key.name);
                changed += 1;
            }
        }
        for key in tracker.service_cidr_keys() {
            if !cidrs.contains(&*key.name) {
                tracker.delete_service_cidr(&key.name);
                changed += 1;
            }
        }
        self.reported = reported;
        drop(tracker);
        let stats = LoadStats {
            objects: load.entries.len(),
            changed,
            errors,
        };
        tracing::info!(
            objects = stats.objects,
            changed = stats.changed,
            errors = stats.errors,
            ignored = load.ignored,
            "loaded the manifest {path}"
        );
        Ok(stats)
    }
}

#[cfg(test)]
impl FileSource {
    /// A source that is given its manifests as text (tests stepping through versions of one).
    pub(crate) fn in_memory() -> Self {
        Self::new(PathBuf::from("(test manifest)"))
    }

    /// `text` applied as a load of the file is; panics on anything the load reports.
    pub(crate) fn load_text(&mut self, text: &str, tracker: &Mutex<ChangeTracker>) {
        let load = read(text).expect("the manifest parses");
        assert!(load.errors.is_empty(), "{:?}", load.errors);
        assert!(load.duplicates.is_empty(), "{:?}", load.duplicates);
        let stats = self.apply(load, tracker).unwrap();
        assert_eq!(
            stats.errors, 0,
            "invalid objects or endpoints (see the log)"
        );
    }
}

fn lock(
    tracker: &Mutex<ChangeTracker>,
) -> anyhow::Result<std::sync::MutexGuard<'_, ChangeTracker>> {
    tracker
        .lock()
        .map_err(|_| anyhow!("the change tracker is unusable: a thread panicked while holding it"))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::model::{DesiredState, Protocol, ServicePortName};
    use crate::sync::{RunnerConfig, SyncRunner};

    /// A directory under the system temp dir, removed on drop (also after a failed assertion).
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(test: &str) -> Self {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "proxy-userspace-{test}-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("creating a temp dir");
            TempDir(dir)
        }

        fn path(&self, name: &str) -> PathBuf {
            self.0.join(name)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A manifest with one service per (name, cluster IP, backend IPs).
    fn manifest(services: &[(&str, &str, &[&str])]) -> String {
        let mut text = String::new();
        for (name, cluster_ip, backends) in services {
            let endpoints: Vec<String> = backends
                .iter()
                .map(|ip| format!("{{addresses: [{ip}]}}"))
                .collect();
            text.push_str(&format!(
                "---
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: demo}}
spec: {{clusterIP: {cluster_ip}, ports: [{{name: http, port: 80, targetPort: http}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: demo, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
ports: [{{name: http, port: 8080}}]
endpoints: [{}]
",
                endpoints.join(", ")
            ));
        }
        text
    }

    /// "name -> ip:port,..." for every service port with endpoints.
    fn summary(state: &DesiredState) -> Vec<String> {
        state
            .port_names()
            .map(|spn| {
                let eps: Vec<String> = state
                    .endpoints_of(spn)
                    .iter()
                    .map(|ep| format!("{}:{}", ep.ip, ep.port))
                    .collect();
                format!("{spn} -> {}", eps.join(","))
            })
            .collect()
    }

    /// The source wired to a real runner whose syncs publish the applied state.
    struct Harness {
        tracker: Arc<Mutex<ChangeTracker>>,
        states: mpsc::UnboundedReceiver<DesiredState>,
        source: tokio::task::JoinHandle<anyhow::Result<()>>,
        synced: oneshot::Receiver<()>,
    }

    impl Harness {
        fn start(path: PathBuf) -> Self {
            let tracker = Arc::new(Mutex::new(ChangeTracker::new()));
            let (runner, handle) = SyncRunner::new(RunnerConfig {
                min_interval: Duration::ZERO,
                max_interval: Duration::from_secs(3600),
                retry_interval: Duration::from_secs(1),
            });
            let (states_tx, states) = mpsc::unbounded_channel();
            let synced_tracker = Arc::clone(&tracker);
            let mut state = DesiredState::default();
            tokio::spawn(runner.run(move || {
                synced_tracker.lock().unwrap().apply(&mut state);
                let _ = states_tx.send(state.clone());
                Ok(())
            }));
            let (synced_tx, synced) = oneshot::channel();
            let source = tokio::spawn(run(path, Arc::clone(&tracker), handle, synced_tx));
            Harness {
                tracker,
                states,
                source,
                synced,
            }
        }

        /// Waits for a sync whose state matches `want`.
        async fn expect(&mut self, want: &[&str]) {
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut last = Vec::new();
            while let Ok(Some(state)) = timeout_at(deadline, self.states.recv()).await {
                last = summary(&state);
                if last == want {
                    return;
                }
            }
            panic!("no sync produced {want:#?}; the last one had {last:#?}");
        }
    }

    fn write_atomically(path: &Path, text: &str) {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }

    const WEB: (&str, &str, &[&str]) = ("web", "10.96.0.10", &["10.244.1.11", "10.244.1.12"]);
    const WEB_SCALED: (&str, &str, &[&str]) = ("web", "10.96.0.10", &["10.244.1.11"]);
    const API: (&str, &str, &[&str]) = ("api", "10.96.0.20", &["10.244.2.11"]);

    #[tokio::test]
    async fn initial_load_then_edit_in_place() {
        let dir = TempDir::new("edit");
        let path = dir.path("services.yaml");
        std::fs::write(&path, manifest(&[WEB])).unwrap();
        let mut harness = Harness::start(path.clone());
        (&mut harness.synced)
            .await
            .expect("the first load must be reported");
        harness
            .expect(&["demo/web:http -> 10.244.1.11:8080,10.244.1.12:8080"])
            .await;

        std::fs::write(&path, manifest(&[WEB_SCALED, API])).unwrap();
        harness
            .expect(&[
                "demo/api:http -> 10.244.2.11:8080",
                "demo/web:http -> 10.244.1.11:8080",
            ])
            .await;
    }

    #[tokio::test]
    async fn atomic_rename_and_removal() {
        let dir = TempDir::new("rename");
        let path = dir.path("services.yaml");
        std::fs::write(&path, manifest(&[WEB, API])).unwrap();
        let mut harness = Harness::start(path.clone());
        harness
            .expect(&[
                "demo/api:http -> 10.244.2.11:8080",
                "demo/web:http -> 10.244.1.11:8080,10.244.1.12:8080",
            ])
            .await;

        // Removing objects from the file deletes them.
        write_atomically(&path, &manifest(&[API]));
        harness.expect(&["demo/api:http -> 10.244.2.11:8080"]).await;
        write_atomically(&path, &manifest(&[WEB_SCALED, API]));
        harness
            .expect(&[
                "demo/api:http -> 10.244.2.11:8080",
                "demo/web:http -> 10.244.1.11:8080",
            ])
            .await;
    }

    #[tokio::test]
    async fn configmap_volume_update() {
        // The layout kubelet's atomic writer makes: the file is a symlink through `..data`,
        // and an update swaps `..data` to a new directory.
        use std::os::unix::fs::symlink;
        let dir = TempDir::new("configmap");
        std::fs::create_dir(dir.path("..v1")).unwrap();
        std::fs::write(dir.path("..v1/services.yaml"), manifest(&[WEB])).unwrap();
        symlink("..v1", dir.path("..data")).unwrap();
        symlink("..data/services.yaml", dir.path("services.yaml")).unwrap();
        let mut harness = Harness::start(dir.path("services.yaml"));
        harness
            .expect(&["demo/web:http -> 10.244.1.11:8080,10.244.1.12:8080"])
            .await;

        std::fs::create_dir(dir.path("..v2")).unwrap();
        std::fs::write(dir.path("..v2/services.yaml"), manifest(&[API])).unwrap();
        symlink("..v2", dir.path("..data_tmp")).unwrap();
        std::fs::rename(dir.path("..data_tmp"), dir.path("..data")).unwrap();
        std::fs::remove_dir_all(dir.path("..v1")).unwrap();
        harness.expect(&["demo/api:http -> 10.244.2.11:8080"]).await;
    }

    #[tokio::test]
    async fn broken_file_keeps_the_state() {
        let dir = TempDir::new("broken");
        let path = dir.path("services.yaml");
        std::fs::write(&path, manifest(&[WEB])).unwrap();
        let mut harness = Harness::start(path.clone());
        let web = ["demo/web:http -> 10.244.1.11:8080,10.244.1.12:8080"];
        harness.expect(&web).await;

        write_atomically(&path, "kind: Service\nmetadata: {name: web\n");
        tokio::time::sleep(Duration::from_millis(600)).await;
        std::fs::remove_file(&path).unwrap();
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(!harness.tracker.lock().unwrap().has_pending());
        assert!(harness.states.try_recv().is_err(), "nothing to sync");
        assert!(!harness.source.is_finished(), "the source keeps watching");

        // Fixing the file resumes the updates.
        write_atomically(&path, &manifest(&[WEB, API]));
        harness
            .expect(&[
                "demo/api:http -> 10.244.2.11:8080",
                "demo/web:http -> 10.244.1.11:8080,10.244.1.12:8080",
            ])
            .await;
    }

    #[tokio::test]
    async fn first_load_errors_say_what_to_do() {
        let dir = TempDir::new("missing");
        let harness = Harness::start(dir.path("absent.yaml"));
        let err = harness.source.await.unwrap().unwrap_err();
        assert!(
            format!("{err:#}").contains("create it (examples/services.yaml shows the format)"),
            "{err:#}"
        );
        assert!(harness.synced.await.is_err(), "never reported as synced");

        let path = dir.path("broken.yaml");
        std::fs::write(&path, "kind: [Service\n").unwrap();
        let harness = Harness::start(path);
        let err = harness.source.await.unwrap().unwrap_err();
        assert!(
            format!("{err:#}").contains("unreadable, so nothing was programmed"),
            "{err:#}"
        );
    }

    #[test]
    fn only_differences_reach_the_tracker() {
        let tracker = Mutex::new(ChangeTracker::new());
        let mut source = FileSource::new(PathBuf::from("test.yaml"));
        let load = |source: &mut FileSource, text: &str| {
            source.apply(read(text).unwrap(), &tracker).unwrap()
        };
        let mut state = DesiredState::default();

        let stats = load(&mut source, &manifest(&[WEB, API]));
        assert_eq!(
            stats,
            LoadStats {
                objects: 4,
                changed: 4,
                errors: 0
            }
        );
        tracker.lock().unwrap().apply(&mut state);

        // The same content again changes nothing.
        let stats = load(&mut source, &manifest(&[WEB, API]));
        assert_eq!(stats.changed, 0);
        assert!(!tracker.lock().unwrap().has_pending());

        // An invalid version is reported and the previous one stays programmed; removing the
        // object later still deletes it.
        let bad = manifest(&[WEB, API]).replace("10.96.0.20", "10.96.0.999");
        let stats = load(&mut source, &bad);
        assert_eq!(
            stats,
            LoadStats {
                objects: 4,
                changed: 1,
                errors: 1
            }
        );
        assert!(!tracker.lock().unwrap().has_pending());
        let stats = load(&mut source, &manifest(&[WEB]));
        assert_eq!(stats.changed, 2);
        let changed = tracker.lock().unwrap().apply(&mut state);
        assert_eq!(
            changed.into_iter().collect::<Vec<_>>(),
            [ServicePortName::new(
                NamespacedName::new("demo", "api"),
                "http",
                Protocol::Tcp
            )]
        );
        assert_eq!(
            summary(&state),
            ["demo/web:http -> 10.244.1.11:8080,10.244.1.12:8080"]
        );

        // A duplicate: the last definition wins.
        let twice = format!("{}{}", manifest(&[WEB]), manifest(&[WEB_SCALED]));
        let stats = load(&mut source, &twice);
        assert_eq!(stats.objects, 2);
        tracker.lock().unwrap().apply(&mut state);
        assert_eq!(summary(&state), ["demo/web:http -> 10.244.1.11:8080"]);
    }

    /// Without a copy of the file's objects, what the tracker does not hold is still reported
    /// once and counted when it goes: a Service it does not proxy, an object never valid.
    #[test]
    fn objects_the_tracker_does_not_hold_are_reported_once() {
        let tracker = Mutex::new(ChangeTracker::new());
        let mut source = FileSource::new(PathBuf::from("test.yaml"));
        let headless = "apiVersion: v1\nkind: Service\nmetadata: {name: db, namespace: demo}\n\
                        spec: {clusterIP: None, ports: [{port: 5432}]}\n---\n";
        let invalid = "apiVersion: v1\nkind: Service\nmetadata: {name: bad, namespace: demo}\n\
                       spec: {clusterIP: 10.96.0.999, ports: [{port: 80}]}\n---\n";
        let text = format!("{headless}{invalid}{}", manifest(&[WEB]));
        let mut load = |text: &str| source.apply(read(text).unwrap(), &tracker).unwrap();
        let stats = load(&text);
        assert_eq!((stats.objects, stats.changed, stats.errors), (4, 4, 1));
        tracker.lock().unwrap().apply(&mut DesiredState::default());
        let stats = load(&text);
        assert_eq!((stats.changed, stats.errors), (0, 0), "reported already");
        let stats = load(&manifest(&[WEB]));
        assert_eq!((stats.objects, stats.changed), (2, 2), "both gone");
        assert!(
            !tracker.lock().unwrap().has_pending(),
            "the tracker held neither"
        );
    }

    #[test]
    fn changes_that_reach_nothing_are_not_counted() {
        // The file source keeps what the tracker was given of each object, not the object: an
        // edit to a label counts as no change, an edit to an address does.
        let tracker = Mutex::new(ChangeTracker::new());
        let mut source = FileSource::new(PathBuf::from("test.yaml"));
        let text = manifest(&[WEB]);
        source.apply(read(&text).unwrap(), &tracker).unwrap();
        let labelled = text.replace(
            "metadata: {name: web, namespace: demo}",
            "metadata: {name: web, namespace: demo, labels: {team: a}}",
        );
        assert_ne!(labelled, text);
        let stats = source.apply(read(&labelled).unwrap(), &tracker).unwrap();
        assert_eq!((stats.objects, stats.changed), (2, 0));
        let moved = labelled.replace("10.96.0.10", "10.96.0.11");
        let stats = source.apply(read(&moved).unwrap(), &tracker).unwrap();
        assert_eq!(stats.changed, 1);

        // Only what the source keeps is left once the text is read: the objects' entries.
        let load = read(&moved).unwrap();
        assert_eq!(load.entries.len(), 2);
        assert!(load.duplicates.is_empty());
    }
}

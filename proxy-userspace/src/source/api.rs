//! The Kubernetes source: Services, EndpointSlices, this node's Node and the ServiceCIDRs,
//! watched through the API server with kube-runtime watchers, as kube-proxy's informers do.
//!
//! Each watcher lists, then watches from the list's resourceVersion. When a watch cannot resume
//! (410 Gone after compaction, or a restart after the server was unreachable) the watcher lists
//! again: objects missing from the new list were deleted meanwhile and are deleted here too.
//! While the API server is unreachable the watchers back off and retry; nothing is deleted, so
//! the last programmed state keeps serving.
use std::{
    collections::HashSet,
    fmt::Debug,
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

use anyhow::Context;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::{
    api::{
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
        networking::v1::ServiceCIDR,
    },
    serde::de::DeserializeOwned,
};
use kube::{
    Api, Client, Resource, ResourceExt,
    config::{Config, KubeConfigOptions, Kubeconfig},
    runtime::{WatchStreamExt, watcher},
};
use tokio::sync::oneshot;

use crate::{
    kubernetes::{InvalidObject, NodeInfo, service_cidrs_of},
    model::{ChangeTracker, NamespacedName},
    serve::healthz::ProxyHealth,
    sync::SyncHandle,
};

/// A client from `--kubeconfig`, or else the in-cluster service account (or the usual
/// KUBECONFIG / ~/.kube/config, for running outside a pod).
pub async fn client(kubeconfig: Option<&Path>) -> anyhow::Result<Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("reading the kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("using the kubeconfig {}", path.display()))?
        }
        None => Config::infer().await.context(
            "no API server configuration: not in a pod (no service account) and no kubeconfig; \
             pass --kubeconfig, or --manifest to run from a file",
        )?,
    };
    Client::try_from(config).context("creating the API client")
}

/// Feeds `tracker` from the API until an unrecoverable error. `synced` fires once both Services
/// and EndpointSlices have completed their first list (kube-proxy programs nothing before).
pub async fn run(
    client: Client,
    node_name: String,
    tracker: Arc<Mutex<ChangeTracker>>,
    sync: SyncHandle,
    health: Arc<ProxyHealth>,
    synced: oneshot::Sender<()>,
) -> anyhow::Result<()> {
    let gate = Arc::new(Mutex::new(Gate {
        services: false,
        slices: false,
        tx: Some(synced),
    }));
    let services = feed_tracker::<Service>(
        Api::all(client.clone()),
        (tracker.clone(), sync.clone()),
        ChangeTracker::update_service,
        ChangeTracker::delete_service,
        ChangeTracker::service_keys,
        {
            let gate = gate.clone();
            move || gate.lock().unwrap().done(|g| &mut g.services)
        },
    );
    let slices = feed_tracker::<EndpointSlice>(
        Api::all(client.clone()),
        (tracker.clone(), sync.clone()),
        update_slice,
        ChangeTracker::delete_slice,
        ChangeTracker::slice_keys,
        move || gate.lock().unwrap().done(|g| &mut g.slices),
    );
    let service_cidrs = watch_service_cidrs(client.clone(), tracker.clone(), sync.clone());
    let node = {
        let name = node_name.clone();
        // Whether the node was seen (and not deleted since): a re-list without it deletes it.
        let seen = Arc::new(AtomicBool::new(false));
        let known = Arc::clone(&seen);
        watch::<Node>(
            Api::all(client),
            watcher::Config::default().fields(&format!("metadata.name={node_name}")),
            move |change| {
                match change {
                    Change::Apply(node) => {
                        seen.store(true, Ordering::Relaxed);
                        let eligible = node_eligible(&node);
                        tracing::debug!(node = %name, eligible, "node updated");
                        health.set_node_eligible(eligible);
                        let info = NodeInfo::of(&node);
                        tracker.lock().unwrap().upsert_node(&name, &info);
                    }
                    Change::Delete(_) => {
                        seen.store(false, Ordering::Relaxed);
                        health.set_node_eligible(false);
                        tracker.lock().unwrap().delete_node(&name);
                    }
                }
                sync.request();
            },
            move || {
                let seen = known.load(Ordering::Relaxed);
                seen.then(|| NamespacedName::new("", node_name.as_str()))
                    .into_iter()
                    .collect()
            },
            || {},
        )
    };
    tokio::try_join!(services, slices, node, service_cidrs)?;
    anyhow::bail!("the API watches ended")
}

/// Watches the ServiceCIDR objects (networking.k8s.io/v1, Kubernetes 1.33) into the tracker.
/// Where the API has none (an older cluster) or the agent may not list them, says so once and
/// does without: traffic to unallocated cluster IPs is then not dropped.
async fn watch_service_cidrs(
    client: Client,
    tracker: Arc<Mutex<ChangeTracker>>,
    sync: SyncHandle,
) -> anyhow::Result<()> {
    let api: Api<ServiceCIDR> = Api::all(client);
    if let Err(kube::Error::Api(status)) =
        api.list(&kube::api::ListParams::default().limit(1)).await
        && (status.code == 404 || status.is_forbidden())
    {
        tracing::info!(
            "no ServiceCIDRs ({}): traffic to unallocated cluster IPs is not dropped",
            if status.code == 404 {
                "the API server has no networking.k8s.io/v1 servicecidrs: before Kubernetes 1.33"
            } else {
                "the agent's ClusterRole does not allow listing servicecidrs"
            }
        );
        return std::future::pending().await;
    }
    let known_tracker = Arc::clone(&tracker);
    watch(
        api,
        watcher::Config::default(),
        move |change| {
            let mut t = tracker.lock().unwrap();
            match change {
                Change::Apply(object) => {
                    let name = object.metadata.name.as_deref().unwrap_or_default();
                    t.upsert_service_cidr(name, service_cidrs_of(&object));
                }
                Change::Delete(key) => t.delete_service_cidr(&key.name),
            }
            sync.request();
        },
        move || known_tracker.lock().unwrap().service_cidr_keys(),
        || {},
    )
    .await
}

/// Watches one kind into the tracker: every change is applied there and requests a sync.
async fn feed_tracker<K>(
    api: Api<K>,
    (tracker, sync): (Arc<Mutex<ChangeTracker>>, SyncHandle),
    update: fn(&mut ChangeTracker, &K) -> Result<(), InvalidObject>,
    delete: fn(&mut ChangeTracker, &NamespacedName),
    keys: fn(&ChangeTracker) -> Vec<NamespacedName>,
    on_listed: impl FnMut(),
) -> anyhow::Result<()>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    K::DynamicType: Default,
{
    let known_tracker = Arc::clone(&tracker);
    let on_change = move |change| {
        let mut t = tracker.lock().unwrap();
        match change {
            Change::Apply(obj) => report(update(&mut t, &obj)),
            Change::Delete(key) => delete(&mut t, &key),
        }
        sync.request();
    };
    // What a re-list may have to delete: what the tracker holds. Objects it does not hold
    // (never valid, or not proxied) have nothing to delete.
    let known = move || keys(&known_tracker.lock().unwrap());
    watch(api, watcher::Config::default(), on_change, known, on_listed).await
}

/// Both initial lists are done: release the first sync.
struct Gate {
    services: bool,
    slices: bool,
    tx: Option<oneshot::Sender<()>>,
}

impl Gate {
    fn done(&mut self, which: impl FnOnce(&mut Self) -> &mut bool) {
        *which(self) = true;
        if self.services
            && self.slices
            && let Some(tx) = self.tx.take()
        {
            tracing::info!("Services and EndpointSlices listed: programming starts");
            let _ = tx.send(());
        }
    }
}

/// This node's primary addresses, as kube-proxy's `--nodeport-addresses primary` takes them
/// ([`NodeInfo::addresses`]). Empty (with a warning) when the Node cannot be read: the caller
/// then falls back to each family's default route's interface.
pub async fn node_ips(client: &Client, node_name: &str) -> Vec<std::net::IpAddr> {
    let api: Api<Node> = Api::all(client.clone());
    let params = kube::api::ListParams::default().fields(&format!("metadata.name={node_name}"));
    let nodes = match api.list(&params).await {
        Ok(list) => list.items,
        Err(e) => {
            tracing::warn!(node = node_name, "reading the Node's addresses: {e}");
            return Vec::new();
        }
    };
    let ips: Vec<std::net::IpAddr> = nodes
        .iter()
        .flat_map(|n| NodeInfo::of(n).addresses)
        .collect();
    if ips.is_empty() {
        tracing::warn!(
            node = node_name,
            "the Node has no InternalIP or ExternalIP address: NodePorts answer on the default \
             route's interface"
        );
    }
    ips
}

/// kube-proxy's rule: a node being deleted (or marked for deletion by the cluster autoscaler)
/// reports unhealthy on /healthz, so load balancers drain it.
fn node_eligible(node: &Node) -> bool {
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == "ToBeDeletedByClusterAutoscaler"));
    node.metadata.deletion_timestamp.is_none() && !tainted
}

/// Applies a slice and logs the endpoints left out of it (the tracker returns each once).
fn update_slice(tracker: &mut ChangeTracker, slice: &EndpointSlice) -> Result<(), InvalidObject> {
    for endpoint in tracker.update_slice(slice)? {
        tracing::warn!("{endpoint}");
    }
    Ok(())
}

fn report(result: Result<(), InvalidObject>) {
    if let Err(e) = result {
        tracing::warn!("skipping invalid object: {e}");
    }
}

enum Change<K> {
    Apply(K),
    Delete(NamespacedName),
}

fn key_of<K: Resource>(obj: &K) -> NamespacedName {
    NamespacedName::new(obj.namespace().unwrap_or_default(), obj.name_any())
}

/// Runs one watcher: applies its events through `on_change`, turns a re-list into deletions of
/// whatever the new list lacks of the `known` objects, calls `on_listed` after each complete
/// list, and logs errors (the watcher retries with backoff).
///
/// The known objects are asked of the caller (the tracker already holds them) rather than kept
/// here, and the first list, which has nothing to delete, keeps no key: with tens of thousands
/// of objects either would be megabytes.
async fn watch<K>(
    api: Api<K>,
    config: watcher::Config,
    mut on_change: impl FnMut(Change<K>),
    mut known: impl FnMut() -> Vec<NamespacedName>,
    mut on_listed: impl FnMut(),
) -> anyhow::Result<()>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    K::DynamicType: Default,
{
    let kind = K::plural(&K::DynamicType::default()).into_owned();
    // The keys of a re-list so far; None during the first list.
    let mut listing: Option<HashSet<NamespacedName>> = None;
    let mut listed = 0;
    let mut listed_once = false;
    let mut failing = false;
    let mut stream = watcher(api, config).default_backoff().boxed();
    loop {
        let event = match stream.try_next().await {
            Ok(Some(event)) => event,
            Ok(None) => return Ok(()),
            Err(e) => {
                log_watch_error(&kind, &e);
                failing = true;
                continue;
            }
        };
        if failing {
            tracing::info!(resource = %kind, "API server reachable again");
            failing = false;
        }
        match event {
            watcher::Event::Init => {
                listing = listed_once.then(HashSet::new);
                listed = 0;
            }
            watcher::Event::InitApply(obj) => {
                if let Some(listing) = &mut listing {
                    listing.insert(key_of(&obj));
                }
                listed += 1;
                on_change(Change::Apply(obj));
            }
            watcher::Event::InitDone => {
                if let Some(listing) = listing.take() {
                    let gone: Vec<NamespacedName> = known()
                        .into_iter()
                        .filter(|key| !listing.contains(key))
                        .collect();
                    if !gone.is_empty() {
                        tracing::info!(resource = %kind, deleted = gone.len(), "re-list: objects deleted meanwhile");
                    }
                    for key in gone {
                        on_change(Change::Delete(key));
                    }
                }
                listed_once = true;
                tracing::info!(resource = %kind, objects = listed, "listed");
                on_listed();
            }
            watcher::Event::Apply(obj) => on_change(Change::Apply(obj)),
            watcher::Event::Delete(obj) => on_change(Change::Delete(key_of(&obj))),
        }
    }
}

fn log_watch_error(kind: &str, e: &watcher::Error) {
    let api_status = match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => Some(s.as_ref()),
        watcher::Error::WatchError(s) => Some(s.as_ref()),
        _ => None,
    };
    match api_status {
        Some(s) if s.is_forbidden() => tracing::error!(
            resource = %kind,
            "forbidden: the agent's ClusterRole must allow list and watch on {kind} \
             (see deploy/kube-proxy-ebpf.yaml): {}",
            s.message
        ),
        Some(s) if s.code == 410 => {
            tracing::info!(resource = %kind, "watch expired (410 Gone): listing again")
        }
        _ => tracing::warn!(
            resource = %kind,
            "API server unreachable or failing; keeping the programmed state and retrying: {e}"
        ),
    }
}

//! The agent: a source feeds the change tracker, a coalescing runner applies the changes to
//! the desired state and hands them to the dataplane.
use std::{
    collections::BTreeSet,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Context;
use tokio::sync::{oneshot, watch};

use crate::{
    dataplane::{Dataplane, NotProgrammable, Scope},
    events::{self, Regarding},
    model::{ChangeTracker, DesiredState, Family, ServicePortName},
    serve::health_check_ports,
    serve::healthz::{self, ProxyHealth},
    serve::http,
    serve::metrics::{self, METRICS},
    source,
    sync::{RunnerConfig, SyncRunner},
};

const HEALTHZ_FLAG: &str = "--healthz-bind-address";

/// The longest time between two full syncs (kube-proxy's `proxyutil.FullSyncPeriod`).
const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);

pub struct AgentConfig {
    pub source: Source,
    /// This node's name (kube-proxy's `--hostname-override`): its Node object, and which
    /// endpoints are local.
    pub node_name: String,
    pub min_sync_period: Duration,
    pub sync_period: Duration,
    /// Where `/healthz` and `/livez` are served; None: not served.
    pub healthz_bind_address: Option<String>,
    /// Where `/metrics` is served; None: not served.
    pub metrics_bind_address: Option<String>,
    /// kube-proxy's `--config` file: when it changes the agent exits, as kube-proxy does, so
    /// that it starts again with the new one.
    pub config_file: Option<crate::kube_proxy::ConfigFile>,
}

/// Where the desired state comes from.
pub enum Source {
    /// A manifest file holding Services and EndpointSlices (and Nodes: this node's gives its
    /// zone and addresses), watched for changes.
    File(PathBuf),
    /// The API server: from a kubeconfig, or in-cluster when None.
    Kubernetes { kubeconfig: Option<PathBuf> },
}

/// Runs until the source fails or the process is interrupted. The dataplane is made once the
/// source's first load is in, so a misconfigured source fails before the node's traffic is
/// touched (nothing attached, no other mode's rules removed).
pub async fn run(
    config: AgentConfig,
    make_dataplane: impl FnOnce(&[std::net::IpAddr]) -> anyhow::Result<Box<dyn Dataplane>>,
) -> anyhow::Result<()> {
    let config_file = config.config_file.clone();
    let tracker = Arc::new(Mutex::new(ChangeTracker::new()));
    // kube-proxy's health timeout: twice the sync period.
    let health = Arc::new(ProxyHealth::new(2 * config.sync_period));
    let (runner, sync_handle) = SyncRunner::with_health(
        RunnerConfig {
            min_interval: config.min_sync_period,
            max_interval: config.sync_period,
            retry_interval: config.min_sync_period.max(Duration::from_secs(1)),
        },
        health.clone(),
    );
    let servers = [
        (
            config.healthz_bind_address,
            HEALTHZ_FLAG,
            healthz::handler(health.clone()),
        ),
        (
            config.metrics_bind_address,
            "--metrics-bind-address",
            metrics::handler(),
        ),
    ];
    // The API client first, so that Events can say what fails from here on (it does not
    // contact the API server yet).
    let client = match &config.source {
        Source::Kubernetes { kubeconfig } => {
            let client = source::api::client(kubeconfig.as_deref()).await?;
            events::start(client.clone(), &config.node_name);
            Some(client)
        }
        Source::File(_) => None,
    };
    // Bound before the source starts, so that a taken port fails the start with a clear error.
    let mut running = Vec::new();
    for (addr, flag, handler) in servers {
        let Some(addr) = addr else { continue };
        let listener = match http::bind(&addr, flag).await {
            Ok(listener) => listener,
            Err(e) => {
                if flag == HEALTHZ_FLAG {
                    let node = Regarding::Node(&config.node_name);
                    let note = Some(format!("failed to start proxier healthz on {addr}: {e:#}"));
                    let (reason, action) = ("FailedToStartProxierHealthcheck", "Listen");
                    events::record(node, true, reason, action, note);
                    events::flush(Duration::from_secs(2)).await;
                }
                return Err(e);
            }
        };
        tracing::info!(%addr, "serving {flag}");
        running.push(tokio::spawn(async move {
            if let Err(e) = http::serve(listener, handler).await {
                tracing::error!("the server on {addr} ({flag}) stopped: {e:#}");
            }
        }));
    }
    export_change_counts(tracker.clone());
    let from_file = matches!(config.source, Source::File(_));
    let (synced_tx, synced_rx) = oneshot::channel();
    // The Node object's addresses, for --nodeport-addresses primary: read from the API here,
    // from the manifest once it is loaded.
    let mut node_ips = Vec::new();
    let mut source = match config.source {
        Source::File(path) => tokio::spawn(source::file::run(
            path,
            tracker.clone(),
            sync_handle,
            synced_tx,
        )),
        Source::Kubernetes { .. } => {
            let node_name = config.node_name.clone();
            let client = client.expect("made above for the API source");
            node_ips = source::api::node_ips(&client, &node_name).await;
            tracing::info!(node = %node_name, "watching the API server");
            tokio::spawn(source::api::run(
                client,
                node_name,
                tracker.clone(),
                sync_handle,
                health.clone(),
                synced_tx,
            ))
        }
    };
    // kube-proxy's "birth cry".
    let node = Regarding::Node(&config.node_name);
    events::record(node, false, "Starting", "StartKubeProxy", None);
    // Nothing is programmed before the source has delivered its first complete view: a
    // partial view would delete services that are merely not loaded yet.
    tokio::select! {
        r = synced_rx => if r.is_err() {
            // The source dropped its side: it failed, and says why.
            return source_ended(source.await);
        },
        r = &mut source => return source_ended(r),
    }

    if from_file {
        // A Node object in the manifest stands in for the API's.
        let tracker = tracker.lock().unwrap();
        node_ips = (tracker.node_addresses(&config.node_name)).map_or_else(Vec::new, <[_]>::to_vec);
    }
    let dataplane = Arc::new(Mutex::new(make_dataplane(&node_ips)?));
    // kube-proxy exits when its Node's addresses change, so that it starts again with them
    // (the DaemonSet restarts it): they decide where NodePorts answer and what the node's
    // address is. Seen by the sync after the change.
    let (addresses_changed, mut addresses_changed_rx) = tokio::sync::mpsc::channel(1);
    let housekeeping = {
        let dataplane = dataplane.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                // Busy syncing: skip this round rather than block a runtime thread.
                let Ok(mut dp) = dataplane.try_lock() else {
                    continue;
                };
                if let Err(e) = dp.housekeeping() {
                    tracing::warn!("housekeeping: {e:#}");
                }
            }
        })
    };

    let mut state = DesiredState::new(config.node_name);
    // The health check node ports of LoadBalancer Services with externalTrafficPolicy Local,
    // fed after each successful sync and served on their own task, so binding never holds up
    // a sync (and a port that cannot be bound is only logged).
    let (health_checks, watched) = watch::channel(health_check_ports::HealthChecks::new());
    let health_check_server = tokio::spawn(health_check_ports::run(health.clone(), watched));
    // The first sync, retries after a failure and one periodic sync an hour look at
    // everything; the other periodic syncs only at what changed (kube-proxy's FullSyncPeriod:
    // rewriting every Service is what costs at 10k of them, a minute in the nftables mode).
    let mut full = true;
    let mut last_full = Instant::now();
    // Trigger times of the changes applied but not yet programmed (a failed sync keeps them).
    let mut triggers = Vec::new();
    let mut no_local = NoLocalEndpoints::default();
    let sync = move || {
        let changed = {
            let mut tracker = tracker.lock().unwrap();
            let changed = tracker.apply(&mut state);
            triggers.extend(tracker.take_trigger_times());
            if let Some(now) = tracker.node_addresses(state.node_name())
                && now != node_ips
            {
                let _ = addresses_changed.try_send(format!(
                    "the Node's addresses changed from {node_ips:?} to {now:?}: exiting, as \
                     kube-proxy does, so that the agent starts again with them"
                ));
            }
            changed
        };
        let scope = if full || last_full.elapsed() >= FULL_SYNC_PERIOD {
            Scope::All
        } else {
            Scope::Changed(&changed)
        };
        let started = Instant::now();
        // Programming a large state takes a while: let the runtime move other tasks (the
        // watchers, the health server) off this thread meanwhile.
        let mut result =
            tokio::task::block_in_place(|| dataplane.lock().unwrap().sync(&state, scope));
        // Not retried at once (it would fail the same way), but the next sync is a full one:
        // the ports left out get their chance again, as space frees up.
        let mut unprogrammable = false;
        if let Err(e) = &result
            && e.is::<NotProgrammable>()
        {
            tracing::error!("{e:#}");
            result = Ok(());
            unprogrammable = true;
        }
        let elapsed = started.elapsed();
        METRICS.synced(elapsed, matches!(scope, Scope::All), result.is_ok());
        if matches!(scope, Scope::All) {
            release_free_memory();
        }
        match &result {
            Ok(()) => {
                match scope {
                    Scope::All => tracing::info!(
                        service_ports = state.port_count(),
                        ?elapsed,
                        "full sync done"
                    ),
                    Scope::Changed(c) => tracing::info!(changed = c.len(), ?elapsed, "sync done"),
                }
                if matches!(scope, Scope::All) {
                    last_full = Instant::now();
                    let served = dataplane.lock().unwrap().families();
                    warn_unserved_families(&state, &served);
                }
                full = unprogrammable;
                METRICS.programmed(&triggers);
                triggers.clear();
                no_local.update(&state, scope);
                // Replaced even when equal: each sync retries the ports that failed to bind.
                health_checks.send_replace(health_check_ports::health_checks(&state));
            }
            Err(e) => {
                tracing::error!(?elapsed, "sync failed (will retry): {e:#}");
                full = true;
            }
        }
        result
    };
    // Every mode's kernel state outlives the agent, as kube-proxy's rules do.
    const STAYS: &str = "what the dataplane programmed stays in the kernel until the next start \
                         (or --cleanup)";
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let config_changed = async {
        match &config_file {
            Some(path) => crate::kube_proxy::changed(path).await,
            None => std::future::pending().await,
        }
    };
    let outcome = tokio::select! {
        () = runner.run(sync) => Ok(()),
        r = config_changed => r,
        Some(why) = addresses_changed_rx.recv() => Err(anyhow::anyhow!(why)),
        r = &mut source => source_ended(r),
        r = tokio::signal::ctrl_c() => {
            r.context("waiting for SIGINT")?;
            tracing::info!("interrupted; {STAYS}");
            Ok(())
        }
        _ = terminate.recv() => {
            tracing::info!("terminated; {STAYS}");
            Ok(())
        }
    };
    housekeeping.abort();
    health_check_server.abort();
    for server in running {
        server.abort();
    }
    outcome
}

/// On `/metrics`: kube-proxy's counts of Service and EndpointSlice changes.
fn export_change_counts(tracker: Arc<Mutex<ChangeTracker>>) {
    METRICS.add_collector(Box::new(move |out| {
        metrics::render_change_counts(out, tracker.lock().unwrap().change_counts());
    }));
}

/// The Service ports whose Local internal / external traffic policy finds no endpoint on this
/// node, kept up to date sync by sync (a partial sync looks only at what changed).
#[derive(Default)]
struct NoLocalEndpoints {
    ports: [BTreeSet<ServicePortName>; 2],
}

impl NoLocalEndpoints {
    fn update(&mut self, state: &DesiredState, scope: Scope<'_>) {
        if matches!(scope, Scope::All) {
            self.ports = Default::default();
        }
        let look = |spn: &ServicePortName| {
            for (ports, lacks) in self.ports.iter_mut().zip(state.lacks_local_endpoints(spn)) {
                if lacks {
                    ports.insert(spn.clone());
                } else {
                    ports.remove(spn);
                }
            }
        };
        match scope {
            Scope::All => state.port_names().for_each(look),
            Scope::Changed(changed) => changed.iter().for_each(look),
        }
        METRICS.no_local_endpoints(self.ports[0].len(), self.ports[1].len());
    }
}

fn source_ended(r: Result<anyhow::Result<()>, tokio::task::JoinError>) -> anyhow::Result<()> {
    match r {
        Ok(Ok(())) => anyhow::bail!("the source stopped unexpectedly"),
        Ok(Err(e)) => Err(e),
        Err(e) => Err(e).context("the source panicked"),
    }
}

/// Hands the pages malloc holds free back to the kernel: a full sync follows a load of the
/// whole state (the first one, a manifest's parse), whose garbage is spread through the heap,
/// where glibc would otherwise keep it (it returns only the heap's free top by itself).
fn release_free_memory() {
    // SAFETY: malloc_trim has no preconditions.
    unsafe { libc::malloc_trim(0) };
}

/// Says, at each full sync, how many Service ports have a cluster IP of a family the mode does
/// not serve: their addresses of that family get nothing (kube-proxy would serve them).
fn warn_unserved_families(state: &DesiredState, served: &[Family]) {
    for family in Family::ALL.into_iter().filter(|f| !served.contains(f)) {
        let ports = state.ports().filter(|(_, p)| p.in_family(family)).count();
        if ports > 0 {
            tracing::warn!(
                service_ports = ports,
                "{ports} Service ports have an {family} cluster IP, which this mode does not \
                 serve yet: their {family} addresses get nothing, and Services of {family} only \
                 no service at all; the nftables and iptables modes serve both families"
            );
        }
    }
}

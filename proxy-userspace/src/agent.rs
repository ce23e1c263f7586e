//! The agent: a source feeds the change tracker, a coalescing runner applies the changes to
//! the desired state and hands them to the dataplane.
use std::{
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Context;
use tokio::sync::oneshot;

use crate::{
    dataplane::{Dataplane, Scope},
    model::{ChangeTracker, DesiredState},
    runner::{RunnerConfig, SyncRunner},
    source,
};

pub struct AgentConfig {
    /// The manifest file holding Services and EndpointSlices.
    pub manifest: PathBuf,
    pub min_sync_period: Duration,
    pub sync_period: Duration,
}

/// Runs until the source fails or the process is interrupted.
pub async fn run(config: AgentConfig, dataplane: Box<dyn Dataplane>) -> anyhow::Result<()> {
    let tracker = Arc::new(Mutex::new(ChangeTracker::new()));
    let (runner, sync_handle) = SyncRunner::new(RunnerConfig {
        min_interval: config.min_sync_period,
        max_interval: config.sync_period,
        retry_interval: config.min_sync_period.max(Duration::from_secs(1)),
    });
    let (synced_tx, synced_rx) = oneshot::channel();
    let mut source = tokio::spawn(source::file::run(
        config.manifest.clone(),
        tracker.clone(),
        sync_handle,
        synced_tx,
    ));
    // Nothing is programmed before the source has delivered its first complete view: a
    // partial view would delete services that are merely not loaded yet.
    tokio::select! {
        r = synced_rx => r.context("the manifest source stopped before its first load")?,
        r = &mut source => return source_ended(r),
    }

    let dataplane = Arc::new(Mutex::new(dataplane));
    let housekeeping = {
        let dataplane = dataplane.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                if let Err(e) = dataplane.lock().unwrap().housekeeping() {
                    tracing::warn!("housekeeping: {e:#}");
                }
            }
        })
    };

    let mut state = DesiredState::default();
    // The first sync, periodic resyncs and retries after a failure look at everything.
    let mut full = true;
    let sync = move || {
        let changed = tracker.lock().unwrap().apply(&mut state);
        let scope = if full || changed.is_empty() {
            Scope::All
        } else {
            Scope::Changed(&changed)
        };
        let started = Instant::now();
        let result = dataplane.lock().unwrap().sync(&state, scope);
        let elapsed = started.elapsed();
        match &result {
            Ok(()) => {
                match scope {
                    Scope::All => tracing::info!(
                        service_ports = state.services.len(),
                        ?elapsed,
                        "full sync done"
                    ),
                    Scope::Changed(c) => tracing::info!(changed = c.len(), ?elapsed, "sync done"),
                }
                full = false;
            }
            Err(e) => {
                tracing::error!(?elapsed, "sync failed (will retry): {e:#}");
                full = true;
            }
        }
        result
    };
    let outcome = tokio::select! {
        () = runner.run(sync) => Ok(()),
        r = &mut source => source_ended(r),
        r = tokio::signal::ctrl_c() => {
            r.context("waiting for a signal")?;
            tracing::info!("interrupted; the pinned maps keep the programmed services");
            Ok(())
        }
    };
    housekeeping.abort();
    outcome
}

fn source_ended(r: Result<anyhow::Result<()>, tokio::task::JoinError>) -> anyhow::Result<()> {
    match r {
        Ok(Ok(())) => anyhow::bail!("the manifest source stopped unexpectedly"),
        Ok(Err(e)) => Err(e),
        Err(e) => Err(e).context("the manifest source panicked"),
    }
}

//! A coalescing sync runner, after kube-proxy's `bounded_frequency_runner.go`.
//!
//! Sources call [`SyncHandle::request`] after every change; the runner turns a burst of requests
//! into one sync, keeps syncs at least `min_interval` apart (a busy cluster must not keep the
//! dataplane rewriting), runs one every `max_interval` anyway (to repair drift), and retries a
//! failed sync after `retry_interval`. The decisions live in `Schedule`, which takes the time as
//! an argument, so tests replay timelines without waiting (kube-proxy injects a clock instead).

use std::{sync::Arc, time::Duration};

use tokio::sync::mpsc;

use crate::serve::healthz::ProxyHealth;
use tokio::time::{Instant, sleep_until};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunnerConfig {
    /// The least time from the start of one sync to the start of the next.
    pub min_interval: Duration,
    /// The most time between syncs: a periodic resync even when nothing was requested.
    pub max_interval: Duration,
    /// After a failed sync, the next one runs this much later (or at min_interval, if later).
    pub retry_interval: Duration,
}

/// Asks the runner for a sync. Cheap to clone; the runner stops once every handle is dropped.
#[derive(Clone, Debug)]
pub struct SyncHandle {
    requests: mpsc::Sender<()>,
    health: Arc<ProxyHealth>,
}

impl SyncHandle {
    /// Requests a sync. Never blocks: requests made before the sync starts share it.
    pub fn request(&self) {
        self.health.queued();
        crate::serve::metrics::METRICS.queued();
        // A full channel already holds a request that this one joins; a closed one means the
        // runner is gone, and with it anything a sync could do.
        let _ = self.requests.try_send(());
    }
}

#[derive(Debug)]
pub struct SyncRunner {
    config: RunnerConfig,
    health: Arc<ProxyHealth>,
    // Capacity one: the pending request is a flag, and extra requests coalesce into it.
    requests: mpsc::Receiver<()>,
}

impl SyncRunner {
    pub fn new(config: RunnerConfig) -> (SyncRunner, SyncHandle) {
        Self::with_health(config, Arc::new(ProxyHealth::new(2 * config.max_interval)))
    }

    /// A runner that reports queued changes and successful syncs to `health`.
    pub fn with_health(config: RunnerConfig, health: Arc<ProxyHealth>) -> (SyncRunner, SyncHandle) {
        let (tx, rx) = mpsc::channel(1);
        (
            SyncRunner {
                config,
                health: health.clone(),
                requests: rx,
            },
            SyncHandle {
                requests: tx,
                health,
            },
        )
    }

    /// Runs `sync` whenever requested, coalescing requests, never more often than min_interval,
    /// at least every max_interval (periodic resync), and again after retry_interval when it
    /// fails. Returns when every SyncHandle is dropped, after serving a request still pending.
    ///
    /// The first sync waits for a request, so nothing is programmed before a source has loaded;
    /// the periodic resync starts after it. `sync` runs on this task: keep it short, or make it
    /// hand the work to a blocking thread.
    pub async fn run<F: FnMut() -> anyhow::Result<()>>(mut self, mut sync: F) {
        let mut schedule = Schedule::new(self.config);
        let mut handles_gone = false;
        loop {
            if handles_gone && !schedule.requested {
                return;
            }
            let next = schedule.next_run(Instant::now());
            tokio::select! {
                request = self.requests.recv(), if !handles_gone => {
                    match request {
                        Some(()) => schedule.requested = true,
                        None => handles_gone = true,
                    }
                }
                () = sleep_until_some(next) => {
                    // A request made while `sync` runs is not covered by it (the state may have
                    // been read already): it waits in the channel and causes the next sync.
                    schedule.started(Instant::now());
                    let result = sync();
                    if let Err(e) = &result {
                        // The caller reports the error itself; say only what happens next.
                        tracing::debug!(
                            "sync failed, retrying in {:?}: {e:#}",
                            self.config.retry_interval
                        );
                    }
                    if result.is_ok() {
                        self.health.updated();
                    }
                    schedule.finished(result.is_ok());
                }
            }
        }
    }
}

/// When syncs are due: the runner's decisions, apart from the waiting.
#[derive(Debug)]
struct Schedule {
    config: RunnerConfig,
    /// A request arrived since the last sync started.
    requested: bool,
    last_start: Option<Instant>,
    retry_at: Option<Instant>,
}

impl Schedule {
    fn new(config: RunnerConfig) -> Self {
        Self {
            config,
            requested: false,
            last_start: None,
            retry_at: None,
        }
    }

    /// When the next sync should start, or None to wait for a request.
    fn next_run(&self, now: Instant) -> Option<Instant> {
        let Some(last) = self.last_start else {
            return self.requested.then_some(now);
        };
        let wanted = if self.requested {
            now
        } else {
            let periodic = last + self.config.max_interval;
            self.retry_at.map_or(periodic, |retry| retry.min(periodic))
        };
        Some(wanted.max(last + self.config.min_interval))
    }

    fn started(&mut self, now: Instant) {
        self.requested = false;
        self.last_start = Some(now);
        self.retry_at = None;
    }

    fn finished(&mut self, ok: bool) {
        if !ok {
            let start = self.last_start.expect("a sync finished without starting");
            self.retry_at = Some(start + self.config.retry_interval);
        }
    }
}

async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: RunnerConfig = RunnerConfig {
        min_interval: Duration::from_secs(1),
        max_interval: Duration::from_secs(60),
        retry_interval: Duration::from_secs(5),
    };

    /// Plays `requests` (seconds from the start) through a Schedule the way `run` does, with
    /// the first `failures` syncs failing, until `end`; returns when syncs started.
    fn simulate(config: RunnerConfig, requests: &[f64], failures: usize, end: f64) -> Vec<f64> {
        let origin = Instant::now();
        let at = |secs: f64| origin + Duration::from_secs_f64(secs);
        let mut requests: Vec<Instant> = requests.iter().map(|&s| at(s)).collect();
        requests.reverse();
        let mut schedule = Schedule::new(config);
        let mut failures = failures;
        let mut now = origin;
        let mut runs = Vec::new();
        loop {
            let next_request = requests.last().copied();
            match (schedule.next_run(now), next_request) {
                // A request due no later than the next sync is seen first.
                (next, Some(request)) if next.is_none_or(|next| request <= next) => {
                    now = request;
                    requests.pop();
                    schedule.requested = true;
                }
                (Some(next), _) if next <= at(end) => {
                    now = next;
                    schedule.started(now);
                    runs.push((now - origin).as_secs_f64());
                    schedule.finished(failures == 0);
                    failures = failures.saturating_sub(1);
                }
                _ => return runs,
            }
        }
    }

    #[test]
    fn waits_for_the_first_request() {
        assert_eq!(simulate(CONFIG, &[], 0, 600.0), [] as [f64; 0]);
        assert_eq!(simulate(CONFIG, &[600.0], 0, 610.0), [600.0]);
    }

    #[test]
    fn coalesces_requests() {
        let burst: Vec<f64> = (0..20).map(|i| 0.1 + f64::from(i) * 0.04).collect();
        // One sync for the first request; the burst during the min interval shares the next.
        let mut requests = vec![0.0, 0.0, 0.0];
        requests.extend(&burst);
        assert_eq!(simulate(CONFIG, &requests, 0, 10.0), [0.0, 1.0]);
    }

    #[test]
    fn keeps_the_min_interval() {
        // 0.2 waits until 1.0; 1.2 until 2.0; 6.2 is long after, so it runs at once.
        assert_eq!(
            simulate(CONFIG, &[0.0, 0.2, 1.2, 6.2], 0, 10.0),
            [0.0, 1.0, 2.0, 6.2]
        );
    }

    #[test]
    fn resyncs_every_max_interval() {
        // The periodic timer restarts from the last sync, whatever caused it.
        assert_eq!(
            simulate(CONFIG, &[0.0, 100.0], 0, 230.0),
            [0.0, 60.0, 100.0, 160.0, 220.0]
        );
    }

    #[test]
    fn retries_after_a_failure() {
        // Two failures retried 5 s apart, then success and no more retries.
        assert_eq!(simulate(CONFIG, &[0.0], 2, 50.0), [0.0, 5.0, 10.0]);
        // A request before the retry is due is the retry.
        assert_eq!(simulate(CONFIG, &[0.0, 2.0], 1, 50.0), [0.0, 2.0]);
        // A retry shorter than min_interval waits for min_interval.
        let config = RunnerConfig {
            retry_interval: Duration::from_millis(100),
            ..CONFIG
        };
        assert_eq!(simulate(config, &[0.0], 1, 10.0), [0.0, 1.0]);
    }

    // The tests below run the real loop on the real clock, so they only assert what timing
    // cannot change: counts, and lower bounds on intervals (timers never fire early).

    /// A runner whose syncs report their start time, failing the first `failures`.
    fn start(
        config: RunnerConfig,
        failures: usize,
    ) -> (
        SyncHandle,
        mpsc::UnboundedReceiver<Instant>,
        tokio::task::JoinHandle<()>,
    ) {
        let (runner, handle) = SyncRunner::new(config);
        let (runs_tx, runs) = mpsc::unbounded_channel();
        let mut failures = failures;
        let task = tokio::spawn(runner.run(move || {
            let _ = runs_tx.send(Instant::now());
            if failures > 0 {
                failures -= 1;
                anyhow::bail!("dataplane busy");
            }
            Ok(())
        }));
        (handle, runs, task)
    }

    async fn next_run(runs: &mut mpsc::UnboundedReceiver<Instant>) -> Instant {
        tokio::time::timeout(Duration::from_secs(10), runs.recv())
            .await
            .expect("a sync should have run")
            .expect("the runner stopped")
    }

    const FAST: RunnerConfig = RunnerConfig {
        min_interval: Duration::from_millis(50),
        max_interval: Duration::from_secs(3600),
        retry_interval: Duration::from_millis(100),
    };

    #[tokio::test]
    async fn coalesces_then_stops_when_handles_are_dropped() {
        let (handle, mut runs, task) = start(FAST, 0);
        let second = handle.clone();
        for _ in 0..100 {
            handle.request();
            second.request();
        }
        drop((handle, second));
        // The pending request is served before the runner returns.
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the runner must return once its handles are gone")
            .unwrap();
        assert!(runs.recv().await.is_some());
        assert!(runs.recv().await.is_none(), "the requests share one sync");
    }

    #[tokio::test]
    async fn a_request_during_a_sync_gets_its_own_sync() {
        let (runner, handle) = SyncRunner::new(FAST);
        let (runs_tx, mut runs) = mpsc::unbounded_channel();
        let inner = handle.clone();
        let mut first = true;
        tokio::spawn(runner.run(move || {
            let _ = runs_tx.send(Instant::now());
            // A change lands while the first sync runs.
            if std::mem::take(&mut first) {
                inner.request();
            }
            Ok(())
        }));
        handle.request();
        let a = next_run(&mut runs).await;
        let b = next_run(&mut runs).await;
        assert!(b - a >= FAST.min_interval, "{:?}", b - a);
    }

    #[tokio::test]
    async fn periodic_resync_and_retry() {
        let config = RunnerConfig {
            max_interval: Duration::from_millis(100),
            ..FAST
        };
        let (handle, mut runs, _task) = start(config, 0);
        handle.request();
        let a = next_run(&mut runs).await;
        let b = next_run(&mut runs).await;
        assert!(b - a >= config.max_interval, "{:?}", b - a);

        let (handle, mut runs, _task) = start(FAST, 1);
        handle.request();
        let a = next_run(&mut runs).await;
        let b = next_run(&mut runs).await;
        assert!(b - a >= FAST.retry_interval, "{:?}", b - a);
    }
}

//! kube-proxy's sync metrics, by kube-proxy's names, in the Prometheus text format on
//! `--metrics-bind-address` (`/metrics`). Global, as Prometheus metrics conventionally are:
//! sources and the sync loop record into it from wherever they run.
use std::{
    fmt::Write as _,
    sync::{Arc, LazyLock, Mutex},
    time::{Duration, SystemTime},
};

use crate::serve::http::Response;

pub static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::default);

/// kube-proxy's buckets for sync durations: ExponentialBuckets(0.001, 2, 15).
const SYNC_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048, 4.096,
    8.192, 16.384,
];

/// kube-proxy's buckets for the network programming latency: 0.25 s and 0.5 s, then every
/// second to 59 s, every 5 s to 115 s, every 30 s to 5 min.
static PROGRAMMING_BUCKETS: LazyLock<Vec<f64>> = LazyLock::new(|| {
    let steps =
        |start: f64, width: f64, count: u32| (0..count).map(move |i| start + width * f64::from(i));
    steps(0.25, 0.25, 2)
        .chain(steps(1.0, 1.0, 59))
        .chain(steps(60.0, 5.0, 12))
        .chain(steps(120.0, 30.0, 7))
        .collect()
});

#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
    collectors: Mutex<Vec<Collector>>,
}

/// Writes metrics kept outside the agent (a mode's kernel-side counters) in the text format,
/// when `/metrics` is scraped.
pub type Collector = Box<dyn Fn(&mut String) + Send>;

struct Inner {
    sync: Histogram,
    full_sync: Histogram,
    partial_sync: Histogram,
    network_programming: Histogram,
    last_synced: Option<SystemTime>,
    last_queued: Option<SystemTime>,
    sync_errors: u64,
    healthz: [u64; 2],
}

impl Default for Inner {
    fn default() -> Self {
        Self {
            sync: Histogram::new(SYNC_BUCKETS),
            full_sync: Histogram::new(SYNC_BUCKETS),
            partial_sync: Histogram::new(SYNC_BUCKETS),
            network_programming: Histogram::new(PROGRAMMING_BUCKETS.as_slice()),
            last_synced: None,
            last_queued: None,
            sync_errors: 0,
            healthz: [0; 2],
        }
    }
}

struct Histogram {
    buckets: &'static [f64],
    counts: Vec<u64>,
    count: u64,
    sum: f64,
}

impl Histogram {
    fn new(buckets: &'static [f64]) -> Self {
        Self {
            buckets,
            counts: vec![0; buckets.len()],
            count: 0,
            sum: 0.0,
        }
    }

    fn observe(&mut self, secs: f64) {
        for (count, le) in self.counts.iter_mut().zip(self.buckets) {
            if secs <= *le {
                *count += 1;
            }
        }
        self.count += 1;
        self.sum += secs;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        header(out, name, help, "histogram");
        for (count, le) in self.counts.iter().zip(self.buckets) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

/// A metric family's `# HELP` and `# TYPE` lines (`kind`: counter, gauge, histogram).
pub fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn unix_seconds(t: Option<SystemTime>) -> f64 {
    t.and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Metrics {
    /// A sync was requested.
    pub fn queued(&self) {
        self.inner.lock().unwrap().last_queued = Some(SystemTime::now());
    }

    /// A sync ran for `took`; `full` when it covered every service port.
    pub fn synced(&self, took: Duration, full: bool, ok: bool) {
        let mut m = self.inner.lock().unwrap();
        let secs = took.as_secs_f64();
        m.sync.observe(secs);
        if full {
            m.full_sync.observe(secs)
        } else {
            m.partial_sync.observe(secs)
        }
        if ok {
            m.last_synced = Some(SystemTime::now());
        } else {
            m.sync_errors += 1;
        }
    }

    /// Changes triggered at `triggers` (EndpointSlices' last-change-trigger-time) are now in the
    /// dataplane: kube-proxy's network programming latency, one observation each.
    pub fn programmed(&self, triggers: &[SystemTime]) {
        let mut m = self.inner.lock().unwrap();
        let now = SystemTime::now();
        for t in triggers {
            // A trigger time ahead of this node's clock (drift) counts as no time.
            let secs = now.duration_since(*t).map_or(0.0, |d| d.as_secs_f64());
            m.network_programming.observe(secs);
        }
    }

    /// Adds metrics that `collector` reads when they are scraped.
    pub fn add_collector(&self, collector: Collector) {
        self.collectors.lock().unwrap().push(collector);
    }

    /// A health probe was answered.
    pub fn probed(&self, healthy: bool) {
        self.inner.lock().unwrap().healthz[usize::from(!healthy)] += 1;
    }

    pub fn render(&self) -> String {
        let m = self.inner.lock().unwrap();
        let mut out = String::new();
        m.sync.render(
            &mut out,
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
        );
        m.full_sync.render(
            &mut out,
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
        );
        m.partial_sync.render(
            &mut out,
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
        );
        m.network_programming.render(
            &mut out,
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
        );
        let gauges = [
            (
                "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
                "The last time proxy rules were successfully synced",
                unix_seconds(m.last_synced),
            ),
            (
                "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
                "The last time a sync of proxy rules was queued",
                unix_seconds(m.last_queued),
            ),
        ];
        for (name, help, value) in gauges {
            header(&mut out, name, help, "gauge");
            let _ = writeln!(out, "{name} {value}");
        }
        let name = "kubeproxy_sync_proxy_rules_errors_total";
        let help = "Syncs of the dataplane that failed (they are retried)";
        header(&mut out, name, help, "counter");
        let _ = writeln!(out, "{name} {}", m.sync_errors);
        let name = "kubeproxy_proxy_healthz_total";
        header(
            &mut out,
            name,
            "Cumulative proxy healthz HTTP status",
            "counter",
        );
        let _ = writeln!(
            out,
            "{name}{{code=\"200\"}} {}\n{name}{{code=\"503\"}} {}",
            m.healthz[0], m.healthz[1]
        );
        for collect in self.collectors.lock().unwrap().iter() {
            collect(&mut out);
        }
        out
    }
}

/// `/metrics`, for [`crate::serve::http::serve`].
pub fn handler() -> Arc<dyn Fn(&str) -> Response + Send + Sync> {
    Arc::new(|path| match path {
        "/metrics" => Response {
            status: "200 OK",
            content_type: "text/plain; version=0.0.4; charset=utf-8",
            headers: Vec::new(),
            body: METRICS.render(),
        },
        _ => Response::not_found(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.synced(Duration::from_micros(500), true, true);
        m.synced(Duration::from_millis(3), false, true);
        m.synced(Duration::from_secs(20), false, false);
        let text = m.render();
        for line in [
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.001\"} 1",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.004\"} 2",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"16.384\"} 2",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"+Inf\"} 3",
            "kubeproxy_sync_proxy_rules_duration_seconds_count 3",
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count 1",
            "kubeproxy_sync_partial_proxy_rules_duration_seconds_count 2",
            "kubeproxy_sync_proxy_rules_errors_total 1",
            "# TYPE kubeproxy_sync_proxy_rules_last_timestamp_seconds gauge",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }

    #[test]
    fn network_programming_latency_uses_kube_proxys_buckets() {
        let m = Metrics::default();
        let now = SystemTime::now();
        let ago = |secs: f64| now - Duration::from_secs_f64(secs);
        // The second is ahead of this node's clock: counted as no time.
        m.programmed(&[
            ago(0.3),
            now + Duration::from_secs(5),
            ago(61.0),
            ago(400.0),
        ]);
        let text = m.render();
        let name = "kubeproxy_network_programming_duration_seconds";
        let buckets = text
            .lines()
            .filter(|l| l.starts_with(&format!("{name}_bucket")))
            .count();
        assert_eq!(buckets, 81, "80 buckets and +Inf:\n{text}");
        for line in [
            format!("{name}_bucket{{le=\"0.25\"}} 1"),
            format!("{name}_bucket{{le=\"0.5\"}} 2"),
            format!("{name}_bucket{{le=\"59\"}} 2"),
            format!("{name}_bucket{{le=\"65\"}} 3"),
            format!("{name}_bucket{{le=\"300\"}} 3"),
            format!("{name}_bucket{{le=\"+Inf\"}} 4"),
            format!("{name}_count 4"),
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }
}

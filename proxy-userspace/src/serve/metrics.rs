//! kube-proxy's sync metrics, by kube-proxy's names, in the Prometheus text format on
//! `--metrics-bind-address` (`/metrics`). Global, as Prometheus metrics conventionally are:
//! sources and the sync loop record into it from wherever they run.
use std::{
    fmt::Write as _,
    sync::{Arc, LazyLock, Mutex},
    time::{Duration, SystemTime},
};

use crate::{model::Family, serve::http::Response};

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

/// kube-proxy's label for the IP family a metric is about. A sync here programs every family
/// a mode serves at once: its metrics carry IPv4's label (kube-proxy's primary proxier's on
/// most clusters); those of one family's rules (the iptables mode's) carry their family's.
const IPV4: &str = "ip_family=\"IPv4\"";

/// The iptables mode's figures of one family.
#[derive(Clone, Copy, Debug, Default)]
struct IptablesFamily {
    restore_failures: u64,
    partial_restore_failures: u64,
    /// Rules written by the last sync, and rules owned, by [`IPTABLES_TABLES`].
    rules_last: [usize; 2],
    rules_total: [usize; 2],
}

/// The families kube-proxy registers only in some of its modes (its `RegisterMetrics(mode)`);
/// the agent exports them in the same modes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ModeFamilies {
    /// No mode started yet, or one whose families are all common (ebpf, userspace).
    #[default]
    Common,
    /// The iptables mode's restore failures and rule counts.
    Iptables,
    /// The IPVS mode's iptables restore failures.
    Ipvs,
    /// The nftables mode's sync and cleanup failures.
    Nftables,
}

#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
    collectors: Mutex<Vec<Collector>>,
}

/// Writes metrics kept outside the agent (a mode's kernel-side counters) in the text format,
/// when `/metrics` is scraped.
pub type Collector = Box<dyn Fn(&mut String) + Send>;

/// The two tables kube-proxy counts iptables rules in, in its label's order.
pub const IPTABLES_TABLES: [&str; 2] = ["filter", "nat"];

struct Inner {
    sync: Histogram,
    full_sync: Histogram,
    partial_sync: Histogram,
    network_programming: Histogram,
    conntrack_reconcile: Histogram,
    last_synced: Option<SystemTime>,
    last_queued: Option<SystemTime>,
    sync_errors: u64,
    /// Probes answered, healthy and not, of /healthz and of /livez.
    healthz: [u64; 2],
    livez: [u64; 2],
    conntrack_deleted: u64,
    /// Service ports with a Local internal / external traffic policy and no local endpoint.
    no_local_endpoints: [usize; 2],
    mode: Option<&'static str>,
    families: ModeFamilies,
    /// The iptables mode's, by family ([`Family::ALL`]' order; None: not served).
    iptables: [Option<IptablesFamily>; 2],
    nftables_sync_failures: u64,
    /// What KUBE-FORWARD's ct-state-invalid rule dropped, as the last sync read it.
    iptables_invalid_drops: Option<u64>,
    unserved_sctp_ports: usize,
}

impl Default for Inner {
    fn default() -> Self {
        Self {
            sync: Histogram::new(SYNC_BUCKETS),
            full_sync: Histogram::new(SYNC_BUCKETS),
            partial_sync: Histogram::new(SYNC_BUCKETS),
            network_programming: Histogram::new(PROGRAMMING_BUCKETS.as_slice()),
            conntrack_reconcile: Histogram::new(SYNC_BUCKETS),
            last_synced: None,
            last_queued: None,
            sync_errors: 0,
            healthz: [0; 2],
            livez: [0; 2],
            conntrack_deleted: 0,
            no_local_endpoints: [0; 2],
            mode: None,
            families: ModeFamilies::Common,
            iptables: [None, None],
            nftables_sync_failures: 0,
            iptables_invalid_drops: None,
            unserved_sctp_ports: 0,
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

    /// The family, its series labelled with `labels` (`name="value"` pairs, comma-joined).
    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        header(out, name, help, "histogram");
        for (count, le) in self.counts.iter().zip(self.buckets) {
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(
            out,
            "{name}_sum{{{labels}}} {}\n{name}_count{{{labels}}} {}",
            self.sum, self.count
        );
    }
}

/// A metric family's `# HELP` and `# TYPE` lines (`kind`: counter, gauge, histogram).
pub fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// A family of one series: its header and `name{labels} value` (no braces without labels).
pub fn single(out: &mut String, (name, help, kind): (&str, &str, &str), labels: &str, value: f64) {
    header(out, name, help, kind);
    match labels {
        "" => writeln!(out, "{name} {value}"),
        _ => writeln!(out, "{name}{{{labels}}} {value}"),
    }
    .unwrap_or(());
}

/// kube-proxy's counts of Service and EndpointSlice changes, in all and waiting for a sync
/// (from [`crate::model::ChangeTracker::change_counts`]).
pub fn render_change_counts(out: &mut String, [services, slices]: [(u64, usize); 2]) {
    for (kind, what, (total, pending)) in [
        ("service", "Service", services),
        ("endpoint", "Endpoint", slices),
    ] {
        let name = format!("kubeproxy_sync_proxy_rules_{kind}_changes");
        let help = format!("Cumulative proxy rules {what} changes");
        single(
            out,
            (&format!("{name}_total"), &help, "counter"),
            "",
            total as f64,
        );
        let help = format!("Pending proxy rules {what} changes");
        single(
            out,
            (&format!("{name}_pending"), &help, "gauge"),
            "",
            pending as f64,
        );
    }
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

    /// After a sync: how many Service ports have a Local internal and external traffic policy
    /// and no endpoint on this node.
    pub fn no_local_endpoints(&self, internal: usize, external: usize) {
        self.inner.lock().unwrap().no_local_endpoints = [internal, external];
    }

    /// A pass over the conntrack table for stale flows took `took` and deleted `deleted`.
    pub fn conntrack_reconciled(&self, took: Duration, deleted: u64) {
        let mut m = self.inner.lock().unwrap();
        m.conntrack_reconcile.observe(took.as_secs_f64());
        m.conntrack_deleted += deleted;
    }

    /// The running mode: its `--proxy-mode` name (served on `/proxyMode`) and the families
    /// kube-proxy exports only in it.
    pub fn set_mode(&self, name: &'static str, families: ModeFamilies) {
        let mut m = self.inner.lock().unwrap();
        m.mode = Some(name);
        m.families = families;
    }

    pub fn mode(&self) -> Option<&'static str> {
        self.inner.lock().unwrap().mode
    }

    /// An iptables-restore of a sync failed; `partial` when it wrote only the changed
    /// Services' chains.
    pub fn iptables_restore_failed(&self, family: Family, partial: bool) {
        let mut m = self.inner.lock().unwrap();
        let f = m.iptables[family as usize].get_or_insert_default();
        f.restore_failures += 1;
        f.partial_restore_failures += u64::from(partial);
    }

    /// The iptables rules of `family` the last sync wrote and those the mode owns now, by
    /// [`IPTABLES_TABLES`].
    pub fn iptables_rules(&self, family: Family, last: [usize; 2], total: [usize; 2]) {
        let mut m = self.inner.lock().unwrap();
        let f = m.iptables[family as usize].get_or_insert_default();
        f.rules_last = last;
        f.rules_total = total;
    }

    /// The packets the iptables mode's ct-state-invalid rule dropped, read after a sync.
    pub fn iptables_invalid_drops(&self, packets: Option<u64>) {
        self.inner.lock().unwrap().iptables_invalid_drops = packets;
    }

    pub fn nftables_sync_failed(&self) {
        self.inner.lock().unwrap().nftables_sync_failures += 1;
    }

    /// How many SCTP Service ports the mode cannot serve (each is also logged and reported
    /// in an Event).
    pub fn unserved_sctp_ports(&self, count: usize) {
        self.inner.lock().unwrap().unserved_sctp_ports = count;
    }

    /// Adds metrics that `collector` reads when they are scraped.
    pub fn add_collector(&self, collector: Collector) {
        self.collectors.lock().unwrap().push(collector);
    }

    /// A health probe was answered: of `/livez` or else of `/healthz`.
    pub fn probed(&self, livez: bool, healthy: bool) {
        let mut m = self.inner.lock().unwrap();
        let probes = if livez { &mut m.livez } else { &mut m.healthz };
        probes[usize::from(!healthy)] += 1;
    }

    pub fn render(&self) -> String {
        let m = self.inner.lock().unwrap();
        let mut out = String::new();
        let out = &mut out;
        m.sync.render(
            out,
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            IPV4,
        );
        m.full_sync.render(
            out,
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            IPV4,
        );
        m.partial_sync.render(
            out,
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            IPV4,
        );
        m.network_programming.render(
            out,
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            IPV4,
        );
        m.conntrack_reconcile.render(
            out,
            "kubeproxy_conntrack_reconciler_sync_duration_seconds",
            "ReconcileConntrackFlowsLatency latency in seconds",
            IPV4,
        );
        let gauge = |name, help| (name, help, "gauge");
        let counter = |name, help| (name, help, "counter");
        single(
            out,
            counter(
                "kubeproxy_conntrack_reconciler_deleted_entries_total",
                "Cumulative conntrack flows deleted by conntrack reconciler",
            ),
            IPV4,
            m.conntrack_deleted as f64,
        );
        single(
            out,
            gauge(
                "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
                "The last time proxy rules were successfully synced",
            ),
            IPV4,
            unix_seconds(m.last_synced),
        );
        single(
            out,
            gauge(
                "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
                "The last time a sync of proxy rules was queued",
            ),
            IPV4,
            unix_seconds(m.last_queued),
        );
        let name = "kubeproxy_sync_proxy_rules_no_local_endpoints_total";
        header(
            out,
            name,
            "Number of services with a Local traffic policy and no endpoints",
            "gauge",
        );
        for (policy, count) in ["internal", "external"].iter().zip(m.no_local_endpoints) {
            let _ = writeln!(out, "{name}{{{IPV4},traffic_policy=\"{policy}\"}} {count}");
        }
        single(
            out,
            counter(
                "kubeproxy_sync_proxy_rules_errors_total",
                "Syncs of the dataplane that failed (they are retried); not one of kube-proxy's",
            ),
            "",
            m.sync_errors as f64,
        );
        single(
            out,
            gauge(
                "kubeproxy_unserved_service_ports",
                "Service ports the running mode cannot serve (SCTP in the userspace mode, and in \
                 the ebpf mode where nft cannot run); not one of kube-proxy's",
            ),
            "protocol=\"SCTP\"",
            m.unserved_sctp_ports as f64,
        );
        for (name, help, probes) in [
            (
                "kubeproxy_proxy_healthz_total",
                "Cumulative proxy healthz HTTP status",
                m.healthz,
            ),
            (
                "kubeproxy_proxy_livez_total",
                "Cumulative proxy livez HTTP status",
                m.livez,
            ),
        ] {
            header(out, name, help, "counter");
            let _ = writeln!(
                out,
                "{name}{{code=\"200\"}} {}\n{name}{{code=\"503\"}} {}",
                probes[0], probes[1]
            );
        }
        // The families served (IPv4 before the first sync, and in the ipvs mode).
        let iptables: Vec<(String, IptablesFamily)> = match m.iptables {
            [None, None] => vec![(IPV4.to_owned(), IptablesFamily::default())],
            _ => (Family::ALL.iter().zip(&m.iptables))
                .filter_map(|(family, f)| Some((format!("ip_family=\"{family}\""), (*f)?)))
                .collect(),
        };
        let per_family =
            |out: &mut String, name: &str, help: &str, value: fn(&IptablesFamily) -> u64| {
                header(out, name, help, "counter");
                for (label, f) in &iptables {
                    let _ = writeln!(out, "{name}{{{label}}} {}", value(f));
                }
            };
        if matches!(m.families, ModeFamilies::Iptables | ModeFamilies::Ipvs) {
            per_family(
                out,
                "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
                "Cumulative proxy iptables restore failures",
                |f| f.restore_failures,
            );
        }
        if m.families == ModeFamilies::Iptables {
            per_family(
                out,
                "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
                "Cumulative proxy iptables partial restore failures",
                |f| f.partial_restore_failures,
            );
            if let Some(packets) = m.iptables_invalid_drops {
                single(
                    out,
                    counter(
                        "kubeproxy_iptables_ct_state_invalid_dropped_packets_total",
                        "packets dropped by iptables to work around conntrack problems",
                    ),
                    "",
                    packets as f64,
                );
            }
            let rules = [
                (
                    "kubeproxy_sync_proxy_rules_iptables_last",
                    "Number of iptables rules written by kube-proxy in last sync",
                    false,
                ),
                (
                    "kubeproxy_sync_proxy_rules_iptables_total",
                    "Total number of iptables rules owned by kube-proxy",
                    true,
                ),
            ];
            for (name, help, total) in rules {
                header(out, name, help, "gauge");
                for (label, f) in &iptables {
                    let counts = if total { f.rules_total } else { f.rules_last };
                    for (table, count) in IPTABLES_TABLES.iter().zip(counts) {
                        let _ = writeln!(out, "{name}{{{label},table=\"{table}\"}} {count}");
                    }
                }
            }
        }
        if m.families == ModeFamilies::Nftables {
            single(
                out,
                counter(
                    "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
                    "Cumulative proxy nftables sync failures",
                ),
                IPV4,
                m.nftables_sync_failures as f64,
            );
            // Chains no longer wanted are deleted in the sync's own transaction: a failure
            // there is a sync failure, and this stays 0.
            single(
                out,
                counter(
                    "kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total",
                    "Cumulative proxy nftables cleanup failures",
                ),
                IPV4,
                0.0,
            );
        }
        drop(m);
        for collect in self.collectors.lock().unwrap().iter() {
            collect(out);
        }
        crate::serve::process::render(out);
        std::mem::take(out)
    }
}

/// `/metrics`, for [`crate::serve::http::serve`].
/// Also, as on kube-proxy's metrics port, `/healthz` (the server answers: `ok`) and
/// `/proxyMode` (the running mode's name; 503 until a mode has started).
pub fn handler() -> Arc<dyn Fn(&str) -> Response + Send + Sync> {
    let text = |status, body: String| Response {
        status,
        content_type: "text/plain; charset=utf-8",
        headers: Vec::new(),
        body,
    };
    Arc::new(move |path| match path {
        "/metrics" => Response {
            status: "200 OK",
            content_type: "text/plain; version=0.0.4; charset=utf-8",
            headers: Vec::new(),
            body: METRICS.render(),
        },
        "/healthz" => text("200 OK", "ok".into()),
        "/proxyMode" => match METRICS.mode() {
            Some(mode) => text("200 OK", mode.into()),
            None => text(
                "503 Service Unavailable",
                "no proxy mode started yet\n".into(),
            ),
        },
        _ => Response::not_found(),
    })
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;

    /// kube-proxy's families that the agent does not export, and why.
    const NOT_EXPORTED: &[(&str, &str)] = &[(
        "kubeproxy_iptables_localhost_nodeports_accepted_packets_total",
        "not exported: NodePorts are never served on 127.0.0.0/8 (route_localnet stays off, \
             CVE-2020-8558), so no packet is accepted there",
    )];

    /// Each family in `text`: its type and the label names of its series (without `le`).
    fn families(text: &str) -> BTreeMap<String, (String, BTreeSet<String>)> {
        let mut found: BTreeMap<String, (String, BTreeSet<String>)> = BTreeMap::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                found.insert(name.into(), (kind.into(), BTreeSet::new()));
            } else if !line.starts_with('#') {
                let series = line.split_whitespace().next().unwrap();
                let (name, labels) = series.split_once('{').unwrap_or((series, ""));
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|suffix| {
                        let base = name.strip_suffix(suffix)?;
                        found.contains_key(base).then_some(base)
                    })
                    .unwrap_or(name);
                let entry = found
                    .get_mut(family)
                    .unwrap_or_else(|| panic!("{line}: no TYPE"));
                for pair in labels
                    .trim_end_matches('}')
                    .split(',')
                    .filter(|p| !p.is_empty())
                {
                    let label = pair.split_once('=').unwrap().0;
                    if label != "le" {
                        entry.1.insert(label.into());
                    }
                }
            }
        }
        found
    }

    #[test]
    fn families_match_kube_proxys_documented_list() {
        let documented = include_str!("testdata/kube_proxy_metrics.txt");
        let mut rendered = BTreeMap::new();
        for families_of in [
            ModeFamilies::Common,
            ModeFamilies::Iptables,
            ModeFamilies::Ipvs,
            ModeFamilies::Nftables,
        ] {
            let m = Metrics::default();
            m.set_mode("test", families_of);
            m.iptables_invalid_drops(Some(7));
            m.add_collector(Box::new(|out| render_change_counts(out, [(3, 1), (4, 2)])));
            rendered.extend(families(&m.render()));
        }
        for line in documented.lines().filter(|l| !l.starts_with('#')) {
            let [name, kind, labels] = line.split(' ').collect::<Vec<_>>()[..] else {
                panic!("bad line {line:?}");
            };
            if NOT_EXPORTED.iter().any(|(n, _)| *n == name) {
                continue;
            }
            let (got_kind, got_labels) = rendered
                .get(name)
                .unwrap_or_else(|| panic!("kube-proxy's {name} is not rendered"));
            // kube-proxy's custom collectors export counters.
            let kind = if kind == "custom" { "counter" } else { kind };
            assert_eq!(got_kind, kind, "{name}'s type");
            let want: BTreeSet<String> = labels
                .split(',')
                .filter(|l| *l != "-")
                .map(String::from)
                .collect();
            assert_eq!(got_labels, &want, "{name}'s labels");
        }
        // And nothing under kube-proxy's prefix that kube-proxy does not have, apart from the
        // agent's own families, which say so in their help.
        let own = [
            "kubeproxy_sync_proxy_rules_errors_total",
            "kubeproxy_unserved_service_ports",
        ];
        for name in rendered.keys().filter(|n| n.starts_with("kubeproxy_")) {
            assert!(
                documented
                    .lines()
                    .any(|l| l.split(' ').next() == Some(name))
                    || own.contains(&name.as_str()),
                "{name} is not one of kube-proxy's"
            );
        }
    }

    #[test]
    fn mode_families_only_in_their_modes() {
        let m = Metrics::default();
        assert!(!m.render().contains("iptables_restore_failures"));
        m.set_mode("nftables", ModeFamilies::Nftables);
        m.nftables_sync_failed();
        let text = m.render();
        assert!(text.contains(
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family=\"IPv4\"} 1"
        ));
        assert!(!text.contains("iptables_restore_failures"));
        m.set_mode("iptables", ModeFamilies::Iptables);
        m.iptables_restore_failed(Family::V4, true);
        m.iptables_rules(Family::V4, [3, 10], [5, 40]);
        m.iptables_rules(Family::V6, [1, 4], [2, 8]);
        let text = m.render();
        for line in [
            "kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family=\"IPv4\"} 1",
            "kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family=\"IPv6\"} 0",
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total{ip_family=\"IPv4\"} 1",
            "kubeproxy_sync_proxy_rules_iptables_last{ip_family=\"IPv4\",table=\"nat\"} 10",
            "kubeproxy_sync_proxy_rules_iptables_total{ip_family=\"IPv4\",table=\"filter\"} 5",
            "kubeproxy_sync_proxy_rules_iptables_total{ip_family=\"IPv6\",table=\"nat\"} 8",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }

    #[test]
    fn probes_counted_apart_and_process_metrics_present() {
        let m = Metrics::default();
        m.probed(false, true);
        m.probed(true, false);
        m.probed(true, true);
        m.no_local_endpoints(2, 1);
        let text = m.render();
        for line in [
            "kubeproxy_proxy_healthz_total{code=\"200\"} 1",
            "kubeproxy_proxy_healthz_total{code=\"503\"} 0",
            "kubeproxy_proxy_livez_total{code=\"200\"} 1",
            "kubeproxy_proxy_livez_total{code=\"503\"} 1",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"internal\"} 2",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"external\"} 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        let found = families(&text);
        for name in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_virtual_memory_bytes",
            "process_start_time_seconds",
            "process_open_fds",
            "process_max_fds",
            "kubernetes_build_info",
        ] {
            assert!(found.contains_key(name), "{name} missing");
        }
        let rss = text
            .lines()
            .find_map(|l| l.strip_prefix("process_resident_memory_bytes "))
            .unwrap();
        assert!(rss.parse::<f64>().unwrap() > 1e6, "RSS {rss}");
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.synced(Duration::from_micros(500), true, true);
        m.synced(Duration::from_millis(3), false, true);
        m.synced(Duration::from_secs(20), false, false);
        let text = m.render();
        for line in [
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.001\"} 1",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.004\"} 2",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"16.384\"} 2",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"+Inf\"} 3",
            "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 3",
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1",
            "kubeproxy_sync_partial_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 2",
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
            format!("{name}_bucket{{{IPV4},le=\"0.25\"}} 1"),
            format!("{name}_bucket{{{IPV4},le=\"0.5\"}} 2"),
            format!("{name}_bucket{{{IPV4},le=\"59\"}} 2"),
            format!("{name}_bucket{{{IPV4},le=\"65\"}} 3"),
            format!("{name}_bucket{{{IPV4},le=\"300\"}} 3"),
            format!("{name}_bucket{{{IPV4},le=\"+Inf\"}} 4"),
            format!("{name}_count{{{IPV4}}} 4"),
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }
}

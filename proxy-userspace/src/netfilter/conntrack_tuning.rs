//! kube-proxy's conntrack set-up (its `--conntrack-*` flags), made at start in every mode as
//! kube-proxy makes it: netfilter's conntrack tracks the node's traffic whatever programs the
//! Services (in the ebpf mode too, for the packets the programs hand to the stack).
use std::time::Duration;

use crate::netfilter::ensure_sysctl;

/// The settings, as kube-proxy's flags give them; zero (or false) leaves the kernel's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConntrackTuning {
    /// `--conntrack-max-per-core`: nf_conntrack_max is this many a CPU, at least `min`.
    pub max_per_core: u32,
    /// `--conntrack-min`.
    pub min: u32,
    /// `--conntrack-tcp-timeout-established`.
    pub tcp_established: Duration,
    /// `--conntrack-tcp-timeout-close-wait`.
    pub tcp_close_wait: Duration,
    /// `--conntrack-tcp-be-liberal`: out-of-window packets are not marked INVALID.
    pub tcp_be_liberal: bool,
    /// `--conntrack-udp-timeout`.
    pub udp: Duration,
    /// `--conntrack-udp-timeout-stream`.
    pub udp_stream: Duration,
}

/// Where netfilter's conntrack settings are, in this network namespace.
const SYSCTLS: &str = "net/netfilter";
/// The table's hash size: the kernel's, for every network namespace.
const HASHSIZE: &str = "/sys/module/nf_conntrack/parameters/hashsize";

impl ConntrackTuning {
    /// The nf_conntrack_max kube-proxy asks for on `cpus` CPUs; 0: none.
    pub fn max(&self, cpus: u32) -> u32 {
        match self.max_per_core {
            0 => 0,
            per_core => per_core.saturating_mul(cpus).max(self.min),
        }
    }

    /// Makes the settings, saying what it changed; what cannot be changed is reported, never
    /// fatal (the mode works with the kernel's settings).
    pub fn apply(&self) {
        if !std::path::Path::new("/proc/sys")
            .join(SYSCTLS)
            .join("nf_conntrack_max")
            .exists()
        {
            tracing::info!(
                "netfilter's conntrack is not in use here (no nf_conntrack module): its \
                 settings (--conntrack-*) have nothing to apply to"
            );
            return;
        }
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        self.raise_max(self.max(cpus));
        let secs = |d: Duration| (!d.is_zero()).then(|| d.as_secs().max(1).to_string());
        let settings = [
            (
                "nf_conntrack_tcp_timeout_established",
                secs(self.tcp_established),
            ),
            (
                "nf_conntrack_tcp_timeout_close_wait",
                secs(self.tcp_close_wait),
            ),
            (
                "nf_conntrack_tcp_be_liberal",
                self.tcp_be_liberal.then(|| "1".to_owned()),
            ),
            ("nf_conntrack_udp_timeout", secs(self.udp)),
            ("nf_conntrack_udp_timeout_stream", secs(self.udp_stream)),
        ];
        for (key, value) in settings {
            let Some(value) = value else { continue };
            match ensure_sysctl(&format!("{SYSCTLS}/{key}"), &value) {
                Ok(true) => tracing::info!(sysctl = key, value, "set netfilter's conntrack"),
                Ok(false) => {}
                Err(e) => tracing::warn!("netfilter's {key} is left as it is: {e:#}"),
            }
        }
    }

    /// nf_conntrack_max to `max` (and the table's hash size to a quarter of it, as kube-proxy
    /// sets both), unless it is that large already: a larger value set on the node is kept.
    /// Only the node's own network namespace may change them.
    fn raise_max(&self, max: u32) {
        if max == 0 {
            return;
        }
        let key = format!("{SYSCTLS}/nf_conntrack_max");
        // The kernel takes an int.
        let max = max.min(i32::MAX as u32);
        let Some(now) = read_number(&format!("/proc/sys/{key}")) else {
            tracing::warn!("nf_conntrack_max cannot be read: left as it is");
            return;
        };
        if now >= max {
            return;
        }
        if let Err(e) = ensure_sysctl(&key, &max.to_string()) {
            tracing::warn!(
                "nf_conntrack_max is {now}, below the {max} --conntrack-max-per-core and \
                 --conntrack-min ask for, and cannot be raised from here ({e:#}): a busy node's \
                 conntrack table may fill; raise it on the node (it can be changed only from the \
                 node's own network namespace)"
            );
            return;
        }
        tracing::info!(
            nf_conntrack_max = max,
            "raised netfilter's conntrack table size"
        );
        let buckets = max / 4;
        if read_number(HASHSIZE).is_some_and(|size| size < buckets)
            && let Err(e) = std::fs::write(HASHSIZE, buckets.to_string())
        {
            tracing::warn!("conntrack's hash size is left as it is ({HASHSIZE}: {e})");
        }
    }
}

fn read_number(path: &str) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tuning() -> ConntrackTuning {
        ConntrackTuning {
            max_per_core: 32768,
            min: 131072,
            tcp_established: Duration::from_secs(86400),
            tcp_close_wait: Duration::from_secs(3600),
            tcp_be_liberal: true,
            udp: Duration::from_secs(42),
            udp_stream: Duration::from_secs(123),
        }
    }

    /// kube-proxy's arithmetic: per core, at least the minimum; 0 per core asks for nothing.
    #[test]
    fn the_table_size_is_per_core_with_a_minimum() {
        assert_eq!(tuning().max(2), 131072);
        assert_eq!(tuning().max(8), 262144);
        let off = ConntrackTuning {
            max_per_core: 0,
            ..tuning()
        };
        assert_eq!(off.max(64), 0);
    }

    /// In a network namespace of its own (never the machine's): the timeouts and the liberal
    /// setting are that namespace's and are set; the table size is the node's and is left (a
    /// warning says so when it is below what is asked).
    #[test]
    fn settings_reach_the_network_namespace() {
        if !crate::testing::privileged("settings_reach_the_network_namespace", "true") {
            return;
        }
        let read = |key: &str| {
            std::fs::read_to_string(format!("/proc/sys/{SYSCTLS}/{key}"))
                .map(|v| v.trim().to_owned())
        };
        let before_max = read("nf_conntrack_max").ok();
        let seen = crate::testing::in_new_netns(move || {
            // Conntrack's settings appear in a namespace once its module is loaded.
            if !std::path::Path::new("/proc/sys/net/netfilter/nf_conntrack_max").exists() {
                return Ok("no conntrack".to_owned());
            }
            ConntrackTuning {
                max_per_core: u32::MAX / 4,
                ..tuning()
            }
            .apply();
            let keys = [
                "nf_conntrack_tcp_timeout_established",
                "nf_conntrack_tcp_timeout_close_wait",
                "nf_conntrack_tcp_be_liberal",
                "nf_conntrack_udp_timeout",
                "nf_conntrack_udp_timeout_stream",
            ];
            let values: Vec<String> = keys.iter().map(|k| read(k)).collect::<Result<_, _>>()?;
            Ok(values.join(" "))
        });
        if seen == "no conntrack" {
            let _ = std::io::Write::write_all(
                &mut std::io::stderr(),
                b"\nSKIPPED settings_reach_the_network_namespace: nf_conntrack is not loaded\n",
            );
            return;
        }
        assert_eq!(seen, "86400 3600 1 42 123");
        assert_eq!(
            read("nf_conntrack_max").ok(),
            before_max,
            "the node's table size"
        );
    }
}

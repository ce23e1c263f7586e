//! Stale UDP conntrack entries, for the netfilter modes (iptables, nftables): UDP has no
//! connection to end, so a conntrack entry keeps sending a flow to the endpoint it was NATed to
//! even after that endpoint left, or keeps a flow that arrived while a port had no endpoints
//! unNATed. Deleting the entries makes the next packet pick an endpoint again (kube-proxy's
//! `conntrack.CleanStaleEntries`).
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    process::{Command, Stdio},
};

use crate::model::{DesiredState, Family, Protocol, ServicePortName};

/// What a UDP Service port was last programmed with: its frontends and endpoints, to find the
/// conntrack entries a change leaves stale.
#[derive(Clone, Debug, Default, PartialEq)]
struct UdpPort {
    frontends: Vec<IpAddr>,
    node_port: Option<u16>,
    endpoints: BTreeSet<IpAddr>,
}

/// The UDP Service ports as last programmed.
#[derive(Debug, Default)]
pub struct StaleUdp {
    ports: BTreeMap<ServicePortName, UdpPort>,
}

impl StaleUdp {
    /// Deletes the conntrack entries of UDP flows that the change to `state` (now programmed)
    /// left pointing nowhere: to an endpoint that left (kube-proxy's rule), or blackholed while
    /// a port had no endpoints.
    ///
    /// Its time and the entries deleted are kube-proxy's conntrack reconciler metrics.
    pub fn clear(&mut self, state: &DesiredState) {
        let started = std::time::Instant::now();
        let mut deleted = 0;
        let mut conntrack_delete =
            |family: Family, args: &[&str]| deleted += conntrack_delete(family, args);
        let mut now = BTreeMap::new();
        for (spn, port) in state.ports() {
            if port.protocol != Protocol::Udp {
                continue;
            }
            // Both families: a mode that serves one has no entries of the other to delete.
            let mut frontends = port.cluster_ips.to_vec();
            frontends.extend(&port.external_ips);
            frontends.extend(&port.load_balancer_ips);
            let endpoints = (state.usable_endpoints(spn, false).iter())
                .map(|ep| ep.ip)
                .collect();
            now.insert(
                spn.clone(),
                UdpPort {
                    frontends,
                    node_port: port.node_port,
                    endpoints,
                },
            );
        }
        for (spn, before) in &self.ports {
            let after = now.get(spn).cloned().unwrap_or_default();
            for gone in before.endpoints.difference(&after.endpoints) {
                let family = Family::of(*gone);
                for vip in before.frontends.iter().filter(|vip| family.has(**vip)) {
                    conntrack_delete(
                        family,
                        &[
                            "--orig-dst",
                            &vip.to_string(),
                            "--dst-nat",
                            &gone.to_string(),
                        ],
                    );
                }
                if let Some(node_port) = before.node_port {
                    conntrack_delete(
                        family,
                        &[
                            "--dport",
                            &node_port.to_string(),
                            "--dst-nat",
                            &gone.to_string(),
                        ],
                    );
                }
            }
        }
        for (spn, after) in &now {
            let had = self.ports.get(spn).is_some_and(|b| !b.endpoints.is_empty());
            if !had && !after.endpoints.is_empty() {
                for vip in &after.frontends {
                    conntrack_delete(Family::of(*vip), &["--orig-dst", &vip.to_string()]);
                }
                if let Some(node_port) = after.node_port {
                    let families = after.endpoints.iter().map(|ep| Family::of(*ep));
                    for family in families.collect::<BTreeSet<_>>() {
                        conntrack_delete(family, &["--dport", &node_port.to_string()]);
                    }
                }
            }
        }
        self.ports = now;
        crate::serve::metrics::METRICS.conntrack_reconciled(started.elapsed(), deleted);
    }
}

/// `conntrack -D -f <family> -p udp ARGS`; the entries it deleted (finding none is not an
/// error).
fn conntrack_delete(family: Family, args: &[&str]) -> u64 {
    let family = match family {
        Family::V4 => "ipv4",
        Family::V6 => "ipv6",
    };
    let result = Command::new("conntrack")
        .args(["-D", "-f", family, "-p", "udp"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output();
    // "conntrack v1.4.7 (conntrack-tracking): 2 flow entries have been deleted."
    let count = |stderr: &[u8]| -> Option<u64> {
        let text = String::from_utf8_lossy(stderr);
        let (before, _) = text.split_once(" flow entries")?;
        before.rsplit(' ').next()?.parse().ok()
    };
    match result {
        // conntrack exits 1 when no entry matched.
        Ok(o) if o.status.success() || count(&o.stderr) == Some(0) => count(&o.stderr).unwrap_or(0),
        Ok(o) => {
            tracing::warn!(
                ?args,
                "deleting stale UDP conntrack entries: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            );
            0
        }
        Err(e) => {
            tracing::warn!("deleting stale UDP conntrack entries: conntrack: {e}");
            0
        }
    }
}

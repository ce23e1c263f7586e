//! SCTP Service ports in the ebpf mode. The programs do not translate SCTP: its checksum is a
//! CRC32c over the whole packet, ports included, which no BPF helper recomputes (the IP
//! addresses are outside it, but a Service's port and target port differ). So these ports are
//! written as nftables rules in kube-proxy's layout ([`crate::modes::nftables::rules`]), in a
//! table of their own, and netfilter's SCTP NAT translates them, checksum included, as in
//! kube-proxy's nftables mode; the programs pass SCTP packets untouched. The table exists only
//! while some SCTP Service port does: its NAT chains turn on netfilter's conntrack for every
//! packet of the node's namespace.
//!
//! Where `nft` cannot be run, each SCTP Service port is reported as not served (logged once,
//! an Event on its Service, `kubeproxy_unserved_service_ports`), never silently dropped.
use std::collections::BTreeSet;

use crate::{
    dataplane::Scope,
    events::{self, Regarding},
    model::{DesiredState, Family, Protocol, ServicePortName},
    modes::nftables::{
        self,
        rules::{Programmed, Table},
    },
    netfilter::rules::NetfilterConfig,
    rows::{Rows, What},
    serve::metrics::METRICS,
};

pub const TABLE: Table = Table {
    family: Family::V4,
    name: "ip kube-proxy-ebpf-sctp",
    comment: "SCTP Service ports (kube-proxy-ebpf, ebpf mode: netfilter translates SCTP)",
    // The programs serve the other protocols' ports of these cluster IPs.
    checks_cluster_ips: false,
};

fn is_sctp(spn: &ServicePortName) -> bool {
    spn.protocol == Protocol::Sctp
}

pub struct SctpPorts {
    config: NetfilterConfig,
    /// What the table holds; None: unknown or absent (written anew when needed).
    programmed: Option<Programmed>,
    /// Why nft cannot serve them, once found.
    unavailable: Option<String>,
    /// The ports reported as not served.
    reported: BTreeSet<ServicePortName>,
}

impl SctpPorts {
    pub fn new(config: NetfilterConfig) -> Self {
        Self {
            config,
            programmed: None,
            unavailable: None,
            reported: BTreeSet::new(),
        }
    }

    /// Writes the SCTP ports of `state` that `scope` names (all of them when the table's
    /// content is not known). The renderer sees the SCTP ports alone, whichever way it goes
    /// (a settings change, say, makes it write the table anew).
    pub fn sync(&mut self, state: &DesiredState, scope: Scope<'_>) -> anyhow::Result<()> {
        let changed: BTreeSet<ServicePortName>;
        let scope = match scope {
            Scope::Changed(all) => {
                changed = all.iter().filter(|spn| is_sctp(spn)).cloned().collect();
                if changed.is_empty() {
                    return Ok(());
                }
                match self.programmed {
                    Some(_) => Scope::Changed(&changed),
                    None => Scope::All,
                }
            }
            Scope::All => Scope::All,
        };
        let state = &state.only(is_sctp);
        if self.programmed.is_none() && state.port_count() == 0 {
            // Nothing to serve (nor to report as not served), and maybe a table of an earlier
            // run to remove.
            self.report(state, "");
            return remove_table();
        }
        if let Some(why) = self.unavailable.clone() {
            self.report(state, &why);
            return Ok(());
        }
        let settings = self.config.settings(Family::V4)?;
        let programmed = self.programmed.take();
        let rendered = nftables::rules::render(state, &settings, TABLE, programmed, scope);
        if !rendered.text.is_empty()
            && let Err(e) = nftables::nft(&rendered.text)
        {
            if let Err(why) = nftables::available() {
                let why = format!("{why:#}");
                self.report(state, &why);
                self.unavailable = Some(why);
                return Ok(());
            }
            return Err(e.context("writing the SCTP Service ports' nftables rules"));
        }
        if rendered.programmed.is_empty() {
            // The last SCTP port went: netfilter's NAT is needed no more.
            return remove_table();
        }
        self.programmed = Some(rendered.programmed);
        Ok(())
    }

    /// Says once of each SCTP port of `state` that it is not served, and why.
    fn report(&mut self, state: &DesiredState, why: &str) {
        let ports: BTreeSet<ServicePortName> =
            state.port_names().filter(|s| is_sctp(s)).cloned().collect();
        for spn in ports.difference(&self.reported) {
            tracing::warn!(
                service = %spn,
                "not served: the ebpf mode serves SCTP through nftables rules, and nft cannot run \
                 here ({why})"
            );
            let note =
                format!("SCTP port {spn} is not served on this node: nft cannot run ({why})");
            events::record(
                Regarding::Service(&spn.service),
                true,
                "SCTPNotServed",
                "Sync",
                Some(note),
            );
        }
        METRICS.unserved_sctp_ports(ports.len());
        self.reported = ports;
    }
}

/// Whether the table is here.
pub fn installed() -> bool {
    nftables::exists(TABLE.name)
}

/// `what` of the table, as the nftables mode's reader reads it; None without the table (also
/// when the running agent removes it meanwhile: its last SCTP port went).
pub fn read(what: What) -> anyhow::Result<Option<Rows>> {
    if !installed() {
        return Ok(None);
    }
    match nftables::inspect::read(what, &[TABLE]) {
        Ok(rows) => Ok(Some(rows)),
        Err(_) if !installed() => Ok(None),
        Err(e) => Err(e),
    }
}

/// Removes the table (`--cleanup`, and a start with no SCTP port); none: nothing done.
pub fn remove_table() -> anyhow::Result<()> {
    if installed() {
        nftables::nft(&format!("delete table {}\n", TABLE.name))?;
        tracing::info!(table = TABLE.name, "removed the SCTP Service ports' table");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::{net::Ipv4Addr, process::Command};

    use super::*;
    use crate::{
        model::{Cidr, NamespacedName},
        node::NodePortAddresses,
        testing::{fixture, in_new_netns, privileged},
    };

    const MANIFEST: &str = "
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080}]}
---
apiVersion: v1
kind: Service
metadata: {name: signal, namespace: shop}
spec: {type: NodePort, clusterIP: 10.96.0.20,
  ports: [{name: assoc, port: 9000, protocol: SCTP, targetPort: 8080, nodePort: 30095}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: signal-1, namespace: shop, labels: {kubernetes.io/service-name: signal}}
addressType: IPv4
ports: [{name: assoc, port: 8080, protocol: SCTP}]
endpoints: [{addresses: [10.244.1.11], nodeName: node1}]
";

    /// The table holds the SCTP ports alone, follows them, and goes with the last one.
    #[test]
    fn the_table_holds_the_sctp_ports_while_there_are_some() {
        if !privileged(
            "modes::ebpf::sctp::tests::the_table_holds_the_sctp_ports",
            "nft",
        ) {
            return;
        }
        let listed = in_new_netns(|| {
            let mut ports = SctpPorts::new(NetfilterConfig {
                cluster_cidrs: vec![Cidr::v4(Ipv4Addr::new(10, 244, 0, 0), 16)],
                masquerade_all: false,
                node_port_addresses: NodePortAddresses::Cidrs(vec![Cidr::v4(
                    Ipv4Addr::UNSPECIFIED,
                    0,
                )]),
                primary: Vec::new(),
            });
            let list = || {
                let out = Command::new("nft").args(["list", "ruleset"]).output()?;
                anyhow::Ok(String::from_utf8_lossy(&out.stdout).into_owned())
            };
            let mut state = fixture(MANIFEST);
            ports.sync(&state, Scope::All)?;
            let with = list()?;
            let signal = ServicePortName::new(
                NamespacedName::new("shop", "signal"),
                "assoc",
                Protocol::Sctp,
            );
            state.remove_port(&signal);
            ports.sync(&state, Scope::Changed(&BTreeSet::from([signal])))?;
            let without = list()?;
            Ok(format!("{with}\n=====\n{without}"))
        });
        let (with, without) = listed.split_once("=====").unwrap();
        assert!(
            with.contains("table ip kube-proxy-ebpf-sctp")
                && with.contains("10.96.0.20 . sctp . 9000")
                && with.contains("dnat to 10.244.1.11:8080"),
            "{with}"
        );
        assert!(
            !with.contains("10.96.0.10"),
            "a TCP port in the table: {with}"
        );
        assert!(!without.contains("kube-proxy-ebpf-sctp"), "{without}");
    }
}

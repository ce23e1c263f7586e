//! SCTP Service ports in the ebpf mode. The programs do not translate SCTP: its checksum is a
//! CRC32c over the whole packet, ports included, which no BPF helper recomputes (the IP
//! addresses are outside it, but a Service's port and target port differ). So these ports are
//! written as nftables rules in kube-proxy's layout ([`crate::modes::nftables::rules`]), in
//! tables of their own (`ip` and `ip6`), and netfilter's SCTP NAT translates them, checksum
//! included, as in kube-proxy's nftables mode; the programs pass SCTP packets untouched. A
//! family's table exists only while some SCTP Service port of that family does: its NAT chains
//! turn on netfilter's conntrack for every packet of that family in the node's namespace.
//!
//! Where `nft` cannot be run, each SCTP Service port is reported as not served (logged once,
//! an Event on its Service, `kubeproxy_unserved_service_ports`), never silently dropped.
use std::{collections::BTreeSet, fmt::Write};

use anyhow::Context;

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

pub const TABLE6: Table = Table {
    family: Family::V6,
    name: "ip6 kube-proxy-ebpf-sctp",
    ..TABLE
};

/// One table a family, each only while that family has an SCTP port.
pub const TABLES: [Table; 2] = [TABLE, TABLE6];

fn is_sctp(spn: &ServicePortName) -> bool {
    spn.protocol == Protocol::Sctp
}

pub struct SctpPorts {
    config: NetfilterConfig,
    /// What each table of [`TABLES`] holds; None: unknown or absent (written anew when
    /// needed).
    programmed: [Option<Programmed>; 2],
    /// Why nft cannot serve them, once found.
    unavailable: Option<String>,
    /// The tables nft can write here, found at the first write as the nftables mode finds
    /// them at its start (a node booted without IPv6 has no `ip6` tables); None: not yet.
    writable: Option<Vec<Table>>,
    /// The ports reported as not served.
    reported: BTreeSet<ServicePortName>,
}

impl SctpPorts {
    pub fn new(config: NetfilterConfig) -> Self {
        Self {
            config,
            programmed: [None, None],
            unavailable: None,
            writable: None,
            reported: BTreeSet::new(),
        }
    }

    /// Writes the SCTP ports of `state` that `scope` names (all of them to a table whose
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
                Scope::Changed(&changed)
            }
            Scope::All => Scope::All,
        };
        let state = &state.only(is_sctp);
        if self.programmed.iter().all(Option::is_none) && state.port_count() == 0 {
            // Nothing to serve (nor to report as not served), and maybe tables of an earlier
            // run to remove.
            self.report(state, "");
            return remove_tables();
        }
        if let Some(why) = self.unavailable.clone() {
            self.report(state, &why);
            return Ok(());
        }
        let first = self.writable.is_none();
        let writable = match &self.writable {
            Some(writable) => writable.clone(),
            None => {
                if let Err(why) = nftables::available() {
                    let why = format!("{why:#}");
                    self.report(state, &why);
                    self.unavailable = Some(why);
                    return Ok(());
                }
                self.writable.insert(writable_tables()).clone()
            }
        };
        // One transaction for both families, as the nftables mode writes them; a family
        // without SCTP ports has no table (netfilter's NAT is then not needed for it).
        let mut text = String::new();
        let mut programmed = [None, None];
        for ((table, was), now) in TABLES.iter().zip(&mut self.programmed).zip(&mut programmed) {
            // Taken: if the transaction fails, the next sync starts from unknown tables.
            let was = was.take();
            if !writable.contains(table) {
                continue; // said at the first write
            }
            if !state.ports().any(|(_, sp)| sp.in_family(table.family)) {
                if was.is_some() || first {
                    // Its last port went, or an earlier run may have left it: gone in the
                    // same transaction (adding it first makes the delete valid without it).
                    let _ = write!(text, "add table {0}\ndelete table {0}\n", table.name);
                }
                continue;
            }
            let scope = if was.is_some() { scope } else { Scope::All };
            let settings = self.config.settings(table.family)?;
            let rendered = nftables::rules::render(state, &settings, *table, was, scope);
            text.push_str(&rendered.text);
            *now = Some(rendered.programmed);
        }
        if !text.is_empty() {
            nftables::nft(&text).context("writing the SCTP Service ports' nftables rules")?;
        }
        self.programmed = programmed;
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

/// Whether a table of [`TABLES`] is here.
pub fn installed() -> bool {
    !present().is_empty()
}

/// The tables of [`TABLES`] that are here (one `nft` run: each full sync without SCTP ports
/// asks).
fn present() -> Vec<Table> {
    let here = nftables::present(TABLES.iter().map(|t| t.name));
    (TABLES.into_iter())
        .filter(|t| here.contains(&t.name))
        .collect()
}

/// `what` of the tables, as the nftables mode's reader reads them; None without them.
pub fn read(what: What) -> anyhow::Result<Option<Rows>> {
    let tables = present();
    if tables.is_empty() {
        return Ok(None);
    }
    match nftables::inspect::read(what, &tables) {
        Ok(rows) => Ok(Some(rows)),
        // The running agent removed or added one meanwhile (a family's last or first SCTP
        // port): read what is there now.
        Err(_) if present() != tables => read(what),
        Err(e) => Err(e),
    }
}

/// Removes the tables (`--cleanup`, and a start with no SCTP port); none: nothing done.
pub fn remove_tables() -> anyhow::Result<()> {
    for table in present() {
        nftables::nft(&format!("delete table {}\n", table.name))?;
        tracing::info!(table = table.name, "removed an SCTP Service ports' table");
    }
    Ok(())
}

/// The tables of [`TABLES`] nft can write here; says which it cannot, and what goes unserved.
fn writable_tables() -> Vec<Table> {
    TABLES
        .into_iter()
        .filter(|table| match nftables::can_write(table) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(
                    "{} SCTP Service ports are not served by the ebpf mode: nft cannot write {} \
                     here ({e:#})",
                    table.family,
                    table.name
                );
                false
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::{
        net::{Ipv4Addr, Ipv6Addr},
        process::Command,
    };

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
---
apiVersion: v1
kind: Service
metadata: {name: signal6, namespace: shop}
spec: {clusterIP: fd00:10:96::20, clusterIPs: [fd00:10:96::20], ipFamilies: [IPv6],
  ports: [{name: assoc, port: 9000, protocol: SCTP, targetPort: 8080}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: signal6-1, namespace: shop, labels: {kubernetes.io/service-name: signal6}}
addressType: IPv6
ports: [{name: assoc, port: 8080, protocol: SCTP}]
endpoints: [{addresses: [fd00:10:244:1::11], nodeName: node1}]
";

    /// Each family's table holds its SCTP ports alone, follows them, and goes with the last.
    #[test]
    fn the_tables_hold_the_sctp_ports_while_there_are_some() {
        if !privileged(
            "modes::ebpf::sctp::tests::the_tables_hold_the_sctp_ports_while_there_are_some",
            "nft",
        ) {
            return;
        }
        let listed = in_new_netns(|| {
            let mut ports = SctpPorts::new(NetfilterConfig {
                cluster_cidrs: vec![Cidr::v4(Ipv4Addr::new(10, 244, 0, 0), 16)],
                masquerade_all: false,
                node_port_addresses: NodePortAddresses::Cidrs(vec![
                    Cidr::v4(Ipv4Addr::UNSPECIFIED, 0),
                    Cidr {
                        addr: Ipv6Addr::UNSPECIFIED.into(),
                        len: 0,
                    },
                ]),
                primary: Vec::new(),
            });
            let list = || {
                let out = Command::new("nft").args(["list", "ruleset"]).output()?;
                anyhow::Ok(String::from_utf8_lossy(&out.stdout).into_owned())
            };
            let mut state = fixture(MANIFEST);
            let mut listed = Vec::new();
            ports.sync(&state, Scope::All)?;
            listed.push(list()?);
            // inspect reads both families' tables.
            let Some(Rows::Services { rows, .. }) = read(What::Services)? else {
                anyhow::bail!("no services read");
            };
            let addresses: Vec<&str> = rows.iter().map(|r| r.address.as_str()).collect();
            anyhow::ensure!(
                addresses.contains(&"10.96.0.20:9000")
                    && addresses.contains(&"[fd00:10:96::20]:9000"),
                "{addresses:?}"
            );
            for name in ["signal6", "signal"] {
                let spn = ServicePortName::new(
                    NamespacedName::new("shop", name),
                    "assoc",
                    Protocol::Sctp,
                );
                state.remove_port(&spn);
                ports.sync(&state, Scope::Changed(&BTreeSet::from([spn])))?;
                listed.push(list()?);
            }
            Ok(listed.join("====="))
        });
        let listed: Vec<&str> = listed.split("=====").collect();
        let [both, ipv4, none] = listed[..] else {
            panic!("{listed:?}")
        };
        assert!(
            both.contains("table ip kube-proxy-ebpf-sctp")
                && both.contains("10.96.0.20 . sctp . 9000")
                && both.contains("dnat to 10.244.1.11:8080")
                && both.contains("table ip6 kube-proxy-ebpf-sctp")
                && both.contains("fd00:10:96::20 . sctp . 9000")
                && both.contains("dnat to [fd00:10:244:1::11]:8080"),
            "{both}"
        );
        assert!(
            !both.contains("10.96.0.10"),
            "a TCP port in the table: {both}"
        );
        assert!(
            ipv4.contains("table ip kube-proxy-ebpf-sctp")
                && !ipv4.contains("table ip6 kube-proxy-ebpf-sctp"),
            "{ipv4}"
        );
        assert!(!none.contains("kube-proxy-ebpf-sctp"), "{none}");
    }

    /// A table an earlier run left for a family without SCTP ports now goes at the first
    /// write.
    #[test]
    fn an_earlier_runs_table_of_a_family_without_sctp_ports_goes() {
        if !privileged(
            "modes::ebpf::sctp::tests::an_earlier_runs_table_of_a_family_without_sctp_ports_goes",
            "nft",
        ) {
            return;
        }
        let listed = in_new_netns(|| {
            nftables::nft("add table ip6 kube-proxy-ebpf-sctp\n")?;
            let mut ports = SctpPorts::new(NetfilterConfig {
                cluster_cidrs: Vec::new(),
                masquerade_all: false,
                node_port_addresses: NodePortAddresses::Primary,
                primary: Vec::new(),
            });
            let mut state = fixture(MANIFEST);
            let signal6 = ServicePortName::new(
                NamespacedName::new("shop", "signal6"),
                "assoc",
                Protocol::Sctp,
            );
            state.remove_port(&signal6);
            ports.sync(&state, Scope::All)?;
            let out = Command::new("nft").args(["list", "tables"]).output()?;
            anyhow::Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        });
        assert_eq!(listed.trim(), "table ip kube-proxy-ebpf-sctp");
    }
}

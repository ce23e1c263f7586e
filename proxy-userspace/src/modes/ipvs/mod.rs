//! kube-proxy's IPVS mode, for nodes where the eBPF datapath cannot run: the kernel's IP
//! Virtual Server does the load balancing. Each sync
//!
//! - binds the cluster, external and load balancer IPs to the dummy interface `kube-ipvs0`
//!   (created if missing; left down, as kube-proxy leaves it), so that the node takes their
//!   packets in;
//! - makes the IPVS table hold one virtual server per frontend ([`rules::plan`]: cluster IPs,
//!   external IPs, load balancer IPs, and each NodePort on each node address) with the
//!   scheduler of `--ipvs-scheduler`, persistence for sessionAffinity ClientIP, and the usable
//!   endpoints as real servers (masquerading forwarding, weight 1), through generic netlink
//!   ([`netlink`]);
//! - writes kube-proxy's ipsets with one `ipset restore`, and its few iptables rules with one
//!   `iptables-restore --noflush` ([`rules`]);
//! - deletes stale UDP conntrack entries when endpoints go.
//!
//! IPv6 is served beside IPv4 where `ip6tables` runs, as kube-proxy runs a proxier a family:
//! each family has its own plan, ipsets (`KUBE-6-...` for IPv6) and iptables rules; the virtual
//! servers of both live in the one IPVS table, the addresses of both on `kube-ipvs0` (IPv6 ones
//! without duplicate address detection, which would leave them unusable on the interface, down).
//!
//! A full sync ([`Scope::All`]) reads the IPVS table and the addresses of `kube-ipvs0` from the
//! kernel and removes whatever the state does not name (virtual servers outside
//! `--ipvs-exclude-cidrs`, addresses); between full syncs the dataplane compares the plan with
//! what it programmed last, so only the changed Service ports' virtual servers are touched.
//!
//! A real server that leaves is terminated gracefully, as kube-proxy's graceful termination
//! manager does: a TCP one with connections is set to weight 0 (no new connections) and deleted
//! once IPVS counts none (active or inactive) for it, checked in [`Dataplane::housekeeping`];
//! UDP and SCTP ones go at once (`net.ipv4.vs.expire_nodest_conn` ends their flows at the next
//! packet). An endpoint that comes back while terminating gets its weight back.
pub mod inspect;
pub mod netlink;
pub mod rules;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    process::{Command, Stdio},
};

use anyhow::{Context, bail};
use netlink::{Dest, Ipvs, OpenError, Service, ServiceKey};

use crate::{
    dataplane::{Dataplane, Scope},
    model::{Cidr, DesiredState, Family},
    netfilter::{
        iptables::{self, Backend, Jump, Tables},
        rules::NetfilterConfig,
        stale_udp::StaleUdp,
    },
    node,
};

/// The dummy interface holding the service addresses (kube-proxy's).
pub const DUMMY: &str = "kube-ipvs0";

/// kube-proxy's default `--ipvs-scheduler`.
pub const DEFAULT_SCHEDULER: &str = "rr";

/// What the mode is configured with (kube-proxy's flags).
#[derive(Clone, Debug)]
pub struct IpvsConfig {
    /// `--ipvs-scheduler`: the IPVS scheduler's name (`rr`, `wrr`, `lc`, `wlc`, `lblc`,
    /// `lblcr`, `dh`, `sh`, `sed`, `nq`, `mh`...), passed to the kernel as is.
    pub scheduler: String,
    /// `--ipvs-strict-arp`: `arp_ignore=1`, `arp_announce=2` on all interfaces, so that the
    /// node does not answer ARP for the addresses on `kube-ipvs0` (needed by L2 load
    /// balancers such as MetalLB).
    pub strict_arp: bool,
    /// `--ipvs-exclude-cidrs`: virtual servers in these ranges are someone else's; a full sync
    /// and `--cleanup` leave them.
    pub exclude_cidrs: Vec<Cidr>,
    /// `--ipvs-tcp-timeout`, `--ipvs-tcpfin-timeout`, `--ipvs-udp-timeout`: IPVS's idle
    /// timeouts of established TCP connections, of TCP connections after a FIN, and of UDP
    /// flows; zero leaves the kernel's (900 s, 120 s, 300 s).
    pub timeouts: netlink::Timeouts,
    /// `--iptables-backend`, for the mode's few iptables rules.
    pub backend: Backend,
    pub netfilter: NetfilterConfig,
}

/// The sysctls the mode needs in the agent's network namespace (kube-proxy's): IPVS keeps
/// conntrack entries (the iptables rules match them), ends the connections of a deleted
/// real server at their next packet, and forgets a persistence template whose real server
/// has weight 0; and the node forwards (a real server's replies to a client that is not the
/// node are translated back on the FORWARD hook).
const SYSCTLS: &[(&str, &str)] = &[
    ("net/ipv4/ip_forward", "1"),
    ("net/ipv4/vs/conntrack", "1"),
    ("net/ipv4/vs/expire_nodest_conn", "1"),
    ("net/ipv4/vs/expire_quiescent_template", "1"),
];
const STRICT_ARP_SYSCTLS: &[(&str, &str)] = &[
    ("net/ipv4/conf/all/arp_ignore", "1"),
    ("net/ipv4/conf/all/arp_announce", "2"),
];

/// The kernel modules the mode needs (for the error saying IPVS is missing).
const MODULES: &str = "ip_vs, ip_vs_rr (and ip_vs_<scheduler>), nf_conntrack";

/// The jumps from the built-in chains to the mode's, kube-proxy's `iptablesJumpChain`.
#[rustfmt::skip]
const JUMPS: &[Jump] = &[
    Jump::new("nat", "OUTPUT", "kubernetes service portals", "KUBE-SERVICES"),
    Jump::new("nat", "PREROUTING", "kubernetes service portals", "KUBE-SERVICES"),
    Jump::new("nat", "POSTROUTING", "kubernetes postrouting rules", "KUBE-POSTROUTING"),
    Jump::new("filter", "FORWARD", "kubernetes forwarding rules", "KUBE-FORWARD"),
    Jump::new("filter", "INPUT", "kubernetes health check rules", "KUBE-NODE-PORT"),
    Jump::new("filter", "INPUT", "kube-proxy firewall rules", "KUBE-PROXY-FIREWALL"),
    Jump::new("filter", "FORWARD", "kube-proxy firewall rules", "KUBE-PROXY-FIREWALL"),
    Jump::new("filter", "INPUT", "kubernetes ipvs access filter", "KUBE-IPVS-FILTER"),
    Jump::new("filter", "OUTPUT", "kubernetes ipvs access filter", "KUBE-IPVS-OUT-FILTER"),
];

/// A virtual server as programmed: the service and its real servers.
#[derive(Clone, Debug)]
struct Programmed {
    service: Service,
    dests: BTreeMap<(IpAddr, u16), Dest>,
}

/// A real server being terminated: its virtual server and address.
type Terminating = (ServiceKey, IpAddr, u16);

pub struct IpvsDataplane {
    config: IpvsConfig,
    ipvs: Ipvs,
    /// The families served: IPv4's, and IPv6's where ip6tables runs here.
    families: Vec<Family>,
    /// The virtual servers (of the families served) as programmed, and the addresses bound to
    /// `kube-ipvs0`; None until a sync succeeded (then the kernel is read).
    programmed: Option<(BTreeMap<ServiceKey, Programmed>, BTreeSet<IpAddr>)>,
    /// Real servers at weight 0, deleted once they have no connections.
    terminating: BTreeSet<Terminating>,
    jumps_checked: bool,
    udp: StaleUdp,
}

fn ipset_restore(input: &str) -> anyhow::Result<()> {
    crate::command::pipe("ipset", &["restore"], input)
}

/// The names of the ipsets here (empty when ipset cannot be run).
fn ipset_names() -> Vec<String> {
    Command::new("ipset")
        .args(["list", "-n"])
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// Whether the dummy interface exists.
fn dummy_exists() -> bool {
    Command::new("ip")
        .args(["link", "show", DUMMY])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn ip(args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new("ip")
        .args(args)
        .output()
        .context("running ip (the iproute2 package)")?;
    if !output.status.success() {
        bail!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The addresses on the dummy interface, both families (an IPv6 link-local one is the
/// kernel's, not a service's).
fn dummy_addresses() -> anyhow::Result<BTreeSet<IpAddr>> {
    let listed = ip(&["-o", "addr", "show", "dev", DUMMY])?;
    Ok(listed
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            words.find(|w| *w == "inet" || *w == "inet6")?;
            words.next()?.split('/').next()?.parse().ok()
        })
        .filter(|ip: &IpAddr| !matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local()))
        .collect())
}

impl IpvsDataplane {
    /// Checks that IPVS, ipset and iptables work here and sets the mode's sysctls. What an
    /// earlier run left is taken over at the first sync.
    pub fn new(config: IpvsConfig) -> anyhow::Result<Self> {
        let opened = Ipvs::open().or_else(|e| match e {
            // As kube-proxy: load the module when it is not (no effect without the module).
            OpenError::NoIpvs => {
                let loaded = Command::new("modprobe")
                    .args(["-q", "ip_vs"])
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success());
                if loaded { Ipvs::open() } else { Err(e) }
            }
            e => Err(e),
        });
        let mut ipvs = opened.map_err(|e| match e {
            OpenError::NoIpvs => anyhow::anyhow!(
                "the IPVS proxy mode needs the kernel's IPVS, which is not available here \
                 (the generic netlink family \"IPVS\" is unknown): load the modules {MODULES} \
                 (modprobe ip_vs ip_vs_{}), or use another --proxy-mode (nftables, iptables)",
                config.scheduler
            ),
            OpenError::Other(e) => e,
        })?;
        let version = Command::new("ipset")
            .arg("version")
            .output()
            .context("running ipset: the IPVS mode needs the ipset command (the ipset package)")?;
        if !version.status.success() {
            bail!(
                "ipset version failed: {}",
                String::from_utf8_lossy(&version.stderr).trim()
            );
        }
        let needs = format!(
            "the IPVS mode needs iptables-{}: iptables-save cannot be run",
            config.backend.name()
        );
        let families = iptables::families_here(config.backend, &needs)?;
        let families = families.into_iter().map(|(t, _)| t.family).collect();
        if config.timeouts != netlink::Timeouts::default() {
            ipvs.set_timeouts(&config.timeouts)?;
        }
        for (key, value) in SYSCTLS {
            crate::netfilter::ensure_sysctl(key, value)?;
        }
        if config.strict_arp {
            for (key, value) in STRICT_ARP_SYSCTLS {
                crate::netfilter::ensure_sysctl(key, value)?;
            }
        }
        Ok(Self {
            config,
            ipvs,
            families,
            programmed: None,
            terminating: BTreeSet::new(),
            jumps_checked: false,
            udp: StaleUdp::default(),
        })
    }

    fn excluded(&self, addr: IpAddr) -> bool {
        self.config
            .exclude_cidrs
            .iter()
            .any(|cidr| cidr.contains(addr))
    }

    fn tables(&self, family: Family) -> Tables {
        Tables {
            backend: self.config.backend,
            family,
        }
    }

    fn settings(&self, family: Family) -> anyhow::Result<rules::Settings> {
        // The node's addresses, without the service addresses bound to the dummy interface.
        let addresses: Vec<_> = node::interface_addresses()?
            .into_iter()
            .filter(|a| a.interface != DUMMY)
            .collect();
        let netfilter = &self.config.netfilter;
        let mut node_port_ips = node::selected_node_ips(
            &netfilter.node_port_addresses,
            &netfilter.primary,
            &addresses,
        );
        node_port_ips.retain(|ip| family.has(*ip));
        let mut node_ips = family.filter(&netfilter.primary);
        if node_ips.is_empty() {
            node_ips.clone_from(&node_port_ips);
        }
        Ok(rules::Settings {
            family,
            scheduler: self.config.scheduler.clone(),
            cluster_cidr: netfilter.cluster_cidr(family),
            masquerade_all: netfilter.masquerade_all,
            node_port_ips,
            node_ips,
        })
    }

    /// The virtual servers of the families served in the kernel, with their real servers.
    fn read_kernel(&mut self) -> anyhow::Result<BTreeMap<ServiceKey, Programmed>> {
        let mut out = BTreeMap::new();
        let services = self.ipvs.services()?;
        let served = services
            .into_iter()
            .filter(|s| self.families.contains(&Family::of(s.key.addr)));
        for service in served.collect::<Vec<_>>() {
            let dests = self
                .ipvs
                .dests(&service.key)?
                .into_iter()
                .map(|d| ((d.addr, d.port), d))
                .collect();
            out.insert(service.key, Programmed { service, dests });
        }
        Ok(out)
    }

    /// Makes the dummy interface hold exactly `want`; `current`: what it holds now.
    fn bind(&self, current: &BTreeSet<IpAddr>, want: &BTreeSet<IpAddr>) -> anyhow::Result<()> {
        let mut batch = String::new();
        for addr in want.difference(current) {
            // Without DAD: on the interface, down, an IPv6 address would stay tentative, and
            // not local.
            let (len, flags) = if addr.is_ipv4() {
                (32, "")
            } else {
                (128, " nodad")
            };
            batch.push_str(&format!("address add {addr}/{len} dev {DUMMY}{flags}\n"));
        }
        for addr in current.difference(want) {
            let len = if addr.is_ipv4() { 32 } else { 128 };
            batch.push_str(&format!("address del {addr}/{len} dev {DUMMY}\n"));
        }
        if !batch.is_empty() {
            crate::command::pipe("ip", &["-batch", "-"], &batch)
                .context("binding the service addresses to kube-ipvs0")?;
        }
        Ok(())
    }

    /// Makes the IPVS table hold `virtual_servers` (every family's); `current`: what it holds
    /// now (the kernel's at a full sync), updated as the changes are made.
    fn reconcile(
        &mut self,
        virtual_servers: &BTreeMap<ServiceKey, rules::VirtualServer>,
        current: &mut BTreeMap<ServiceKey, Programmed>,
        full: bool,
    ) -> anyhow::Result<()> {
        let stale: Vec<ServiceKey> = current
            .keys()
            .filter(|k| !virtual_servers.contains_key(k))
            .copied()
            .collect();
        for key in stale {
            // Someone else's (--ipvs-exclude-cidrs): left, and forgotten.
            if !self.excluded(key.addr) {
                self.ipvs.delete_service(&key)?;
            }
            current.remove(&key);
            self.terminating.retain(|(k, _, _)| *k != key);
        }
        for (key, vs) in virtual_servers {
            let now = match current.get_mut(key) {
                Some(now) => {
                    if now.service != vs.service {
                        self.ipvs.update_service(&vs.service)?;
                        now.service = vs.service.clone();
                    }
                    now
                }
                None => {
                    self.ipvs.add_service(&vs.service)?;
                    current.entry(*key).or_insert(Programmed {
                        service: vs.service.clone(),
                        dests: BTreeMap::new(),
                    })
                }
            };
            for &(addr, port) in &vs.dests {
                match now.dests.get_mut(&(addr, port)) {
                    Some(d) if d.weight == 1 => {}
                    Some(d) => {
                        // Back while terminating (or changed by someone else): serving again.
                        self.ipvs.put_dest(key, addr, port, 1, true)?;
                        d.weight = 1;
                        self.terminating.remove(&(*key, addr, port));
                    }
                    None => {
                        self.ipvs.put_dest(key, addr, port, 1, false)?;
                        now.dests.insert(
                            (addr, port),
                            Dest {
                                addr,
                                port,
                                weight: 1,
                                active_conns: 0,
                                inactive_conns: 0,
                            },
                        );
                    }
                }
            }
            let leaving: Vec<(IpAddr, u16)> = now
                .dests
                .keys()
                .filter(|d| !vs.dests.contains(d))
                .filter(|(a, p)| !self.terminating.contains(&(*key, *a, *p)))
                .copied()
                .collect();
            if leaving.is_empty() {
                continue;
            }
            // The connection counts, for the graceful termination (fresh ones at a full sync).
            let counts: BTreeMap<(IpAddr, u16), Dest> = if full {
                now.dests.clone()
            } else {
                self.ipvs
                    .dests(key)?
                    .into_iter()
                    .map(|d| ((d.addr, d.port), d))
                    .collect()
            };
            for (addr, port) in leaving {
                let connections = counts
                    .get(&(addr, port))
                    .map_or(0, |d| d.active_conns + d.inactive_conns);
                if key.protocol != libc::IPPROTO_TCP as u8 || connections == 0 {
                    self.ipvs.delete_dest(key, addr, port)?;
                    now.dests.remove(&(addr, port));
                } else {
                    self.ipvs.put_dest(key, addr, port, 0, true)?;
                    if let Some(d) = now.dests.get_mut(&(addr, port)) {
                        d.weight = 0;
                    }
                    self.terminating.insert((*key, addr, port));
                }
            }
        }
        Ok(())
    }

    fn try_sync(&mut self, state: &DesiredState, scope: Scope<'_>) -> anyhow::Result<()> {
        let mut plans = Vec::new();
        for &family in &self.families {
            let settings = self.settings(family)?;
            plans.push((rules::plan(state, &settings), settings));
        }
        let full = matches!(scope, Scope::All);
        let (mut current, bound) = match self.programmed.take() {
            Some(p) if !full => p,
            _ => {
                if !dummy_exists() {
                    ip(&["link", "add", DUMMY, "type", "dummy"])
                        .context("creating the dummy interface kube-ipvs0")?;
                }
                let bound = dummy_addresses()?;
                (self.read_kernel()?, bound)
            }
        };
        let full = full || !self.jumps_checked;
        let bind: BTreeSet<IpAddr> = plans.iter().flat_map(|(p, _)| p.bind.clone()).collect();
        self.bind(&bound, &bind)?;
        for (plan, settings) in &plans {
            // The sets first: the rules refer to them.
            ipset_restore(&rules::ipset_restore(plan))?;
            let tables = self.tables(plan.family);
            let restored = iptables::restore(tables, &rules::iptables_restore(plan, settings));
            if restored.is_err() {
                crate::serve::metrics::METRICS.iptables_restore_failed(plan.family, false);
            }
            restored?;
        }
        if full || scope.checks_jumps() {
            for &family in &self.families {
                iptables::ensure_jumps(self.tables(family), JUMPS)?;
            }
            self.jumps_checked = true;
        }
        let virtual_servers = plans.into_iter().flat_map(|(p, _)| p.virtual_servers);
        self.reconcile(&virtual_servers.collect(), &mut current, full)?;
        self.programmed = Some((current, bind));
        self.udp.clear(state);
        Ok(())
    }

    /// Deletes the terminating real servers that have no connections left (or are gone).
    fn finish_terminations(&mut self) -> anyhow::Result<()> {
        let keys: BTreeSet<ServiceKey> = self.terminating.iter().map(|(k, _, _)| *k).collect();
        for key in keys {
            let dests: BTreeMap<(IpAddr, u16), Dest> = match self.ipvs.dests(&key) {
                Ok(dests) => dests.into_iter().map(|d| ((d.addr, d.port), d)).collect(),
                Err(e) => {
                    // The virtual server went (deleted by someone else): nothing to wait for.
                    self.terminating.retain(|(k, _, _)| *k != key);
                    return Err(e.context("finishing the termination of its real servers"));
                }
            };
            let pending: Vec<Terminating> = self
                .terminating
                .iter()
                .filter(|(k, _, _)| *k == key)
                .copied()
                .collect();
            for t @ (_, addr, port) in pending {
                match dests.get(&(addr, port)) {
                    Some(d) if d.active_conns + d.inactive_conns > 0 => continue,
                    Some(_) => self.ipvs.delete_dest(&key, addr, port)?,
                    None => {}
                }
                self.terminating.remove(&t);
                if let Some((programmed, _)) = &mut self.programmed
                    && let Some(vs) = programmed.get_mut(&key)
                {
                    vs.dests.remove(&(addr, port));
                }
            }
        }
        Ok(())
    }
}

impl Dataplane for IpvsDataplane {
    fn sync(&mut self, state: &DesiredState, scope: Scope<'_>) -> anyhow::Result<()> {
        // On failure what the kernel holds is not known: try_sync took the record, so the next
        // sync reads the kernel.
        self.try_sync(state, scope)
    }

    fn housekeeping(&mut self) -> anyhow::Result<()> {
        if self.terminating.is_empty() {
            return Ok(());
        }
        self.finish_terminations()
    }

    fn families(&self) -> Vec<Family> {
        self.families.clone()
    }
}

/// The chains of `table` in `t`'s iptables-save output, and the targets jumped to from each.
fn saved_rules(t: Tables, table: &str) -> anyhow::Result<Vec<(String, String)>> {
    let output = Command::new(t.tool("iptables-save"))
        .args(["-t", table])
        .stderr(Stdio::null())
        .output()
        .context("running iptables-save")?;
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("-A ")?;
            let chain = rest.split_whitespace().next()?.to_owned();
            let target = rest
                .split(" -j ")
                .nth(1)?
                .split_whitespace()
                .next()?
                .to_owned();
            Some((chain, target))
        })
        .collect())
}

/// Removes the mode's jumps and chains from `b`: the chains are flushed (their rules refer to
/// the ipsets), and deleted unless something else still jumps to them (the iptables mode's
/// per-Service chains jump to KUBE-MARK-MASQ, which the two modes share).
fn cleanup_rules(b: Tables) -> anyhow::Result<usize> {
    let mut removed = iptables::remove_jumps(b, JUMPS)?;
    let mut input = String::new();
    for table in ["filter", "nat"] {
        let present = iptables::chains(b, table).unwrap_or_default();
        let ours: Vec<&str> = rules::CHAINS
            .iter()
            .filter(|(t, c)| *t == table && present.contains(*c))
            .map(|(_, c)| *c)
            .collect();
        if ours.is_empty() {
            continue;
        }
        let referenced: BTreeSet<String> = saved_rules(b, table)?
            .into_iter()
            .filter(|(chain, _)| !ours.contains(&chain.as_str()))
            .map(|(_, target)| target)
            .collect();
        input.push_str(&format!("*{table}\n"));
        for chain in &ours {
            input.push_str(&format!(":{chain} - [0:0]\n"));
        }
        for chain in ours.iter().filter(|c| !referenced.contains(**c)) {
            input.push_str(&format!("-X {chain}\n"));
            removed += 1;
        }
        input.push_str("COMMIT\n");
    }
    if !input.is_empty() {
        iptables::restore(b, &input)?;
    }
    Ok(removed)
}

/// Removes everything the mode installed (kube-proxy's `--cleanup`): the iptables jumps and
/// chains (from both backends), the ipsets, the IPVS virtual servers of the mode (those at an
/// address bound to `kube-ipvs0`, and those at a port of its NodePort sets), and `kube-ipvs0`.
/// Unlike kube-proxy, which flushes the whole IPVS table, other virtual servers (keepalived's,
/// say) stay. Nothing installed: nothing done (IPVS is not even loaded for it).
pub fn cleanup() -> anyhow::Result<()> {
    // What is ours, read before the sets and the interface that tell it go.
    let bound = if dummy_exists() {
        dummy_addresses()?
    } else {
        BTreeSet::new()
    };
    let mut node_ports = BTreeSet::new();
    for family in Family::ALL {
        node_ports.extend(ipset_members(
            &[
                (rules::NODE_PORT_TCP, libc::IPPROTO_TCP as u8),
                (rules::NODE_PORT_UDP, libc::IPPROTO_UDP as u8),
            ]
            .map(|(set, protocol)| (rules::set_name(set, family), protocol)),
        ));
    }
    let every = Backend::ALL.into_iter().flat_map(|backend| {
        Family::ALL
            .into_iter()
            .map(move |family| Tables { backend, family })
    });
    for t in every.filter(|t| iptables::available(*t)) {
        let removed = cleanup_rules(t)?;
        if removed > 0 {
            tracing::info!(
                backend = t.backend.name(),
                family = %t.family,
                removed,
                "cleaned up the IPVS mode's iptables rules"
            );
        }
    }
    let names = ipset_names();
    let ours: Vec<&String> = names.iter().filter(|n| rules::is_own_set(n)).collect();
    if !ours.is_empty() {
        let input: String = ours.iter().map(|n| format!("destroy {n}\n")).collect();
        ipset_restore(&input)?;
        tracing::info!(sets = ours.len(), "cleaned up the IPVS mode's ipsets");
    }
    if netlink::loaded() && (!bound.is_empty() || !node_ports.is_empty()) {
        match Ipvs::open() {
            Ok(mut ipvs) => {
                let mut removed = 0;
                for service in ipvs.services()? {
                    let key = service.key;
                    if bound.contains(&key.addr) || node_ports.contains(&(key.protocol, key.port)) {
                        ipvs.delete_service(&key)?;
                        removed += 1;
                    }
                }
                if removed > 0 {
                    tracing::info!(removed, "cleaned up the IPVS virtual servers");
                }
            }
            Err(OpenError::NoIpvs) => {}
            Err(OpenError::Other(e)) => return Err(e),
        }
    }
    if dummy_exists() {
        ip(&["link", "del", DUMMY])?;
        tracing::info!("deleted {DUMMY}");
    }
    Ok(())
}

/// The ports in kube-proxy's NodePort sets (bitmap:port), with the protocol each set is for.
fn ipset_members(sets: &[(String, u8)]) -> BTreeSet<(u8, u16)> {
    let mut members = BTreeSet::new();
    for (set, protocol) in sets {
        let protocol = *protocol;
        let Ok(output) = Command::new("ipset")
            .args(["save", set])
            .stderr(Stdio::null())
            .output()
        else {
            continue;
        };
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            if let Some(port) = line
                .strip_prefix("add ")
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|p| p.parse().ok())
            {
                members.insert((protocol, port));
            }
        }
    }
    members
}

/// Whether the mode's state is here: `kube-ipvs0` or its ipsets (an earlier run in this mode,
/// or kube-proxy's). Virtual servers alone are not: they may be another load balancer's.
pub fn installed() -> bool {
    dummy_exists() || ipset_names().iter().any(|n| rules::is_own_set(n))
}

#[cfg(test)]
mod tests;

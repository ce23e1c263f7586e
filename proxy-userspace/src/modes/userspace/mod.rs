//! kube-proxy's userspace mode (its first proxy mode, removed in 1.26), for nodes where neither
//! BPF nor NAT to the endpoints is wanted: the agent itself proxies every Service port. Each
//! Service port gets a proxy socket on an ephemeral port of the node ([`proxy`]), which picks
//! an endpoint ([`balancer`]: round robin, ClientIP affinity, retries) and copies the bytes;
//! iptables nat rules ([`rules`], one `iptables-restore --noflush` per sync) send the Service's
//! frontends to it.
//!
//! A Service port keeps its proxy socket, and so its proxy port and its rules, for as long as
//! it exists: a sync that changes only its endpoints changes only the socket's endpoint list,
//! and established connections carry on. Its socket closes when it goes (its proxied TCP
//! connections carry on, as in kube-proxy). Each sync reconciles the sockets of the Service
//! ports in its scope ([`Scope::All`]: all of them, and closes those of Service ports the state
//! no longer names), then rewrites the rules of all.
//!
//! Each family is served on its own, as kube-proxy runs a proxier per family: a Service port
//! with a cluster IP of the family gets proxy sockets of the family, proxying to the endpoints
//! of the family, and rules through `iptables-restore` (IPv4) or `ip6tables-restore` (IPv6,
//! where it runs here).
//!
//! What the proxy cannot do, as in kube-proxy: the endpoint sees the node's address, never the
//! client's. So externalTrafficPolicy Local is honoured only in its choice of endpoints (this
//! node's), not in keeping the client address; where it picks other endpoints than
//! internalTrafficPolicy, the external frontends get a proxy socket of their own. Also unlike
//! the other modes: no SCTP, and the proxy sockets listen on every node address.
pub mod balancer;
pub mod inspect;
pub mod proxy;
pub mod rules;

#[cfg(test)]
mod netns_tests;

use std::{
    collections::{BTreeMap, BTreeSet},
    hash::BuildHasher as _,
    net::{IpAddr, SocketAddr},
    process::{Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use tokio::runtime::Handle;

use self::{
    balancer::Balancer,
    proxy::{ProxySocket, Shared},
    rules::{Listener, ProxyPorts},
};
use crate::{
    dataplane::{Dataplane, Scope},
    model::{DesiredState, Family, Protocol, ServicePortName},
    netfilter::iptables::{self, Backend, Jump, Tables},
    node::{self, NodePortAddresses},
};

/// kube-proxy's default `--udp-timeout`: how long a UDP session lives without traffic.
pub const DEFAULT_UDP_TIMEOUT: Duration = Duration::from_millis(250);

/// What the mode is configured with (kube-proxy's flags).
#[derive(Clone, Debug)]
pub struct UserspaceConfig {
    /// Which iptables the rules go to (`--iptables-backend`).
    pub backend: Backend,
    /// `--nodeport-addresses`, and the Node object's addresses for `primary`.
    pub node_port_addresses: NodePortAddresses,
    /// The Node object's addresses (empty with the manifest source). The first of each family
    /// the node holds is where the node's own traffic to a Service of the family is DNATed to.
    pub primary: Vec<IpAddr>,
    /// `--udp-timeout`: a UDP session ends after this long without a datagram either way.
    pub udp_timeout: Duration,
}

const PORTALS_COMMENT: &str = "handle ClusterIPs; NOTE: this must be before the NodePort rules";
const NODEPORTS_COMMENT: &str =
    "handle service NodePorts; NOTE: this must be the last rule in the chain";
const NON_LOCAL_COMMENT: &str = "Ensure that non-local NodePort traffic can flow";
const FIREWALL_COMMENT: &str = "kubernetes service portals firewall";

/// The jumps from the built-in chains to the mode's. The first five are kube-proxy's own, so
/// that cleanup also removes what a kube-proxy in userspace mode left.
#[rustfmt::skip]
const JUMPS: &[Jump] = &[
    Jump::new("nat", "PREROUTING", PORTALS_COMMENT, rules::CONTAINER_PORTALS),
    Jump::new("nat", "OUTPUT", PORTALS_COMMENT, rules::HOST_PORTALS),
    Jump::new("nat", "PREROUTING", NODEPORTS_COMMENT, rules::CONTAINER_NODEPORTS).appended().matching(&["-m", "addrtype", "--dst-type", "LOCAL"]),
    Jump::new("nat", "OUTPUT", NODEPORTS_COMMENT, rules::HOST_NODEPORTS).appended().matching(&["-m", "addrtype", "--dst-type", "LOCAL"]),
    Jump::new("filter", "INPUT", NON_LOCAL_COMMENT, rules::NON_LOCAL_NODEPORTS),
    Jump::new("filter", "INPUT", FIREWALL_COMMENT, rules::FIREWALL).new_only(),
    Jump::new("filter", "FORWARD", FIREWALL_COMMENT, rules::FIREWALL).new_only(),
    Jump::new("filter", "OUTPUT", FIREWALL_COMMENT, rules::FIREWALL).new_only(),
];

/// The proxy sockets of one Service port.
#[derive(Debug, Default)]
struct ServiceProxy {
    internal: Option<ProxySocket>,
    /// Only where the external frontends need their own ([`rules::needs_external_listener`]).
    external: Option<ProxySocket>,
}

impl ServiceProxy {
    fn ports(&self) -> Option<ProxyPorts> {
        Some(ProxyPorts {
            internal: self.internal.as_ref()?.port,
            external: self.external.as_ref().map(|s| s.port),
        })
    }

    fn sockets(&self) -> impl Iterator<Item = &ProxySocket> {
        self.internal.iter().chain(&self.external)
    }
}

pub struct UserspaceDataplane {
    config: UserspaceConfig,
    /// Where the proxy sockets are served: the agent's runtime.
    runtime: Handle,
    /// The families served: IPv4's, and IPv6's where ip6tables runs here.
    proxiers: Vec<Proxier>,
    /// Service ports already reported as not proxied (SCTP).
    unsupported: BTreeSet<ServicePortName>,
    jumps_checked: bool,
}

/// The proxy sockets and rules of one family (kube-proxy's proxier of the family).
struct Proxier {
    tables: Tables,
    proxies: BTreeMap<ServicePortName, ServiceProxy>,
    /// Proxy ports of UDP sockets closed or left without endpoints since the rules were last
    /// written: their conntrack entries are deleted once the new rules are in.
    stale_udp: Vec<u16>,
    warned_no_node_ip: bool,
}

/// Raises the limit of open files as far as the kernel allows (`fs.nr_open`): a proxy socket a
/// Service port and one or two a proxied connection exhaust a container runtime's default
/// (often 1024, or tens of thousands) with thousands of Services. Without CAP_SYS_RESOURCE,
/// only up to the hard limit. Returns the limit now in force (children inherit it).
pub fn raise_open_files_limit() -> u64 {
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(1 << 20);
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read or write the one struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return 0;
        }
        let before = limit.rlim_cur;
        let wanted = libc::rlimit {
            rlim_cur: nr_open,
            rlim_max: nr_open.max(limit.rlim_max),
        };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &wanted) == 0 {
            tracing::info!(before, after = nr_open, "raised the limit of open files");
            return nr_open;
        }
        let e = std::io::Error::last_os_error();
        limit.rlim_cur = limit.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        tracing::warn!(
            limit = limit.rlim_cur,
            "cannot raise the limit of open files to fs.nr_open ({e}): a proxy socket a \
             Service port and two a connection must fit in it"
        );
    }
    limit.rlim_cur
}

impl UserspaceDataplane {
    /// Checks that iptables works here (and ip6tables, for IPv6: where it cannot run, IPv6
    /// Services are not served, with a warning); the proxy sockets will be served on the
    /// current tokio runtime (the agent's), so this must be called from within it.
    pub fn new(config: UserspaceConfig) -> anyhow::Result<Self> {
        let runtime = Handle::try_current()
            .context("the userspace mode serves its proxy sockets on a tokio runtime")?;
        let needs = "the userspace mode needs iptables-save and iptables-restore (the iptables \
                     package)";
        let mut proxiers = Vec::new();
        for (tables, _) in iptables::families_here(config.backend, needs)? {
            proxiers.push(Proxier {
                tables,
                proxies: BTreeMap::new(),
                stale_udp: Vec::new(),
                warned_no_node_ip: false,
            });
        }
        raise_open_files_limit();
        Ok(Self {
            config,
            runtime,
            proxiers,
            unsupported: BTreeSet::new(),
            jumps_checked: false,
        })
    }

    /// The proxy ports of the Service port `spn` in `family`, if it has a proxy socket there.
    pub fn proxy_ports(&self, family: Family, spn: &ServicePortName) -> Option<ProxyPorts> {
        let proxier = self.proxiers.iter().find(|p| p.tables.family == family)?;
        proxier.proxies.get(spn)?.ports()
    }

    /// Opens, updates or closes the proxy sockets of `spn` in each family to match `state`.
    fn reconcile(&mut self, state: &DesiredState, spn: &ServicePortName) -> std::io::Result<()> {
        let port = state.port(spn);
        let mut result = Ok(());
        for proxier in &mut self.proxiers {
            let opened = proxier.reconcile(&self.runtime, self.config.udp_timeout, state, spn);
            result = result.and(opened);
        }
        if port.is_some_and(|p| p.protocol == Protocol::Sctp) {
            if self.unsupported.insert(spn.clone()) {
                tracing::warn!(service = %spn, "not proxied: the userspace mode has no SCTP");
                let note = format!(
                    "SCTP port {spn} is not served on this node: the userspace mode has no SCTP \
                     (as kube-proxy's had none)"
                );
                let service = crate::events::Regarding::Service(&spn.service);
                crate::events::record(service, true, "SCTPNotServed", "Sync", Some(note));
                crate::serve::metrics::METRICS.unserved_sctp_ports(self.unsupported.len());
            }
        } else if self.unsupported.remove(spn) {
            crate::serve::metrics::METRICS.unserved_sctp_ports(self.unsupported.len());
        }
        result
    }
}

impl Proxier {
    /// The rules' settings of the family.
    fn settings(&mut self, config: &UserspaceConfig) -> anyhow::Result<rules::Settings> {
        let family = self.tables.family;
        let addresses = node::interface_addresses()?;
        let routes = node::DefaultRoutes::of_this_node();
        let node_ip = node::primary_ip(family, &config.primary, routes.of(family), &addresses);
        let node_ip = node_ip.unwrap_or_else(|| {
            let loopback = family.loopback().addr;
            // Said once there are Services of the family (an IPv4-only node has no IPv6 ones).
            if !self.warned_no_node_ip && !self.proxies.is_empty() {
                tracing::warn!(
                    "the node has no {family} address but loopback ones: its own processes reach \
                     {family} Services through {loopback} (TCP works, UDP replies do not)"
                );
                self.warned_no_node_ip = true;
            }
            loopback
        });
        Ok(rules::Settings {
            family,
            node_ip,
            node_port_addresses: node::node_port_ips(
                &config.node_port_addresses,
                family,
                &config.primary,
                &addresses,
            ),
        })
    }

    /// Opens, updates or closes the family's proxy sockets of `spn` to match `state`.
    fn reconcile(
        &mut self,
        runtime: &Handle,
        udp_timeout: Duration,
        state: &DesiredState,
        spn: &ServicePortName,
    ) -> std::io::Result<()> {
        let family = self.tables.family;
        let Some(port) = state.port(spn).filter(|p| rules::proxied(p, family)) else {
            if let Some(mut gone) = self.proxies.remove(spn) {
                for slot in [&mut gone.internal, &mut gone.external] {
                    close(slot, &mut self.stale_udp);
                }
            }
            return Ok(());
        };
        let affinity = port
            .session_affinity_timeout
            .map(|s| Duration::from_secs(s.get().into()));
        let opener = Opener {
            runtime,
            udp_timeout,
            family,
            protocol: port.protocol,
            affinity,
        };
        // The logs' name of a socket: the Service port's, saying IPv6 and external.
        let name = |external: bool| {
            let mut name = spn.to_string();
            if family == Family::V6 {
                name.push_str(" (IPv6)");
            }
            if external {
                name.push_str(" (external)");
            }
            name
        };
        let proxy = self.proxies.entry(spn.clone()).or_default();
        opener.update(
            &mut proxy.internal,
            name(false),
            rules::endpoints(state, spn, port, Listener::Internal, family),
            &mut self.stale_udp,
        )?;
        if rules::needs_external_listener(port, family) {
            opener.update(
                &mut proxy.external,
                name(true),
                rules::endpoints(state, spn, port, Listener::External, family),
                &mut self.stale_udp,
            )?;
        } else {
            close(&mut proxy.external, &mut self.stale_udp);
        }
        Ok(())
    }
}

/// Opens and updates the proxy sockets of one Service port in one family.
struct Opener<'a> {
    runtime: &'a Handle,
    udp_timeout: Duration,
    family: Family,
    protocol: Protocol,
    affinity: Option<Duration>,
}

impl Opener<'_> {
    /// Makes `slot` an open proxy socket for `name` proxying to `endpoints`: the one there
    /// (only its endpoints and affinity updated), or a new one.
    fn update(
        &self,
        slot: &mut Option<ProxySocket>,
        name: String,
        endpoints: Vec<SocketAddr>,
        stale_udp: &mut Vec<u16>,
    ) -> std::io::Result<()> {
        if slot.as_ref().is_some_and(|s| !s.is_running()) {
            tracing::error!(service = %name, "the proxy socket's task stopped: opening another");
            close(slot, stale_udp);
        }
        let socket = match slot {
            Some(socket) => socket,
            None => {
                // A random start, so that nodes do not all begin with the same endpoint.
                let start = std::hash::RandomState::new().hash_one(&name) as usize;
                let shared = Arc::new(Shared {
                    name,
                    balancer: std::sync::Mutex::new(Balancer::new(self.affinity, start)),
                });
                let socket = ProxySocket::open(
                    self.runtime,
                    self.family,
                    self.protocol,
                    shared,
                    self.udp_timeout,
                )?;
                tracing::info!(
                    service = %socket.shared.name,
                    protocol = %self.protocol,
                    proxy_port = socket.port,
                    "opened the proxy socket"
                );
                slot.insert(socket)
            }
        };
        let mut balancer = socket.shared.balancer();
        balancer.set_affinity(self.affinity);
        let had_endpoints = !balancer.endpoints().is_empty();
        if balancer.set_endpoints(endpoints) {
            tracing::debug!(
                service = %socket.shared.name,
                endpoints = ?balancer.endpoints(),
                "endpoints changed"
            );
            if self.protocol == Protocol::Udp && had_endpoints && balancer.endpoints().is_empty() {
                stale_udp.push(socket.port);
            }
            socket.end_sessions_not_to(balancer.endpoints());
        }
        Ok(())
    }
}

/// Closes the proxy socket in `slot`, if any.
fn close(slot: &mut Option<ProxySocket>, stale_udp: &mut Vec<u16>) {
    if let Some(socket) = slot.take() {
        tracing::info!(
            service = %socket.shared.name,
            protocol = %socket.protocol,
            proxy_port = socket.port,
            "closed the proxy socket"
        );
        if socket.protocol == Protocol::Udp {
            stale_udp.push(socket.port);
        }
    }
}

impl Dataplane for UserspaceDataplane {
    fn sync(&mut self, state: &DesiredState, scope: Scope<'_>) -> anyhow::Result<()> {
        let names: BTreeSet<ServicePortName> = match scope {
            Scope::All => self
                .proxiers
                .iter()
                .flat_map(|p| p.proxies.keys())
                .chain(state.port_names())
                .cloned()
                .collect(),
            Scope::Changed(changed) => changed.clone(),
        };
        let mut failed = Vec::new();
        for spn in &names {
            if let Err(e) = self.reconcile(state, spn) {
                failed.push(format!("{spn}: {e}"));
            }
        }
        for proxier in &mut self.proxiers {
            let settings = proxier.settings(&self.config)?;
            let ports: BTreeMap<ServicePortName, ProxyPorts> = proxier
                .proxies
                .iter()
                .filter_map(|(spn, proxy)| Some((spn.clone(), proxy.ports()?)))
                .collect();
            iptables::restore(proxier.tables, &rules::render(state, &settings, &ports))?;
        }
        // The chains exist now; the jumps to them are checked once and at each full or
        // periodic sync (something else may have flushed the built-in chains).
        if !self.jumps_checked || scope.checks_jumps() {
            for proxier in &self.proxiers {
                iptables::ensure_jumps(proxier.tables, JUMPS)?;
            }
            self.jumps_checked = true;
        }
        // UDP flows redirected to a socket now closed (or without endpoints) would keep going
        // there while their conntrack entry lives: deleted, their next datagram meets the new
        // rules (kube-proxy cleared a removed UDP Service's entries too).
        for proxier in &mut self.proxiers {
            for port in proxier.stale_udp.drain(..) {
                clear_udp_flows(proxier.tables.family, port);
            }
        }
        self.expire_affinity();
        if !failed.is_empty() {
            bail!("opening proxy sockets failed: {}", failed.join("; "));
        }
        Ok(())
    }

    fn housekeeping(&mut self) -> anyhow::Result<()> {
        self.expire_affinity();
        Ok(())
    }

    fn families(&self) -> Vec<Family> {
        self.proxiers.iter().map(|p| p.tables.family).collect()
    }
}

impl UserspaceDataplane {
    /// Forgets the clients whose session affinity expired.
    fn expire_affinity(&self) {
        let now = Instant::now();
        let proxies = self.proxiers.iter().flat_map(|p| p.proxies.values());
        for socket in proxies.flat_map(ServiceProxy::sockets) {
            socket.shared.balancer().expire(now);
        }
    }
}

/// The chains of `table` that the mode owns and that exist.
fn owned_chains(t: impl Into<Tables>, table: &str) -> anyhow::Result<BTreeSet<String>> {
    let owned: &[&str] = rules::CHAINS
        .iter()
        .find(|(t, _)| *t == table)
        .map_or(&[], |(_, c)| c);
    let mut chains = iptables::chains(t, table)?;
    chains.retain(|c| owned.contains(&c.as_str()));
    Ok(chains)
}

/// Both families' tools of `b`.
fn tables_of(backend: Backend) -> impl Iterator<Item = Tables> {
    Family::ALL
        .into_iter()
        .map(move |family| Tables { backend, family })
}

/// How many of the mode's chains `b` holds, both families (0 where its tools fail).
fn held(b: Backend) -> usize {
    let tables = tables_of(b);
    let counts = tables.flat_map(|t| {
        (rules::CHAINS.iter()).map(move |(table, _)| owned_chains(t, table).map_or(0, |c| c.len()))
    });
    counts.sum()
}

/// The backend for `--iptables-backend auto`: the one already holding the mode's chains (an
/// earlier run's, or a kube-proxy's in userspace mode), else the node's.
pub fn detect_backend() -> anyhow::Result<Backend> {
    Backend::detect(held)
}

/// Removes everything the mode installed (or a kube-proxy in userspace mode left), from both
/// backends and both families: the jumps, then the chains (kube-proxy's `--cleanup`). Nothing
/// installed: nothing done. The proxy sockets are the agent's own and go with it.
pub fn cleanup() -> anyhow::Result<()> {
    let every = Backend::ALL.into_iter().flat_map(tables_of);
    for t in every.filter(|t| iptables::available(*t)) {
        let mut removed = iptables::remove_jumps(t, JUMPS)?;
        let mut chains = Vec::new();
        for (table, _) in rules::CHAINS {
            chains.push((*table, owned_chains(t, table)?));
        }
        removed += iptables::delete_chains(t, &chains)?;
        if removed > 0 {
            tracing::info!(
                backend = t.backend.name(),
                family = %t.family,
                removed,
                "cleaned up the userspace mode's rules"
            );
        }
    }
    Ok(())
}

/// Whether the mode's chains are installed here, in either backend and family (an earlier run
/// in this mode, or a kube-proxy's in userspace mode).
pub fn installed() -> bool {
    Backend::ALL.into_iter().any(|b| held(b) > 0)
}

/// Deletes the conntrack entries of `family`'s UDP flows redirected to the proxy port `port`.
fn clear_udp_flows(family: Family, port: u16) {
    let port = port.to_string();
    let family_arg = match family {
        Family::V4 => "ipv4",
        Family::V6 => "ipv6",
    };
    let args = [
        "-D",
        "-f",
        family_arg,
        "-p",
        "udp",
        "--dst-nat",
        "--reply-port-src",
        &port,
    ];
    match Command::new("conntrack")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
    {
        Ok(o) if o.status.success() => {}
        // conntrack exits 1 when no entry matched.
        Ok(o) if String::from_utf8_lossy(&o.stderr).contains("0 flow entries") => {}
        Ok(o) => tracing::warn!(
            proxy_port = %port,
            "deleting stale UDP conntrack entries: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => tracing::warn!("deleting stale UDP conntrack entries: conntrack: {e}"),
    }
}

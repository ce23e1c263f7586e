//! kube-proxy's iptables mode, for nodes where the eBPF datapath cannot run: the rules of
//! [`rules`], written with one `iptables-restore --noflush` per sync, the jumps from the
//! built-in chains to kube-proxy's, and stale UDP conntrack entries deleted when endpoints go.
//!
//! As kube-proxy's, a partial sync writes the own chains of only the Service ports that changed
//! (the shared chains, which jump to every port's, are written whole each time); a full sync
//! (the first, the periodic ones, and the retry after a failure) writes all of them. Either
//! deletes in the same transaction the per-Service chains no longer wanted.
pub mod inspect;
pub mod rules;

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
    process::{Command, Stdio},
};

use anyhow::{Context, bail};

use crate::{
    dataplane::{Dataplane, Scope},
    model::DesiredState,
    modes::ebpf::external::{self, NodePortAddresses},
    netfilter::stale_udp::StaleUdp,
};

/// Which of the kernel's two iptables implementations the rules go to: the same rules, very
/// different costs at scale (here, iptables-restore of 10k Services took 2 s with legacy and
/// 190 s with nf_tables).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Legacy,
    Nft,
}

impl Backend {
    pub(crate) const ALL: [Backend; 2] = [Backend::Legacy, Backend::Nft];

    /// The backend's own binary of `tool` (`iptables`, `iptables-save`, `iptables-restore`).
    pub(crate) fn tool(self, tool: &str) -> String {
        let (prefix, rest) = tool.split_at("iptables".len());
        format!("{prefix}-{}{rest}", self.name())
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Legacy => "legacy",
            Backend::Nft => "nft",
        }
    }

    /// The backend that already holds kube-proxy's rules (an earlier run's, or kube-proxy's:
    /// as kube-proxy's image picks it), else the node's own `iptables` (its alternatives link).
    pub fn detect() -> anyhow::Result<Self> {
        let held = |b: Backend| owned_chains(b, "nat").map_or(0, |c| c.len());
        let (legacy, nft) = (held(Backend::Legacy), held(Backend::Nft));
        if legacy != nft {
            return Ok(if legacy > nft {
                Backend::Legacy
            } else {
                Backend::Nft
            });
        }
        let version = Command::new("iptables")
            .arg("--version")
            .output()
            .context("running iptables --version: the iptables mode needs the iptables package")?;
        let version = String::from_utf8_lossy(&version.stdout);
        Ok(if version.contains("legacy") {
            Backend::Legacy
        } else {
            Backend::Nft
        })
    }
}

/// What the mode is configured with (kube-proxy's flags).
#[derive(Clone, Debug)]
pub struct IptablesConfig {
    pub backend: Backend,
    /// `--cluster-cidr`.
    pub cluster_cidr: Option<(Ipv4Addr, u8)>,
    /// `--masquerade-all`.
    pub masquerade_all: bool,
    /// `--nodeport-addresses`, and the Node object's addresses for `primary`.
    pub node_port_addresses: NodePortAddresses,
    pub primary: Vec<IpAddr>,
}

/// The jumps from the built-in chains to kube-proxy's: (table, chain, for new connections
/// only, comment, target).
#[rustfmt::skip]
const JUMPS: &[(&str, &str, bool, &str, &str)] = &[
    ("nat", "PREROUTING", false, "kubernetes service portals", "KUBE-SERVICES"),
    ("nat", "OUTPUT", false, "kubernetes service portals", "KUBE-SERVICES"),
    ("nat", "POSTROUTING", false, "kubernetes postrouting rules", "KUBE-POSTROUTING"),
    ("filter", "INPUT", true, "kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL"),
    ("filter", "INPUT", false, "kubernetes health check service ports", "KUBE-NODEPORTS"),
    ("filter", "INPUT", true, "kubernetes externally-visible service portals", "KUBE-EXTERNAL-SERVICES"),
    ("filter", "FORWARD", true, "kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL"),
    ("filter", "FORWARD", false, "kubernetes forwarding rules", "KUBE-FORWARD"),
    ("filter", "FORWARD", true, "kubernetes service portals", "KUBE-SERVICES"),
    ("filter", "FORWARD", true, "kubernetes externally-visible service portals", "KUBE-EXTERNAL-SERVICES"),
    ("filter", "OUTPUT", true, "kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL"),
    ("filter", "OUTPUT", true, "kubernetes service portals", "KUBE-SERVICES"),
];

/// `iptables -t TABLE OP CHAIN [POSITION] RULE` for one of [`JUMPS`].
fn jump(
    b: Backend,
    op: &str,
    (table, chain, new_only, comment, target): &(&str, &str, bool, &str, &str),
) -> anyhow::Result<bool> {
    let mut args = vec![op, chain];
    if op == "-I" {
        args.push("1");
    }
    if *new_only {
        args.extend(["-m", "conntrack", "--ctstate", "NEW"]);
    }
    args.extend(["-m", "comment", "--comment", comment, "-j", target]);
    iptables(b, table, &args)
}

/// Chains the mode owns, by table: the fixed ones, and prefixes of the per-Service ones.
#[rustfmt::skip]
const FIXED_CHAINS: &[(&str, &[&str])] = &[
    (
        "filter",
        &[
            "KUBE-NODEPORTS",
            "KUBE-SERVICES",
            "KUBE-EXTERNAL-SERVICES",
            "KUBE-FORWARD",
            "KUBE-PROXY-FIREWALL",
        ],
    ),
    (
        "nat",
        &[
            "KUBE-SERVICES",
            "KUBE-NODEPORTS",
            "KUBE-POSTROUTING",
            "KUBE-MARK-MASQ",
        ],
    ),
];
const SERVICE_CHAIN_PREFIXES: &[&str] = &[
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-EXT-",
    "KUBE-FW-",
    "KUBE-SEP-",
];

pub struct IptablesDataplane {
    config: IptablesConfig,
    /// The per-Service nat chains programmed now.
    chains: BTreeSet<String>,
    jumps_checked: bool,
    udp: StaleUdp,
}

impl IptablesDataplane {
    /// Checks that iptables works here, and finds the chains an earlier run left (they are
    /// replaced at the first sync).
    pub fn new(config: IptablesConfig) -> anyhow::Result<Self> {
        let chains = service_chains(config.backend, "nat").context(
            "the iptables mode needs iptables-save and iptables-restore (the iptables package)",
        )?;
        Ok(Self {
            config,
            chains,
            jumps_checked: false,
            udp: StaleUdp::default(),
        })
    }

    fn settings(&self) -> anyhow::Result<rules::Settings> {
        Ok(rules::Settings {
            cluster_cidr: self.config.cluster_cidr,
            masquerade_all: self.config.masquerade_all,
            node_port_addresses: node_port_ips(
                &self.config.node_port_addresses,
                &self.config.primary,
            )?,
        })
    }
}

/// The node addresses NodePorts answer on, as the netfilter modes write them; None: every
/// local address (a `--nodeport-addresses` CIDR matching everything, as kube-proxy does).
pub(crate) fn node_port_ips(
    spec: &NodePortAddresses,
    primary: &[IpAddr],
) -> anyhow::Result<Option<Vec<Ipv4Addr>>> {
    if matches!(spec, NodePortAddresses::Cidrs(c) if c.iter().any(|(_, len)| *len == 0)) {
        return Ok(None);
    }
    Ok(Some(selected_node_ips(
        spec,
        primary,
        &external::interface_addresses()?,
    )))
}

/// The addresses among `addresses` (the node's interfaces) that `spec` selects.
pub(crate) fn selected_node_ips(
    spec: &NodePortAddresses,
    primary: &[IpAddr],
    addresses: &[external::InterfaceAddr],
) -> Vec<Ipv4Addr> {
    let default_route = external::default_route_interface();
    external::node_addresses(spec, primary, default_route.as_deref(), addresses)
        .iter()
        .map(|a| a.addr)
        .collect()
}

impl Dataplane for IptablesDataplane {
    fn sync(&mut self, state: &DesiredState, scope: Scope<'_>) -> anyhow::Result<()> {
        let settings = self.settings()?;
        let changed = match scope {
            // Until a sync succeeded, what the chains hold is not known.
            Scope::Changed(changed) if self.jumps_checked => Some(changed),
            _ => None,
        };
        let rendered = rules::render(state, &settings, &self.chains, changed);
        restore(self.config.backend, &rendered.text)?;
        self.chains = rendered.chains;
        // The chains exist now; the jumps to them are checked once and at each full or
        // periodic sync (something else may have flushed the built-in chains).
        if !self.jumps_checked || scope.checks_jumps() {
            ensure_jumps(self.config.backend)?;
            self.jumps_checked = true;
        }
        self.udp.clear(state);
        Ok(())
    }
}

/// Runs `iptables-restore --noflush` on `input`: one transaction, all or nothing.
pub(crate) fn restore(b: Backend, input: &str) -> anyhow::Result<()> {
    crate::command::pipe(&b.tool("iptables-restore"), &["-w", "--noflush"], input)
}

pub(crate) fn iptables(b: Backend, table: &str, args: &[&str]) -> anyhow::Result<bool> {
    let status = Command::new(b.tool("iptables"))
        .args(["-w", "-t", table])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .context("running iptables")?;
    Ok(status.success())
}

fn ensure_jumps(b: Backend) -> anyhow::Result<()> {
    for rule in JUMPS {
        if !jump(b, "-C", rule)? && !jump(b, "-I", rule)? {
            bail!("cannot add the jump to {} in {} {}", rule.4, rule.0, rule.1);
        }
    }
    Ok(())
}

/// The chains of `table` that the mode owns, as iptables-save lists them.
fn owned_chains(b: Backend, table: &str) -> anyhow::Result<BTreeSet<String>> {
    let output = Command::new(b.tool("iptables-save"))
        .args(["-t", table])
        .stderr(Stdio::piped())
        .output()
        .context("running iptables-save")?;
    if !output.status.success() {
        bail!(
            "iptables-save -t {table} failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let fixed: &[&str] = FIXED_CHAINS
        .iter()
        .find(|(t, _)| *t == table)
        .map_or(&[], |(_, c)| c);
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix(':')?.split_whitespace().next())
        .filter(|c| fixed.contains(c) || SERVICE_CHAIN_PREFIXES.iter().any(|p| c.starts_with(p)))
        .map(str::to_owned)
        .collect())
}

/// The per-Service chains of `table`.
fn service_chains(b: Backend, table: &str) -> anyhow::Result<BTreeSet<String>> {
    Ok(owned_chains(b, table)?
        .into_iter()
        .filter(|c| SERVICE_CHAIN_PREFIXES.iter().any(|p| c.starts_with(p)))
        .collect())
}

/// Removes everything the mode installed, from both backends: the jumps, then its chains
/// (kube-proxy's `--cleanup`). Nothing installed: nothing done.
pub fn cleanup() -> anyhow::Result<()> {
    for b in Backend::ALL.into_iter().filter(|b| available(*b)) {
        let mut removed = 0;
        for rule in JUMPS {
            while jump(b, "-D", rule)? {
                removed += 1;
            }
        }
        let mut input = String::new();
        for (table, _) in FIXED_CHAINS {
            let chains = owned_chains(b, table)?;
            if chains.is_empty() {
                continue;
            }
            input.push_str(&format!("*{table}\n"));
            for chain in &chains {
                input.push_str(&format!(":{chain} - [0:0]\n"));
            }
            for chain in &chains {
                input.push_str(&format!("-X {chain}\n"));
            }
            input.push_str("COMMIT\n");
            removed += chains.len();
        }
        if !input.is_empty() {
            restore(b, &input)?;
        }
        if removed > 0 {
            tracing::info!(backend = b.name(), removed, "cleaned up the iptables rules");
        }
    }
    Ok(())
}

/// Whether `b`'s tools can be run here.
pub(crate) fn available(b: Backend) -> bool {
    Command::new(b.tool("iptables-save"))
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether the mode's chains are installed here, in either backend (an earlier run in this
/// mode, or kube-proxy's). KUBE-SERVICES alone may be the IPVS mode's: the mode's own
/// KUBE-NODEPORTS (IPVS has KUBE-NODE-PORT) or per-Service chains tell.
pub fn installed() -> bool {
    Backend::ALL.into_iter().any(|b| {
        owned_chains(b, "nat").is_ok_and(|chains| {
            chains.iter().any(|c| {
                c == "KUBE-NODEPORTS" || SERVICE_CHAIN_PREFIXES.iter().any(|p| c.starts_with(p))
            })
        })
    })
}

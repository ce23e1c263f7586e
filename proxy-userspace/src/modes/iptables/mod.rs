//! kube-proxy's iptables mode, for nodes where the eBPF datapath cannot run: the rules of
//! [`rules`], written with one `iptables-restore --noflush` per sync and family (IPv6's with
//! `ip6tables-restore`, as kube-proxy's second proxier), the jumps from the built-in chains to
//! kube-proxy's, and stale UDP conntrack entries deleted when endpoints go.
//!
//! As kube-proxy's, a partial sync writes the own chains of only the Service ports that changed
//! (the shared chains, which jump to every port's, are written whole each time); a full sync
//! (the first, the periodic ones, and the retry after a failure) writes all of them. Either
//! deletes in the same transaction the per-Service chains no longer wanted.
pub mod inspect;
pub mod rules;

use std::collections::{BTreeSet, HashMap};

use crate::{
    dataplane::{Dataplane, Scope},
    model::{DesiredState, Family},
    netfilter::{
        iptables::{self, Backend, Jump, Tables},
        rules::NetfilterConfig,
        stale_udp::StaleUdp,
    },
    serve::metrics::{IPTABLES_TABLES, METRICS},
};

/// What the mode is configured with (kube-proxy's flags).
#[derive(Clone, Debug)]
pub struct IptablesConfig {
    pub backend: Backend,
    pub netfilter: NetfilterConfig,
}

/// The jumps from the built-in chains to kube-proxy's: kube-proxy's `iptablesJumpChains`, in
/// its order. Each is inserted first in its chain, so the last of a chain comes first in it:
/// INPUT holds the firewall, then the health check ports, then the external services, as
/// kube-proxy's.
#[rustfmt::skip]
pub(crate) const JUMPS: &[Jump] = &[
    Jump::new("filter", "INPUT", "kubernetes externally-visible service portals", "KUBE-EXTERNAL-SERVICES").new_only(),
    Jump::new("filter", "FORWARD", "kubernetes externally-visible service portals", "KUBE-EXTERNAL-SERVICES").new_only(),
    Jump::new("filter", "INPUT", "kubernetes health check service ports", "KUBE-NODEPORTS"),
    Jump::new("filter", "FORWARD", "kubernetes service portals", "KUBE-SERVICES").new_only(),
    Jump::new("filter", "OUTPUT", "kubernetes service portals", "KUBE-SERVICES").new_only(),
    Jump::new("filter", "FORWARD", "kubernetes forwarding rules", "KUBE-FORWARD"),
    Jump::new("filter", "INPUT", "kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL").new_only(),
    Jump::new("filter", "OUTPUT", "kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL").new_only(),
    Jump::new("filter", "FORWARD", "kubernetes load balancer firewall", "KUBE-PROXY-FIREWALL").new_only(),
    Jump::new("nat", "OUTPUT", "kubernetes service portals", "KUBE-SERVICES"),
    Jump::new("nat", "PREROUTING", "kubernetes service portals", "KUBE-SERVICES"),
    Jump::new("nat", "POSTROUTING", "kubernetes postrouting rules", "KUBE-POSTROUTING"),
];

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
    /// The families served: IPv4's, and IPv6's where the kernel has IPv6 tables.
    families: Vec<FamilyTables>,
    jumps_checked: bool,
    udp: StaleUdp,
}

/// One family's tables.
struct FamilyTables {
    tables: Tables,
    /// The per-Service nat chains programmed now.
    chains: BTreeSet<String>,
    rules: RuleCounts,
}

impl IptablesDataplane {
    /// Checks that iptables works here, and finds the chains an earlier run left (they are
    /// replaced at the first sync). IPv6 is served where `ip6tables` works (not on a node
    /// booted without IPv6, say), as kube-proxy serves the families its node has.
    pub fn new(config: IptablesConfig) -> anyhow::Result<Self> {
        let needs = "the iptables mode needs iptables-save and iptables-restore (the iptables \
                     package)";
        let mut families = Vec::new();
        for (tables, mut chains) in iptables::families_here(config.backend, needs)? {
            chains.retain(|c| is_service_chain(c));
            families.push(FamilyTables {
                tables,
                chains,
                rules: RuleCounts::default(),
            });
        }
        Ok(Self {
            config,
            families,
            jumps_checked: false,
            udp: StaleUdp::default(),
        })
    }
}

impl Dataplane for IptablesDataplane {
    fn sync(&mut self, state: &DesiredState, scope: Scope<'_>) -> anyhow::Result<()> {
        let changed = match scope {
            // Until a sync succeeded, what the chains hold is not known.
            Scope::Changed(changed) if self.jumps_checked => Some(changed),
            _ => None,
        };
        let mut drops = None;
        for f in &mut self.families {
            let settings = self.config.netfilter.settings(f.tables.family)?;
            let rendered = rules::render(state, &settings, &f.chains, changed);
            if let Err(e) = iptables::restore(f.tables, &rendered.text) {
                METRICS.iptables_restore_failed(f.tables.family, changed.is_some());
                // The next sync writes every family whole.
                self.jumps_checked = false;
                return Err(e);
            }
            f.chains = rendered.chains;
            let written = f.rules.written(&rendered.text);
            METRICS.iptables_rules(f.tables.family, written, f.rules.totals());
            // Read here rather than at each scrape: the sync holds no runtime thread it would
            // block.
            if let Some(n) = invalid_drops(f.tables) {
                drops = Some(drops.unwrap_or(0) + n);
            }
        }
        METRICS.iptables_invalid_drops(drops);
        // The chains exist now; the jumps to them are checked once and at each full or
        // periodic sync (something else may have flushed the built-in chains).
        if !self.jumps_checked || scope.checks_jumps() {
            for f in &self.families {
                iptables::ensure_jumps(f.tables, JUMPS)?;
            }
            self.jumps_checked = true;
        }
        self.udp.clear(state);
        Ok(())
    }

    fn families(&self) -> Vec<Family> {
        self.families.iter().map(|f| f.tables.family).collect()
    }
}

/// The packets KUBE-FORWARD's `--ctstate INVALID` rule dropped, from its counter (kube-proxy
/// reads an nfacct object its rule updates); None when it cannot be read.
fn invalid_drops(tables: Tables) -> Option<u64> {
    let listed = std::process::Command::new(tables.tool("iptables"))
        .args([
            "-w",
            "5",
            "-t",
            "filter",
            "-L",
            "KUBE-FORWARD",
            "-v",
            "-x",
            "-n",
        ])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    // "   12   720 DROP  0  --  *  *  0.0.0.0/0  0.0.0.0/0  ctstate INVALID"
    String::from_utf8_lossy(&listed.stdout)
        .lines()
        .find_map(|line| {
            let mut words = line.split_whitespace();
            let packets = words.next()?.parse::<u64>().ok()?;
            (words.nth(1) == Some("DROP") && line.contains("ctstate INVALID")).then_some(packets)
        })
}

/// The rules in each chain the mode wrote, by table, as kube-proxy counts them for
/// `kubeproxy_sync_proxy_rules_iptables_{last,total}` (the jumps from the built-in chains are
/// not counted). A partial sync leaves the chains it does not declare as they were.
#[derive(Debug, Default)]
struct RuleCounts {
    chains: HashMap<(usize, String), usize>,
}

impl RuleCounts {
    /// Takes in an iptables-restore input that was applied; returns the rules it wrote, by
    /// [`IPTABLES_TABLES`].
    fn written(&mut self, text: &str) -> [usize; 2] {
        let mut written = [0; 2];
        let mut table = None;
        for line in text.lines() {
            if let Some(name) = line.strip_prefix('*') {
                table = IPTABLES_TABLES.iter().position(|t| *t == name);
                continue;
            }
            let Some(t) = table else { continue };
            let chain_of = |rest: &str| rest.split_whitespace().next().unwrap_or("").to_owned();
            if let Some(rest) = line.strip_prefix(':') {
                // Declared: flushed, and rewritten by the rules that follow.
                self.chains.insert((t, chain_of(rest)), 0);
            } else if let Some(rest) = line.strip_prefix("-A ") {
                *self.chains.entry((t, chain_of(rest))).or_default() += 1;
                written[t] += 1;
            } else if let Some(rest) = line.strip_prefix("-X ") {
                self.chains.remove(&(t, chain_of(rest)));
            }
        }
        written
    }

    /// The rules in the mode's chains now, by [`IPTABLES_TABLES`].
    fn totals(&self) -> [usize; 2] {
        let mut totals = [0; 2];
        for ((t, _), n) in &self.chains {
            totals[*t] += n;
        }
        totals
    }
}

/// The chains of `table` that the mode owns, as iptables-save lists them.
fn owned_chains(t: impl Into<Tables>, table: &str) -> anyhow::Result<BTreeSet<String>> {
    let fixed: &[&str] = FIXED_CHAINS
        .iter()
        .find(|(t, _)| *t == table)
        .map_or(&[], |(_, c)| c);
    let mut chains = iptables::chains(t, table)?;
    chains.retain(|c| fixed.contains(&c.as_str()) || is_service_chain(c));
    Ok(chains)
}

fn is_service_chain(chain: &str) -> bool {
    SERVICE_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p))
}

/// The backend for `--iptables-backend auto`: the one holding the mode's chains, else the
/// node's.
pub fn detect_backend() -> anyhow::Result<Backend> {
    Backend::detect(|b| owned_chains(b, "nat").map_or(0, |c| c.len()))
}

/// Both backends' tools of both families.
fn every_tables() -> impl Iterator<Item = Tables> {
    Backend::ALL.into_iter().flat_map(|backend| {
        Family::ALL
            .into_iter()
            .map(move |family| Tables { backend, family })
    })
}

/// Removes everything the mode installed, from both backends and both families: the jumps,
/// then its chains (kube-proxy's `--cleanup`). Nothing installed: nothing done.
pub fn cleanup() -> anyhow::Result<()> {
    // Where a family's tables cannot be listed (no IPv6 here), nothing of it was installed.
    for t in
        every_tables().filter(|t| iptables::available(*t) && iptables::chains(*t, "nat").is_ok())
    {
        let mut removed = iptables::remove_jumps(t, JUMPS)?;
        let mut chains = Vec::new();
        for (table, _) in FIXED_CHAINS {
            chains.push((*table, owned_chains(t, table)?));
        }
        removed += iptables::delete_chains(t, &chains)?;
        if removed > 0 {
            let (backend, family) = (t.backend.name(), t.family.name());
            tracing::info!(backend, family, removed, "cleaned up the iptables rules");
        }
    }
    Ok(())
}

/// Whether the mode's chains are installed here, in either backend and family (an earlier run
/// in this mode, or kube-proxy's). KUBE-SERVICES alone may be the IPVS mode's: the mode's own
/// KUBE-NODEPORTS (IPVS has KUBE-NODE-PORT) or per-Service chains tell.
pub fn installed() -> bool {
    every_tables().any(|t| {
        owned_chains(t, "nat").is_ok_and(|chains| {
            chains
                .iter()
                .any(|c| c == "KUBE-NODEPORTS" || is_service_chain(c))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{SERVICES, fixture, netfilter_settings};

    /// kube-proxy's rule counts: a partial sync writes fewer rules, and the mode still owns
    /// as many as after the full one; a Service removed takes its rules with it.
    #[test]
    fn rule_counts_follow_full_and_partial_syncs() {
        let settings = netfilter_settings();
        let mut state = fixture(SERVICES);
        let mut counts = RuleCounts::default();
        let full = rules::render(&state, &settings, &BTreeSet::new(), None);
        let written = counts.written(&full.text);
        let lines = |table: &str| {
            let section = full.text.split(&format!("*{table}\n")).nth(1).unwrap();
            let section = section.split("COMMIT").next().unwrap();
            section.lines().filter(|l| l.starts_with("-A ")).count()
        };
        assert_eq!(written, [lines("filter"), lines("nat")]);
        assert_eq!(counts.totals(), written);
        let web = state
            .port_names()
            .find(|spn| spn.to_string() == "shop/web:http")
            .unwrap()
            .clone();
        let changed = BTreeSet::from([web.clone()]);
        let partial = rules::render(&state, &settings, &full.chains, Some(&changed));
        let written_partial = counts.written(&partial.text);
        assert!(
            written_partial[1] < written[1],
            "{written_partial:?} {written:?}"
        );
        assert_eq!(counts.totals(), written, "the same rules are owned");
        state.remove_port(&web);
        let gone = rules::render(&state, &settings, &partial.chains, Some(&changed));
        counts.written(&gone.text);
        let after = rules::render(&state, &settings, &BTreeSet::new(), None);
        assert_eq!(counts.totals(), RuleCounts::default().written(&after.text));
    }
}

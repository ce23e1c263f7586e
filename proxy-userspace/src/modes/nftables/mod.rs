//! kube-proxy's nftables mode, for nodes where the eBPF datapath cannot run: the ruleset of
//! [`rules`] in `table ip kube-proxy` and `table ip6 kube-proxy`, both written with one
//! `nft -f` transaction per sync, and stale UDP conntrack entries deleted when endpoints go.
//!
//! As kube-proxy's, syncs are incremental: between full syncs only the changed Service ports'
//! chains and map elements are written. The dataplane keeps what the table holds
//! ([`rules::Programmed`]); a failed transaction changes nothing in the kernel, but the next
//! sync writes the table anew all the same.
pub mod inspect;
pub mod rules;

use std::process::{Command, Stdio};

use anyhow::{Context, bail};

use crate::{
    dataplane::{Dataplane, Scope},
    model::{DesiredState, Family},
    netfilter::{rules::NetfilterConfig, stale_udp::StaleUdp},
};

pub struct NftablesDataplane {
    config: NetfilterConfig,
    /// The tables written, each with what it holds: None until the first sync and after a
    /// failed one.
    tables: Vec<(rules::Table, Option<rules::Programmed>)>,
    udp: StaleUdp,
}

impl NftablesDataplane {
    /// Checks that nft works here, and which families it can write (IPv6 not on a node booted
    /// without it: kube-proxy checks the same). What an earlier run left in the tables is
    /// replaced at the first sync.
    pub fn new(config: NetfilterConfig) -> anyhow::Result<Self> {
        available()?;
        let mut tables = Vec::new();
        for table in rules::TABLES {
            match can_write(&table) {
                Ok(()) => tables.push((table, None)),
                Err(e) => tracing::warn!(
                    "{} Services are not served: nft cannot write {} here ({e:#})",
                    table.family,
                    table.name
                ),
            }
        }
        Ok(Self {
            config,
            tables,
            udp: StaleUdp::default(),
        })
    }
}

impl Dataplane for NftablesDataplane {
    fn sync(&mut self, state: &DesiredState, scope: Scope<'_>) -> anyhow::Result<()> {
        let mut text = String::new();
        let mut programmed = Vec::with_capacity(self.tables.len());
        for (table, was) in &mut self.tables {
            let settings = self.config.settings(table.family)?;
            // Taken: if the transaction fails, the next sync starts from unknown tables.
            let rendered = rules::render(state, &settings, *table, was.take(), scope);
            text.push_str(&rendered.text);
            programmed.push(rendered.programmed);
        }
        // One transaction for both families: they change together or not at all.
        if !text.is_empty()
            && let Err(e) = nft(&text)
        {
            crate::serve::metrics::METRICS.nftables_sync_failed();
            return Err(e);
        }
        for ((_, slot), p) in self.tables.iter_mut().zip(programmed) {
            *slot = Some(p);
        }
        self.udp.clear(state);
        Ok(())
    }

    fn families(&self) -> Vec<Family> {
        self.tables.iter().map(|(table, _)| table.family).collect()
    }
}

/// Whether nft runs here: Ok, or why not.
pub(crate) fn available() -> anyhow::Result<()> {
    let output = Command::new("nft")
        .args(["list", "tables"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .context("running nft: the nftables mode needs the nft command (the nftables package)")?;
    if !output.status.success() {
        bail!(
            "nft list tables failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// Whether nft can write `table` here (not an `ip6` one on a node booted without IPv6): a
/// transaction checked, not committed.
pub(crate) fn can_write(table: &rules::Table) -> anyhow::Result<()> {
    let check = format!("add table {}\n", table.name);
    crate::command::pipe("nft", &["--check", "-f", "-"], &check)
}

/// Runs `nft -f -` on `input`: one transaction, all or nothing.
pub(crate) fn nft(input: &str) -> anyhow::Result<()> {
    crate::command::pipe("nft", &["-f", "-"], input)
}

/// The tables kube-proxy's nftables mode writes, and so does this one.
const TABLES: &[&str] = &[rules::TABLE.name, rules::TABLE6.name];

/// Whether `table` exists here (false also when nft cannot be run).
pub(crate) fn exists(table: &str) -> bool {
    !present([table]).is_empty()
}

/// Those of the tables `names` (such as "ip kube-proxy") that exist here, from one `nft list
/// tables` (none when nft cannot be run).
pub(crate) fn present<'a>(names: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    let listed = Command::new("nft")
        .args(["list", "tables"])
        .stderr(Stdio::null())
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
        .unwrap_or_default();
    let listed: Vec<&str> = (listed.lines())
        .filter_map(|l| l.trim().strip_prefix("table "))
        .collect();
    names.into_iter().filter(|n| listed.contains(n)).collect()
}

/// Removes the tables (kube-proxy's `--cleanup`): everything the mode installed, and kube-proxy's
/// own. Nothing installed: nothing done.
pub fn cleanup() -> anyhow::Result<()> {
    for table in present(TABLES.iter().copied()) {
        nft(&format!("delete table {table}\n"))?;
        tracing::info!(table, "cleaned up the nftables rules");
    }
    Ok(())
}

/// Whether the mode's table is installed here (an earlier run in this mode, or kube-proxy's).
pub fn installed() -> bool {
    !present(TABLES.iter().copied()).is_empty()
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeSet, io::Write as _, net::Ipv4Addr};

    use super::*;
    use crate::{
        model::{Cidr, NamespacedName, Protocol, ServicePortName},
        modes::nftables::rules::tests::FIXTURE,
        node::NodePortAddresses,
        testing::fixture,
    };

    /// Set to 1 to make the kernel tests fail instead of skipping (as the sandbox tests').
    const NO_SKIP_ENV: &str = "SANDBOX_NO_SKIP";

    /// Whether tests that program nftables can run here (root, nft). Otherwise prints a loud
    /// `SKIPPED <test>: <reason>` line to stderr and returns false (or panics when
    /// `SANDBOX_NO_SKIP=1`).
    pub(super) fn privileged(test: &str) -> bool {
        // SAFETY: geteuid has no preconditions.
        let reason = if unsafe { libc::geteuid() } != 0 {
            "not running as root".to_string()
        } else {
            match Command::new("nft").arg("--version").output() {
                Ok(o) if o.status.success() => return true,
                Ok(o) => format!(
                    "nft --version failed: {}",
                    String::from_utf8_lossy(&o.stderr)
                ),
                Err(e) => format!("nft unavailable: {e}"),
            }
        };
        if std::env::var(NO_SKIP_ENV).is_ok_and(|v| v == "1") {
            panic!("{test} cannot run: {reason} ({NO_SKIP_ENV}=1)");
        }
        // Straight to fd 2: `eprintln!` would be captured by the test harness.
        let _ = writeln!(std::io::stderr(), "\nSKIPPED {test}: {reason}\n");
        false
    }

    /// The dataplane as the agent drives it, in a network namespace of the test's thread:
    /// the table appears at the first sync, follows a partial one, and cleanup removes it.
    #[test]
    fn dataplane_syncs_and_cleans_up() {
        if !privileged("modes::nftables::tests::dataplane_syncs_and_cleans_up") {
            return;
        }
        // A thread of its own: the namespace is the thread's, and so its children's (nft).
        std::thread::spawn(|| {
            // SAFETY: unshare has no memory preconditions; it changes this thread only.
            assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
            assert!(!installed());
            cleanup().unwrap();
            let mut dp = NftablesDataplane::new(NetfilterConfig {
                cluster_cidrs: vec![Cidr::v4(std::net::Ipv4Addr::new(10, 244, 0, 0), 16)],
                masquerade_all: false,
                node_port_addresses: NodePortAddresses::Cidrs(vec![Cidr::v4(
                    Ipv4Addr::UNSPECIFIED,
                    0,
                )]),
                primary: Vec::new(),
            })
            .unwrap();
            let mut state = fixture(FIXTURE);
            dp.sync(&state, Scope::All).unwrap();
            assert!(installed());
            let web =
                ServicePortName::new(NamespacedName::new("shop", "web"), "http", Protocol::Tcp);
            state.remove_port(&web);
            dp.sync(&state, Scope::Changed(&BTreeSet::from([web])))
                .unwrap();
            let listed = Command::new("nft")
                .args(["list", "table", "ip", "kube-proxy"])
                .output()
                .unwrap();
            let listed = String::from_utf8_lossy(&listed.stdout);
            assert!(listed.contains("chain services {"), "{listed}");
            assert!(!listed.contains("shop/web"), "{listed}");
            cleanup().unwrap();
            assert!(!installed());
        })
        .join()
        .unwrap();
    }
}

//! The iptables tools the netfilter modes run: the two backends, `iptables-restore`, single
//! rules, and the jumps from the built-in chains to a mode's own.
use std::{
    collections::BTreeSet,
    process::{Command, Stdio},
};

use anyhow::{Context, bail};

use crate::model::Family;

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

    /// The backend that holds more of a mode's chains (`held`: how many `b` holds; an earlier
    /// run's, or kube-proxy's: as kube-proxy's image picks it), else the node's own `iptables`
    /// (its alternatives link).
    pub fn detect(held: impl Fn(Backend) -> usize) -> anyhow::Result<Self> {
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
            .context("running iptables --version: the netfilter modes need the iptables package")?;
        let version = String::from_utf8_lossy(&version.stdout);
        Ok(if version.contains("legacy") {
            Backend::Legacy
        } else {
            Backend::Nft
        })
    }
}

/// The tools of one backend for one family: `iptables-*` (IPv4) or `ip6tables-*` (IPv6). A
/// [`Backend`] alone stands for its IPv4 tools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tables {
    pub backend: Backend,
    pub family: Family,
}

impl Tables {
    /// The binary of `tool` (`iptables`, `iptables-save`, `iptables-restore`) for the family.
    pub(crate) fn tool(self, tool: &str) -> String {
        let tool = self.backend.tool(tool);
        match self.family {
            Family::V4 => tool,
            Family::V6 => tool.replacen("iptables", "ip6tables", 1),
        }
    }
}

impl From<Backend> for Tables {
    fn from(backend: Backend) -> Self {
        Self {
            backend,
            family: Family::V4,
        }
    }
}

/// Runs `iptables-restore --noflush` on `input`: one transaction, all or nothing.
pub(crate) fn restore(t: impl Into<Tables>, input: &str) -> anyhow::Result<()> {
    let tool = t.into().tool("iptables-restore");
    crate::command::pipe(&tool, &["-w", "--noflush"], input)
}

pub(crate) fn iptables(t: impl Into<Tables>, table: &str, args: &[&str]) -> anyhow::Result<bool> {
    let status = Command::new(t.into().tool("iptables"))
        .args(["-w", "-t", table])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .context("running iptables")?;
    Ok(status.success())
}

/// Whether `t`'s tools can be run here.
pub(crate) fn available(t: impl Into<Tables>) -> bool {
    Command::new(t.into().tool("iptables-save"))
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A rule in a built-in chain that jumps to one of a mode's chains:
/// `[-m conntrack --ctstate NEW] [MATCHES] -m comment --comment COMMENT -j TARGET`.
#[derive(Clone, Copy)]
pub(crate) struct Jump {
    table: &'static str,
    chain: &'static str,
    /// Inserted first in the chain (else appended).
    first: bool,
    /// For new connections only.
    new_only: bool,
    matches: &'static [&'static str],
    comment: &'static str,
    target: &'static str,
}

impl Jump {
    /// A jump inserted first in `table`'s `chain`, for every packet.
    pub const fn new(
        table: &'static str,
        chain: &'static str,
        comment: &'static str,
        target: &'static str,
    ) -> Self {
        Self {
            table,
            chain,
            first: true,
            new_only: false,
            matches: &[],
            comment,
            target,
        }
    }

    /// Only for new connections.
    pub const fn new_only(self) -> Self {
        Self {
            new_only: true,
            ..self
        }
    }

    /// Appended to the chain rather than inserted first.
    pub const fn appended(self) -> Self {
        Self {
            first: false,
            ..self
        }
    }

    /// With these matches too (before the comment).
    pub const fn matching(self, matches: &'static [&'static str]) -> Self {
        Self { matches, ..self }
    }

    /// `iptables -t TABLE OP CHAIN [1] RULE` (`-C`, `-D`, or `add`); whether it succeeded.
    fn run(&self, t: Tables, op: &str) -> anyhow::Result<bool> {
        let op = match op {
            "add" if self.first => "-I",
            "add" => "-A",
            other => other,
        };
        let mut args = vec![op, self.chain];
        if op == "-I" {
            args.push("1");
        }
        args.extend(self.rule());
        iptables(t, self.table, &args)
    }

    /// The rule's matches and target.
    fn rule(&self) -> Vec<&'static str> {
        let mut args = Vec::new();
        if self.new_only {
            args.extend(["-m", "conntrack", "--ctstate", "NEW"]);
        }
        args.extend_from_slice(self.matches);
        args.extend([
            "-m",
            "comment",
            "--comment",
            self.comment,
            "-j",
            self.target,
        ]);
        args
    }

    /// The jump added to a model of the tables (the packet tracer's).
    #[cfg(test)]
    pub(crate) fn add_to(&self, tables: &mut super::tracer::Iptables) {
        let rule = self.rule().into_iter().map(str::to_owned).collect();
        tables.add(self.table, self.chain, self.first, rule);
    }
}

/// Adds those of `jumps` that are missing.
pub(crate) fn ensure_jumps(t: impl Into<Tables>, jumps: &[Jump]) -> anyhow::Result<()> {
    let t = t.into();
    for jump in jumps {
        if !jump.run(t, "-C")? && !jump.run(t, "add")? {
            bail!(
                "cannot add the jump to {} in {} {}",
                jump.target,
                jump.table,
                jump.chain
            );
        }
    }
    Ok(())
}

/// Deletes every copy of `jumps`; how many there were.
pub(crate) fn remove_jumps(t: impl Into<Tables>, jumps: &[Jump]) -> anyhow::Result<usize> {
    let t = t.into();
    let mut removed = 0;
    for jump in jumps {
        while jump.run(t, "-D")? {
            removed += 1;
        }
    }
    Ok(removed)
}

/// The chains of `table` in `t`, as iptables-save declares them.
pub(crate) fn chains(t: impl Into<Tables>, table: &str) -> anyhow::Result<BTreeSet<String>> {
    let output = Command::new(t.into().tool("iptables-save"))
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
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix(':')?.split_whitespace().next())
        .map(str::to_owned)
        .collect())
}

/// `backend`'s tools of each family a mode serves here, with the chains of their nat table
/// (read to show the tools run): IPv4's, which must run (else the error, with `needs` as its
/// context), and IPv6's, left out with a warning where ip6tables cannot run (a node booted
/// without IPv6, say), as kube-proxy serves the families its node has.
pub(crate) fn families_here(
    backend: Backend,
    needs: &str,
) -> anyhow::Result<Vec<(Tables, BTreeSet<String>)>> {
    let mut here = Vec::new();
    for family in Family::ALL {
        let tables = Tables { backend, family };
        match chains(tables, "nat") {
            Ok(nat) => here.push((tables, nat)),
            Err(e) if family == Family::V6 => {
                tracing::warn!("IPv6 Services are not served: ip6tables cannot run here ({e:#})")
            }
            Err(e) => return Err(e).context(needs.to_owned()),
        }
    }
    Ok(here)
}

/// Flushes and deletes `chains` of each table in one `iptables-restore`; how many.
pub(crate) fn delete_chains(
    t: impl Into<Tables>,
    chains: &[(&str, BTreeSet<String>)],
) -> anyhow::Result<usize> {
    let mut input = String::new();
    let mut deleted = 0;
    for (table, chains) in chains.iter().filter(|(_, c)| !c.is_empty()) {
        input.push_str(&format!("*{table}\n"));
        for chain in chains {
            input.push_str(&format!(":{chain} - [0:0]\n"));
        }
        for chain in chains {
            input.push_str(&format!("-X {chain}\n"));
        }
        input.push_str("COMMIT\n");
        deleted += chains.len();
    }
    if !input.is_empty() {
        restore(t, &input)?;
    }
    Ok(deleted)
}

/// The nat and filter tables of `t`, as iptables-save prints them.
pub(crate) fn save(t: impl Into<Tables>) -> anyhow::Result<String> {
    let save = t.into().tool("iptables-save");
    let mut text = crate::command::run(&save, &["-t", "nat"], "iptables")?;
    text.push_str(&crate::command::run(&save, &["-t", "filter"], "iptables")?);
    Ok(text)
}

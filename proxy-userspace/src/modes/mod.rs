//! The proxy modes, one folder each, and their registry: every mode is listed once here with
//! what it can do (start, find and remove its state, read it back). `--proxy-mode`, `auto`,
//! `--cleanup` and `inspect` all go through this list. No mode imports another: what several
//! use lives in [`crate::node`] and [`crate::netfilter`].
pub mod ebpf;
pub mod iptables;
pub mod ipvs;
pub mod nftables;
#[cfg(test)]
mod packet_flows;
pub mod userspace;

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use crate::{
    dataplane::Dataplane,
    model::Cidr,
    netfilter::{iptables::Backend, rules::NetfilterConfig},
    node::NodePortAddresses,
    rows::{Rows, What},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProxyMode {
    Ebpf,
    Nftables,
    Iptables,
    Ipvs,
    Userspace,
}

impl ProxyMode {
    pub const ALL: [ProxyMode; 5] = [
        ProxyMode::Ebpf,
        ProxyMode::Nftables,
        ProxyMode::Iptables,
        ProxyMode::Ipvs,
        ProxyMode::Userspace,
    ];

    /// What `--proxy-mode auto` tries, in order.
    pub const AUTO: [ProxyMode; 3] = [ProxyMode::Ebpf, ProxyMode::Nftables, ProxyMode::Iptables];

    /// The order in which modes' state is removed: IPVS before iptables, as its jumps go to
    /// chains the iptables mode's cleanup deletes.
    const REMOVAL: [ProxyMode; 5] = [
        ProxyMode::Ipvs,
        ProxyMode::Iptables,
        ProxyMode::Nftables,
        ProxyMode::Userspace,
        ProxyMode::Ebpf,
    ];

    fn mode(self) -> &'static Mode {
        match self {
            ProxyMode::Ebpf => &EBPF,
            ProxyMode::Nftables => &NFTABLES,
            ProxyMode::Iptables => &IPTABLES,
            ProxyMode::Ipvs => &IPVS,
            ProxyMode::Userspace => &USERSPACE,
        }
    }

    /// The `--proxy-mode` value.
    pub fn name(self) -> &'static str {
        self.mode().name
    }

    /// One line for `--help`.
    pub fn about(self) -> &'static str {
        self.mode().about
    }

    /// Whether the mode's state is on this node (in this network namespace).
    pub fn installed(self, at: &Installation) -> bool {
        (self.mode().installed)(at)
    }

    /// Removes what the mode installed (kube-proxy's `--cleanup`); nothing installed: nothing
    /// done.
    pub fn cleanup(self, at: &Installation) -> anyhow::Result<()> {
        (self.mode().cleanup)(at)
    }

    /// `what` of the mode's state, read back.
    pub fn inspect(self, what: What, at: &Installation) -> anyhow::Result<Rows> {
        (self.mode().inspect)(what, at)
    }

    /// On `/metrics`: `kubeproxy_proxy_mode{mode, requested}` 1, this mode running where
    /// `--proxy-mode` asked for `requested` (`auto` falls back where the ebpf mode cannot load).
    /// Also sets what `/proxyMode` answers and the families kube-proxy exports only in this
    /// mode.
    pub fn export(self, requested: &'static str) {
        use crate::serve::metrics::{METRICS, ModeFamilies};
        let families = match self {
            ProxyMode::Iptables => ModeFamilies::Iptables,
            ProxyMode::Ipvs => ModeFamilies::Ipvs,
            ProxyMode::Nftables => ModeFamilies::Nftables,
            ProxyMode::Ebpf | ProxyMode::Userspace => ModeFamilies::Common,
        };
        METRICS.set_mode(self.name(), families);
        METRICS.add_collector(Box::new(move |out| {
            use std::fmt::Write as _;
            let name = "kubeproxy_proxy_mode";
            let help = "The proxy mode this agent runs (mode) and the --proxy-mode it was given \
                        (requested)";
            crate::serve::metrics::header(out, name, help, "gauge");
            let _ = writeln!(
                out,
                "{name}{{mode=\"{}\",requested=\"{requested}\"}} 1",
                self.name()
            );
        }));
    }

    /// Starts the mode after removing what the others left (it would serve stale state beside
    /// this one's). The ebpf mode removes it once its programs are ready to take over, so that
    /// kube-proxy's rules serve until then and the connections they opened stay theirs.
    pub fn start(self, config: &mut StartConfig) -> anyhow::Result<Box<dyn Dataplane>> {
        let installation = Installation::at(&config.ebpf.pin_dir);
        let others: Vec<ProxyMode> = Self::REMOVAL
            .into_iter()
            .filter(|&other| other != self && other.installed(&installation))
            .collect();
        let remove = move || {
            for other in others {
                match other {
                    ProxyMode::Ebpf => {
                        tracing::info!("removing the eBPF programs of an earlier ebpf-mode run")
                    }
                    _ => tracing::warn!(
                        "removing the rules of an earlier {}-mode run (or of kube-proxy: stop \
                         it before starting this agent)",
                        other.name()
                    ),
                }
                other.cleanup(&installation)?;
            }
            Ok(())
        };
        match self {
            ProxyMode::Ebpf => config.ebpf.remove_replaced = Some(Box::new(remove)),
            _ => remove()?,
        }
        (self.mode().start)(config)
    }
}

impl clap::ValueEnum for ProxyMode {
    fn value_variants<'a>() -> &'a [Self] {
        &Self::ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.name()).help(self.about()))
    }
}

/// Removes what every mode installed here, then exits (`agent --cleanup`).
pub fn cleanup_all(at: &Installation) -> anyhow::Result<()> {
    for mode in ProxyMode::REMOVAL {
        mode.cleanup(at)?;
    }
    Ok(())
}

/// Where the modes' state lives besides the kernel's own tables: the ebpf mode's pins.
#[derive(Clone, Debug)]
pub struct Installation {
    /// `--bpf-pin-dir`.
    pub pin_dir: PathBuf,
}

/// The agent's flags that the modes start with, and the Node object's addresses.
pub struct StartConfig {
    /// The Node object's addresses (the API source; empty with the manifest source).
    pub node_ips: Vec<IpAddr>,
    /// `--cluster-cidr`: at most one range a family.
    pub cluster_cidrs: Vec<Cidr>,
    pub masquerade_all: bool,
    pub node_port_addresses: NodePortAddresses,
    /// `--iptables-backend`; None: the one holding the mode's chains, else the node's.
    pub iptables_backend: Option<Backend>,
    pub ipvs_scheduler: String,
    pub ipvs_strict_arp: bool,
    pub ipvs_exclude_cidrs: Vec<Cidr>,
    pub ipvs_timeouts: ipvs::netlink::Timeouts,
    pub udp_timeout: Duration,
    pub ct_lifetimes: CtLifetimes,
    pub ebpf: ebpf::StartConfig,
}

/// How long an idle flow stays in conntrack, by its state: the agent's
/// `--conntrack-tcp-timeout-established`, `--conntrack-tcp-timeout-close-wait` (which the
/// netfilter modes give netfilter, as kube-proxy does), `--bpf-ct-timeout-tcp-syn` and
/// `--bpf-ct-timeout-udp` (the ebpf mode's own). Zero: left as it is (netfilter) or the default
/// (ebpf).
#[derive(Clone, Copy, Debug, Default)]
pub struct CtLifetimes {
    pub tcp_established: Duration,
    pub tcp_opening: Duration,
    pub tcp_half_closed: Duration,
    pub udp: Duration,
}

impl StartConfig {
    fn netfilter(&self) -> NetfilterConfig {
        NetfilterConfig {
            cluster_cidrs: self.cluster_cidrs.clone(),
            masquerade_all: self.masquerade_all,
            node_port_addresses: self.node_port_addresses.clone(),
            primary: self.node_ips.clone(),
        }
    }

    /// Once a netfilter mode started.
    fn warn_without_cluster_cidr(&self) {
        if self.cluster_cidrs.is_empty() && !self.masquerade_all {
            tracing::warn!(
                "no --cluster-cidr: connections to cluster IPs from outside the pod network are \
                 not masqueraded"
            );
        }
    }

    fn backend(&self, detect: fn() -> anyhow::Result<Backend>) -> anyhow::Result<Backend> {
        self.iptables_backend.map_or_else(detect, Ok)
    }
}

/// What the registry knows of a mode.
struct Mode {
    name: &'static str,
    about: &'static str,
    start: fn(&mut StartConfig) -> anyhow::Result<Box<dyn Dataplane>>,
    installed: fn(&Installation) -> bool,
    cleanup: fn(&Installation) -> anyhow::Result<()>,
    inspect: fn(What, &Installation) -> anyhow::Result<Rows>,
}

const EBPF: Mode = Mode {
    name: "ebpf",
    about: "tc and XDP programs with BPF maps",
    start: |config| {
        let node_ips = config.node_ips.clone();
        let addresses = config.node_port_addresses.clone();
        let lifetimes = config.ct_lifetimes;
        let netfilter = config.netfilter();
        Ok(Box::new(ebpf::start(
            node_ips,
            addresses,
            lifetimes,
            netfilter,
            &mut config.ebpf,
        )?))
    },
    installed: |at| ebpf::installed(&at.pin_dir),
    cleanup: |at| {
        let _lock = ebpf::lock_pin_dir(&at.pin_dir)?;
        ebpf::cleanup(&at.pin_dir)
    },
    inspect: |what, at| ebpf::inspect::read(what, &at.pin_dir),
};

const NFTABLES: Mode = Mode {
    name: "nftables",
    about: "kube-proxy's nftables mode (`table ip kube-proxy`), for nodes where BPF cannot run",
    start: |config| {
        let dp = nftables::NftablesDataplane::new(config.netfilter())?;
        config.warn_without_cluster_cidr();
        tracing::info!("nftables dataplane ready");
        Ok(Box::new(dp))
    },
    installed: |_| nftables::installed(),
    cleanup: |_| nftables::cleanup(),
    inspect: |what, _| nftables::inspect::read(what, &nftables::rules::TABLES),
};

const IPTABLES: Mode = Mode {
    name: "iptables",
    about: "kube-proxy's iptables rules (NAT chains), for nodes without BPF or nftables",
    start: |config| {
        let backend = config.backend(iptables::detect_backend)?;
        let dp = iptables::IptablesDataplane::new(iptables::IptablesConfig {
            backend,
            netfilter: config.netfilter(),
        })?;
        config.warn_without_cluster_cidr();
        tracing::info!(backend = backend.name(), "iptables dataplane ready");
        Ok(Box::new(dp))
    },
    installed: |_| iptables::installed(),
    cleanup: |_| iptables::cleanup(),
    inspect: |what, _| iptables::inspect::read(what),
};

const IPVS: Mode = Mode {
    name: "ipvs",
    about: "kube-proxy's IPVS mode: the kernel's IP Virtual Server balances, with ipsets and a \
            few iptables rules (needs the ip_vs modules)",
    start: |config| {
        let backend = config.backend(iptables::detect_backend)?;
        let scheduler = match config.ipvs_scheduler.as_str() {
            "" => ipvs::DEFAULT_SCHEDULER.to_owned(),
            name => name.to_owned(),
        };
        let dp = ipvs::IpvsDataplane::new(ipvs::IpvsConfig {
            scheduler: scheduler.clone(),
            strict_arp: config.ipvs_strict_arp,
            exclude_cidrs: config.ipvs_exclude_cidrs.clone(),
            timeouts: config.ipvs_timeouts,
            backend,
            netfilter: config.netfilter(),
        })?;
        config.warn_without_cluster_cidr();
        tracing::info!(backend = backend.name(), scheduler, "ipvs dataplane ready");
        Ok(Box::new(dp))
    },
    installed: |_| ipvs::installed(),
    cleanup: |_| ipvs::cleanup(),
    inspect: |what, _| ipvs::inspect::read(what),
};

const USERSPACE: Mode = Mode {
    name: "userspace",
    about: "kube-proxy's first mode: the agent itself proxies each Service port, which iptables \
            rules redirect to it (endpoints see the node's address)",
    start: |config| {
        let backend = config.backend(userspace::detect_backend)?;
        let dp = userspace::UserspaceDataplane::new(userspace::UserspaceConfig {
            backend,
            node_port_addresses: config.node_port_addresses.clone(),
            primary: config.node_ips.clone(),
            udp_timeout: config.udp_timeout,
        })?;
        tracing::info!(backend = backend.name(), "userspace dataplane ready");
        Ok(Box::new(dp))
    },
    installed: |_| userspace::installed(),
    cleanup: |_| userspace::cleanup(),
    inspect: |what, _| userspace::inspect::read(what),
};

/// The mode installed on this node (in this network namespace), for `inspect`: the ebpf mode's
/// pins, else the one mode whose rules are here.
pub fn detect(at: &Installation) -> anyhow::Result<ProxyMode> {
    // A non-ebpf agent removes the pins when it starts, and the ebpf agent the others' rules.
    if ProxyMode::Ebpf.installed(at) {
        return Ok(ProxyMode::Ebpf);
    }
    let mut found: Vec<ProxyMode> = ProxyMode::ALL
        .into_iter()
        .filter(|m| *m != ProxyMode::Ebpf && m.installed(at))
        .collect();
    // The IPVS mode writes some of the iptables mode's chains (KUBE-SERVICES...) too.
    if found.contains(&ProxyMode::Ipvs) {
        found.retain(|m| *m != ProxyMode::Iptables);
    }
    match found.as_slice() {
        [mode] => Ok(*mode),
        [] => {
            // SAFETY: geteuid has no preconditions.
            let root = unsafe { libc::geteuid() } == 0;
            anyhow::bail!(
                "no proxy mode is installed on this node (in this network namespace): no pinned \
                 maps in {} (ebpf), no `table ip kube-proxy` (nftables), no kube-proxy iptables \
                 chains (iptables, userspace), no IPVS virtual servers (ipvs). Is the agent \
                 running here? Pass --bpf-pin-dir if it pins its maps elsewhere, or --proxy-mode \
                 to read one mode's state{}",
                at.pin_dir.display(),
                if root {
                    ""
                } else {
                    " (reading the rules needs root)"
                }
            )
        }
        several => {
            let names: Vec<&str> = several.iter().map(|m| m.name()).collect();
            anyhow::bail!(
                "the state of several proxy modes is on this node ({}): pass --proxy-mode to \
                 choose one (an agent starting in one mode removes the others'; `agent \
                 --cleanup` removes all)",
                names.join(", ")
            )
        }
    }
}

impl Installation {
    pub fn at(pin_dir: &Path) -> Self {
        Self {
            pin_dir: pin_dir.to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::ProxyMode;

    /// The text of every `.rs` file under `dir`.
    fn sources(dir: &Path) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                out.extend(sources(&path));
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                out.push((path.display().to_string(), text));
            }
        }
        out
    }

    /// The layering the tree promises (ARCHITECTURE.md): no mode imports another, dataplane code
    /// does not import the inspect command, and the model knows neither clap nor the API types.
    /// One exception: the ebpf mode's SCTP ports are written by the nftables mode's renderer
    /// (`modes/ebpf/sctp.rs`), so that both write the same rules.
    #[test]
    fn modes_import_no_other_mode_and_the_model_no_cli() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let allowed =
            |path: &str, other: &str| path.ends_with("modes/ebpf/sctp.rs") && other == "nftables";
        for mode in ProxyMode::ALL.map(ProxyMode::name) {
            for (path, text) in sources(&src.join("modes").join(mode)) {
                for other in ProxyMode::ALL
                    .map(ProxyMode::name)
                    .into_iter()
                    .filter(|o| *o != mode && !allowed(&path, o))
                {
                    assert!(
                        !text.contains(&format!("modes::{other}")),
                        "{path} imports {other}"
                    );
                }
                assert!(
                    !text.contains("crate::inspect"),
                    "{path} imports the inspect command"
                );
            }
        }
        for dir in ["model", "node", "netfilter"] {
            for (path, text) in sources(&src.join(dir)) {
                assert!(!text.contains("crate::modes"), "{path} imports a mode");
            }
        }
        for (path, text) in sources(&src.join("model")) {
            if path.ends_with("tests.rs") {
                continue; // the tracker's tests feed it API objects
            }
            for word in ["clap", "k8s_openapi"] {
                assert!(!text.contains(word), "{path} uses {word}");
            }
        }
    }
}

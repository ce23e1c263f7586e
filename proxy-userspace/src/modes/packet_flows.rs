//! kube-proxy's proxier tests as cases for the packet tracer (`netfilter/tracer`): each file of
//! `testdata/packet_flows/` holds one test's Services and EndpointSlices (in steps, where the
//! test changes them), the node it runs on, and its packet flows with the outcome kube-proxy's
//! test expects. Each step is synced as
//! the agent syncs (the first in full, the later ones with only the changed Service ports),
//! rendered afresh, and synced in full over what the step left (the periodic full sync); the
//! three must hold the same rules, and every flow is traced through them, in the iptables and
//! the nftables modes. Where this project differs from kube-proxy on purpose, the flow says so
//! (`ours`, with the reason).
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
    sync::Mutex,
};

use serde::Deserialize;

use crate::{
    dataplane::Scope,
    model::{ChangeTracker, Cidr, DesiredState, Family},
    modes::{iptables as ipt, nftables as nft},
    netfilter::{
        rules::Settings,
        tracer::{Iptables, Nftables, Node, Packet, Rules, Trace, trace},
    },
    node::{self, InterfaceAddr, NodePortAddresses},
    source::file::FileSource,
};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Case {
    kube_proxy_test: String,
    node_name: String,
    settings: CaseSettings,
    steps: Vec<Step>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CaseSettings {
    #[serde(rename = "clusterCIDR")]
    cluster_cidr: Option<String>,
    #[serde(default)]
    masquerade_all: bool,
    /// kube-proxy's `--nodeport-addresses` (CIDRs); None: every local address.
    node_port_addresses: Option<Vec<String>>,
    /// The node's addresses of the case's family (kube-proxy's test runs one proxier).
    #[serde(rename = "nodeIPs")]
    node_ips: Vec<IpAddr>,
    local_addresses: Vec<IpAddr>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Step {
    name: String,
    /// The manifest at this step: every object (those missing since the last step are gone).
    objects: String,
    flows: Vec<Flow>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Flow {
    name: String,
    source: IpAddr,
    protocol: String,
    destination: IpAddr,
    port: u16,
    /// kube-proxy's expectation, in its tracer's words (see [`Trace::output`]).
    output: String,
    masq: bool,
    /// kube-proxy's iptables mode's expectation, where it differs from its nftables mode's.
    iptables: Option<Expected>,
    /// The modes whose kube-proxy tests have this flow, where only one has it.
    modes: Option<Vec<Mode>>,
    /// This project's, where it differs from kube-proxy on purpose, by mode.
    #[serde(default)]
    ours: Vec<Ours>,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Expected {
    output: String,
    masq: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Ours {
    mode: Mode,
    output: String,
    masq: bool,
    because: String,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Mode {
    Iptables,
    Nftables,
}

impl Flow {
    fn packet(&self) -> Packet {
        let protocol = match self.protocol.as_str() {
            "TCP" => "tcp",
            "UDP" => "udp",
            "SCTP" => "sctp",
            other => panic!("flow {:?}: protocol {other:?}", self.name),
        };
        Packet::new(self.source, protocol, self.destination, self.port)
    }

    fn expected(&self, mode: Mode) -> Expected {
        if let Some(ours) = self.ours.iter().find(|o| o.mode == mode) {
            assert!(!ours.because.is_empty());
            return Expected {
                output: ours.output.clone(),
                masq: ours.masq,
            };
        }
        match (mode, &self.iptables) {
            (Mode::Iptables, Some(iptables)) => iptables.clone(),
            _ => Expected {
                output: self.output.clone(),
                masq: self.masq,
            },
        }
    }
}

/// Whether `trace` is what `expected` says: the same endpoints in any order, each as likely,
/// and the masquerading of the packets let through.
fn agrees(trace: &Trace, expected: &Expected) -> bool {
    let words =
        |s: &str| -> BTreeSet<String> { s.split(", ").map(|w| w.trim().to_owned()).collect() };
    let delivered = !matches!(expected.output.as_str(), "DROP" | "REJECT");
    words(&trace.output()) == words(&expected.output)
        && trace.even()
        && (!delivered || trace.masquerade() == Some(expected.masq))
}

/// The models of one mode: synced step by step as the agent syncs them, and rendered afresh.
trait Model: Clone {
    const MODE: Mode;
    fn new() -> Self;
    /// `changed`: the Service ports changed since the last sync (None: a full sync).
    fn sync(&mut self, state: &DesiredState, settings: &Settings, changed: Option<&Changed>);
    fn fresh(state: &DesiredState, settings: &Settings) -> Self {
        let mut model = Self::new();
        model.sync(state, settings, None);
        model
    }
    fn rules(&self) -> &dyn Rules;
    /// What it holds, sorted.
    fn dump(&self) -> String;
}

#[derive(Clone)]
struct IptablesModel {
    tables: Iptables,
    chains: BTreeSet<String>,
}

impl Model for IptablesModel {
    const MODE: Mode = Mode::Iptables;

    fn new() -> Self {
        let mut tables = Iptables::default();
        for jump in ipt::JUMPS {
            jump.add_to(&mut tables);
        }
        Self {
            tables,
            chains: BTreeSet::new(),
        }
    }

    fn sync(&mut self, state: &DesiredState, settings: &Settings, changed: Option<&Changed>) {
        let rendered = ipt::rules::render(state, settings, &self.chains, changed);
        self.tables.restore(&rendered.text);
        self.chains = rendered.chains;
    }

    fn rules(&self) -> &dyn Rules {
        &self.tables
    }

    fn dump(&self) -> String {
        self.tables.dump()
    }
}

#[derive(Clone)]
struct NftablesModel {
    tables: Nftables,
    programmed: Option<nft::rules::Programmed>,
}

impl Model for NftablesModel {
    const MODE: Mode = Mode::Nftables;

    fn new() -> Self {
        Self {
            tables: Nftables::default(),
            programmed: None,
        }
    }

    fn sync(&mut self, state: &DesiredState, settings: &Settings, changed: Option<&Changed>) {
        let scope = changed.map_or(Scope::All, Scope::Changed);
        let programmed = self.programmed.take();
        let table = nft::rules::TABLES
            .into_iter()
            .find(|t| t.family == settings.family);
        let table = table.expect("a table of each family");
        let rendered = nft::rules::render(state, settings, table, programmed, scope);
        self.tables.apply(&rendered.text);
        self.programmed = Some(rendered.programmed);
    }

    fn rules(&self) -> &dyn Rules {
        &self.tables
    }

    fn dump(&self) -> String {
        self.tables.dump()
    }
}

/// The Service ports a step changed.
type Changed = BTreeSet<crate::model::ServicePortName>;

impl CaseSettings {
    /// The family of the case's proxier: its node's.
    fn family(&self) -> Family {
        Family::of(*self.node_ips.first().expect("a node IP"))
    }

    fn settings(&self) -> Settings {
        let family = self.family();
        Settings {
            family,
            cluster_cidr: (self.cluster_cidr.as_ref()).map(|c| c.parse::<Cidr>().unwrap()),
            masquerade_all: self.masquerade_all,
            node_port_addresses: self.node_port_addresses.as_ref().and_then(|cidrs| {
                let spec =
                    NodePortAddresses::Cidrs(cidrs.iter().map(|c| c.parse().unwrap()).collect());
                let on = |interface: &str, addr| InterfaceAddr {
                    interface: interface.to_owned(),
                    addr,
                };
                let addresses: Vec<InterfaceAddr> = (self.node().addresses.into_iter())
                    .map(|addr| on("eth0", addr))
                    .chain([on("lo", Ipv4Addr::LOCALHOST.into())])
                    .collect();
                node::node_port_ips(&spec, family, &[], &addresses)
            }),
            node_ips: self.node_ips.clone(),
        }
    }

    fn node(&self) -> Node {
        let mut addresses = self.local_addresses.clone();
        addresses.extend(&self.node_ips);
        Node { addresses }
    }
}

/// Runs every step of `case` in the mode of `M`; the flows whose trace differs from what is
/// expected, one line each.
fn run<M: Model>(file: &str, case: &Case) -> Vec<String> {
    let settings = case.settings.settings();
    let node = case.settings.node();
    let tracker = Mutex::new(ChangeTracker::new());
    let mut source = FileSource::in_memory();
    let mut state = DesiredState::new(&case.node_name);
    let mut synced = M::new();
    let mut failures = Vec::new();
    for (i, step) in case.steps.iter().enumerate() {
        source.load_text(&step.objects, &tracker);
        let changed = tracker.lock().unwrap().apply(&mut state);
        synced.sync(&state, &settings, (i > 0).then_some(&changed));
        let fresh = M::fresh(&state, &settings);
        // The periodic full sync, over what the syncs before left.
        let mut resynced = synced.clone();
        resynced.sync(&state, &settings, None);
        let at = format!(
            "{file} ({}), step {:?}, {:?} mode",
            case.kube_proxy_test,
            step.name,
            M::MODE
        );
        for (how, model) in [("synced", &synced), ("resynced in full", &resynced)] {
            if model.dump() != fresh.dump() {
                failures.push(format!(
                    "{at}: {how}, the rules differ from those rendered afresh:\n{}\n-- afresh:\n{}",
                    model.dump(),
                    fresh.dump()
                ));
            }
        }
        let flows = (step.flows.iter()).filter(|f| {
            f.modes
                .as_ref()
                .is_none_or(|modes| modes.contains(&M::MODE))
        });
        for flow in flows {
            let expected = flow.expected(M::MODE);
            for (how, model) in [
                ("synced", &synced),
                ("fresh", &fresh),
                ("resynced", &resynced),
            ] {
                let got = trace(model.rules(), &node, &flow.packet());
                if !agrees(&got, &expected) {
                    failures.push(format!(
                        "{at}, {how}: flow {:?} ({} {} -> {}:{}): {got}; expected {:?}, {}",
                        flow.name,
                        flow.protocol,
                        flow.source,
                        flow.destination,
                        flow.port,
                        expected.output,
                        if expected.masq {
                            "masqueraded"
                        } else {
                            "not masqueraded"
                        },
                    ));
                }
            }
        }
    }
    failures
}

/// The cases, by file name.
fn cases() -> Vec<(String, Case)> {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/modes/testdata/packet_flows");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let text = std::fs::read_to_string(&path).unwrap();
            let case = serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
            (name, case)
        })
        .collect()
}

/// Every case in the modes it concerns: `iptables_*` files hold tests of kube-proxy's iptables
/// mode alone; the others, tests both its modes have.
#[test]
fn kube_proxys_packet_flows() {
    let cases = cases();
    assert!(!cases.is_empty());
    let mut failures = Vec::new();
    let mut flows = 0;
    for (file, case) in &cases {
        let modes = match file.starts_with("iptables_") {
            true => vec![Mode::Iptables],
            false => vec![Mode::Iptables, Mode::Nftables],
        };
        for flow in case.steps.iter().flat_map(|s| &s.flows) {
            flows += 1;
            let named = (flow.modes.iter().flatten()).chain(flow.ours.iter().map(|o| &o.mode));
            for mode in named {
                assert!(
                    modes.contains(mode),
                    "{file}: flow {:?} names {mode:?}, which does not run the case",
                    flow.name
                );
            }
        }
        failures.extend(run::<IptablesModel>(file, case));
        if modes.contains(&Mode::Nftables) {
            failures.extend(run::<NftablesModel>(file, case));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of the {flows} flows of {} cases went elsewhere than expected:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// The jumps from the built-in chains end up in kube-proxy's order.
#[test]
fn iptables_jumps_in_kube_proxys_order() {
    let mut tables = Iptables::default();
    for jump in ipt::JUMPS {
        jump.add_to(&mut tables);
    }
    let dump = tables.dump();
    let targets = |chain: &str| -> Vec<String> {
        let line = dump.lines().find(|l| l.starts_with(chain)).unwrap();
        let words: Vec<&str> = line.split(' ').collect();
        let at = words.iter().enumerate().filter(|(_, w)| **w == "-j");
        at.map(|(i, _)| words[i + 1].to_owned()).collect()
    };
    assert_eq!(
        targets("filter INPUT:"),
        [
            "KUBE-PROXY-FIREWALL",
            "KUBE-NODEPORTS",
            "KUBE-EXTERNAL-SERVICES"
        ]
    );
    assert_eq!(
        targets("filter FORWARD:"),
        [
            "KUBE-PROXY-FIREWALL",
            "KUBE-FORWARD",
            "KUBE-SERVICES",
            "KUBE-EXTERNAL-SERVICES"
        ]
    );
    assert_eq!(
        targets("filter OUTPUT:"),
        ["KUBE-PROXY-FIREWALL", "KUBE-SERVICES"]
    );
}

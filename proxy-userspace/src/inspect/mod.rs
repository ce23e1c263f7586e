//! `proxy-userspace inspect`: reads what the mode installed on the node (while the agent runs
//! or after it stopped) and prints it as a table for people or JSON for scripts. In the ebpf
//! mode, the pinned maps; in the others, the mode's own state, parsed back into the same rows:
//! the nftables table ([`nftables`]), the iptables rules ([`iptables`], [`userspace`]), the IPVS
//! table and kube-proxy's ipsets ([`ipvs`]), the kernel's conntrack table ([`conntrack`]) and
//! the affinity the kernel remembers.
mod conntrack;
mod iptables;
mod ipvs;
mod nftables;
mod userspace;

use std::{
    fmt::Write as _,
    net::Ipv4Addr,
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{Context, bail};
use aya::maps::{HashMap as BpfHashMap, Map, MapData, lpm_trie::LpmTrie};
use proxy_common::{
    AffinityKey, AffinityValue, BACKEND_DRAINING, Backend, Be32, CT_CLOSING, CT_EXTERNAL,
    CT_FORWARD, CT_SNAT, CtKey, CtValue, HAIRPIN_ADDR, IPPROTO_TCP, IPPROTO_UDP, MAP_AFFINITY,
    MAP_BACKENDS, MAP_CONNTRACK, MAP_SERVICES, MAP_SOURCE_RANGES, NODE_PORT_ADDR, SCOPE_INTERNAL,
    SERVICE_AFFINITY, SERVICE_DRAINING, SERVICE_EXTERNAL, SERVICE_LOAD_BALANCER,
    SERVICE_LOCAL_ONLY, SERVICE_MAGLEV, SOURCE_RANGE_FRONTEND_BITS, ServiceKey, ServiceValue,
    SourceRangeKey,
};
use serde::Serialize;

pub fn proto_name(proto: u8) -> &'static str {
    match proto {
        IPPROTO_TCP => "TCP",
        IPPROTO_UDP => "UDP",
        132 => "SCTP",
        _ => "?",
    }
}

fn ip(addr: Be32) -> Ipv4Addr {
    Ipv4Addr::from(addr.octets())
}

/// One service address with its backends, in slot order.
#[derive(Debug, Serialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServiceRow {
    /// `*:port` for a NodePort (every node address).
    pub address: String,
    pub protocol: &'static str,
    /// ClusterIP, NodePort, LoadBalancer or ExternalIP.
    pub kind: &'static str,
    /// The endpoints of an externalTrafficPolicy Local frontend for clients inside the cluster.
    pub in_cluster_scope: bool,
    pub backends: Vec<BackendRow>,
    /// Removed: serves only the TCP connections already established through it.
    pub draining: bool,
    /// Only this node's endpoints (internalTrafficPolicy: Local on a cluster IP,
    /// externalTrafficPolicy: Local on the others); none: dropped.
    pub local_only: bool,
    /// loadBalancerSourceRanges: the only sources admitted from outside.
    pub source_ranges: Vec<String>,
    /// sessionAffinity ClientIP, with this timeout.
    pub affinity_timeout_seconds: Option<u32>,
    /// New flows pick by Maglev (else at random).
    pub maglev: bool,
}

#[derive(Debug, Serialize, PartialEq, Eq, PartialOrd, Ord, Clone)]
pub struct BackendRow {
    pub id: u32,
    pub address: String,
    pub protocol: &'static str,
    /// Left its service port: keeps its established TCP connections, takes no new flows.
    pub draining: bool,
}

#[derive(Debug, Serialize, PartialEq)]
pub struct FlowRow {
    pub direction: &'static str,
    pub protocol: &'static str,
    pub source: String,
    pub destination: String,
    /// The service address the flow was sent to.
    pub service: String,
    pub backend_id: u32,
    /// A flow from outside the node (NodePort, LoadBalancer, external IP).
    pub external: bool,
    /// For a flow sent to another node's endpoint: the node address and port it is sent from
    /// (forward entry), or the client it answers (reply entry).
    pub translated: Option<String>,
    pub packets: u64,
    pub idle_seconds: f64,
    /// A FIN or RST was seen: the entry has the short closing lifetime.
    pub closing: bool,
    /// Past its lifetime: the programs ignore it (the LRU evicts it eventually).
    pub expired: bool,
}

fn open(pin_dir: &Path, name: &str) -> anyhow::Result<MapData> {
    let path = pin_dir.join(name);
    MapData::from_pin(&path).with_context(|| {
        format!(
            "cannot open the pinned map {}: is the agent running (or has it run) with \
             --bpf-pin-dir {}? Reading pinned maps needs root or CAP_BPF",
            path.display(),
            pin_dir.display()
        )
    })
}

pub fn backends(pin_dir: &Path) -> anyhow::Result<Vec<BackendRow>> {
    let map: BpfHashMap<_, u32, Backend> = Map::HashMap(open(pin_dir, MAP_BACKENDS)?).try_into()?;
    let mut rows = Vec::new();
    for entry in map.iter() {
        let (id, b) = entry?;
        rows.push(backend_row(id, &b));
    }
    rows.sort();
    Ok(rows)
}

/// The source ranges of each frontend, as CIDRs.
fn source_ranges(
    pin_dir: &Path,
) -> anyhow::Result<std::collections::HashMap<ServiceKey, Vec<String>>> {
    let mut out: std::collections::HashMap<ServiceKey, Vec<String>> = Default::default();
    // Agents before layout 4 had no such map: nothing to show.
    let Ok(data) = MapData::from_pin(pin_dir.join(MAP_SOURCE_RANGES)) else {
        return Ok(out);
    };
    let trie: LpmTrie<_, SourceRangeKey, u8> = Map::LpmTrie(data).try_into()?;
    for key in trie.keys() {
        let key = key?;
        let d = key.data();
        let len = key.prefix_len().saturating_sub(SOURCE_RANGE_FRONTEND_BITS);
        out.entry(ServiceKey::new(d.addr, d.port, d.proto, 0))
            .or_default()
            .push(format!("{}/{len}", ip(d.source)));
    }
    for ranges in out.values_mut() {
        ranges.sort();
    }
    Ok(out)
}

fn backend_row(id: u32, b: &Backend) -> BackendRow {
    BackendRow {
        id,
        address: format!("{}:{}", ip(b.addr), b.port.get()),
        protocol: proto_name(b.proto),
        draining: b.flags & BACKEND_DRAINING != 0,
    }
}

pub fn services(pin_dir: &Path) -> anyhow::Result<Vec<ServiceRow>> {
    let svc: BpfHashMap<_, ServiceKey, ServiceValue> =
        Map::HashMap(open(pin_dir, MAP_SERVICES)?).try_into()?;
    let be: BpfHashMap<_, u32, Backend> = Map::HashMap(open(pin_dir, MAP_BACKENDS)?).try_into()?;
    let ranges = source_ranges(pin_dir)?;
    let mut rows = Vec::new();
    for key in svc.keys() {
        let key = key?;
        if key.slot != 0 {
            continue;
        }
        // The agent may rewrite a service while we read it: a slot that vanished is skipped.
        let Ok(head) = svc.get(&key, 0) else { continue };
        let mut backends = Vec::new();
        for slot in 1..=head.count {
            let Ok(v) = svc.get(&ServiceKey { slot, ..key }, 0) else {
                continue;
            };
            match be.get(&v.backend_id, 0) {
                Ok(b) => backends.push(backend_row(v.backend_id, &b)),
                Err(_) => backends.push(BackendRow {
                    id: v.backend_id,
                    address: "(missing)".into(),
                    protocol: proto_name(key.proto),
                    draining: false,
                }),
            }
        }
        let external = head.flags & SERVICE_EXTERNAL != 0;
        let in_cluster_scope = key.scope == SCOPE_INTERNAL;
        let kind = if key.addr == NODE_PORT_ADDR {
            "NodePort"
        } else if head.flags & SERVICE_LOAD_BALANCER != 0 {
            "LoadBalancer"
        } else if external || in_cluster_scope {
            "ExternalIP"
        } else {
            "ClusterIP"
        };
        let frontend = ServiceKey::new(key.addr, key.port, key.proto, 0);
        rows.push(ServiceRow {
            address: match key.addr == NODE_PORT_ADDR {
                true => format!("*:{}", key.port.get()),
                false => format!("{}:{}", ip(key.addr), key.port.get()),
            },
            protocol: proto_name(key.proto),
            kind,
            in_cluster_scope,
            backends,
            draining: head.flags & SERVICE_DRAINING != 0,
            source_ranges: match in_cluster_scope {
                true => Vec::new(),
                false => ranges.get(&frontend).cloned().unwrap_or_default(),
            },
            local_only: head.flags & SERVICE_LOCAL_ONLY != 0,
            affinity_timeout_seconds: (head.flags & SERVICE_AFFINITY != 0)
                .then(|| head.affinity_timeout_secs()),
            maglev: head.flags & SERVICE_MAGLEV != 0,
        });
    }
    rows.sort();
    Ok(rows)
}

pub fn conntrack(pin_dir: &Path) -> anyhow::Result<Vec<FlowRow>> {
    let ct: BpfHashMap<_, CtKey, CtValue> =
        Map::LruHashMap(open(pin_dir, MAP_CONNTRACK)?).try_into()?;
    let now = monotonic_ns();
    let entries: std::collections::HashMap<CtKey, CtValue> = ct.iter().collect::<Result<_, _>>()?;
    let mut rows = Vec::new();
    for (k, v) in &entries {
        // The programs keep a flow's time in its forward entry (they refresh the reply entry
        // only now and then): a reply entry is as idle as its flow.
        let last_seen = match v.direction {
            CT_FORWARD => v.last_seen_ns,
            _ => entries
                .get(&forward_key(k, v))
                .filter(|f| f.direction == CT_FORWARD && f.backend_id == v.backend_id)
                .map_or(v.last_seen_ns, |f| f.last_seen_ns.max(v.last_seen_ns)),
        };
        let v = CtValue {
            last_seen_ns: last_seen,
            ..*v
        };
        rows.push(FlowRow {
            direction: if v.direction == CT_FORWARD {
                "forward"
            } else {
                "reply"
            },
            protocol: proto_name(k.proto),
            source: format!("{}:{}", ip(k.saddr), k.sport.get()),
            destination: format!("{}:{}", ip(k.daddr), k.dport.get()),
            service: format!("{}:{}", ip(v.vip), v.vport.get()),
            backend_id: v.backend_id,
            external: v.flags & CT_EXTERNAL != 0,
            translated: (v.flags & CT_SNAT != 0)
                .then(|| format!("{}:{}", ip(v.nat_addr), v.nat_port.get())),
            packets: u64::from(v.packets),
            idle_seconds: now.saturating_sub(v.last_seen_ns) as f64 / 1e9,
            closing: v.flags & CT_CLOSING != 0,
            expired: v.expired(k.proto, now),
        });
    }
    rows.sort_by(|a, b| {
        (&a.service, &a.source, a.direction).cmp(&(&b.service, &b.source, b.direction))
    });
    Ok(rows)
}

/// The forward entry's key of the flow whose reply entry is `k`, `v`: from the client (for an
/// external flow, the one the entry names; for a pod reaching itself, the pod) to the service
/// address.
fn forward_key(k: &CtKey, v: &CtValue) -> CtKey {
    let (client, client_port) = if v.flags & CT_EXTERNAL != 0 {
        (v.nat_addr, v.nat_port)
    } else if k.daddr == HAIRPIN_ADDR {
        (k.saddr, k.dport)
    } else {
        (k.daddr, k.dport)
    };
    CtKey {
        saddr: client,
        daddr: v.vip,
        sport: client_port,
        dport: v.vport,
        proto: k.proto,
        pad: [0; 3],
    }
}

/// A client's affinity to a backend (sessionAffinity ClientIP).
#[derive(Debug, Serialize, PartialEq)]
pub struct AffinityRow {
    pub client: String,
    pub service: String,
    pub protocol: &'static str,
    pub backend_id: u32,
    pub idle_seconds: f64,
}

pub fn affinity(pin_dir: &Path) -> anyhow::Result<Vec<AffinityRow>> {
    let map: BpfHashMap<_, AffinityKey, AffinityValue> =
        Map::LruHashMap(open(pin_dir, MAP_AFFINITY)?).try_into()?;
    let now = monotonic_ns();
    let mut rows = Vec::new();
    for entry in map.iter() {
        let (k, v) = entry?;
        rows.push(AffinityRow {
            // The socket programs record host-network clients as 0.0.0.0: this node.
            client: match k.client.get() {
                0 => "this node".to_owned(),
                _ => ip(k.client).to_string(),
            },
            service: format!("{}:{}", ip(k.vip), k.vport.get()),
            protocol: proto_name(k.proto),
            backend_id: v.backend_id,
            idle_seconds: now.saturating_sub(v.last_used_ns) as f64 / 1e9,
        });
    }
    rows.sort_by(|a, b| (&a.service, &a.client).cmp(&(&b.service, &b.client)));
    Ok(rows)
}

pub fn affinity_table(rows: &[AffinityRow]) -> String {
    let mut out = format!(
        "{:<16} {:<22} {:<5} {:>8} {:>8}\n",
        "CLIENT", "SERVICE", "PROTO", "BACKEND", "IDLE(s)"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{:<16} {:<22} {:<5} {:>8} {:>8.1}",
            r.client, r.service, r.protocol, r.backend_id, r.idle_seconds
        );
    }
    out
}

/// The clock bpf_ktime_get_ns() reads (to tell how long ago an entry was used, or to write
/// entries by hand in tests).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

pub fn services_table(rows: &[ServiceRow]) -> String {
    services_table_of(rows, true)
}

/// `ids`: the backends have ids (the eBPF maps'; the other modes' have none).
fn services_table_of(rows: &[ServiceRow], ids: bool) -> String {
    let mut out = format!(
        "{:<24} {:<5} {:<12} {}\n",
        "SERVICE",
        "PROTO",
        "KIND",
        if ids {
            "BACKENDS (id address)"
        } else {
            "BACKENDS"
        }
    );
    for r in rows {
        let list: Vec<String> = r
            .backends
            .iter()
            .map(|b| match ids {
                true => format!("{} {}", b.id, b.address),
                false => b.address.clone(),
            })
            .collect();
        let list = match (r.draining, list.is_empty()) {
            (true, _) => "(removed: draining its established connections)".to_owned(),
            (false, true) => "(none)".to_owned(),
            (false, false) => list.join(", "),
        };
        let mut policies = Vec::new();
        if r.in_cluster_scope {
            policies.push("in-cluster clients".to_owned());
        }
        if r.local_only {
            policies.push(match r.kind {
                "ClusterIP" => "internal traffic local".to_owned(),
                _ => "external traffic local".to_owned(),
            });
        }
        if !r.source_ranges.is_empty() {
            policies.push(format!("sources {}", r.source_ranges.join(" ")));
        }
        if let Some(timeout) = r.affinity_timeout_seconds {
            policies.push(format!("affinity {timeout}s"));
        }
        if r.maglev {
            policies.push("maglev".to_owned());
        }
        let list = match policies.is_empty() {
            true => list,
            false => format!("{list} [{}]", policies.join(", ")),
        };
        let _ = writeln!(
            out,
            "{:<24} {:<5} {:<12} {}",
            r.address, r.protocol, r.kind, list
        );
    }
    out
}

pub fn backends_table(rows: &[BackendRow]) -> String {
    let mut out = format!("{:>8} {:<24} {:<5} STATE\n", "ID", "ADDRESS", "PROTO");
    for r in rows {
        let state = if r.draining { "draining" } else { "active" };
        let _ = writeln!(
            out,
            "{:>8} {:<24} {:<5} {state}",
            r.id, r.address, r.protocol
        );
    }
    out
}

pub fn conntrack_table(rows: &[FlowRow]) -> String {
    let mut out = format!(
        "{:<8} {:<5} {:<22} {:<22} {:<22} {:>8} {:>8} {:>8} STATE\n",
        "DIR", "PROTO", "SOURCE", "DESTINATION", "SERVICE", "BACKEND", "PACKETS", "IDLE(s)"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{:<8} {:<5} {:<22} {:<22} {:<22} {:>8} {:>8} {:>8.1} {}{}",
            r.direction,
            r.protocol,
            r.source,
            r.destination,
            r.service,
            r.backend_id,
            r.packets,
            r.idle_seconds,
            match (r.expired, r.closing) {
                (true, _) => "expired",
                (false, true) => "closing",
                (false, false) => "open",
            },
            match (&r.translated, r.direction) {
                (Some(nat), "forward") => format!(" (sent from {nat})"),
                (Some(nat), _) => format!(" (answers {nat})"),
                (None, _) if r.external => " (external)".to_owned(),
                (None, _) => String::new(),
            }
        );
    }
    out
}

/// A proxy mode whose state `inspect` reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// The pinned BPF maps in --bpf-pin-dir.
    Ebpf,
    /// `table ip kube-proxy` (nft -j list table ip kube-proxy).
    Nftables,
    /// kube-proxy's iptables chains (iptables-save, of the backend holding them).
    Iptables,
    /// The userspace mode's iptables chains (KUBE-PORTALS-*, KUBE-NODEPORT-*).
    Userspace,
    /// kube-proxy's IPVS mode: found, not read yet.
    Ipvs,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Nftables => "nftables",
            Mode::Iptables => "iptables",
            Mode::Userspace => "userspace",
            Mode::Ipvs => "ipvs",
        }
    }
}

/// What `inspect` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum What {
    /// Each frontend (cluster IP, NodePort, load balancer IP, external IP) with its endpoints
    /// and policies.
    Services,
    /// The endpoints.
    Backends,
    /// The flows sent to a Service.
    Conntrack,
    /// sessionAffinity ClientIP: which client is sent to which endpoint.
    Affinity,
}

/// The mode installed on this node (in this network namespace): the ebpf mode's pins in
/// `pin_dir`, else the one mode whose rules are here.
pub fn detect(pin_dir: &Path) -> anyhow::Result<Mode> {
    // A non-ebpf agent removes the pins when it starts, and the ebpf agent the others' rules.
    if pin_dir.join(MAP_SERVICES).exists() {
        return Ok(Mode::Ebpf);
    }
    let mut found = Vec::new();
    if crate::nftables::installed() {
        found.push(Mode::Nftables);
    }
    // The IPVS mode writes some of the iptables mode's chains (KUBE-SERVICES...) too.
    if crate::ipvs::installed() {
        found.push(Mode::Ipvs);
    } else if crate::iptables::installed() {
        found.push(Mode::Iptables);
    }
    if crate::userspace::installed() {
        found.push(Mode::Userspace);
    }
    match found.as_slice() {
        [mode] => Ok(*mode),
        [] => {
            // SAFETY: geteuid has no preconditions.
            let root = unsafe { libc::geteuid() } == 0;
            bail!(
                "no proxy mode is installed on this node (in this network namespace): no pinned \
                 maps in {} (ebpf), no `table ip kube-proxy` (nftables), no kube-proxy iptables \
                 chains (iptables, userspace), no IPVS virtual servers (ipvs). Is the agent \
                 running here? Pass --bpf-pin-dir if it pins its maps elsewhere, or --proxy-mode \
                 to read one mode's state{}",
                pin_dir.display(),
                if root {
                    ""
                } else {
                    " (reading the rules needs root)"
                }
            )
        }
        several => {
            let names: Vec<&str> = several.iter().map(|m| m.name()).collect();
            bail!(
                "the state of several proxy modes is on this node ({}): pass --proxy-mode to \
                 choose one (an agent starting in one mode removes the others'; `agent \
                 --cleanup` removes all)",
                names.join(", ")
            )
        }
    }
}

/// `what` of `mode`'s state, as a table or as JSON.
pub fn show(mode: Mode, what: What, pin_dir: &Path, json: bool) -> anyhow::Result<String> {
    fn out<T: Serialize + ?Sized>(
        rows: &T,
        json: bool,
        table: impl FnOnce(&T) -> String,
    ) -> anyhow::Result<String> {
        match json {
            true => Ok(serde_json::to_string_pretty(rows)?),
            false => Ok(table(rows)),
        }
    }
    // The iptables rules of the iptables and userspace modes.
    let iptables_rules = || -> anyhow::Result<String> {
        match mode {
            Mode::Iptables => iptables_save(crate::iptables::Backend::detect()?),
            _ => iptables_save(crate::userspace::detect_backend()?),
        }
    };
    // The frontends in the mode's own state.
    let frontends = || -> anyhow::Result<Vec<ServiceRow>> {
        match mode {
            Mode::Nftables => nftables::services(&nft_list()?),
            Mode::Ipvs => Ok(ipvs::services(&ipvs::read()?, &ipset_save()?)),
            Mode::Iptables => Ok(iptables::services(&iptables_rules()?)),
            _ => Ok(userspace::services(&iptables_rules()?)),
        }
    };
    match (mode, what) {
        (Mode::Ebpf, What::Services) => out(&services(pin_dir)?, json, |r| services_table(r)),
        (Mode::Ebpf, What::Backends) => out(&backends(pin_dir)?, json, |r| backends_table(r)),
        (Mode::Ebpf, What::Conntrack) => out(&conntrack(pin_dir)?, json, |r| conntrack_table(r)),
        (Mode::Ebpf, What::Affinity) => out(&affinity(pin_dir)?, json, |r| affinity_table(r)),
        (_, What::Services) => out(&frontends()?, json, |r| services_table_of(r, false)),
        (_, What::Conntrack) => {
            let flows = conntrack::flows(&conntrack_list()?, &frontends()?);
            out(&flows, json, |r| flows_table(r))
        }
        (Mode::Ipvs, What::Backends) => {
            out(&ipvs::backends(&frontends()?), json, |r| endpoints_table(r))
        }
        (Mode::Ipvs, What::Affinity) => {
            let path = "/proc/net/ip_vs_conn";
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
            out(&ipvs::affinity(&text), json, |r| client_affinity_table(r))
        }
        (Mode::Userspace, What::Backends | What::Affinity) => bail!(
            "`inspect {}` is not available in userspace mode: the endpoints and the ClientIP \
             affinity live in the agent's memory (each Service port's proxy). `inspect \
             services` shows each frontend's proxy port",
            match what {
                What::Backends => "backends",
                _ => "affinity",
            }
        ),
        (Mode::Nftables, What::Backends) => out(&nftables::backends(&nft_list()?)?, json, |r| {
            endpoints_table(r)
        }),
        (_, What::Backends) => {
            let rows = iptables::backends(&iptables_rules()?);
            out(&rows, json, |r| endpoints_table(r))
        }
        (Mode::Nftables, What::Affinity) => {
            let rows = nftables::affinity(&nft_list()?)?;
            out(&rows, json, |r| client_affinity_table(r))
        }
        (_, What::Affinity) => {
            let rows = iptables::affinity(&iptables_rules()?, &recent_lists()?);
            out(&rows, json, |r| client_affinity_table(r))
        }
    }
}

/// Runs `program args`: its output, or an error with what it printed.
fn run(program: &str, args: &[&str], package: &str) -> anyhow::Result<String> {
    let output = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("running {program} (the {package} package)"))?;
    if !output.status.success() {
        bail!(
            "{program} {} failed ({}): {}{}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim(),
            // SAFETY: geteuid has no preconditions.
            match unsafe { libc::geteuid() } {
                0 => "",
                _ => " (it needs root)",
            }
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The nftables mode's table, as nft lists it in JSON.
fn nft_list() -> anyhow::Result<String> {
    let (family, table) = crate::nftables::rules::TABLE
        .split_once(' ')
        .expect("family and name");
    run("nft", &["-j", "list", "table", family, table], "nftables")
}

/// The nat and filter tables of `backend`, as iptables-save prints them.
fn iptables_save(backend: crate::iptables::Backend) -> anyhow::Result<String> {
    let save = backend.tool("iptables-save");
    let mut text = run(&save, &["-t", "nat"], "iptables")?;
    text.push_str(&run(&save, &["-t", "filter"], "iptables")?);
    Ok(text)
}

/// kube-proxy's ipsets (the IPVS mode's), as `ipset save` prints them.
fn ipset_save() -> anyhow::Result<String> {
    run("ipset", &["save"], "ipset")
}

/// The kernel's conntrack table.
fn conntrack_list() -> anyhow::Result<String> {
    run("conntrack", &["-L", "-o", "extended"], "conntrack")
}

/// The `recent` match's lists (iptables session affinity): name and text. None loaded: none.
fn recent_lists() -> anyhow::Result<Vec<(String, String)>> {
    let dir = Path::new("/proc/self/net/xt_recent");
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    let mut lists = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(entry.path())
            .with_context(|| format!("reading {}", entry.path().display()))?;
        lists.push((name, text));
    }
    Ok(lists)
}

/// A flow the kernel's conntrack table holds (the nftables, iptables and userspace modes).
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct ConntrackRow {
    /// Always `forward`: the kernel's entry holds both directions.
    pub direction: &'static str,
    pub protocol: &'static str,
    pub source: String,
    /// The frontend the client sent the flow to.
    pub destination: String,
    /// The service address it matched (`*:port` for a NodePort).
    pub service: String,
    /// A flow to a NodePort, load balancer or external IP.
    pub external: bool,
    /// Where the flow was sent: the endpoint (in the userspace mode, the proxy port).
    pub translated: String,
    /// Packets from the client; None unless the kernel counts them
    /// (`net.netfilter.nf_conntrack_acct`).
    pub packets: Option<u64>,
    /// TCP's state; for UDP, `replied` or `unreplied`.
    pub state: String,
    /// The seconds the kernel keeps the entry without traffic.
    pub expires_seconds: u64,
}

/// A client's affinity to an endpoint, as the kernel remembers it (nftables, iptables modes).
#[derive(Debug, Serialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct ClientAffinityRow {
    pub client: String,
    /// The Service port, as kube-proxy names it (`namespace/name:port`).
    pub service: String,
    pub protocol: &'static str,
    pub endpoint: String,
    /// The seconds until it is forgotten; None where the kernel does not say (iptables).
    pub expires_seconds: Option<u64>,
}

fn flows_table(rows: &[ConntrackRow]) -> String {
    let mut out = format!(
        "{:<8} {:<5} {:<22} {:<22} {:<22} {:<22} {:>8} {:>10} STATE\n",
        "DIR", "PROTO", "SOURCE", "DESTINATION", "SERVICE", "TRANSLATED", "PACKETS", "EXPIRES(s)"
    );
    for r in rows {
        let packets = r.packets.map_or("-".to_owned(), |p| p.to_string());
        let _ = writeln!(
            out,
            "{:<8} {:<5} {:<22} {:<22} {:<22} {:<22} {:>8} {:>10} {}{}",
            r.direction,
            r.protocol,
            r.source,
            r.destination,
            r.service,
            r.translated,
            packets,
            r.expires_seconds,
            r.state,
            if r.external { " (external)" } else { "" }
        );
    }
    out
}

/// The endpoints of the modes without backend ids or draining.
fn endpoints_table(rows: &[BackendRow]) -> String {
    let mut out = format!("{:<24} PROTO\n", "ADDRESS");
    for r in rows {
        let _ = writeln!(out, "{:<24} {}", r.address, r.protocol);
    }
    out
}

fn client_affinity_table(rows: &[ClientAffinityRow]) -> String {
    let mut out = format!(
        "{:<16} {:<32} {:<5} {:<22} {:>10}\n",
        "CLIENT", "SERVICE", "PROTO", "ENDPOINT", "EXPIRES(s)"
    );
    for r in rows {
        let expires = r.expires_seconds.map_or("-".to_owned(), |s| s.to_string());
        let _ = writeln!(
            out,
            "{:<16} {:<32} {:<5} {:<22} {:>10}",
            r.client, r.service, r.protocol, r.endpoint, expires
        );
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use std::io::Write as _;

    use super::*;

    /// Whether tests that write rules into the kernel can run here (root, `tool`). Otherwise
    /// prints a loud `SKIPPED <test>: <reason>` line and returns false (or panics when
    /// `SANDBOX_NO_SKIP=1`), as the modes' own kernel tests do.
    pub(crate) fn privileged(test: &str, tool: &str) -> bool {
        // SAFETY: geteuid has no preconditions.
        let reason = if unsafe { libc::geteuid() } != 0 {
            "not running as root".to_owned()
        } else {
            match Command::new(tool).arg("--version").output() {
                Ok(o) if o.status.success() => return true,
                Ok(o) => format!(
                    "{tool} --version failed: {}",
                    String::from_utf8_lossy(&o.stderr)
                ),
                Err(e) => format!("{tool} unavailable: {e}"),
            }
        };
        if std::env::var("SANDBOX_NO_SKIP").is_ok_and(|v| v == "1") {
            panic!("{test} cannot run: {reason} (SANDBOX_NO_SKIP=1)");
        }
        // Straight to fd 2: `eprintln!` would be captured by the test harness.
        let _ = writeln!(std::io::stderr(), "\nSKIPPED {test}: {reason}\n");
        false
    }

    /// Runs `f` on a thread in a network namespace of its own (its commands run there too).
    pub(crate) fn in_new_netns(
        f: impl FnOnce() -> anyhow::Result<String> + Send + 'static,
    ) -> String {
        std::thread::spawn(move || {
            // SAFETY: unshare has no memory preconditions; it changes this thread only.
            assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
            f()
        })
        .join()
        .unwrap()
        .unwrap()
    }

    #[test]
    fn tables_of_the_other_modes() {
        let mut web = iptables::row("10.96.0.10:80".into(), "TCP", "ClusterIP");
        web.backends = vec![
            iptables::backend("10.244.1.11:8080".into(), "TCP"),
            iptables::backend("10.244.1.12:8080".into(), "TCP"),
        ];
        web.affinity_timeout_seconds = Some(10800);
        let mut none = iptables::row("*:30082".into(), "TCP", "NodePort");
        none.local_only = true;
        assert_eq!(
            services_table_of(&[web, none], false),
            "SERVICE                  PROTO KIND         BACKENDS\n\
             10.96.0.10:80            TCP   ClusterIP    10.244.1.11:8080, 10.244.1.12:8080 [affinity 10800s]\n\
             *:30082                  TCP   NodePort     (none) [external traffic local]\n"
        );
    }
}

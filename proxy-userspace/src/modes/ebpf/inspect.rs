//! The ebpf mode's reader: its pinned maps, both families', read back into rows.
use std::{collections::HashMap, net::SocketAddr, path::Path};

use anyhow::Context;
use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData, lpm_trie::LpmTrie};
use proxy_common::{
    Addr, AffinityKey, AffinityValue, BACKEND_DRAINING, Backend, Be32, Be128, CT_CLOSING,
    CT_EXTERNAL, CT_FORWARD, CT_HALF_CLOSED, CT_NETFILTER, CT_OPENING, CT_REPLY, CT_SNAT,
    CT_STATES, CtKey, CtValue, IPPROTO_TCP, MAP_CT_LIFETIMES, SCOPE_INTERNAL, SERVICE_AFFINITY,
    SERVICE_DRAINING, SERVICE_EXTERNAL, SERVICE_LOAD_BALANCER, SERVICE_LOCAL_ONLY, SERVICE_MAGLEV,
    ServiceKey, ServiceValue, SourceRangeKey, ct_lifetime_ns,
};

use super::writer::FamilyMaps;
use crate::{
    model::Protocol,
    rows::{AffinityRow, BackendRow, FlowRow, Rows, ServiceRow, What},
};

/// A protocol number as the rows spell it.
fn proto_name(proto: u8) -> &'static str {
    Protocol::from_number(proto).map_or("?", Protocol::name)
}

/// An address and port as the rows spell them (`[addr]:port` for IPv6).
fn socket<A: Addr>(addr: A, port: proxy_common::Be16) -> String {
    SocketAddr::new(addr.ip(), port.get()).to_string()
}

/// The rows of both families' maps, IPv4's first, each family's sorted.
fn both<T>(
    pin_dir: &Path,
    v4: fn(&Path) -> anyhow::Result<Vec<T>>,
    v6: fn(&Path) -> anyhow::Result<Vec<T>>,
) -> anyhow::Result<Vec<T>> {
    let mut rows = v4(pin_dir)?;
    // Agents before IPv6 had no IPv6 maps: nothing of that family to show.
    if pin_dir.join(Be128::SERVICES).exists() {
        rows.extend(v6(pin_dir)?);
    }
    Ok(rows)
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

/// Both families' backends (each family's ids are its own).
pub fn backends(pin_dir: &Path) -> anyhow::Result<Vec<BackendRow>> {
    both(pin_dir, backends_of::<Be32>, backends_of::<Be128>)
}

fn backends_of<A: FamilyMaps>(pin_dir: &Path) -> anyhow::Result<Vec<BackendRow>> {
    let map: BpfHashMap<_, u32, Backend<A>> =
        Map::HashMap(open(pin_dir, A::BACKENDS)?).try_into()?;
    let mut rows = Vec::new();
    for entry in map.iter() {
        let (id, b) = entry?;
        rows.push(backend_row(id, &b));
    }
    rows.sort();
    Ok(rows)
}

/// The source ranges of each frontend, as CIDRs.
fn source_ranges<A: FamilyMaps>(
    pin_dir: &Path,
) -> anyhow::Result<HashMap<ServiceKey<A>, Vec<String>>> {
    let mut out: HashMap<ServiceKey<A>, Vec<String>> = Default::default();
    // Agents before layout 4 had no such map: nothing to show.
    let Ok(data) = MapData::from_pin(pin_dir.join(A::SOURCE_RANGES)) else {
        return Ok(out);
    };
    let trie: LpmTrie<_, SourceRangeKey<A>, u8> = Map::LpmTrie(data).try_into()?;
    for key in trie.keys() {
        let key = key?;
        let d = key.data();
        let len = key
            .prefix_len()
            .saturating_sub(SourceRangeKey::<A>::FRONTEND_BITS);
        out.entry(ServiceKey::new(d.addr, d.port, d.proto, 0))
            .or_default()
            .push(format!("{}/{len}", d.source.ip()));
    }
    for ranges in out.values_mut() {
        ranges.sort();
    }
    Ok(out)
}

fn backend_row<A: Addr>(id: u32, b: &Backend<A>) -> BackendRow {
    BackendRow {
        id,
        address: socket(b.addr, b.port),
        protocol: proto_name(b.proto),
        draining: b.flags & BACKEND_DRAINING != 0,
    }
}

/// Both families' frontends.
pub fn services(pin_dir: &Path) -> anyhow::Result<Vec<ServiceRow>> {
    both(pin_dir, services_of::<Be32>, services_of::<Be128>)
}

fn services_of<A: FamilyMaps>(pin_dir: &Path) -> anyhow::Result<Vec<ServiceRow>> {
    let svc: BpfHashMap<_, ServiceKey<A>, ServiceValue> =
        Map::HashMap(open(pin_dir, A::SERVICES)?).try_into()?;
    let be: BpfHashMap<_, u32, Backend<A>> =
        Map::HashMap(open(pin_dir, A::BACKENDS)?).try_into()?;
    let ranges = source_ranges::<A>(pin_dir)?;
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
        let kind = if key.addr == A::NODE_PORT {
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
            address: match key.addr == A::NODE_PORT {
                true => format!("*:{}", key.port.get()),
                false => socket(key.addr, key.port),
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

/// Both families' flows.
pub fn conntrack(pin_dir: &Path) -> anyhow::Result<Vec<FlowRow>> {
    both(pin_dir, conntrack_of::<Be32>, conntrack_of::<Be128>)
}

fn conntrack_of<A: FamilyMaps>(pin_dir: &Path) -> anyhow::Result<Vec<FlowRow>> {
    let ct: BpfHashMap<_, CtKey<A>, CtValue<A>> =
        Map::LruHashMap(open(pin_dir, A::CONNTRACK)?).try_into()?;
    let lifetimes = configured_lifetimes(pin_dir);
    let now = monotonic_ns();
    let entries: HashMap<CtKey<A>, CtValue<A>> = ct.iter().collect::<Result<_, _>>()?;
    let mut rows = Vec::new();
    for (k, v) in &entries {
        // The programs keep a flow's time in its forward entry (they refresh the reply entry
        // only now and then): a reply entry is as idle as its flow.
        let last_seen = match v.direction {
            CT_REPLY => entries
                .get(&forward_key(k, v))
                .filter(|f| f.direction == CT_FORWARD && f.backend_id == v.backend_id)
                .map_or(v.last_seen_ns, |f| f.last_seen_ns.max(v.last_seen_ns)),
            _ => v.last_seen_ns,
        };
        let v = CtValue {
            last_seen_ns: last_seen,
            ..*v
        };
        rows.push(FlowRow {
            direction: match v.direction {
                CT_FORWARD => "forward",
                CT_NETFILTER => "netfilter",
                _ => "reply",
            },
            protocol: proto_name(k.proto),
            source: socket(k.saddr, k.sport),
            destination: socket(k.daddr, k.dport),
            service: socket(v.vip, v.vport),
            backend_id: v.backend_id,
            external: v.flags & CT_EXTERNAL != 0,
            translated: (v.flags & CT_SNAT != 0 || v.direction == CT_NETFILTER)
                .then(|| socket(v.nat_addr, v.nat_port)),
            packets: u64::from(v.packets),
            idle_seconds: now.saturating_sub(v.last_seen_ns) as f64 / 1e9,
            closing: v.flags & CT_CLOSING != 0,
            state: flow_state(k, &v, now, &lifetimes),
            expired: expired(k, &v, now, &lifetimes),
        });
    }
    rows.sort_by(|a, b| {
        (&a.service, &a.source, a.direction).cmp(&(&b.service, &b.source, b.direction))
    });
    Ok(rows)
}

/// The lifetimes the agent configured ([`MAP_CT_LIFETIMES`] by state; all 0, the programs'
/// defaults, where an older agent left no such map).
fn configured_lifetimes(pin_dir: &Path) -> [u64; CT_STATES as usize] {
    let mut lifetimes = [0; CT_STATES as usize];
    if let Ok(data) = MapData::from_pin(pin_dir.join(MAP_CT_LIFETIMES))
        && let Ok(map) = Array::<_, u64>::try_from(Map::Array(data))
    {
        for (state, lifetime) in (0..).zip(&mut lifetimes) {
            *lifetime = map.get(&state, 0).unwrap_or(0);
        }
    }
    lifetimes
}

/// Whether the entry `k`, `v` has been idle past its state's lifetime, as the programs judge it.
fn expired<A>(
    k: &CtKey<A>,
    v: &CtValue<A>,
    now: u64,
    lifetimes: &[u64; CT_STATES as usize],
) -> bool {
    let state = v.state(k.proto);
    v.idle_past(now, ct_lifetime_ns(state, lifetimes[state as usize]))
}

/// Where the flow of the entry `k`, `v` stands (see [`FlowRow::state`]).
fn flow_state<A>(
    k: &CtKey<A>,
    v: &CtValue<A>,
    now: u64,
    lifetimes: &[u64; CT_STATES as usize],
) -> &'static str {
    let tcp = k.proto == IPPROTO_TCP;
    if expired(k, v, now, lifetimes) {
        "expired"
    } else if v.flags & CT_CLOSING != 0 {
        "closing"
    } else if tcp && v.flags & CT_OPENING != 0 {
        "opening"
    } else if tcp && v.flags & CT_HALF_CLOSED != 0 {
        "half-closed"
    } else {
        "open"
    }
}

/// The forward entry's key of the flow whose reply entry is `k`, `v`: from the client (for an
/// external flow, the one the entry names; for a pod reaching itself, the pod) to the service
/// address.
fn forward_key<A: Addr>(k: &CtKey<A>, v: &CtValue<A>) -> CtKey<A> {
    let (client, client_port) = if v.flags & CT_EXTERNAL != 0 {
        (v.nat_addr, v.nat_port)
    } else if k.daddr == A::HAIRPIN {
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

/// Both families' affinity entries.
pub fn affinity(pin_dir: &Path) -> anyhow::Result<Vec<AffinityRow>> {
    both(pin_dir, affinity_of::<Be32>, affinity_of::<Be128>)
}

fn affinity_of<A: FamilyMaps>(pin_dir: &Path) -> anyhow::Result<Vec<AffinityRow>> {
    let map: BpfHashMap<_, AffinityKey<A>, AffinityValue> =
        Map::LruHashMap(open(pin_dir, A::AFFINITY)?).try_into()?;
    let now = monotonic_ns();
    let mut rows = Vec::new();
    for entry in map.iter() {
        let (k, v) = entry?;
        rows.push(AffinityRow {
            // The socket programs record host-network clients as the unspecified address.
            client: match k.client == A::default() {
                true => "this node".to_owned(),
                false => k.client.ip().to_string(),
            },
            service: socket(k.vip, k.vport),
            protocol: proto_name(k.proto),
            backend_id: v.backend_id,
            idle_seconds: now.saturating_sub(v.last_used_ns) as f64 / 1e9,
        });
    }
    rows.sort_by(|a, b| (&a.service, &a.client).cmp(&(&b.service, &b.client)));
    Ok(rows)
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

/// `what` of the maps pinned in `pin_dir`.
/// The SCTP Service ports, which netfilter translates, are listed from their nftables tables
/// beside the maps' frontends and backends (without ids).
pub fn read(what: What, pin_dir: &Path) -> anyhow::Result<Rows> {
    let sctp = super::sctp::read;
    Ok(match what {
        What::Services => {
            let mut rows = services(pin_dir)?;
            if let Some(Rows::Services { rows: more, .. }) = sctp(what)? {
                rows.extend(more);
            }
            Rows::Services { rows, ids: true }
        }
        What::Backends => {
            let mut rows = backends(pin_dir)?;
            if let Some(Rows::Backends { rows: more, .. }) = sctp(what)? {
                rows.extend(more);
            }
            Rows::Backends { rows, ids: true }
        }
        What::Conntrack => Rows::Flows(conntrack(pin_dir)?),
        What::Affinity => Rows::Affinity(affinity(pin_dir)?),
    })
}

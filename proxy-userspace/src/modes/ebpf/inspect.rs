//! The ebpf mode's reader: its pinned maps, read back into rows.
use std::{net::Ipv4Addr, path::Path};

use anyhow::Context;
use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData, lpm_trie::LpmTrie};
use proxy_common::{
    AffinityKey, AffinityValue, BACKEND_DRAINING, Backend, Be32, CT_CLOSING, CT_EXTERNAL,
    CT_FORWARD, CT_HALF_CLOSED, CT_NETFILTER, CT_OPENING, CT_REPLY, CT_SNAT, CT_STATES, CtKey,
    CtValue, HAIRPIN_ADDR, IPPROTO_TCP, MAP_AFFINITY, MAP_BACKENDS, MAP_CONNTRACK,
    MAP_CT_LIFETIMES, MAP_SERVICES, MAP_SOURCE_RANGES, NODE_PORT_ADDR, SCOPE_INTERNAL,
    SERVICE_AFFINITY, SERVICE_DRAINING, SERVICE_EXTERNAL, SERVICE_LOAD_BALANCER,
    SERVICE_LOCAL_ONLY, SERVICE_MAGLEV, ServiceKey, ServiceValue, SourceRangeKey, ct_lifetime_ns,
};

use crate::{
    model::Protocol,
    rows::{AffinityRow, BackendRow, FlowRow, Rows, ServiceRow, What},
};

/// A protocol number as the rows spell it.
fn proto_name(proto: u8) -> &'static str {
    Protocol::from_number(proto).map_or("?", Protocol::name)
}

fn ip(addr: Be32) -> Ipv4Addr {
    Ipv4Addr::from(addr.octets())
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
        let len = key
            .prefix_len()
            .saturating_sub(<SourceRangeKey>::FRONTEND_BITS);
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
    let lifetimes = configured_lifetimes(pin_dir);
    let now = monotonic_ns();
    let entries: std::collections::HashMap<CtKey, CtValue> = ct.iter().collect::<Result<_, _>>()?;
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
            source: format!("{}:{}", ip(k.saddr), k.sport.get()),
            destination: format!("{}:{}", ip(k.daddr), k.dport.get()),
            service: format!("{}:{}", ip(v.vip), v.vport.get()),
            backend_id: v.backend_id,
            external: v.flags & CT_EXTERNAL != 0,
            translated: (v.flags & CT_SNAT != 0 || v.direction == CT_NETFILTER)
                .then(|| format!("{}:{}", ip(v.nat_addr), v.nat_port.get())),
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
fn expired(k: &CtKey, v: &CtValue, now: u64, lifetimes: &[u64; CT_STATES as usize]) -> bool {
    let state = v.state(k.proto);
    v.idle_past(now, ct_lifetime_ns(state, lifetimes[state as usize]))
}

/// Where the flow of the entry `k`, `v` stands (see [`FlowRow::state`]).
fn flow_state(
    k: &CtKey,
    v: &CtValue,
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
/// The SCTP Service ports, which netfilter translates, are listed from their nftables table
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

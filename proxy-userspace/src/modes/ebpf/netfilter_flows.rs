//! Taking over from kube-proxy without breaking a connection. A connection opened through
//! kube-proxy's rules (or this agent's iptables and nftables modes, which write them) is
//! translated by its entry in the kernel's conntrack table, which keeps its NAT binding after
//! the rules are gone. Left to the programs, its next packet would be sent to an endpoint picked
//! anew (most often another one, which answers with a reset), and even on the same endpoint it
//! would clash with that entry. So before the programs take over, each such connection to a
//! frontend gets entries of kind [`CT_NETFILTER`] on both of its 5-tuples: the programs pass its
//! packets untouched, and netfilter keeps it on its endpoint to its end.
//!
//! The NAT binding is applied only while the kernel tracks connections in the namespace and has
//! its NAT hooks registered, and both last only while some rule needs them: once kube-proxy's
//! rules are gone, nothing may (deleting a DNAT rule stops its established connections on
//! 6.18). So the agent holds both with a table of its own ([`NAT_HOOKS_TABLE`]: empty NAT
//! chains, and a rule that reads conntrack in a chain no packet goes through) from before it
//! removes kube-proxy's rules while such connections may live: until a start finds none, or
//! `--cleanup`.
use std::{net::SocketAddrV4, path::Path};

use anyhow::Context;
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use proxy_common::{
    Be16, Be32, CT_NETFILTER, CtKey, CtValue, IPPROTO_TCP, MAP_CONNTRACK, MAP_SERVICES,
    NODE_PORT_ADDR, ServiceKey, ServiceValue,
};

use super::inspect::monotonic_ns;
use crate::netfilter::conntrack::{TranslatedFlow, translated_tcp_flows};

/// bpf(2)'s flag: insert only if the key is not there.
const BPF_NOEXIST: u64 = 1;

/// The nftables table that keeps connection tracking and the NAT hooks on (see the module's
/// comment).
pub const NAT_HOOKS_TABLE: &str = "ip kube-proxy-ebpf-nat-hooks";

/// The table: an empty chain at each NAT hook (nothing new is translated), and a chain no
/// hook calls whose rule reads conntrack (no packet pays for it).
const NAT_HOOKS: &str = "
add table ip kube-proxy-ebpf-nat-hooks
add chain ip kube-proxy-ebpf-nat-hooks prerouting { type nat hook prerouting priority -100; }
add chain ip kube-proxy-ebpf-nat-hooks output { type nat hook output priority -100; }
add chain ip kube-proxy-ebpf-nat-hooks postrouting { type nat hook postrouting priority 100; }
add chain ip kube-proxy-ebpf-nat-hooks input { type nat hook input priority 100; }
add chain ip kube-proxy-ebpf-nat-hooks conntrack
flush chain ip kube-proxy-ebpf-nat-hooks conntrack
add rule ip kube-proxy-ebpf-nat-hooks conntrack ct state established accept
";

/// Before the programs take over and kube-proxy's rules go: whether the kernel translates open
/// TCP connections (to anything: which are frontends' is known later), and if so connection
/// tracking and NAT held on ([`NAT_HOOKS_TABLE`]). Where it translates none, netfilter is left
/// untouched: on 5.10, holding conntrack even for a moment changed the namespace for good
/// (after it, the scenario `spoofed-teardown`'s UDP NodePort datagrams went unanswered; likely
/// the IPv4 defragmentation conntrack turns on, which that kernel never turns off again). A
/// failure is logged: the takeover goes on, and such connections are then left to the programs
/// (they may be reset) rather than to a netfilter that may stop translating them (they would
/// stall).
pub fn hold() -> bool {
    match translated_tcp_flows() {
        Ok(flows) if flows.is_empty() => {
            release();
            return false;
        }
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(
                "cannot read the kernel's conntrack table ({e:#}): connections opened through \
                 kube-proxy's rules may be reset when the programs take over"
            );
            return false;
        }
    }
    match crate::command::pipe("nft", &["-f", "-"], NAT_HOOKS) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(
                "cannot keep connection tracking and NAT on ({e:#}): connections opened \
                 through kube-proxy's rules may be reset when the programs take over"
            );
            false
        }
    }
}

/// Once kube-proxy's rules are gone (no connection through them can start any more), with
/// [`hold`] done: the open connections the kernel translated to a frontend of `pin_dir`'s maps
/// are left to it ([`keep`]); where there are none, the hold is let go. A failure is logged and
/// the hold kept (a connection an earlier takeover left may still need it).
pub fn leave_to_netfilter(pin_dir: &Path) {
    match keep(pin_dir) {
        Ok(0) => release(),
        Ok(connections) => tracing::info!(
            connections,
            "connections opened through kube-proxy's rules stay on their endpoints: netfilter \
             translates them to their end"
        ),
        Err(e) => tracing::warn!(
            "leaving kube-proxy's connections to netfilter failed ({e:#}): the programs may \
             send them to other endpoints"
        ),
    }
}

/// The open TCP connections the kernel translated to a frontend of `pin_dir`'s maps, each left
/// to netfilter by entries of kind [`CT_NETFILTER`]; how many.
fn keep(pin_dir: &Path) -> anyhow::Result<usize> {
    let flows = translated_tcp_flows()?;
    let services: BpfHashMap<_, ServiceKey, ServiceValue> =
        Map::HashMap(MapData::from_pin(pin_dir.join(MAP_SERVICES))?).try_into()?;
    let mut conntrack: BpfHashMap<_, CtKey, CtValue> =
        Map::LruHashMap(MapData::from_pin(pin_dir.join(MAP_CONNTRACK))?).try_into()?;
    let is_frontend = |addr: SocketAddrV4| {
        let port = Be16::new(addr.port());
        [be32(addr), NODE_PORT_ADDR].into_iter().any(|a| {
            services
                .get(&ServiceKey::new(a, port, IPPROTO_TCP, 0), 0)
                .is_ok()
        })
    };
    let now = monotonic_ns();
    let mut kept = 0;
    for flow in flows.iter().filter(|f| is_frontend(f.original.1)) {
        for (key, value) in entries(flow, now) {
            // An entry there already is a flow the programs serve (a restarted agent's).
            match conntrack.insert(key, value, BPF_NOEXIST) {
                Ok(()) => {}
                Err(e) if already_there(&e) => {}
                Err(e) => return Err(e).context("writing a conntrack entry"),
            }
        }
        kept += 1;
    }
    Ok(kept)
}

/// Removes [`NAT_HOOKS_TABLE`] if it is there.
pub fn release() {
    let table = format!("table {NAT_HOOKS_TABLE}");
    let listed = crate::command::run("nft", &["list", "tables", "ip"], "nftables");
    if !listed.is_ok_and(|tables| tables.lines().any(|l| l.trim() == table)) {
        return;
    }
    if let Err(e) = crate::command::pipe("nft", &["-f", "-"], &format!("delete {table}\n")) {
        tracing::warn!("removing the nftables {table}: {e:#}");
    }
}

fn be32(addr: SocketAddrV4) -> Be32 {
    Be32::from_octets(addr.ip().octets())
}

/// The two entries of `flow`: keyed by its packets' 5-tuple each way; the NAT fields name
/// where the flow goes (for `inspect`).
fn entries(flow: &TranslatedFlow, now: u64) -> [(CtKey, CtValue); 2] {
    let key = |(src, dst): (SocketAddrV4, SocketAddrV4)| CtKey {
        saddr: be32(src),
        daddr: be32(dst),
        sport: Be16::new(src.port()),
        dport: Be16::new(dst.port()),
        proto: IPPROTO_TCP,
        pad: [0; 3],
    };
    let value = |nat: SocketAddrV4| CtValue {
        vip: be32(flow.original.1),
        vport: Be16::new(flow.original.1.port()),
        direction: CT_NETFILTER,
        nat_addr: be32(nat),
        nat_port: Be16::new(nat.port()),
        last_seen_ns: now,
        ..CtValue::default()
    };
    [
        (key(flow.original), value(flow.reply.0)),
        (key(flow.reply), value(flow.original.0)),
    ]
}

fn already_there(e: &aya::maps::MapError) -> bool {
    matches!(e, aya::maps::MapError::SyscallError(s) if s.io_error.raw_os_error() == Some(libc::EEXIST))
}

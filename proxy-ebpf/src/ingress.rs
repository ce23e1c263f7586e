//! Packets leaving a pod: a packet to a service address is sent to a backend (DNAT). The first
//! packet of a flow picks a backend at random and records the choice in conntrack; later packets
//! follow that record while it is within its lifetime and its backend exists.
use aya_ebpf::{
    bindings::{BPF_ANY, TC_ACT_OK},
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    programs::TcContext,
};
use proxy_common::{
    Backend, CT_CLOSING, CT_FORWARD, CT_REPLY, CtKey, CtValue, HAIRPIN_ADDR, ServiceKey,
    ServiceValue,
};

use crate::{
    maps::{BACKENDS, CONNTRACK, SERVICES},
    packet::{self, End, Error},
};

#[inline(always)]
pub fn try_ingress(ctx: &TcContext) -> Result<i32, Error> {
    let Some(mut flow) = packet::parse(ctx) else {
        return Ok(TC_ACT_OK);
    };
    let key = flow.key;
    if key.daddr == HAIRPIN_ADDR {
        return hairpin_reply(ctx, &mut flow);
    }
    let svc_key = ServiceKey::new(key.daddr, key.dport, key.proto, 0);
    // SAFETY: services values are plain data; the agent replaces them whole.
    let Some(svc) = (unsafe { SERVICES.get(svc_key) }).copied() else {
        return Ok(TC_ACT_OK); // not a service: untouched
    };
    let now = unsafe { bpf_ktime_get_ns() };
    let backend = match established(&key, flow.closing, now) {
        Some(backend) => backend,
        None => {
            // A service without endpoints passes untouched for now (kube-proxy rejects such
            // packets with ICMP; that comes with the reject issue).
            let Some((backend_id, backend)) = select_backend(&svc_key, &svc) else {
                return Ok(TC_ACT_OK);
            };
            record_flow(&key, backend_id, &backend, now);
            backend
        }
    };
    flow.rewrite(ctx, End::Destination, backend.addr, backend.port)?;
    if backend.addr != key.saddr {
        return Ok(TC_ACT_OK);
    }
    // The pod reaches itself: without a foreign source its reply would never leave it.
    flow.rewrite(ctx, End::Source, HAIRPIN_ADDR, key.sport)?;
    packet::bounce(ctx)
}

/// A pod's reply to a hairpin flow (backend -> [`HAIRPIN_ADDR`]): back to the same pod, from
/// the service address.
#[inline(always)]
fn hairpin_reply(ctx: &TcContext, flow: &mut packet::Flow) -> Result<i32, Error> {
    let Some(entry) = CONNTRACK.get_ptr_mut(flow.key) else {
        return Ok(TC_ACT_OK);
    };
    // SAFETY: see established().
    let entry = unsafe { &mut *entry };
    let now = unsafe { bpf_ktime_get_ns() };
    if entry.direction != CT_REPLY || entry.expired(flow.key.proto, now) {
        return Ok(TC_ACT_OK);
    }
    entry.last_seen_ns = now;
    entry.packets += 1;
    let (vip, vport, pod, pod_port) = (entry.vip, entry.vport, flow.key.saddr, flow.key.dport);
    if flow.closing {
        entry.flags |= CT_CLOSING;
        let forward = CtKey {
            saddr: pod,
            daddr: vip,
            sport: pod_port,
            dport: vport,
            proto: flow.key.proto,
            pad: [0; 3],
        };
        if let Some(forward) = CONNTRACK.get_ptr_mut(forward) {
            unsafe { (*forward).flags |= CT_CLOSING };
        }
    }
    flow.rewrite(ctx, End::Destination, pod, pod_port)?;
    flow.rewrite(ctx, End::Source, vip, vport)?;
    packet::bounce(ctx)
}

/// The backend of a flow already in conntrack, if the entry is within its lifetime and its
/// backend still exists (for this protocol). Re-creates the reply entry if the LRU evicted it
/// alone, so replies keep their reverse NAT.
#[inline(always)]
fn established(key: &CtKey, closing: bool, now: u64) -> Option<Backend> {
    let entry = CONNTRACK.get_ptr_mut(key)?;
    // SAFETY: an LRU map value; a concurrent eviction can at worst make us read a recycled
    // entry, which the direction and backend checks below reject or the backend lookup corrects.
    let entry = unsafe { &mut *entry };
    if entry.direction != CT_FORWARD || entry.expired(key.proto, now) {
        return None;
    }
    let backend = unsafe { BACKENDS.get(entry.backend_id) }.copied()?;
    if backend.proto != key.proto {
        return None;
    }
    entry.last_seen_ns = now;
    entry.packets += 1;
    if closing {
        entry.flags |= CT_CLOSING;
    }
    let reply_key = reply_key(key, &backend);
    match CONNTRACK.get_ptr_mut(reply_key) {
        Some(reply) if closing => unsafe { (*reply).flags |= CT_CLOSING },
        Some(_) => {}
        None => {
            let mut reply = *entry;
            reply.direction = CT_REPLY;
            reply.packets = 0;
            let _ = CONNTRACK.insert(reply_key, reply, BPF_ANY as u64);
        }
    }
    Some(backend)
}

/// Where the backend's replies to the flow `key` come from and go to (for a hairpin flow, to
/// [`HAIRPIN_ADDR`]: the source its packets were given).
#[inline(always)]
fn reply_key(key: &CtKey, backend: &Backend) -> CtKey {
    let hairpin = backend.addr == key.saddr;
    CtKey {
        saddr: backend.addr,
        daddr: if hairpin { HAIRPIN_ADDR } else { key.saddr },
        sport: backend.port,
        dport: key.sport,
        proto: key.proto,
        pad: [0; 3],
    }
}

#[inline(always)]
fn select_backend(svc_key: &ServiceKey, svc: &ServiceValue) -> Option<(u32, Backend)> {
    if svc.count == 0 {
        return None;
    }
    let slot = (unsafe { bpf_get_prandom_u32() } % svc.count as u32) as u16 + 1;
    let slot_key = ServiceKey::new(svc_key.addr, svc_key.port, svc_key.proto, slot);
    let backend_id = unsafe { SERVICES.get(slot_key) }?.backend_id;
    let backend = unsafe { BACKENDS.get(backend_id) }.copied()?;
    Some((backend_id, backend))
}

/// Records both directions of a new flow: the reply entry first, so that no reply can arrive
/// before the record that reverse-NATs it.
#[inline(always)]
fn record_flow(key: &CtKey, backend_id: u32, backend: &Backend, now: u64) {
    let reply_key = reply_key(key, backend);
    let mut value = CtValue {
        backend_id,
        vip: key.daddr,
        vport: key.dport,
        direction: CT_REPLY,
        flags: 0,
        pad: [0; 4],
        last_seen_ns: now,
        packets: 0,
    };
    // LRU inserts make room by evicting the least recently used flow; a failure here (memory
    // pressure) only means the next packet of this flow picks a backend again.
    let _ = CONNTRACK.insert(reply_key, value, BPF_ANY as u64);
    value.direction = CT_FORWARD;
    value.packets = 1;
    let _ = CONNTRACK.insert(key, value, BPF_ANY as u64);
}

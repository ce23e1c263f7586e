//! Conntrack: two entries a flow, each keyed by the 5-tuple its direction's packets carry.
//! The forward entry (client -> service address) names the backend; the reply entry (backend ->
//! client, or backend -> [`HAIRPIN_ADDR`] for a pod reaching itself) names the service address
//! the replies must come from. A reply entry is used only while its forward entry is live and
//! names the same backend: the forward entry is the flow.
use aya_ebpf::{bindings::BPF_ANY, helpers::bpf_ktime_get_ns};
use proxy_common::{
    BACKEND_DRAINING, Backend, Be16, Be32, CT_CLOSING, CT_FIN, CT_FORWARD, CT_REPLY, CtKey,
    CtValue, HAIRPIN_ADDR, IPPROTO_TCP,
};

use crate::{
    maps::{BACKENDS, CONNTRACK},
    packet::Flow,
};

/// The backend of a flow already in conntrack, if the flow is within its lifetime and its
/// backend may keep it: the backend exists (for this protocol) and is either still in the
/// service or draining with an established TCP connection. A SYN and any UDP packet leave a
/// draining backend (kube-proxy's behaviour: only TCP connections outlive their endpoint's
/// removal). Re-creates the reply entry if the LRU evicted it alone (or something else took
/// its 5-tuple), so replies keep their reverse NAT.
#[inline(always)]
pub fn established(flow: &Flow, now: u64) -> Option<Backend> {
    let key = &flow.key;
    let entry = CONNTRACK.get_ptr_mut(key)?;
    // SAFETY: an LRU map value; a concurrent eviction can at worst make us read a recycled
    // entry, which the direction and backend checks below reject or the backend lookup corrects.
    let entry = unsafe { &mut *entry };
    if entry.direction != CT_FORWARD || entry.expired(key.proto, now) {
        return None;
    }
    // A new connection on the 5-tuple of one that just closed is a new flow.
    if flow.syn_only() && entry.flags & CT_CLOSING != 0 {
        return None;
    }
    let backend = unsafe { BACKENDS.get(entry.backend_id) }.copied()?;
    if backend.proto != key.proto {
        return None;
    }
    if backend.flags & BACKEND_DRAINING != 0 && (key.proto != IPPROTO_TCP || flow.syn_only()) {
        return None;
    }
    let reply_key = reply_key(key, &backend);
    let reply = CONNTRACK
        .get_ptr_mut(reply_key)
        .map(|r| unsafe { &mut *r })
        .filter(|r| r.direction == CT_REPLY && r.backend_id == entry.backend_id);
    match reply {
        Some(reply) => touch(entry, Some(reply), flow, now),
        None => {
            touch(entry, None, flow, now);
            let mut reply = *entry;
            reply.direction = CT_REPLY;
            reply.flags &= CT_CLOSING;
            reply.packets = 0;
            let _ = CONNTRACK.insert(reply_key, reply, BPF_ANY as u64);
        }
    }
    Some(backend)
}

/// A packet of the flow went in the direction of `this`: both entries are refreshed (a flow has
/// one lifetime, whichever side speaks), and TCP teardown is followed: a RST, or a FIN from each
/// side, closes the flow. A closed flow is not refreshed any more: it ends
/// [`proxy_common::CT_LIFETIME_CLOSING_NS`] after it closed, whatever either side still sends.
#[inline(always)]
fn touch(this: &mut CtValue, other: Option<&mut CtValue>, flow: &Flow, now: u64) {
    this.packets += 1;
    if this.flags & CT_CLOSING != 0 {
        return;
    }
    this.last_seen_ns = now;
    if flow.fin() {
        this.flags |= CT_FIN;
    }
    let mut closed = flow.rst();
    if let Some(other) = other {
        other.last_seen_ns = now;
        closed |= this.flags & other.flags & CT_FIN != 0;
        if closed {
            other.flags |= CT_CLOSING;
        }
    }
    if closed {
        this.flags |= CT_CLOSING;
    }
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

/// Records both directions of a new flow: the reply entry first, so that no reply can arrive
/// before the record that reverse-NATs it.
#[inline(always)]
pub fn record_flow(key: &CtKey, backend_id: u32, backend: &Backend, now: u64) {
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

/// The reply entry of `flow` (a backend's packet to `client`) if its flow is live, touched along
/// with the flow's forward entry: the service address the packet must appear to come from. A
/// reply entry whose flow ended (expired, evicted, or now sent elsewhere) is deleted: later
/// traffic on its 5-tuple (the client talking to the backend directly, say) is not a reply to
/// the service.
#[inline(always)]
pub fn reply(flow: &Flow, client: Be32) -> Option<(Be32, Be16)> {
    let entry = CONNTRACK.get_ptr_mut(flow.key)?;
    // SAFETY: see established().
    let entry = unsafe { &mut *entry };
    if entry.direction != CT_REPLY {
        return None;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    let (vip, vport) = (entry.vip, entry.vport);
    let forward_key = CtKey {
        saddr: client,
        daddr: vip,
        sport: flow.key.dport,
        dport: vport,
        proto: flow.key.proto,
        pad: [0; 3],
    };
    let forward = CONNTRACK
        .get_ptr_mut(forward_key)
        .map(|f| unsafe { &mut *f })
        .filter(|f| {
            f.direction == CT_FORWARD
                && f.backend_id == entry.backend_id
                && !f.expired(flow.key.proto, now)
        });
    let Some(forward) = forward else {
        let _ = CONNTRACK.remove(flow.key);
        return None;
    };
    touch(entry, Some(forward), flow, now);
    Some((vip, vport))
}

/// A new connection from a pod straight to `key.daddr` (no service): a reply entry left on
/// its reverse 5-tuple by an earlier flow through a service must not rewrite its replies.
#[inline(always)]
pub fn forget_reply(key: &CtKey) {
    let reverse = CtKey {
        saddr: key.daddr,
        daddr: key.saddr,
        sport: key.dport,
        dport: key.sport,
        proto: key.proto,
        pad: [0; 3],
    };
    if unsafe { CONNTRACK.get(reverse) }.is_some_and(|e| e.direction == CT_REPLY) {
        let _ = CONNTRACK.remove(reverse);
    }
}

//! Packets leaving a pod: a packet to a service address is sent to a backend (DNAT). The first
//! packet of a flow picks a backend at random and records the choice in conntrack; later packets
//! follow that record while it is within its lifetime and its backend may keep it (see
//! [`conntrack::established`]).
use aya_ebpf::{
    bindings::TC_ACT_UNSPEC,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    programs::TcContext,
};
use proxy_common::{
    AffinityKey, AffinityValue, BACKEND_DRAINING, Backend, CtKey, DROP_HAIRPIN_WITHOUT_FLOW,
    DROP_NO_BACKEND, DROP_NO_LOCAL_ENDPOINTS, HAIRPIN_ADDR, SERVICE_AFFINITY, SERVICE_LOCAL_ONLY,
    ServiceKey, ServiceValue,
};

use crate::{
    conntrack,
    maps::{AFFINITY, BACKENDS, SERVICES},
    packet::{self, Drop, End},
};

#[inline(always)]
pub fn try_ingress(ctx: &TcContext) -> Result<i32, Drop> {
    let Some(mut flow) = packet::parse(ctx) else {
        return Ok(TC_ACT_UNSPEC);
    };
    let key = flow.key;
    if key.daddr == HAIRPIN_ADDR {
        return hairpin_reply(ctx, &mut flow);
    }
    let svc_key = ServiceKey::new(key.daddr, key.dport, key.proto, 0);
    // SAFETY: services values are plain data; the agent replaces them whole.
    let Some(svc) = (unsafe { SERVICES.get(svc_key) }).copied() else {
        if flow.syn_only() {
            // A connection straight to a pod: replies on its 5-tuple are not from a service.
            conntrack::forget_reply(&key);
        }
        return Ok(TC_ACT_UNSPEC); // not a service: untouched, on to the next tc program
    };
    let now = unsafe { bpf_ktime_get_ns() };
    let backend = match conntrack::established(&flow, now) {
        Some(backend) => backend,
        None => {
            let picked = if svc.flags & SERVICE_AFFINITY != 0 {
                affinity_backend(&key, &svc_key, &svc, now)?
            } else {
                select_backend(&svc_key, svc.count)?
            };
            let Some((backend_id, backend)) = picked else {
                if svc.flags & SERVICE_LOCAL_ONLY != 0 {
                    return Err(Drop(DROP_NO_LOCAL_ENDPOINTS));
                }
                // No usable endpoint (or a removed service, draining): the packet passes
                // untouched for now (kube-proxy rejects it with ICMP; that comes with the
                // reject issue).
                return Ok(TC_ACT_UNSPEC);
            };
            conntrack::record_flow(&key, backend_id, &backend, now);
            backend
        }
    };
    flow.rewrite(ctx, End::Destination, backend.addr, backend.port)?;
    if backend.addr != key.saddr {
        return Ok(TC_ACT_UNSPEC);
    }
    // The pod reaches itself: without a foreign source its reply would never leave it.
    flow.rewrite(ctx, End::Source, HAIRPIN_ADDR, key.sport)?;
    packet::bounce(ctx)
}

/// A pod's reply to a hairpin flow (backend -> [`HAIRPIN_ADDR`]): back to the same pod, from
/// the service address.
#[inline(always)]
fn hairpin_reply(ctx: &TcContext, flow: &mut packet::Flow) -> Result<i32, Drop> {
    // The pod is the client: replies go back to its own address.
    let pod = flow.key.saddr;
    let Some((vip, vport)) = conntrack::reply(flow, pod) else {
        // No flow behind it: routed on, it would leave the node with a link-local address.
        return Err(Drop(DROP_HAIRPIN_WITHOUT_FLOW));
    };
    flow.rewrite(ctx, End::Destination, pod, flow.key.dport)?;
    flow.rewrite(ctx, End::Source, vip, vport)?;
    packet::bounce(ctx)
}

/// sessionAffinity ClientIP: the backend of the client's last new flow to this frontend while
/// that is within the service's timeout and the backend takes new flows; otherwise a random
/// one, remembered for the client's next flows.
#[inline(always)]
fn affinity_backend(
    key: &CtKey,
    svc_key: &ServiceKey,
    svc: &ServiceValue,
    now: u64,
) -> Result<Option<(u32, Backend)>, Drop> {
    let client = AffinityKey {
        client: key.saddr,
        vip: key.daddr,
        vport: key.dport,
        proto: key.proto,
        pad: 0,
    };
    let timeout_ns = u64::from(svc.affinity_timeout_secs()) * 1_000_000_000;
    if let Some(last) = AFFINITY.get_ptr_mut(&client) {
        // SAFETY: an LRU map value; a concurrent update at worst gives another fresh backend.
        let last = unsafe { &mut *last };
        if now.saturating_sub(last.last_used_ns) <= timeout_ns
            && let Some(backend) = unsafe { BACKENDS.get(last.backend_id) }
            && backend.flags & BACKEND_DRAINING == 0
            && backend.proto == key.proto
        {
            last.last_used_ns = now;
            return Ok(Some((last.backend_id, *backend)));
        }
    }
    let picked = select_backend(svc_key, svc.count)?;
    if let Some((backend_id, _)) = picked {
        let value = AffinityValue {
            backend_id,
            pad: 0,
            last_used_ns: now,
        };
        let _ = AFFINITY.insert(&client, &value, 0);
    }
    Ok(picked)
}

/// A random backend of the service `svc_key`, which had `count` of them when its head was
/// read; `None` when it has none.
#[inline(always)]
fn select_backend(svc_key: &ServiceKey, count: u16) -> Result<Option<(u32, Backend)>, Drop> {
    if count == 0 {
        return Ok(None);
    }
    if let Some(found) = pick(svc_key, count) {
        return Ok(Some(found));
    }
    // The agent shrank the service between the head lookup and ours: read the count again.
    let count = match unsafe { SERVICES.get(svc_key) } {
        Some(ServiceValue { count: 0, .. }) | None => return Ok(None),
        Some(svc) => svc.count,
    };
    // Never pass a packet to a service address untranslated (it would follow the default
    // route): drop it, and the client retransmits.
    pick(svc_key, count).map(Some).ok_or(Drop(DROP_NO_BACKEND))
}

#[inline(always)]
fn pick(svc_key: &ServiceKey, count: u16) -> Option<(u32, Backend)> {
    let slot = (unsafe { bpf_get_prandom_u32() } % count as u32) as u16 + 1;
    let slot_key = ServiceKey::new(svc_key.addr, svc_key.port, svc_key.proto, slot);
    let backend_id = unsafe { SERVICES.get(slot_key) }?.backend_id;
    let backend = unsafe { BACKENDS.get(backend_id) }.copied()?;
    Some((backend_id, backend))
}

//! Packets leaving a pod: a packet to a service address is sent to a backend (DNAT). The first
//! packet of a flow picks a backend at random and records the choice in conntrack; later packets
//! follow that record while it is within its lifetime and its backend exists.
use aya_ebpf::{
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC},
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    programs::TcContext,
};
use proxy_common::{Backend, HAIRPIN_ADDR, ServiceKey, ServiceValue};

use crate::{
    conntrack,
    maps::{BACKENDS, SERVICES},
    packet::{self, End, Error},
};

#[inline(always)]
pub fn try_ingress(ctx: &TcContext) -> Result<i32, Error> {
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
        return Ok(TC_ACT_UNSPEC); // not a service: untouched, on to the next tc program
    };
    let now = unsafe { bpf_ktime_get_ns() };
    let backend = match conntrack::established(&flow, now) {
        Some(backend) => backend,
        None => {
            // A service without endpoints passes untouched for now (kube-proxy rejects such
            // packets with ICMP; that comes with the reject issue).
            let Some((backend_id, backend)) = select_backend(&svc_key, &svc) else {
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
fn hairpin_reply(ctx: &TcContext, flow: &mut packet::Flow) -> Result<i32, Error> {
    // The pod is the client: replies go back to its own address.
    let pod = flow.key.saddr;
    let Some((vip, vport)) = conntrack::reply(flow, pod) else {
        // No flow behind it: routed on, it would leave the node with a link-local address.
        return Ok(TC_ACT_SHOT);
    };
    flow.rewrite(ctx, End::Destination, pod, flow.key.dport)?;
    flow.rewrite(ctx, End::Source, vip, vport)?;
    packet::bounce(ctx)
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

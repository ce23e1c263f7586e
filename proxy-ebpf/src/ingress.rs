//! Packets leaving a pod: a packet to a service address is sent to a backend (DNAT). The first
//! packet of a flow picks a backend (`lb.rs`: affinity, random or Maglev) and records the choice
//! in conntrack; later packets follow that record while it is within its lifetime and its
//! backend may keep it (see [`conntrack::established_flow`]). A packet with a spoofed source
//! (source.rs) starts no flow and changes none: it is dropped.
use aya_ebpf::{bindings::TC_ACT_UNSPEC, helpers::bpf_ktime_get_ns, programs::TcContext};
use proxy_common::{
    DROP_HAIRPIN_WITHOUT_FLOW, DROP_INVALID_SOURCE, DROP_NO_LOCAL_ENDPOINTS, DROP_SOURCE_RANGE,
    SERVICE_DRAINING, SERVICE_LOCAL_ONLY,
};

use crate::{
    conntrack,
    family::Family,
    frontend, lb,
    packet::{self, Drop, End, Flow},
    source,
};

/// What to do with a pod's packet.
pub enum Action<A> {
    /// Return this tc verdict (the packet may have been rewritten).
    Verdict(i32),
    /// Answer it with a port unreachable (a service without endpoints): left to the caller, so
    /// that the answer's buffers need not share this path's stack frame.
    Reject(Flow<A>),
    /// Answer it with a fragmentation needed (IPv6: packet too big) with this MTU, likewise
    /// (external.rs: too big for the interface it would be forwarded out of).
    TooBig(Flow<A>, u16),
    /// Not a TCP or UDP flow, from outside: an ICMP error about one is translated
    /// (`icmp::from_outside`), left to the caller likewise (IPv6).
    IcmpFromOutside,
}

#[inline(always)]
pub fn try_ingress<A: Family>(ctx: &TcContext) -> Result<Action<A>, Drop> {
    let Some(mut flow) = A::parse(ctx) else {
        return Ok(Action::Verdict(TC_ACT_UNSPEC));
    };
    let key = flow.key;
    if key.daddr == A::HAIRPIN {
        return hairpin_reply(ctx, &mut flow).map(Action::Verdict);
    }
    let Some((svc_key, svc)) = frontend::internal(key.daddr, key.dport, key.proto) else {
        if flow.syn_only() {
            // A connection straight to a pod: replies on its 5-tuple are not from a service,
            // unless this is a service flow's SYN seen a second time (at a bridge, say).
            conntrack::forget_finished_reply(&key, unsafe { bpf_ktime_get_ns() }, false);
        }
        // Not a service: untouched, on to the next tc program.
        return Ok(Action::Verdict(TC_ACT_UNSPEC));
    };
    // SAFETY: reading the context's ifindex.
    let pod_iface = unsafe { (*ctx.skb.skb).ifindex };
    let checked = source::changes_flow(&flow);
    if checked && source::spoofed(ctx, &flow, pod_iface) {
        return Err(Drop(DROP_INVALID_SOURCE));
    }
    let now = unsafe { bpf_ktime_get_ns() };
    let backend = match conntrack::established_flow(&flow, now) {
        // Opened through kube-proxy's rules before the programs took over: theirs to the end.
        Some(live) if live.netfilter => return Ok(Action::Verdict(TC_ACT_UNSPEC)),
        Some(live) => live.backend,
        // A datagram's later fragment whose first one started no flow: left as it is.
        None if flow.later_fragment() => return Ok(Action::Verdict(TC_ACT_UNSPEC)),
        None if !checked && source::spoofed(ctx, &flow, pod_iface) => {
            return Err(Drop(DROP_INVALID_SOURCE));
        }
        // loadBalancerSourceRanges hold for pods too (kube-proxy checks a flow's first packet).
        None if frontend::source_refused(&svc_key, &svc, key.saddr) => {
            return Err(Drop(DROP_SOURCE_RANGE));
        }
        None => {
            let Some((backend_id, backend)) =
                lb::new_flow_backend(&key, &svc_key, &svc, now, lb::random())?
            else {
                if svc.flags & SERVICE_LOCAL_ONLY != 0 {
                    return Err(Drop(DROP_NO_LOCAL_ENDPOINTS));
                }
                if svc.flags & SERVICE_DRAINING != 0 {
                    // A removed service: as if it were not there.
                    return Ok(Action::Verdict(TC_ACT_UNSPEC));
                }
                // No usable endpoint: refused at once, as kube-proxy does.
                return Ok(Action::Reject(flow));
            };
            conntrack::record_flow(&flow, backend_id, &backend, now, false);
            backend
        }
    };
    flow.rewrite(ctx, End::Destination, backend.addr, backend.port)?;
    if backend.addr != key.saddr {
        return Ok(Action::Verdict(TC_ACT_UNSPEC));
    }
    // The pod reaches itself: without a foreign source its reply would never leave it.
    flow.rewrite(ctx, End::Source, A::HAIRPIN, key.sport)?;
    packet::bounce(ctx).map(Action::Verdict)
}

/// A pod's reply to a hairpin flow (backend -> [`proxy_common::Addr::HAIRPIN`]): back to the
/// same pod, from the service address.
#[inline(always)]
fn hairpin_reply<A: Family>(ctx: &TcContext, flow: &mut packet::Flow<A>) -> Result<i32, Drop> {
    // The pod is the client: replies go back to its own address.
    let pod = flow.key.saddr;
    // SAFETY: reading the context's ifindex.
    let pod_iface = unsafe { (*ctx.skb.skb).ifindex };
    if source::changes_flow(flow) && source::spoofed(ctx, flow, pod_iface) {
        return Err(Drop(DROP_INVALID_SOURCE));
    }
    let Some((vip, vport)) = conntrack::reply(flow, pod, false) else {
        // No flow behind it: routed on, it would leave the node with a link-local address.
        return Err(Drop(DROP_HAIRPIN_WITHOUT_FLOW));
    };
    flow.rewrite(ctx, End::Destination, pod, flow.key.dport)?;
    flow.rewrite(ctx, End::Source, vip, vport)?;
    packet::bounce(ctx)
}

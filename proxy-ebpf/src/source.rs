//! Source validation, as the kernel's strict rp_filter does it: a packet whose source address
//! is not routed back through the interface it came in on (or the bridge that interface is a
//! port of) is spoofed. Checked only for the packets that can change a flow (a new flow's
//! first, and TCP SYN, FIN and RST), so established packets pay nothing; only for packets
//! from the interfaces the agent lists in SOURCE_IFACES (pod interfaces): a pod must not
//! close or re-balance another pod's Service connections. Outside clients are held to
//! plausible sequence numbers instead (conntrack.rs).
use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_BLACKHOLE, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_NOT_FWDED,
        BPF_FIB_LKUP_RET_PROHIBIT, BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LKUP_RET_UNREACHABLE,
    },
    programs::TcContext,
};

use crate::{
    conntrack, external,
    family::Family,
    maps::SOURCE_IFACES,
    packet::{Flow, TCP_FIN, TCP_RST, TCP_SYN},
};

/// Whether the packet `flow` could change a flow it belongs to (a TCP SYN, FIN or RST).
#[inline(always)]
pub fn changes_flow<A>(flow: &Flow<A>) -> bool {
    flow.tcp_flags() & (TCP_FIN | TCP_SYN | TCP_RST) != 0
}

/// Whether `flow`, which came into the node on the interface `arrived_on` (0: sent by the node
/// itself), has a source that is not routed back through that interface. Unknown interfaces,
/// and lookups that cannot tell (forwarding off there, say), pass.
#[inline(always)]
pub fn spoofed<A: Family>(ctx: &TcContext, flow: &Flow<A>, arrived_on: u32) -> bool {
    let Some(&route_back) = (unsafe { SOURCE_IFACES.get(arrived_on) }) else {
        return false;
    };
    let (rc, route) = external::route(ctx, &conntrack::reversed(&flow.key), 0, arrived_on);
    match rc as u32 {
        BPF_FIB_LKUP_RET_SUCCESS | BPF_FIB_LKUP_RET_NO_NEIGH => route.ifindex != route_back,
        // No route back, or the source is one of the node's own (or a broadcast) address.
        BPF_FIB_LKUP_RET_BLACKHOLE
        | BPF_FIB_LKUP_RET_UNREACHABLE
        | BPF_FIB_LKUP_RET_PROHIBIT
        | BPF_FIB_LKUP_RET_NOT_FWDED => true,
        _ => false,
    }
}

/// Whether the packet `flow`, about to leave by a tc egress program, could change a flow and
/// came from a pod interface with a spoofed source (the interface it entered the node on).
#[inline(always)]
pub fn from_spoofed_source<A: Family>(ctx: &TcContext, flow: &Flow<A>) -> bool {
    // SAFETY: reading the context's ingress ifindex.
    let arrived_on = unsafe { (*ctx.skb.skb).ingress_ifindex };
    changes_flow(flow) && spoofed(ctx, flow, arrived_on)
}

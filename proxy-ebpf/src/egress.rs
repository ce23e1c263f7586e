//! Packets going to a pod: a reply from a backend gets the service address back as its source
//! (reverse NAT), so the client sees the address it connected to.
use aya_ebpf::{helpers::bpf_ktime_get_ns, programs::TcContext};
use proxy_common::CT_REPLY;

use crate::{
    maps::CONNTRACK,
    packet::{self, End, Error},
};

#[inline(always)]
pub fn try_egress(ctx: &TcContext) -> Result<(), Error> {
    let Some(flow) = packet::parse(ctx) else {
        return Ok(());
    };
    let Some(entry) = CONNTRACK.get_ptr_mut(flow.key) else {
        return Ok(());
    };
    // SAFETY: see ingress::established.
    let entry = unsafe { &mut *entry };
    if entry.direction != CT_REPLY {
        return Ok(());
    }
    entry.last_seen_ns = unsafe { bpf_ktime_get_ns() };
    entry.packets += 1;
    let (vip, vport) = (entry.vip, entry.vport);
    flow.rewrite(ctx, End::Source, vip, vport)
}

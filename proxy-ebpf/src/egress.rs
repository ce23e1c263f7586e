//! Packets going to a pod: a reply from a backend gets the service address back as its source
//! (reverse NAT), so the client sees the address it connected to; so does an ICMP error about
//! a packet the pod sent to a service (icmp.rs). A SYN, FIN or RST from a spoofed source
//! (another pod posing as the backend, source.rs) passes untranslated and changes no flow.
use aya_ebpf::{bindings::TC_ACT_UNSPEC, programs::TcContext};

use crate::{
    conntrack,
    family::Family,
    icmp,
    packet::{Drop, End},
    source,
};

#[inline(always)]
pub fn try_egress<A: Family>(ctx: &TcContext) -> Result<i32, Drop> {
    let Some(mut flow) = A::parse(ctx) else {
        icmp::to_client::<A>(ctx, 0)?;
        return Ok(TC_ACT_UNSPEC);
    };
    if source::from_spoofed_source(ctx, &flow) {
        return Ok(TC_ACT_UNSPEC);
    }
    let client = flow.key.daddr;
    let Some((vip, vport)) = conntrack::reply(&flow, client, false) else {
        return Ok(TC_ACT_UNSPEC);
    };
    flow.rewrite(ctx, End::Source, vip, vport)?;
    Ok(TC_ACT_UNSPEC)
}

//! Packets going to a pod: a reply from a backend gets the service address back as its source
//! (reverse NAT), so the client sees the address it connected to.
use aya_ebpf::{bindings::TC_ACT_OK, helpers::bpf_ktime_get_ns, programs::TcContext};
use proxy_common::{CT_CLOSING, CT_REPLY, CtKey};

use crate::{
    maps::CONNTRACK,
    packet::{self, End, Error},
};

#[inline(always)]
pub fn try_egress(ctx: &TcContext) -> Result<i32, Error> {
    let Some(mut flow) = packet::parse(ctx) else {
        return Ok(TC_ACT_OK);
    };
    let Some(entry) = CONNTRACK.get_ptr_mut(flow.key) else {
        return Ok(TC_ACT_OK);
    };
    // SAFETY: see ingress::established.
    let entry = unsafe { &mut *entry };
    let now = unsafe { bpf_ktime_get_ns() };
    // An expired entry is a flow that ended: later traffic on the same 5-tuple (say, the client
    // talking to the backend directly) is not a reply to the service.
    if entry.direction != CT_REPLY || entry.expired(flow.key.proto, now) {
        return Ok(TC_ACT_OK);
    }
    entry.last_seen_ns = now;
    entry.packets += 1;
    let (vip, vport) = (entry.vip, entry.vport);
    if flow.closing {
        // The backend closes: both directions get the short lifetime.
        entry.flags |= CT_CLOSING;
        let forward = CtKey {
            saddr: flow.key.daddr,
            daddr: vip,
            sport: flow.key.dport,
            dport: vport,
            proto: flow.key.proto,
            pad: [0; 3],
        };
        if let Some(forward) = CONNTRACK.get_ptr_mut(forward) {
            unsafe { (*forward).flags |= CT_CLOSING };
        }
    }
    flow.rewrite(ctx, End::Source, vip, vport)?;
    Ok(TC_ACT_OK)
}

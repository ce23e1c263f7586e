//! Packets from outside the node to its NodePorts, LoadBalancer and external IPs, on the
//! interfaces that carry the node's addresses. The decision ([`decide`]) is shared by the XDP
//! program (xdp.rs: the fast path) and the tc programs here, which handle what XDP leaves to
//! the stack: packets with IP options, rejects, and forwarding where XDP cannot transmit or
//! the next hop's address is not resolved yet (`bpf_redirect_neigh` resolves it).
//!
//! externalTrafficPolicy Cluster: a local endpoint gets the packet with the client's address
//! (the stack delivers it to the pod; its replies are translated on their way out, by
//! [`try_external_egress`]); another node's endpoint gets it from this node's address and a
//! port picked in conntrack, so that its replies come back here and are translated back
//! (forwarded by a route lookup: the stack would refuse a packet with its own source).
//! externalTrafficPolicy Local: only local endpoints, the client's address kept.
use aya_ebpf::{
    EbpfContext,
    bindings::{
        BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS,
        TC_ACT_UNSPEC, bpf_fib_lookup,
    },
    helpers::{bpf_fib_lookup as fib_lookup, bpf_ktime_get_ns, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};
use proxy_common::{
    BACKEND_LOCAL, Backend, Be16, Be32, CONFIG_SNAT_ADDR, CT_EXTERNAL, CtKey, DROP_FRAG_NEEDED,
    DROP_NO_LOCAL_ENDPOINTS, DROP_NO_ROUTE, DROP_SNAT_PORTS_EXHAUSTED, DROP_SOURCE_RANGE,
    SERVICE_DRAINING, SERVICE_LOCAL_ONLY, SERVICE_TWO_SCOPES,
};

use crate::{
    conntrack,
    family::Family,
    frontend, icmp, lb,
    maps::{CONFIG, EXTERNAL_IFACES},
    packet::{self, Drop, End, FAILED, Flow, IP_CSUM_OFF, IP_DF, IP_FRAG_FLAGS_OFF, IP_TTL_OFF},
    reject, source,
};

/// What to do with a packet that came from outside.
pub enum Verdict {
    /// Not for a frontend (or a removed one): on to the stack untouched.
    Pass,
    /// Rewrite the source to `src` and the destination to `dst` (either may be unchanged).
    /// `forward`: send it out by a route lookup (its source is now a node address, or it is a
    /// reply going back to the client); otherwise hand it to the stack (a local endpoint).
    Nat {
        src: (Be32, Be16),
        dst: (Be32, Be16),
        forward: bool,
    },
    /// No usable endpoint: answer with an ICMP port unreachable (tc only).
    Reject,
}

/// The decision for `flow`, a packet that arrived on the external interface `ingress`. Records
/// new flows in conntrack.
#[inline(always)]
pub fn decide<C: EbpfContext>(ctx: &C, flow: &Flow, ingress: u32) -> Result<Verdict, Drop> {
    let key = flow.key;
    let (node_addr, to_node) = frontend::node_addr(key.daddr);
    if node_addr && let Some((service, client)) = conntrack::snat_reply(flow) {
        return Ok(Verdict::Nat {
            src: service,
            dst: client,
            forward: true,
        });
    }
    let Some((svc_key, svc)) = frontend::external(key.daddr, key.dport, key.proto, to_node) else {
        if flow.syn_only() {
            // A connection straight to a pod (or to anything else): a reply entry left on its
            // reverse 5-tuple by an earlier flow through a frontend (the client reusing its
            // port) must not rewrite its replies.
            conntrack::forget_finished_reply(&key, unsafe { bpf_ktime_get_ns() }, true);
        }
        return Ok(Verdict::Pass);
    };
    if frontend::source_refused(&svc_key, &svc, key.saddr) {
        return Err(Drop(DROP_SOURCE_RANGE));
    }
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(live) = conntrack::established_flow(flow, now) {
        if live.netfilter {
            return Ok(Verdict::Pass); // netfilter's to the end, as in ingress.rs
        }
        return Ok(nat(&key, &live.backend, live.snat));
    }
    if flow.later_fragment() {
        return Ok(Verdict::Pass); // its first fragment started no flow
    }
    let Some((backend_id, backend)) =
        lb::new_flow_backend(&key, &svc_key, &svc, now, lb::random())?
    else {
        if svc.flags & SERVICE_LOCAL_ONLY != 0 {
            return Err(Drop(DROP_NO_LOCAL_ENDPOINTS));
        }
        if svc.flags & SERVICE_DRAINING != 0 {
            return Ok(Verdict::Pass);
        }
        return Ok(Verdict::Reject);
    };
    if svc.flags & SERVICE_TWO_SCOPES != 0 || backend.flags & BACKEND_LOCAL != 0 {
        conntrack::record_flow(flow, backend_id, &backend, now, true);
        return Ok(nat(&key, &backend, conntrack::no_snat()));
    }
    let node = snat_source(ctx, &key, &backend, ingress, to_node);
    if node.raw() == 0 {
        return Err(Drop(DROP_NO_ROUTE));
    }
    let port = conntrack::record_snat_flow(flow, backend_id, &backend, node, now)
        .ok_or(Drop(DROP_SNAT_PORTS_EXHAUSTED))?;
    Ok(nat(&key, &backend, (node, port)))
}

#[inline(always)]
fn nat(key: &CtKey, backend: &Backend, snat: (Be32, Be16)) -> Verdict {
    let forward = snat != conntrack::no_snat();
    Verdict::Nat {
        src: if forward {
            snat
        } else {
            (key.saddr, key.sport)
        },
        dst: (backend.addr, backend.port),
        forward,
    }
}

/// The address a flow (now `key`) sent on to another node's `backend` leaves from: that of the
/// interface the route to the backend goes out of, as netfilter's MASQUERADE picks, where the
/// external programs are there to take the replies; else the node address the client used, or
/// for LoadBalancer and external IPs the node's primary address.
#[inline(always)]
fn snat_source<C: EbpfContext>(
    ctx: &C,
    key: &CtKey,
    backend: &Backend,
    ingress: u32,
    to_node: bool,
) -> Be32 {
    let towards = CtKey {
        daddr: backend.addr,
        dport: backend.port,
        ..*key
    };
    let (rc, route) = self::route(ctx, &towards, 0, ingress);
    // The lookup names the egress interface whether or not the next hop is resolved or the
    // packet fits (forwarding checks those again).
    let rc = rc as u32;
    if rc == BPF_FIB_LKUP_RET_SUCCESS
        || rc == BPF_FIB_LKUP_RET_NO_NEIGH
        || rc == BPF_FIB_LKUP_RET_FRAG_NEEDED
    {
        let addr = unsafe { EXTERNAL_IFACES.get(route.ifindex) }.map_or(0, |i| i.snat_addr.raw());
        if addr != 0 {
            return Be32::from_raw(addr);
        }
    }
    if to_node { key.daddr } else { primary_addr() }
}

/// The node's primary address (`CONFIG_SNAT_ADDR`, the attacher's; 0.0.0.0 until written).
#[inline(always)]
pub fn primary_addr() -> Be32 {
    Be32::from_raw(CONFIG.get(CONFIG_SNAT_ADDR).copied().unwrap_or(0))
}

/// A route lookup for a translated packet `key` (of `tot_len` bytes) that came in on
/// `ifindex`: the return code, and the egress interface and MAC addresses on success. A
/// `tot_len` of 0 has the kernel check the MTU as its own forwarding does, GSO-aware (a GRO
/// packet's length is that of all its segments).
#[inline(always)]
pub fn route<C: EbpfContext, A: Family>(
    ctx: &C,
    key: &CtKey<A>,
    tot_len: u16,
    ifindex: u32,
) -> (i64, bpf_fib_lookup) {
    // SAFETY: a plain C struct; all zeros is a valid (empty) lookup.
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    A::fib_addrs(&mut params, key);
    params.l4_protocol = key.proto;
    params.sport = key.sport.raw();
    params.dport = key.dport.raw();
    params.__bindgen_anon_1.tot_len = tot_len;
    params.ifindex = ifindex;
    // SAFETY: the context and a lookup struct of the size given.
    let rc = unsafe {
        fib_lookup(
            ctx.as_ptr(),
            &mut params,
            size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    (rc, params)
}

/// A packet from outside, on the tc ingress of an external interface.
#[inline(always)]
pub fn try_external_ingress(ctx: &TcContext) -> Result<i32, Drop> {
    let Some(mut flow) = packet::parse(ctx) else {
        return icmp::from_outside(ctx);
    };
    // SAFETY: reading the context's ifindex.
    let ingress = unsafe { (*ctx.skb.skb).ifindex };
    let (src, dst) = match decide(ctx, &flow, ingress)? {
        Verdict::Pass => return Ok(TC_ACT_UNSPEC),
        Verdict::Reject => return reject::reject(ctx, &flow),
        Verdict::Nat {
            src,
            dst,
            forward: false,
        } => {
            flow.rewrite(ctx, End::Destination, dst.0, dst.1)?;
            flow.rewrite(ctx, End::Source, src.0, src.1)?;
            return Ok(TC_ACT_UNSPEC);
        }
        Verdict::Nat { src, dst, .. } => (src, dst),
    };
    let translated = CtKey {
        saddr: src.0,
        sport: src.1,
        daddr: dst.0,
        dport: dst.1,
        ..flow.key
    };
    let (rc, route) = self::route(ctx, &translated, 0, ingress);
    if rc as u32 == BPF_FIB_LKUP_RET_FRAG_NEEDED && dont_fragment(ctx)? {
        // As the kernel's forwarding answers: the client learns the path's MTU. The MTU comes
        // with the lookup from Linux 5.12; before, 0 has the client take its minimum (552).
        // SAFETY: the lookup's output member of the union.
        let mtu = unsafe { route.__bindgen_anon_1.mtu_result };
        crate::count_drop(ctx, DROP_FRAG_NEEDED);
        return reject::frag_needed(ctx, &flow, mtu);
    }
    flow.rewrite(ctx, End::Destination, dst.0, dst.1)?;
    flow.rewrite(ctx, End::Source, src.0, src.1)?;
    send(ctx, rc, &route)
}

/// Whether the packet's IP header forbids fragmenting it (DF).
#[inline(always)]
fn dont_fragment(ctx: &TcContext) -> Result<bool, Drop> {
    let flags: u8 = ctx.load(IP_FRAG_FLAGS_OFF).map_err(|_| FAILED)?;
    Ok(flags & IP_DF != 0)
}

/// Sends a translated packet (now `key`) out by a route lookup, resolving the next hop if need
/// be.
#[inline(always)]
pub fn forward_tc(ctx: &TcContext, key: &CtKey) -> Result<i32, Drop> {
    // SAFETY: reading the context's ifindex.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let (rc, route) = self::route(ctx, key, 0, ifindex);
    send(ctx, rc, &route)
}

/// Sends a translated packet out as the route lookup `route` (its return code `rc`) says.
/// One too big for the egress interface that may be fragmented goes as it is: a tunnel
/// fragments the packet it is carried in (flannel's and Calico's VXLAN; the kernel's own
/// forwarding would have fragmented it), a plain interface of a smaller MTU drops it.
#[inline(always)]
fn send(ctx: &TcContext, rc: i64, route: &bpf_fib_lookup) -> Result<i32, Drop> {
    let rc = rc as u32;
    let resolved = rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_FRAG_NEEDED;
    if !resolved && rc != BPF_FIB_LKUP_RET_NO_NEIGH {
        return Err(Drop(DROP_NO_ROUTE));
    }
    decrement_ttl(ctx)?;
    if resolved {
        let mut macs = [0u8; 12];
        macs[..6].copy_from_slice(&route.dmac);
        macs[6..].copy_from_slice(&route.smac);
        ctx.store(0, &macs, 0).map_err(|_| FAILED)?;
        // SAFETY: a helper with plain integer arguments.
        return Ok(unsafe { bpf_redirect(route.ifindex, 0) } as i32);
    }
    // SAFETY: no neighbour parameters (the kernel takes the next hop from its own lookup).
    Ok(unsafe { bpf_redirect_neigh(route.ifindex, core::ptr::null_mut(), 0, 0) } as i32)
}

/// A forwarded packet loses a hop; one that has none left goes no further.
#[inline(always)]
fn decrement_ttl(ctx: &TcContext) -> Result<(), Drop> {
    let word: [u8; 2] = ctx.load(IP_TTL_OFF).map_err(|_| FAILED)?;
    if word[0] <= 1 {
        return Err(Drop(DROP_NO_ROUTE));
    }
    let new = [word[0] - 1, word[1]];
    let (from, to) = (u16::from_ne_bytes(word), u16::from_ne_bytes(new));
    ctx.l3_csum_replace(IP_CSUM_OFF, from as u64, to as u64, 2)
        .map_err(|_| FAILED)?;
    ctx.store(IP_TTL_OFF, &new, 0).map_err(|_| FAILED)
}

/// A packet leaving the node on an external interface: a local endpoint's reply to an
/// external client gets the frontend's address back as its source (a SYN, FIN or RST from a
/// spoofed source passes untranslated and changes no flow).
#[inline(always)]
pub fn try_external_egress(ctx: &TcContext) -> Result<i32, Drop> {
    let Some(mut flow) = packet::parse(ctx) else {
        icmp::to_client(ctx, CT_EXTERNAL)?;
        return Ok(TC_ACT_UNSPEC);
    };
    if source::from_spoofed_source(ctx, &flow) {
        return Ok(TC_ACT_UNSPEC);
    }
    let client = flow.key.daddr;
    if let Some((vip, vport)) = conntrack::reply(&flow, client, true) {
        flow.rewrite(ctx, End::Source, vip, vport)?;
    }
    Ok(TC_ACT_UNSPEC)
}

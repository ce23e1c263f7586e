//! Conntrack: two entries a flow, each keyed by the 5-tuple its direction's packets carry.
//! The forward entry (client -> service address) names the backend; the reply entry (backend ->
//! client, or backend -> [`Family::HAIRPIN`] for a pod reaching itself) names the service
//! address the replies must come from. A reply entry is used only while its forward entry is
//! live and names the same backend: the forward entry is the flow. Generic over the address
//! family (family.rs): each family has its own maps.
//!
//! An external flow sent to another node's endpoint ([`CT_SNAT`]) leaves from a node address
//! and a port picked here; its reply entry is keyed to that address and port, and the NAT
//! fields of its entries say where each direction's packets go back to.
use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST},
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
};
use proxy_common::{
    BACKEND_DRAINING, Backend, Be16, CONFIG_SNAT_PORT_MAX, CONFIG_SNAT_PORT_MIN, CT_ANSWERED,
    CT_CLOSING, CT_EXTERNAL, CT_FIN, CT_FLOW_FLAGS, CT_FORWARD, CT_HALF_CLOSED, CT_NETFILTER,
    CT_OPENING, CT_REPLY, CT_SNAT, CT_TIME_WAIT, CtKey, CtValue, IPPROTO_TCP, SNAT_CLOSE_GRACE_NS,
    SNAT_PORT_MAX, SNAT_PORT_MIN, SNAT_TIME_WAIT_NS, ct_lifetime_ns, seq_plausible,
};

use crate::{
    family::Family,
    maps::{CONFIG, CT_LIFETIMES},
    packet::{Flow, TCP_FIN, TCP_RST, TCP_SYN},
};

/// Whether `entry`, of protocol `proto`, has been idle longer than its state's lifetime at `now`.
#[inline(always)]
fn expired<A: Family>(entry: &CtValue<A>, proto: u8, now: u64) -> bool {
    let state = entry.state(proto);
    let configured = CT_LIFETIMES.get(state).copied().unwrap_or(0);
    entry.idle_past(now, ct_lifetime_ns(state, configured))
}

/// [`Live::snat`] of a flow that keeps its client's address.
#[inline(always)]
pub fn no_snat<A: Family>() -> (A, Be16) {
    (A::default(), Be16::new(0))
}

/// A flow found in conntrack: its backend, and for an external flow sent from a node
/// address, that address and port (else 0.0.0.0:0, never a node address). Not an `Option`:
/// the compiler would keep its payload on the stack only when set, and 5.10's verifier refuses
/// the read of it on the other path, which it cannot tell apart.
pub struct Live<A> {
    pub backend: Backend<A>,
    pub snat: (A, Be16),
    /// A flow netfilter translates ([`CT_NETFILTER`]): its packet passes untouched (`backend`
    /// and `snat` are zero).
    pub netfilter: bool,
}

/// The backend of a flow already in conntrack, if the flow is within its lifetime and its
/// backend may keep it: the backend exists (for this protocol) and is either still in the
/// service or draining with an established TCP connection. A SYN and any UDP packet leave a
/// draining backend (kube-proxy's behaviour: only TCP connections outlive their endpoint's
/// removal). The packets [`reply_due`] names also look at the reply entry: they re-create it
/// if the LRU evicted it alone (or something else took its 5-tuple), so replies keep their
/// reverse NAT.
/// With the flow's source translation, or a flow netfilter translates ([`Live::netfilter`]).
#[inline(always)]
pub fn established_flow<A: Family>(flow: &Flow<A>, now: u64) -> Option<Live<A>> {
    let key = &flow.key;
    let entry = A::conntrack().get_ptr_mut(key)?;
    // SAFETY: an LRU map value; a concurrent eviction can at worst make us read a recycled
    // entry, which the direction and backend checks below reject or the backend lookup corrects.
    let entry = unsafe { &mut *entry };
    if expired(entry, key.proto, now) {
        return None;
    }
    if entry.direction == CT_NETFILTER {
        return netfilter_flow(entry, flow, now);
    }
    if entry.direction != CT_FORWARD {
        return None;
    }
    // A new connection on the 5-tuple of one that just closed is a new flow.
    if flow.syn_only() && entry.flags & CT_CLOSING != 0 {
        return None;
    }
    let backend = unsafe { A::backends().get(entry.backend_id) }.copied()?;
    if backend.proto != key.proto {
        return None;
    }
    if backend.flags & BACKEND_DRAINING != 0 && (key.proto != IPPROTO_TCP || flow.syn_only()) {
        return None;
    }
    let snat = match entry.flags & CT_SNAT != 0 {
        true => (entry.nat_addr, entry.nat_port),
        false => no_snat(),
    };
    let snatted = snat != no_snat();
    if !snatted && !reply_due(flow, entry, now) {
        entry.packets += 1;
        entry.last_seen_ns = now;
        follow_seq(entry, flow);
        return Some(Live {
            backend,
            snat,
            netfilter: false,
        });
    }
    let reply_key = reply_key(key, entry, &backend);
    let found = A::conntrack()
        .get_ptr_mut(reply_key)
        .map(|r| unsafe { &mut *r });
    let taken = found.is_some();
    let reply = found.filter(|r| {
        r.direction == CT_REPLY
            && r.backend_id == entry.backend_id
            && (!snatted || (r.nat_addr, r.nat_port) == (key.saddr, key.sport))
    });
    match reply {
        Some(reply) => touch(entry, Some(reply), flow, now),
        // A translated flow whose port went to a newer flow (it had closed, its reply entry
        // was evicted, or it was taken over by [`record_snat_flow`]) is over: its packet is
        // taken as a new flow's, and never takes the port back (two clients would share one
        // 5-tuple at the endpoint). A closed one keeps its port only while its entry does.
        None if snatted && (taken || entry.flags & CT_CLOSING != 0) => return None,
        None => {
            touch(entry, None, flow, now);
            let mut reply = *entry;
            reply.direction = CT_REPLY;
            reply.flags &= CT_FLOW_FLAGS;
            reply.packets = 0;
            reply.seq_hint = 0;
            if entry.flags & CT_EXTERNAL != 0 {
                (reply.nat_addr, reply.nat_port) = (key.saddr, key.sport);
            }
            // A translated flow's port is taken again only if it is still free.
            let flags = if snatted { BPF_NOEXIST } else { BPF_ANY };
            let _ = A::conntrack().insert(reply_key, reply, flags as u64);
        }
    }
    Some(Live {
        backend,
        snat,
        netfilter: false,
    })
}

/// A packet on the 5-tuple of a flow netfilter translates ([`CT_NETFILTER`]): the flow lives
/// on while its packets come, and they pass untouched. A bare SYN is a new connection on the
/// 5-tuple (the client reusing its port): the entry goes, and the programs serve it.
#[inline(always)]
fn netfilter_flow<A: Family>(entry: &mut CtValue<A>, flow: &Flow<A>, now: u64) -> Option<Live<A>> {
    if flow.syn_only() {
        let _ = A::conntrack().remove(flow.key);
        return None;
    }
    entry.packets += 1;
    entry.last_seen_ns = now;
    Some(Live {
        backend: Backend::default(),
        snat: no_snat(),
        netfilter: true,
    })
}

/// Forward packets between two looks at the flow's reply entry: most packets of a busy flow
/// need one conntrack lookup, not two.
const REPLY_CHECK_PACKETS: u32 = 32;
/// A flow quiet this long has its reply entry looked at again by its next forward packet.
const REPLY_CHECK_IDLE_NS: u64 = 1_000_000_000;

/// Whether the forward packet `flow` of the open flow `entry` must look at the reply entry: to
/// follow a teardown (FIN, RST) or a new connection on the tuple (SYN), to re-create the entry
/// if the LRU evicted it (so replies keep their reverse NAT), and to refresh its time. Each
/// reply packet refreshes both entries anyway; a flow whose replies stopped has its reply
/// entry checked every [`REPLY_CHECK_PACKETS`] packets, and after a quiet second.
#[inline(always)]
fn reply_due<A: Family>(flow: &Flow<A>, entry: &CtValue<A>, now: u64) -> bool {
    flow.tcp_flags() & (TCP_FIN | TCP_SYN | TCP_RST) != 0
        || entry.flags & (CT_CLOSING | CT_OPENING) != 0
        || entry.packets.is_multiple_of(REPLY_CHECK_PACKETS)
        || now.saturating_sub(entry.last_seen_ns) >= REPLY_CHECK_IDLE_NS
}

/// A packet of the flow went in the direction of `this`: both entries are refreshed (a flow has
/// one lifetime, whichever side speaks), and TCP teardown is followed: a RST, or a FIN from each
/// side, closes the flow. A closed flow is not refreshed any more: it ends
/// [`proxy_common::CT_LIFETIME_CLOSING_NS`] after it closed, whatever either side still sends.
/// Closed by the client's FIN coming last, the backend closed first: [`CT_TIME_WAIT`].
/// The handshake is followed too: a reply answers the flow ([`CT_ANSWERED`]), and the client's
/// next packet ends its opening ([`CT_OPENING`]); a FIN half-closes it ([`CT_HALF_CLOSED`]).
/// Those flags are the flow's: both entries get them.
/// A TCP packet whose sequence number is implausible for its direction ([`seq_plausible`]: a
/// blind spoofer's RST or FIN) refreshes the flow and changes nothing else; nor does the
/// client's packet end the opening unless it acknowledges what the backend sent.
#[inline(always)]
fn touch<A: Family>(
    this: &mut CtValue<A>,
    other: Option<&mut CtValue<A>>,
    flow: &Flow<A>,
    now: u64,
) {
    this.packets += 1;
    if this.flags & CT_CLOSING != 0 {
        return;
    }
    this.last_seen_ns = now;
    if !follow_seq(this, flow) {
        if let Some(other) = other {
            other.last_seen_ns = now;
        }
        return;
    }
    let mut set = 0;
    let mut cleared = 0;
    if this.direction == CT_REPLY {
        set |= CT_ANSWERED;
    } else if this.flags & CT_ANSWERED != 0
        && other
            .as_ref()
            .is_none_or(|o| flow.key.proto != IPPROTO_TCP || seq_plausible(o.seq_hint, flow.ack))
    {
        cleared |= CT_OPENING;
    }
    if flow.fin() {
        this.flags |= CT_FIN;
        set |= CT_HALF_CLOSED;
    }
    this.flags = (this.flags | set) & !cleared;
    let Some(other) = other else {
        if flow.rst() {
            this.flags |= CT_CLOSING;
        }
        return;
    };
    other.last_seen_ns = now;
    other.flags = (other.flags | set) & !cleared;
    let closed_by_fins = this.flags & other.flags & CT_FIN != 0;
    if flow.rst() || closed_by_fins {
        let time_wait = if !flow.rst() && this.direction == CT_FORWARD {
            CT_TIME_WAIT
        } else {
            0
        };
        this.flags |= CT_CLOSING | time_wait;
        other.flags |= CT_CLOSING | time_wait;
    }
}

/// Follows the sequence numbers of `this` entry's direction with the TCP packet `flow`: whether
/// its sequence number is plausible ([`seq_plausible`]); a plausible one past the entry's
/// hint moves the hint on (written only when it moved: once per 64 KiB of data). UDP: always.
#[inline(always)]
fn follow_seq<A: Family>(this: &mut CtValue<A>, flow: &Flow<A>) -> bool {
    if flow.key.proto != IPPROTO_TCP {
        return true;
    }
    if !seq_plausible(this.seq_hint, flow.seq) {
        return false;
    }
    if this.seq_hint == 0 || (flow.seq.wrapping_sub(this.seq_hint) as i16) > 0 {
        this.seq_hint = flow.seq;
    }
    true
}

/// Where the backend's replies to the flow `key` (whose forward entry is `forward`) come from
/// and go to: the client, or for a hairpin flow [`Family::HAIRPIN`] (the source its packets were
/// given), or for a flow sent from a node address that address and port.
#[inline(always)]
fn reply_key<A: Family>(key: &CtKey<A>, forward: &CtValue<A>, backend: &Backend<A>) -> CtKey<A> {
    let (daddr, dport) = if forward.flags & CT_SNAT != 0 {
        (forward.nat_addr, forward.nat_port)
    } else {
        let hairpin = backend.addr == key.saddr;
        (if hairpin { A::HAIRPIN } else { key.saddr }, key.sport)
    };
    CtKey {
        saddr: backend.addr,
        daddr,
        sport: backend.port,
        dport,
        proto: key.proto,
        pad: [0; 3],
    }
}

/// A new flow's forward entry (its first packet `flow`), before any NAT field. A TCP flow
/// starts [`CT_OPENING`], its client's sequence numbers where that packet's are.
#[inline(always)]
fn forward_value<A: Family>(flow: &Flow<A>, backend_id: u32, flags: u8, now: u64) -> CtValue<A> {
    let key = &flow.key;
    let opening = if key.proto == IPPROTO_TCP {
        CT_OPENING
    } else {
        0
    };
    CtValue {
        backend_id,
        vip: key.daddr,
        vport: key.dport,
        direction: CT_FORWARD,
        flags: flags | opening,
        nat_addr: A::default(),
        last_seen_ns: now,
        nat_port: Be16::new(0),
        seq_hint: flow.seq,
        packets: 1,
    }
}

/// Records both directions of a new flow: the reply entry first, so that no reply can arrive
/// before the record that reverse-NATs it. `external`: the flow came from outside the node
/// (its replies are translated on the way out of the node, and its reply entry names the
/// client).
#[inline(always)]
pub fn record_flow<A: Family>(
    flow: &Flow<A>,
    backend_id: u32,
    backend: &Backend<A>,
    now: u64,
    external: bool,
) {
    let key = &flow.key;
    let flags = if external { CT_EXTERNAL } else { 0 };
    let forward = forward_value(flow, backend_id, flags, now);
    let mut reply = CtValue {
        direction: CT_REPLY,
        packets: 0,
        seq_hint: 0,
        ..forward
    };
    if external {
        (reply.nat_addr, reply.nat_port) = (key.saddr, key.sport);
    }
    // LRU inserts make room by evicting the least recently used flow; a failure here (memory
    // pressure) only means the next packet of this flow picks a backend again.
    let _ = A::conntrack().insert(reply_key(key, &forward, backend), reply, BPF_ANY as u64);
    let _ = A::conntrack().insert(key, forward, BPF_ANY as u64);
}

/// Tries per new translated flow: a port is taken at random each time, so this many
/// collisions in a row mean the range is nearly full for this endpoint.
const SNAT_TRIES: u32 = 8;

/// Records a new external flow sent to another node's endpoint from `node` and a free port
/// (see [`port_free`]) of the configured range, and returns that port. `None` when none was
/// found: the packet is dropped and the client retries.
#[inline(always)]
pub fn record_snat_flow<A: Family>(
    flow: &Flow<A>,
    backend_id: u32,
    backend: &Backend<A>,
    node: A,
    now: u64,
) -> Option<Be16> {
    let key = &flow.key;
    let mut forward = forward_value(flow, backend_id, CT_EXTERNAL | CT_SNAT, now);
    forward.nat_addr = node;
    let reply = CtValue {
        direction: CT_REPLY,
        packets: 0,
        seq_hint: 0,
        nat_addr: key.saddr,
        nat_port: key.sport,
        ..forward
    };
    let (min, max) = snat_ports();
    let range = u32::from(max - min) + 1;
    // The tried port of the longest idle flow still being opened, and when it was last seen
    // (not an `Option`: see [`Live`]).
    let mut opening_port = 0u16;
    let mut opening_seen = u64::MAX;
    for _ in 0..SNAT_TRIES {
        let port = min + (unsafe { bpf_get_prandom_u32() } % range) as u16;
        let reply_key = snat_reply_key(backend, node, port, key.proto);
        // A port a flow still holds (to this endpoint): try another. One whose flow is done
        // with it is overwritten; an unused one is taken only if no other CPU took it meanwhile.
        let flags = match unsafe { A::conntrack().get(reply_key) } {
            Some(old) if !port_free(old, key.proto, now) => {
                if reclaimable(old, now) && old.last_seen_ns < opening_seen {
                    (opening_port, opening_seen) = (port, old.last_seen_ns);
                }
                continue;
            }
            Some(_) => BPF_ANY,
            None => BPF_NOEXIST,
        };
        if A::conntrack()
            .insert(reply_key, reply, flags as u64)
            .is_err()
        {
            continue;
        }
        forward.nat_port = Be16::new(port);
        let _ = A::conntrack().insert(key, forward, BPF_ANY as u64);
        return Some(forward.nat_port);
    }
    // Every port tried is held: the range is nearly full for this endpoint, by live flows or
    // by a flood of SYNs nobody completes. The longest idle of the flows still being opened
    // gives its port up (netfilter's early_drop of unassured flows, for the same reason), so
    // that new connections keep being served while a flood runs; its own next packet finds
    // the port gone and starts a new flow.
    if opening_port == 0 {
        return None;
    }
    let reply_key = snat_reply_key(backend, node, opening_port, key.proto);
    // Unless another CPU changed the entry meanwhile.
    let old = unsafe { A::conntrack().get(reply_key) }?;
    if old.last_seen_ns != opening_seen || !reclaimable(old, now) {
        return None;
    }
    A::conntrack()
        .insert(reply_key, reply, BPF_ANY as u64)
        .ok()?;
    forward.nat_port = Be16::new(opening_port);
    let _ = A::conntrack().insert(key, forward, BPF_ANY as u64);
    Some(forward.nat_port)
}

/// A flow being opened idle this long gives its port up to a new flow when the range is full
/// ([`record_snat_flow`]): a handshake in progress is faster.
const SNAT_RECLAIM_IDLE_NS: u64 = 1_000_000_000;

/// Whether the live flow whose reply entry is `old` may give its port up: it is still being
/// opened (no data acknowledged yet) and has been idle [`SNAT_RECLAIM_IDLE_NS`].
#[inline(always)]
fn reclaimable<A: Family>(old: &CtValue<A>, now: u64) -> bool {
    old.flags & CT_OPENING != 0 && now.saturating_sub(old.last_seen_ns) > SNAT_RECLAIM_IDLE_NS
}

/// The reply entry's key of a flow sent to `backend` from `node`:`port`.
#[inline(always)]
fn snat_reply_key<A: Family>(backend: &Backend<A>, node: A, port: u16, proto: u8) -> CtKey<A> {
    CtKey {
        saddr: backend.addr,
        daddr: node,
        sport: backend.port,
        dport: Be16::new(port),
        proto,
        pad: [0; 3],
    }
}

/// The configured source port range of translated flows (the defaults until the agent wrote
/// one).
#[inline(always)]
fn snat_ports() -> (u16, u16) {
    let min = CONFIG.get(CONFIG_SNAT_PORT_MIN).copied().unwrap_or(0) as u16;
    let max = CONFIG.get(CONFIG_SNAT_PORT_MAX).copied().unwrap_or(0) as u16;
    if min == 0 || max < min {
        (SNAT_PORT_MIN, SNAT_PORT_MAX)
    } else {
        (min, max)
    }
}

/// Whether `old`, the reply entry of an earlier translated flow on a port (to the same
/// endpoint), leaves that port to a new flow: its flow went idle past its lifetime, or closed
/// more than [`SNAT_CLOSE_GRACE_NS`] ago ([`SNAT_TIME_WAIT_NS`] if the endpoint closed first).
/// Reusing closed flows' ports is what lets one node carry thousands of short connections a
/// second to one endpoint.
#[inline(always)]
fn port_free<A: Family>(old: &CtValue<A>, proto: u8, now: u64) -> bool {
    if old.flags & CT_CLOSING == 0 {
        return expired(old, proto, now);
    }
    let hold = if old.flags & CT_TIME_WAIT != 0 {
        SNAT_TIME_WAIT_NS
    } else {
        SNAT_CLOSE_GRACE_NS
    };
    now.saturating_sub(old.last_seen_ns) > hold
}

/// The reply entry of `flow` (a backend's packet to `client`) if its flow is live, touched along
/// with the flow's forward entry: the service address the packet must appear to come from. A
/// reply entry whose flow ended (expired, evicted, or now sent elsewhere) is deleted: later
/// traffic on its 5-tuple (the client talking to the backend directly, say) is not a reply to
/// the service.
/// `external`: the packet leaves the node (only external flows' replies do), else it goes to a
/// pod.
#[inline(always)]
pub fn reply<A: Family>(flow: &Flow<A>, client: A, external: bool) -> Option<(A, Be16)> {
    let entry = A::conntrack().get_ptr_mut(flow.key)?;
    // SAFETY: see established_flow().
    let entry = unsafe { &mut *entry };
    let wanted = if external { CT_EXTERNAL } else { 0 };
    if entry.direction != CT_REPLY || entry.flags & (CT_EXTERNAL | CT_SNAT) != wanted {
        return None;
    }
    live_reply(flow, entry, client, flow.key.dport)
}

/// A reply of an external flow sent from a node address (a packet from the endpoint to that
/// address and port), if its flow is live: the service address it must come from, and the
/// client address and port it goes back to.
#[inline(always)]
pub fn snat_reply<A: Family>(flow: &Flow<A>) -> Option<((A, Be16), (A, Be16))> {
    let entry = A::conntrack().get_ptr_mut(flow.key)?;
    // SAFETY: see established_flow().
    let entry = unsafe { &mut *entry };
    if entry.direction != CT_REPLY || entry.flags & CT_SNAT == 0 {
        return None;
    }
    let client = (entry.nat_addr, entry.nat_port);
    let service = live_reply(flow, entry, client.0, client.1)?;
    Some((service, client))
}

/// The service address of the reply entry `entry` (of a flow from `client`:`client_port`),
/// touched along with its flow's forward entry, if that is live and names the same backend;
/// otherwise the reply entry is deleted.
#[inline(always)]
fn live_reply<A: Family>(
    flow: &Flow<A>,
    entry: &mut CtValue<A>,
    client: A,
    client_port: Be16,
) -> Option<(A, Be16)> {
    let now = unsafe { bpf_ktime_get_ns() };
    let (vip, vport) = (entry.vip, entry.vport);
    let forward_key = forward_key_of(entry, client, client_port, flow.key.proto);
    let forward = A::conntrack()
        .get_ptr_mut(forward_key)
        .map(|f| unsafe { &mut *f })
        .filter(|f| forward_is_live(f, entry, flow.key.proto, now));
    let Some(forward) = forward else {
        let _ = A::conntrack().remove(flow.key);
        return None;
    };
    touch(entry, Some(forward), flow, now);
    Some((vip, vport))
}

/// The forward entry's key of the flow whose reply entry is `reply`: from its client
/// (`client`:`client_port`) to the service address the reply entry names.
#[inline(always)]
fn forward_key_of<A: Family>(
    reply: &CtValue<A>,
    client: A,
    client_port: Be16,
    proto: u8,
) -> CtKey<A> {
    CtKey {
        saddr: client,
        daddr: reply.vip,
        sport: client_port,
        dport: reply.vport,
        proto,
        pad: [0; 3],
    }
}

/// Whether `forward` is the live forward entry of the flow whose reply entry is `reply`.
#[inline(always)]
fn forward_is_live<A: Family>(
    forward: &CtValue<A>,
    reply: &CtValue<A>,
    proto: u8,
    now: u64,
) -> bool {
    forward.direction == CT_FORWARD
        && forward.backend_id == reply.backend_id
        && !expired(forward, proto, now)
}

/// The reply entry with the 5-tuple `reply_key`, if its flow is live: found from an ICMP error
/// about a packet sent towards a translated flow's client (the quoted packet, reversed). Looked
/// up, never touched: an error is no sign of life. `flags`: the flow's kind (`CT_EXTERNAL`,
/// `CT_SNAT`, both or none), exactly.
#[inline(always)]
pub fn related_to_reply<A: Family>(
    reply_key: &CtKey<A>,
    flags: u8,
    now: u64,
) -> Option<CtValue<A>> {
    let reply = unsafe { A::conntrack().get(reply_key) }.copied()?;
    if reply.direction != CT_REPLY || reply.flags & (CT_EXTERNAL | CT_SNAT) != flags {
        return None;
    }
    // The forward entry is keyed from the client: the reply entry's NAT fields name it where
    // they are set (external flows), else this 5-tuple's destination does.
    let (client, client_port) = match flags & CT_EXTERNAL != 0 {
        true => (reply.nat_addr, reply.nat_port),
        false => (reply_key.daddr, reply_key.dport),
    };
    let forward_key = forward_key_of(&reply, client, client_port, reply_key.proto);
    let forward = unsafe { A::conntrack().get(forward_key) }?;
    forward_is_live(forward, &reply, reply_key.proto, now).then_some(reply)
}

/// The external flow whose forward direction has the 5-tuple `forward_key` (client -> service
/// address), if it is live: found from an ICMP error about a packet sent to its client from the
/// service address. Its forward entry and backend; never touched.
#[inline(always)]
pub fn related_to_forward<A: Family>(
    forward_key: &CtKey<A>,
    now: u64,
) -> Option<(CtValue<A>, Backend<A>)> {
    let forward = unsafe { A::conntrack().get(forward_key) }.copied()?;
    if forward.direction != CT_FORWARD
        || forward.flags & CT_EXTERNAL == 0
        || expired(&forward, forward_key.proto, now)
    {
        return None;
    }
    let backend = unsafe { A::backends().get(forward.backend_id) }.copied()?;
    Some((forward, backend))
}

/// The 5-tuple of the other direction of `key`.
#[inline(always)]
pub fn reversed<A: Family>(key: &CtKey<A>) -> CtKey<A> {
    CtKey {
        saddr: key.daddr,
        daddr: key.saddr,
        sport: key.dport,
        dport: key.sport,
        proto: key.proto,
        pad: [0; 3],
    }
}

/// A new connection straight to `key.daddr` (no frontend): a reply entry left on its reverse
/// 5-tuple by an earlier flow through a frontend (the client reusing its port) must not rewrite
/// its replies once that flow is over (closed, expired or gone). An open flow's entry stays: the
/// packet may be that flow's own first packet, translated already and seen again (by the tc
/// program after XDP, or at a bridge after the pod's port). `external_only`: only entries of
/// flows from outside the node (the external programs' own).
#[inline(always)]
pub fn forget_finished_reply<A: Family>(key: &CtKey<A>, now: u64, external_only: bool) {
    let reverse = reversed(key);
    let Some(reply) = (unsafe { A::conntrack().get(reverse) }).copied() else {
        return;
    };
    let external = reply.flags & CT_EXTERNAL != 0;
    if reply.direction != CT_REPLY || (external_only && !external) {
        return;
    }
    // The forward entry is keyed from the client (an external flow's reply entry names it; a
    // pod's flow comes from this packet's source) to the service address.
    let (saddr, sport) = if external {
        (reply.nat_addr, reply.nat_port)
    } else {
        (key.saddr, key.sport)
    };
    let forward_key = forward_key_of(&reply, saddr, sport, key.proto);
    let open = unsafe { A::conntrack().get(forward_key) }
        .is_some_and(|f| forward_is_live(f, &reply, key.proto, now) && f.flags & CT_CLOSING == 0);
    if !open {
        let _ = A::conntrack().remove(reverse);
    }
}

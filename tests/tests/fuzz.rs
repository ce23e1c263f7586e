//! The tc programs fuzzed against the reference model (`proxy_tests::reference`): generated and
//! mutated frames go through `tc_ingress` or `tc_egress` under BPF_PROG_TEST_RUN and through the
//! model, and verdicts and bytes must be the same. About half the frames are IPv6 (which the
//! programs hand to `tc_ingress6` and `tc_egress6`): the services are dual-stack, each with an
//! IPv6 twin of its address and IPv6 endpoints (the sandbox's twins of its IPv4 endpoints, or
//! after some changes of other pods), and IPv6 frames come with extension headers where IPv4
//! ones come with options. At every step of time, and at least
//! every quarter second, the whole conntrack and session affinity maps of both families are
//! compared with the model's, last uses included. Meanwhile the agent's map writer reprograms
//! the services (endpoints added, removed, turned not ready or terminating; services deleted,
//! renamed and re-added; full syncs, which end the drains), and the maps must hold what the
//! desired state says.
//!
//! The model cannot tell a random pick from a kept affinity that happens to be the same
//! backend: that an affinity lapses is checked statistically (a lapsed client must not go back
//! to its old backend nearly every time).
//!
//! `FUZZ_SEED=<n>` replays a run (the seed is printed first), `FUZZ_FRAMES=<n>` sets the
//! number of frames (the default is a short run; CI's long form sets 1000000), and
//! `FUZZ_CHECK_EVERY=<n>` compares conntrack every n frames as well (1: after each frame, to find
//! the frame an entry went wrong at). The frames are a function of the seed, except for one
//! thing: the programs pick a new flow's backend with `bpf_get_prandom_u32`, and the backends'
//! replies are sent from the backend that was picked. A replay sends the same frames otherwise.
//!
//! Time: the model counts whole seconds. At each conntrack comparison the harness writes every
//! entry's last use as the kernel's clock then, plus half a second, minus the model's idle time;
//! a program's refresh afterwards writes a later time. So the kernel's idea of how long an entry
//! has been idle is the model's, minus half a second, plus the real time since the comparison.
//! Time passes only in steps of a multiple of [`AGE_UNIT`] (7) seconds, and no lifetime (10 s,
//! 60 s, 1 h, and the [`TCP_LIFETIME`] the run configures) is within 2 s of such a multiple: the two agree on every expiry as long as
//! comparisons are less than 2.5 s apart.
use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::Path,
    time::{Duration, Instant},
};

use aya::{
    maps::{HashMap as BpfHashMap, Map, MapData},
    programs::{SchedClassifier, TestRun, TestRunOptions},
};
use proxy_common::{
    Addr, AffinityKey, AffinityValue, Be16, Be32, Be128, CT_ANSWERED, CT_CLOSING, CT_FIN,
    CT_FORWARD, CT_HALF_CLOSED, CT_OPENING, CT_REPLY, CT_STATE_TCP_ESTABLISHED, CT_TIME_WAIT,
    CtKey, CtValue, MAP_AFFINITY, MAP_AFFINITY6, MAP_CONNTRACK, MAP_CONNTRACK6,
};
use proxy_tests::{
    packet::{self, ETH_HLEN, Spec},
    privileged,
    programs::{Programs, Svc, TC_ACT_SHOT, TC_ACT_UNSPEC, add_service, spn},
    reference::{
        self, AUTH, Client, DEST_OPTIONS, Direction, Entry, Event, FRAGMENT, HOP_BY_HOP, Headers,
        ICMPV6, IPV6_END, Model, Note, Outcome, ROUTING, TC_ACT_REDIRECT, TCP, Tables, Tuple, UDP,
        hairpin_of,
    },
    twin,
};
use proxy_userspace::{
    dataplane::Scope,
    model::{DesiredState, Endpoint, Placement, Protocol, ServicePortName},
    modes::ebpf::MapSizes,
    modes::ebpf::inspect::monotonic_ns,
};

/// Frames of the default (short) run.
const SHORT_RUN: u64 = 200_000;

/// Conntrack is large enough never to evict: an eviction the model does not know of would be
/// reported as a difference. The address space below bounds the number of flows.
const SIZES: MapSizes = MapSizes {
    services: 256,
    backends: 1024,
    conntrack: 1 << 16,
    conntrack6: 1 << 16,
};

const NS: u64 = 1_000_000_000;
/// Time steps are multiples of this many seconds (see the module documentation).
const AGE_UNIT: u64 = 7;
/// An established TCP flow's lifetime in the run (`--conntrack-tcp-timeout-established`).
const TCP_LIFETIME: Duration = Duration::from_secs(1200);
/// How often (at most) conntrack is compared and the kernel's clock put in step with the model's.
const CHECK_INTERVAL: Duration = Duration::from_millis(250);

// A small address space, so that flows meet: few clients and ports, backends that are clients
// too (a pod reaching itself through a service: hairpin), services sharing backends and
// target ports (flows of two services from one client port share a reply 5-tuple).
const VIP_A: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const VIP_B: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
const VIP_C: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 12);
const CLIENTS: [Ipv4Addr; 3] = [
    Ipv4Addr::new(10, 244, 1, 10),
    Ipv4Addr::new(10, 244, 1, 11),
    Ipv4Addr::new(10, 244, 1, 12),
];
const PODS: [Ipv4Addr; 3] = [
    Ipv4Addr::new(10, 244, 1, 11),
    Ipv4Addr::new(10, 244, 1, 12),
    Ipv4Addr::new(10, 244, 2, 11),
];
/// The node the programs run on.
const NODE: &str = "node1";
const CLIENT_PORTS: [u16; 4] = [40000, 40001, 40002, 40003];
/// Client ports used now and then: more flows, still a bounded number of them.
const MORE_CLIENT_PORTS: std::ops::Range<u16> = 41000..41064;

struct ServiceDef {
    /// A service goes by one of these at a time: a rename hands its address to another name.
    names: [&'static str; 2],
    vip: Ipv4Addr,
    port: u16,
    protocol: Protocol,
    target_port: u16,
    at_start: bool,
    /// sessionAffinity: ClientIP, with this timeout (seconds; 30 is clear of every multiple of
    /// [`AGE_UNIT`] by 2 s, as the lifetimes are).
    affinity: Option<u32>,
    /// internalTrafficPolicy: Local (this node is [`NODE`]).
    local: bool,
}

impl ServiceDef {
    /// The frontend of its IPv4 address, or of the IPv6 twin.
    fn frontend(&self, v6: bool) -> (IpAddr, u16, u8) {
        (in_family(self.vip, v6), self.port, self.protocol.number())
    }
}

/// `addr`, or its IPv6 twin (the sandbox's; 8.8.8.8's is Google's 2001:4860:4860::8888).
fn in_family(addr: Ipv4Addr, v6: bool) -> IpAddr {
    match (v6, addr.octets()) {
        (false, _) => addr.into(),
        (true, [8, 8, 8, 8]) => Ipv6Addr::new(0x2001, 0x4860, 0x4860, 0, 0, 0, 0, 0x8888).into(),
        (true, _) => twin(addr).into(),
    }
}

const SERVICES: [ServiceDef; 9] = [
    ServiceDef {
        names: ["web", "web-v2"],
        vip: VIP_A,
        port: 80,
        protocol: Protocol::Tcp,
        target_port: 8080,
        at_start: true,
        affinity: None,
        local: false,
    },
    ServiceDef {
        names: ["dns", "coredns"],
        vip: VIP_A,
        port: 53,
        protocol: Protocol::Udp,
        target_port: 53,
        at_start: true,
        affinity: None,
        local: false,
    },
    ServiceDef {
        names: ["dns-tcp", "coredns-tcp"],
        vip: VIP_A,
        port: 53,
        protocol: Protocol::Tcp,
        target_port: 53,
        at_start: true,
        affinity: None,
        local: false,
    },
    ServiceDef {
        names: ["api", "api-v2"],
        vip: VIP_B,
        port: 443,
        protocol: Protocol::Tcp,
        target_port: 8080,
        at_start: true,
        affinity: None,
        local: false,
    },
    ServiceDef {
        names: ["stats", "stats-v2"],
        vip: VIP_B,
        port: 443,
        protocol: Protocol::Udp,
        target_port: 8080,
        at_start: true,
        affinity: None,
        local: false,
    },
    ServiceDef {
        names: ["late", "later"],
        vip: VIP_C,
        port: 80,
        protocol: Protocol::Tcp,
        target_port: 8080,
        at_start: false,
        affinity: None,
        local: false,
    },
    ServiceDef {
        names: ["sticky", "sticky-v2"],
        vip: VIP_B,
        port: 8443,
        protocol: Protocol::Tcp,
        target_port: 8080,
        at_start: true,
        affinity: Some(30),
        local: false,
    },
    ServiceDef {
        names: ["sticky-udp", "sticky-udp-v2"],
        vip: VIP_B,
        port: 8443,
        protocol: Protocol::Udp,
        target_port: 8080,
        at_start: true,
        affinity: Some(30),
        local: false,
    },
    ServiceDef {
        names: ["node-dns", "node-dns-v2"],
        vip: VIP_C,
        port: 53,
        protocol: Protocol::Udp,
        target_port: 53,
        at_start: true,
        affinity: None,
        local: true,
    },
];

/// Addresses the generator sends to besides the services': near misses and elsewhere (or their
/// IPv6 twins).
const NOT_SERVICES: [(Ipv4Addr, u16, u8); 3] = [
    (VIP_A, 81, TCP),
    (VIP_C, 80, UDP),
    (Ipv4Addr::new(8, 8, 8, 8), 53, UDP),
];

const FIN: u8 = 0x01;
const SYN: u8 = 0x02;
const RST: u8 = 0x04;
const PSH: u8 = 0x08;
const ACK: u8 = 0x10;

/// splitmix64: small, fast, and good enough to drive a fuzzer.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// In 0..n (n > 0), uniform but for a negligible modulo bias.
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, num: usize, den: usize) -> bool {
        self.below(den) < num
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    fn byte(&mut self) -> u8 {
        self.next() as u8
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.byte()).collect()
    }
}

/// The cluster as the agent is told about it.
struct World {
    state: DesiredState,
    /// Which of its names each service has now (None: deleted).
    name: [Option<usize>; SERVICES.len()],
    /// What the last changes were, for a report.
    log: VecDeque<String>,
}

impl World {
    fn new(rng: &mut Rng) -> Self {
        let mut world = Self {
            state: DesiredState::new(NODE),
            name: [None; SERVICES.len()],
            log: VecDeque::new(),
        };
        for (i, def) in SERVICES.iter().enumerate() {
            if def.at_start {
                let mut eps = random_endpoints(rng, def);
                match eps.first_mut() {
                    Some(ep) => ep.ready = true, // something to start with
                    None => eps = vec![endpoint(PODS[i % PODS.len()], def.target_port)],
                }
                world.put(i, 0, eps);
            }
        }
        world
    }

    fn spn(&self, i: usize) -> Option<ServicePortName> {
        self.name[i].map(|n| spn(SERVICES[i].names[n], SERVICES[i].protocol))
    }

    /// Service `i` under its name `n`, with the IPv4 `endpoints` (sorted, unique, as the model
    /// keeps them); dual-stack: its address's IPv6 twin too, with the endpoints' twins.
    fn put(&mut self, i: usize, n: usize, endpoints: Vec<Endpoint>) -> ServicePortName {
        let twins = endpoints.iter().map(twin_endpoint).collect();
        self.put_families(i, n, endpoints, twins)
    }

    /// [`World::put`] with IPv6 endpoints of their own (twins of other pods than the IPv4
    /// ones', or other readiness: a dual-stack Service's EndpointSlices of each family are
    /// written apart).
    fn put_families(
        &mut self,
        i: usize,
        n: usize,
        endpoints: Vec<Endpoint>,
        endpoints6: Vec<Endpoint>,
    ) -> ServicePortName {
        let def = &SERVICES[i];
        let key = add_service(
            &mut self.state,
            &Svc {
                name: def.names[n],
                vip: def.vip,
                port: def.port,
                protocol: def.protocol,
                endpoints: &[],
            },
        );
        let port = self.state.port_mut(&key).unwrap();
        port.cluster_ips = [&port.cluster_ips[..], &[in_family(def.vip, true)]]
            .concat()
            .into();
        port.session_affinity_timeout = def.affinity.and_then(std::num::NonZeroU32::new);
        port.internal_traffic_local = def.local;
        self.state
            .set_endpoints(key.clone(), [endpoints, endpoints6].concat());
        self.name[i] = Some(n);
        key
    }

    fn remove(&mut self, i: usize) -> ServicePortName {
        let key = self.spn(i).expect("a present service");
        self.state.remove_port(&key);
        self.name[i] = None;
        key
    }

    /// One random change; returns the ports it changed, and whether to sync everything (which
    /// also ends the drains: the drain period is zero).
    fn change(&mut self, rng: &mut Rng) -> (BTreeSet<ServicePortName>, bool) {
        let i = rng.below(SERVICES.len());
        let def = &SERVICES[i];
        let mut changed = BTreeSet::new();
        let what = match (rng.below(10), self.name[i]) {
            (0..=3, Some(n)) => {
                let eps = random_endpoints(rng, def);
                let what = format!("{}: endpoints {}", def.names[n], show_endpoints(&eps));
                changed.insert(self.put(i, n, eps));
                what
            }
            (4..=5, Some(n)) => {
                let key = self.spn(i).unwrap();
                let all = self.state.endpoints_of(&key);
                let mut eps: Vec<Endpoint> =
                    all.iter().filter(|ep| ep.ip.is_ipv4()).cloned().collect();
                if eps.is_empty() {
                    eps = random_endpoints(rng, def);
                } else {
                    let k = rng.below(eps.len());
                    let ready = !eps[k].ready;
                    set_ready(&mut eps[k], ready, rng);
                }
                let what = format!("{}: endpoints {}", def.names[n], show_endpoints(&eps));
                changed.insert(self.put(i, n, eps));
                what
            }
            (8, Some(n)) => {
                // The IPv6 endpoints alone change: each family's differ from now on.
                let key = self.spn(i).unwrap();
                let v4: Vec<Endpoint> = (self.state.endpoints_of(&key).iter())
                    .filter(|ep| ep.ip.is_ipv4())
                    .cloned()
                    .collect();
                let v6: Vec<Endpoint> = random_endpoints(rng, def)
                    .iter()
                    .map(twin_endpoint)
                    .collect();
                let what = format!("{}: IPv6 endpoints {}", def.names[n], show_endpoints(&v6));
                changed.insert(self.put_families(i, n, v4, v6));
                what
            }
            (6, Some(n)) => {
                changed.insert(self.remove(i));
                format!("{}: deleted", def.names[n])
            }
            (7, Some(n)) => {
                // Renamed, keeping the address (kube-dns replaced by coredns), in one sync.
                let eps = random_endpoints(rng, def);
                changed.insert(self.remove(i));
                let what = format!(
                    "{} renamed {}: endpoints {}",
                    def.names[n],
                    def.names[1 - n],
                    show_endpoints(&eps)
                );
                changed.insert(self.put(i, 1 - n, eps));
                what
            }
            (0..=7, None) => {
                let n = rng.below(2);
                let eps = random_endpoints(rng, def);
                let what = format!(
                    "{}: created, endpoints {}",
                    def.names[n],
                    show_endpoints(&eps)
                );
                changed.insert(self.put(i, n, eps));
                what
            }
            _ => "nothing".to_owned(),
        };
        let all = changed.is_empty() || rng.chance(1, 5);
        self.log.push_back(format!(
            "{what} ({})",
            if all { "full sync" } else { "sync" }
        ));
        if self.log.len() > 16 {
            self.log.pop_front();
        }
        (changed, all)
    }
}

fn set_ready(ep: &mut Endpoint, ready: bool, rng: &mut Rng) {
    ep.ready = ready;
    // Not ready: starting up, or terminating (still serving or not); the map writer only
    // looks at `ready`.
    ep.terminating = !ready && rng.chance(1, 2);
    ep.serving = ready || (ep.terminating && rng.chance(1, 2));
}

fn random_endpoints(rng: &mut Rng, def: &ServiceDef) -> Vec<Endpoint> {
    let mut eps = Vec::new();
    for pod in PODS {
        if rng.chance(2, 3) {
            let mut ep = endpoint(pod, def.target_port);
            if rng.chance(1, 6) {
                set_ready(&mut ep, false, rng);
            }
            eps.push(ep);
        }
    }
    eps
}

/// `ep` at its pod's IPv6 twin.
fn twin_endpoint(ep: &Endpoint) -> Endpoint {
    Endpoint {
        ip: twin(ep.ipv4().expect("IPv4 endpoints")).into(),
        ..ep.clone()
    }
}

fn endpoint(pod: Ipv4Addr, port: u16) -> Endpoint {
    Endpoint {
        ip: IpAddr::V4(pod),
        port,
        ready: true,
        serving: true,
        terminating: false,
        // Pods of 10.244.1.0/24 run on this node.
        placement: Placement::shared(
            Some(if pod.octets()[2] == 1 { NODE } else { "node2" }),
            None,
        ),
    }
}

fn show_endpoints(eps: &[Endpoint]) -> String {
    let shown: Vec<String> = eps
        .iter()
        .map(|e| format!("{}{}", e.ip, if e.ready { "" } else { " (not ready)" }))
        .collect();
    format!("[{}]", shown.join(", "))
}

/// The maps hold what the state asks for: each service's frontend sends new flows to exactly the
/// endpoints the state says new connections go to (the ready ones, or, when none is, the serving
/// terminating ones); a deleted service's frontend is draining or gone.
fn check_programmed(world: &World, tables: &Tables) -> Result<(), String> {
    for (i, def) in SERVICES.iter().enumerate() {
        for v6 in [false, true] {
            let fe = tables.frontends.get(&def.frontend(v6));
            match world.spn(i) {
                Some(key) => {
                    let fe = fe.ok_or_else(|| format!("{key}: no frontend (IPv6: {v6})"))?;
                    let backends = tables.backends_of(in_family(def.vip, v6));
                    let mut have: Vec<(IpAddr, u16)> = (fe.slots.iter())
                        .map(|id| (backends[id].addr, backends[id].port))
                        .collect();
                    have.sort();
                    let mut want: Vec<(IpAddr, u16)> = (world.state.cluster_endpoints(&key))
                        .into_iter()
                        .filter(|ep| ep.ip.is_ipv6() == v6)
                        .map(|ep| (ep.ip, ep.port))
                        .collect();
                    want.sort();
                    if fe.draining || have != want {
                        return Err(format!(
                            "{key}: frontend {fe:?}, backends {have:?}, wanted {want:?}"
                        ));
                    }
                }
                None => {
                    if fe.is_some_and(|fe| !fe.draining || !fe.slots.is_empty()) {
                        return Err(format!("{}: deleted, yet {fe:?}", def.names[0]));
                    }
                }
            }
        }
    }
    let known = |k: &(IpAddr, u16, u8)| {
        (SERVICES.iter()).any(|d| d.frontend(false) == *k || d.frontend(true) == *k)
    };
    match tables.frontends.keys().find(|k| !known(k)) {
        Some(k) => Err(format!("a frontend no service had: {k:?}")),
        None => Ok(()),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Prog {
    Ingress,
    Egress,
}

impl Prog {
    fn name(self) -> &'static str {
        match self {
            Prog::Ingress => "tc_ingress",
            Prog::Egress => "tc_egress",
        }
    }
}

/// What the generator meant a frame to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    /// A client to a service address (or a near miss).
    ToService,
    /// Again on a recent client 5-tuple.
    Again,
    /// A backend's packet to a client of a recent flow (or to the hairpin address).
    Reply,
    /// A step of a scripted TCP connection (handshake, data, FIN/RST endings) or UDP exchange.
    Session,
    /// A pod to another pod directly, or to an address that is no service.
    Direct,
    /// A pod to the hairpin address, out of the blue.
    Stray,
    /// An ICMP error (or another ICMP message) to a pod about a packet of a recent flow as the
    /// node sent it on.
    IcmpError,
    /// A datagram of a recent flow (either way) in two fragments: the first now, the later one
    /// soon after (now and then before the first, or never).
    Fragments,
    /// One of the above, mutated (truncated, bad lengths, IHL, version, fragments, protocol,
    /// IPv6 extension headers, ethertype, checksums, flipped bytes, trailing bytes).
    Mutant,
    /// Random bytes.
    Random,
}

struct Frame {
    prog: Prog,
    bytes: Vec<u8>,
    kind: Kind,
}

#[derive(Clone, Copy, Debug)]
enum Step {
    /// The client sends on the flow.
    Client(Tuple, u8),
    /// The flow's backend sends to the client.
    Backend(Tuple, u8),
}

struct Generator {
    rng: Rng,
    /// Recent client 5-tuples (to service addresses, mostly).
    recent: Vec<Tuple>,
    /// Scripted exchanges under way, their next steps.
    scripts: Vec<VecDeque<Step>>,
    /// Later fragments of datagrams whose first fragment went already.
    fragments: Vec<Frame>,
}

impl Generator {
    fn new(seed: u64) -> Self {
        Self {
            rng: Rng(seed),
            recent: Vec::new(),
            scripts: Vec::new(),
            fragments: Vec::new(),
        }
    }

    fn next(&mut self, model: &Model) -> Frame {
        if !self.fragments.is_empty() && self.rng.chance(1, 3) {
            let i = self.rng.below(self.fragments.len());
            return self.fragments.swap_remove(i);
        }
        if !self.scripts.is_empty() && self.rng.chance(1, 3) {
            let i = self.rng.below(self.scripts.len());
            let step = self.scripts[i].pop_front().expect("scripts are not empty");
            if self.scripts[i].is_empty() {
                self.scripts.swap_remove(i);
            }
            return self.step(model, step, Kind::Session);
        }
        match self.rng.below(1000) {
            0..280 => {
                let t = self.new_client_tuple();
                let flags = self.tcp_flags();
                let prog = if self.rng.chance(1, 30) {
                    Prog::Egress
                } else {
                    Prog::Ingress
                };
                self.frame(prog, t, flags, Kind::ToService)
            }
            280..430 => {
                let t = self.recent_tuple();
                let flags = self.tcp_flags();
                self.step(model, Step::Client(t, flags), Kind::Again)
            }
            430..600 => {
                let t = self.recent_tuple();
                let flags = self.tcp_flags();
                let mut f = self.step(model, Step::Backend(t, flags), Kind::Reply);
                if self.rng.chance(1, 12) {
                    f.prog = other(f.prog);
                }
                f
            }
            600..610 => self.icmp_error(model),
            610..620 => self.fragments(model),
            620..680 => {
                let script = self.script();
                self.scripts.push(script);
                let last = self.scripts.len() - 1;
                let step = self.scripts[last].pop_front().unwrap();
                self.step(model, step, Kind::Session)
            }
            680..740 => self.direct(model),
            740..760 => {
                let v6 = self.rng.chance(1, 2);
                let pod = in_family(self.rng.pick(&CLIENTS), v6);
                let any_port = self.rng.next() as u16;
                let t = Tuple {
                    src: pod,
                    dst: hairpin_of(pod),
                    sport: self.rng.pick(&[8080, 53, any_port]),
                    dport: self.rng.pick(&CLIENT_PORTS),
                    proto: self.rng.pick(&[TCP, UDP]),
                };
                let flags = self.tcp_flags();
                self.frame(Prog::Ingress, t, flags, Kind::Stray)
            }
            760..960 => {
                let mut f = match self.rng.below(4) {
                    3 => self.icmp_error(model),
                    0 => {
                        let t = self.new_client_tuple();
                        let flags = self.tcp_flags();
                        self.frame(Prog::Ingress, t, flags, Kind::Mutant)
                    }
                    1 => {
                        let t = self.recent_tuple();
                        let flags = self.tcp_flags();
                        self.step(model, Step::Client(t, flags), Kind::Mutant)
                    }
                    _ => {
                        let t = self.recent_tuple();
                        let flags = self.tcp_flags();
                        self.step(model, Step::Backend(t, flags), Kind::Mutant)
                    }
                };
                f.kind = Kind::Mutant;
                for _ in 0..1 + self.rng.below(2) {
                    self.mutate(&mut f.bytes);
                }
                if self.rng.chance(1, 5) {
                    f.prog = other(f.prog);
                }
                f
            }
            _ => {
                // IPv6's fixed header alone is 40 bytes.
                let v6 = self.rng.chance(1, 2);
                let len = self.rng.below(if v6 { 141 } else { 101 });
                let mut bytes = self.rng.bytes(len);
                if len >= 15 && self.rng.chance(1, 2) {
                    let ethertype: u16 = if v6 { 0x86dd } else { 0x0800 };
                    bytes[12..14].copy_from_slice(&ethertype.to_be_bytes());
                    if self.rng.chance(1, 2) {
                        bytes[14] = if v6 { 0x60 } else { 0x45 };
                    }
                    // Now and then a payload length that fits, and TCP or UDP next.
                    if v6 && len >= IPV6_END && self.rng.chance(1, 2) {
                        let payload = (len - IPV6_END) as u16;
                        bytes[ETH_HLEN + 4..ETH_HLEN + 6].copy_from_slice(&payload.to_be_bytes());
                        bytes[ETH_HLEN + 6] = self.rng.pick(&[TCP, UDP, FRAGMENT, ICMPV6]);
                    }
                }
                let prog = if self.rng.chance(1, 2) {
                    Prog::Ingress
                } else {
                    Prog::Egress
                };
                Frame {
                    prog,
                    bytes,
                    kind: Kind::Random,
                }
            }
        }
    }

    fn new_client_tuple(&mut self) -> Tuple {
        let v6 = self.rng.chance(1, 2);
        let src = in_family(self.rng.pick(&CLIENTS), v6);
        let sport = if self.rng.chance(1, 10) {
            MORE_CLIENT_PORTS.start + self.rng.below(MORE_CLIENT_PORTS.len()) as u16
        } else {
            self.rng.pick(&CLIENT_PORTS)
        };
        let (dst, dport, proto) = if self.rng.chance(1, 10) {
            let (addr, port, proto) = self.rng.pick(&NOT_SERVICES);
            (in_family(addr, v6), port, proto)
        } else {
            SERVICES[self.rng.below(SERVICES.len())].frontend(v6)
        };
        let t = Tuple {
            src,
            dst,
            sport,
            dport,
            proto,
        };
        if self.recent.len() < 48 {
            self.recent.push(t);
        } else {
            let i = self.rng.below(self.recent.len());
            self.recent[i] = t;
        }
        t
    }

    fn recent_tuple(&mut self) -> Tuple {
        if self.recent.is_empty() {
            return self.new_client_tuple();
        }
        let i = self.rng.below(self.recent.len());
        self.recent[i]
    }

    fn tcp_flags(&mut self) -> u8 {
        match self.rng.below(20) {
            0..=3 => SYN,
            4..=7 => ACK,
            8..=9 => PSH | ACK,
            10..=11 => FIN | ACK,
            12 => RST,
            13 => RST | ACK,
            14 => SYN | ACK,
            15 => FIN,
            16 => 0,
            17 => SYN | FIN,
            _ => self.rng.byte(),
        }
    }

    /// Where the backend of the client flow `t` is: the one the model knows the flow went to,
    /// or else one it might have gone to. (Randomness is drawn either way, so that the frames
    /// that follow do not depend on the programs' random picks.)
    fn backend_of(&mut self, model: &Model, t: &Tuple) -> (IpAddr, u16) {
        let v6 = t.src.is_ipv6();
        let port = SERVICES
            .iter()
            .find(|d| d.frontend(v6) == (t.dst, t.dport, t.proto))
            .map_or(8080, |d| d.target_port);
        let guess = (in_family(self.rng.pick(&PODS), v6), port);
        match model.conntrack().get(t) {
            Some(e) if e.direction == Direction::Forward => e.backend,
            _ => guess,
        }
    }

    fn step(&mut self, model: &Model, step: Step, kind: Kind) -> Frame {
        match step {
            Step::Client(t, flags) => self.frame(Prog::Ingress, t, flags, kind),
            Step::Backend(t, flags) => {
                let (addr, port) = self.backend_of(model, &t);
                // A pod's reply to itself goes to the hairpin address, and leaves it on ingress.
                let (dst, prog) = if addr == t.src {
                    (hairpin_of(addr), Prog::Ingress)
                } else {
                    (t.src, Prog::Egress)
                };
                let reply = Tuple {
                    src: addr,
                    dst,
                    sport: port,
                    dport: t.sport,
                    proto: t.proto,
                };
                self.frame(prog, reply, flags, kind)
            }
        }
    }

    /// An ICMP message to a pod about a recent flow's packet as the node sent it on (to the
    /// backend it went to, or might have): an error from that backend or from a router, or
    /// now and then a message that is no error; quoting the least a router sends or more (an
    /// IPv6 packet now and then as its first fragment). Now and then to the other program.
    fn icmp_error(&mut self, model: &Model) -> Frame {
        let t = self.recent_tuple();
        let flags = self.tcp_flags();
        let (addr, port) = self.backend_of(model, &t);
        let sent = Tuple {
            dst: addr,
            dport: port,
            ..t
        };
        let mut quoted = self.frame(Prog::Egress, sent, flags, Kind::IcmpError).bytes;
        let v6 = addr.is_ipv6();
        let from = self
            .rng
            .pick(&[addr, in_family(Ipv4Addr::new(10, 244, 9, 1), v6)]);
        let (kind, code) = if v6 {
            // Port unreachable, no route, packet too big, time exceeded, parameter problem;
            // echo request and reply, neighbour solicitation are no errors.
            self.rng.pick(&[
                (1, 4),
                (1, 0),
                (2, 0),
                (3, 0),
                (4, 0),
                (128, 0),
                (129, 0),
                (135, 0),
            ])
        } else {
            // Port unreachable, fragmentation needed, time exceeded, parameter problem; echo
            // reply and redirect are no errors.
            self.rng
                .pick(&[(3, 3), (3, 4), (11, 0), (12, 0), (0, 0), (5, 1)])
        };
        let quote = self.rng.pick(&[8, 12, 20, 28, 100]);
        if v6 && self.rng.chance(1, 4) {
            let cut = 8 * (1 + self.rng.below(3));
            if cut < payload_len6(&quoted) {
                quoted = packet::fragments(&quoted, cut).0;
            }
        }
        let prog = if self.rng.chance(1, 10) {
            Prog::Ingress
        } else {
            Prog::Egress
        };
        Frame {
            prog,
            bytes: packet::icmp_error(from, kind, code, &quoted, quote),
            kind: Kind::IcmpError,
        }
    }

    /// A packet of a recent flow, from its client or its backend, cut in two fragments at a
    /// multiple of 8 bytes past the whole L4 header (IPv4: the first also lacks don't-fragment;
    /// IPv6: a fragment header after the fixed one). The first is returned, the later one kept
    /// for soon; now and then the other way round, or the later one lost.
    fn fragments(&mut self, model: &Model) -> Frame {
        let t = self.recent_tuple();
        let flags = self.tcp_flags();
        let step = match self.rng.chance(1, 2) {
            true => Step::Client(t, flags),
            false => Step::Backend(t, flags),
        };
        let whole = self.step(model, step, Kind::Fragments);
        let bytes = &whole.bytes;
        let Ok(h) = reference::parse(bytes) else {
            return whole;
        };
        // Where the fragmentable part starts, and where the datagram ends.
        let (header_end, end) = if t.src.is_ipv6() {
            (IPV6_END, IPV6_END + payload_len6(bytes))
        } else {
            let header_len = usize::from(bytes[ETH_HLEN] & 0x0f) * 4;
            let total = usize::from(u16::from_be_bytes([
                bytes[ETH_HLEN + 2],
                bytes[ETH_HLEN + 3],
            ]));
            (ETH_HLEN + header_len, ETH_HLEN + total)
        };
        let l4_len: usize = if t.proto == TCP { 20 } else { 8 };
        let cut = (h.l4 + l4_len - header_end).next_multiple_of(8) + 8 * self.rng.below(2);
        if header_end + cut >= end {
            return whole; // too short to cut: sent whole
        }
        let (mut first, mut later) = packet::fragments(bytes, cut);
        if t.src.is_ipv6() {
            let id = self.fragment_id();
            for piece in [&mut first, &mut later] {
                piece[IPV6_END + 4..IPV6_END + 8].copy_from_slice(&id.to_be_bytes());
            }
        }
        let piece = |bytes| Frame {
            prog: whole.prog,
            bytes,
            kind: Kind::Fragments,
        };
        let (first, later) = (piece(first), piece(later));
        match self.rng.below(10) {
            0 => {
                self.fragments.push(first);
                later
            }
            1 => first,
            _ => {
                self.fragments.push(later);
                first
            }
        }
    }

    /// An IPv6 datagram's identification: few of them (as IPv4's, mostly one: see
    /// [`Self::frame`]), so that datagrams meet and the fragments map stays small.
    fn fragment_id(&mut self) -> u32 {
        match self.rng.chance(1, 4) {
            true => 0x1234 | u32::from(self.rng.byte()) << 24,
            false => 0x1234,
        }
    }

    /// A connection's or exchange's packets, both ways.
    fn script(&mut self) -> VecDeque<Step> {
        let t = if self.rng.chance(1, 2) {
            self.new_client_tuple()
        } else {
            self.recent_tuple()
        };
        use Step::{Backend as B, Client as C};
        let mut steps = if t.proto == UDP {
            vec![C(t, 0), B(t, 0), C(t, 0), B(t, 0), B(t, 0)]
        } else {
            vec![
                C(t, SYN),
                B(t, SYN | ACK),
                C(t, ACK),
                C(t, PSH | ACK),
                B(t, PSH | ACK),
            ]
        };
        if t.proto == TCP {
            steps.extend(match self.rng.below(6) {
                // Closed by both FINs; what follows the close is not refreshed; a new SYN
                // reopens the 5-tuple.
                0 => vec![
                    C(t, FIN | ACK),
                    B(t, FIN | ACK),
                    C(t, ACK),
                    B(t, ACK),
                    C(t, SYN),
                ],
                1 => vec![B(t, FIN | ACK), C(t, FIN | ACK), C(t, ACK)],
                2 => vec![C(t, RST)],
                3 => vec![B(t, RST | ACK), C(t, ACK)],
                // A half-close keeps the flow.
                4 => vec![C(t, FIN | ACK), C(t, PSH | ACK), B(t, PSH | ACK)],
                _ => vec![],
            });
        }
        steps.into()
    }

    /// A pod straight to another pod or elsewhere: to the backend of a recent flow from its
    /// client port (a bare SYN there forgets that flow's reply entry), to any pod, or a pod's
    /// packet to another on egress.
    fn direct(&mut self, model: &Model) -> Frame {
        let flags = self.tcp_flags();
        match self.rng.below(3) {
            0 => {
                let t = self.recent_tuple();
                let backend = self.backend_of(model, &t);
                let flags = if self.rng.chance(1, 2) { SYN } else { flags };
                let direct = Tuple {
                    dst: backend.0,
                    dport: backend.1,
                    ..t
                };
                self.frame(Prog::Ingress, direct, flags, Kind::Direct)
            }
            n => {
                let v6 = self.rng.chance(1, 2);
                let t = Tuple {
                    src: in_family(self.rng.pick(&CLIENTS), v6),
                    dst: in_family(self.rng.pick(&PODS), v6),
                    sport: self.rng.pick(&CLIENT_PORTS),
                    dport: self.rng.pick(&[8080, 53]),
                    proto: self.rng.pick(&[TCP, UDP]),
                };
                let prog = if n == 1 { Prog::Ingress } else { Prog::Egress };
                self.frame(prog, t, flags, Kind::Direct)
            }
        }
    }

    /// A well-formed frame for `t` (IPv4 options or IPv6 extension headers, payload, MACs, TTL
    /// and id or hop limit and flow label vary; now and then a UDP zero checksum, or Ethernet
    /// padding after the IP packet).
    fn frame(&mut self, prog: Prog, t: Tuple, tcp_flags: u8, kind: Kind) -> Frame {
        let v6 = t.src.is_ipv6();
        let (ip_options, ext_headers) = match (self.rng.chance(1, 6), v6) {
            (true, false) => (self.ip_options(), vec![]),
            (true, true) => (vec![], self.ext_headers()),
            (false, _) => (vec![], vec![]),
        };
        let payload_len = self.rng.below(25);
        let spec = Spec {
            src: t.src,
            dst: t.dst,
            sport: t.sport,
            dport: t.dport,
            proto: t.proto,
            ip_options,
            payload: self.rng.bytes(payload_len),
            tcp_flags,
            udp_zero_checksum: t.proto == UDP && self.rng.chance(1, 5),
            seq: self.seq_number(),
            ack: self.seq_number(),
        };
        let mut bytes = spec.build();
        insert_ext_headers(&mut bytes, &ext_headers);
        if self.rng.chance(1, 2) {
            let macs = self.rng.bytes(12);
            bytes[..12].copy_from_slice(&macs);
        }
        if self.rng.chance(1, 4) {
            if v6 {
                bytes[ETH_HLEN + 3] = self.rng.byte(); // flow label
                bytes[ETH_HLEN + 7] = self.rng.byte(); // hop limit
            } else {
                bytes[ETH_HLEN + 4] = self.rng.byte(); // id
                bytes[ETH_HLEN + 8] = self.rng.byte(); // TTL
                packet::set_ip_checksum(&mut bytes);
            }
        }
        if self.rng.chance(1, 10) {
            let n = 1 + self.rng.below(20);
            bytes.extend(self.rng.bytes(n));
        }
        Frame { prog, bytes, kind }
    }

    /// IPv4 options: NOPs, a record route, or anything.
    fn ip_options(&mut self) -> Vec<u8> {
        let words = 1 + self.rng.below(10);
        match self.rng.below(3) {
            0 => {
                let mut o = vec![1u8; words * 4]; // NOPs, then end of options
                *o.last_mut().unwrap() = 0;
                o
            }
            1 => {
                // Record route, with its pointer at the first free slot.
                let mut o = vec![0u8; words * 4];
                o[0] = 7;
                o[1] = (words * 4 - 1).min(39) as u8;
                o[2] = 4;
                o
            }
            _ => self.rng.bytes(words * 4),
        }
    }

    /// IPv6 extension headers (see [`insert_ext_headers`]): mostly one to three of hop-by-hop
    /// and destination options, a routing header, AH, an atomic fragment; now and then more
    /// than the programs walk.
    fn ext_headers(&mut self) -> Vec<(u8, Vec<u8>)> {
        let n = if self.rng.chance(1, 10) {
            6 + self.rng.below(2)
        } else {
            1 + self.rng.below(3)
        };
        (0..n).map(|_| self.ext_header()).collect()
    }

    /// One IPv6 extension header: its number, and its bytes (the first, the next header, is
    /// filled in when it is inserted).
    fn ext_header(&mut self) -> (u8, Vec<u8>) {
        match self.rng.below(5) {
            0 | 1 => {
                // Hop-by-hop or destination options: PadN to a length of 8 or 16 bytes.
                let units = self.rng.below(2);
                let mut h = vec![0, units as u8, 1, (6 + 8 * units - 2) as u8];
                h.resize(8 + 8 * units, 0);
                (self.rng.pick(&[HOP_BY_HOP, DEST_OPTIONS]), h)
            }
            2 => {
                // A routing header of type 4 (segment routing) with no segments left.
                let mut h = vec![0, 0, 4, 0];
                h.resize(8, 0);
                (ROUTING, h)
            }
            3 => {
                // AH: its length in 4-byte units, minus 2; SPI, sequence number, a 12-byte ICV.
                let mut h = vec![0, 4, 0, 0];
                h.extend(self.rng.bytes(20));
                (AUTH, h)
            }
            _ => {
                // An atomic fragment: offset 0, no more fragments.
                let mut h = vec![0, 0, 0, 0];
                h.extend(self.fragment_id().to_be_bytes());
                (FRAGMENT, h)
            }
        }
    }

    /// A TCP sequence or acknowledgment number: mostly near one place (in window, moving it on
    /// a little), now and then a little or far out of window, or anywhere.
    fn seq_number(&mut self) -> u32 {
        let units: u16 = match self.rng.below(20) {
            0..=9 => 0x4000,
            10..=12 => 0x4001,
            13 => 0x3fff,
            14 => 0x3ffe,
            15 => 0x4008,
            16 => 0x4009,
            17 => 0x4000u16.wrapping_add(0x8000),
            18 => 0,
            _ => self.rng.next() as u16,
        };
        (u32::from(units) << 16) | u32::from(self.rng.next() as u16)
    }

    /// One byte of `f` (not empty) flipped somewhere.
    fn flip_byte(&mut self, f: &mut [u8]) {
        let i = self.rng.below(f.len());
        f[i] ^= 1 + self.rng.below(255) as u8;
    }

    /// The checksum at `at` in `f` made 0, all ones, or anything.
    fn bad_checksum(&mut self, f: &mut [u8], at: usize) {
        let any = self.rng.next() as u16;
        let c = self.rng.pick(&[0, 0xffff, any]);
        f[at..at + 2].copy_from_slice(&c.to_be_bytes());
    }

    fn mutate(&mut self, f: &mut Vec<u8>) {
        if is_ipv6(f) {
            return self.mutate6(f);
        }
        if f.len() < ETH_HLEN + 20 {
            if !f.is_empty() {
                self.flip_byte(f);
            }
            return;
        }
        let ip = ETH_HLEN;
        let l4 = reference::parse(f).ok().map(|h| h.l4);
        match self.rng.below(12) {
            0 => f.truncate(self.rng.below(f.len())),
            1 => f[ip] = (f[ip] & 0xf0) | self.rng.below(16) as u8,
            2 => f[ip] = ((self.rng.below(16) as u8) << 4) | (f[ip] & 0x0f),
            3 => {
                let total = u16::from_be_bytes([f[ip + 2], f[ip + 3]]);
                let len = (f.len() - ETH_HLEN) as u16;
                let new = match self.rng.below(5) {
                    0 => self.rng.next() as u16,
                    1 => total.saturating_sub(1 + self.rng.below(8) as u16),
                    2 => total + 1 + self.rng.below(8) as u16,
                    3 => len,
                    _ => (usize::from(f[ip] & 0x0f) * 4 + self.rng.pick(&[7, 8, 19, 20])) as u16,
                };
                f[ip + 2..ip + 4].copy_from_slice(&new.to_be_bytes());
            }
            4 => {
                let frag: u16 = match self.rng.below(6) {
                    0 => 0x2000,                            // more fragments
                    1 => 1 + self.rng.below(0x1fff) as u16, // a later fragment
                    2 => 0x2000 | (1 + self.rng.below(0x1fff) as u16),
                    3 => 0x4000, // don't fragment: fine
                    4 => 0x8000, // the reserved bit: fine
                    _ => 0x6000,
                };
                f[ip + 6..ip + 8].copy_from_slice(&frag.to_be_bytes());
            }
            5 => {
                f[ip + 9] = match f[ip + 9] {
                    TCP if self.rng.chance(1, 3) => UDP,
                    UDP if self.rng.chance(1, 3) => TCP,
                    _ => self.rng.pick(&[0, 1, 2, 47, 50, 58, 132, 255]),
                }
            }
            6 => {
                let ethertype: u16 = self.rng.pick(&[0x0806, 0x86dd, 0x8100, 0x88cc, 0x0801]);
                f[12..14].copy_from_slice(&ethertype.to_be_bytes());
            }
            7 => {
                self.bad_checksum(f, ip + 10);
            }
            8 => {
                let at = match l4 {
                    Some(l4) => l4 + if f[ip + 9] == TCP { 16 } else { 6 },
                    None => ip + 10,
                };
                self.bad_checksum(f, at);
            }
            9 => {
                for _ in 0..1 + self.rng.below(4) {
                    self.flip_byte(f);
                }
            }
            10 => match l4 {
                // The TCP data offset and flags, anything.
                Some(l4) if f[ip + 9] == TCP => {
                    f[l4 + 12] = self.rng.byte();
                    f[l4 + 13] = self.rng.byte();
                }
                _ => f[ip + 1] = self.rng.byte(), // DSCP/ECN
            },
            _ => {
                let n = 1 + self.rng.below(40);
                f.extend(self.rng.bytes(n));
            }
        }
    }

    /// [`Self::mutate`] of an IPv6 frame: truncated, bad payload lengths (a jumbogram's 0),
    /// version, next header, fragment and other extension headers (too many, cut short, odd
    /// lengths), ethertype, checksum, flipped bytes, TCP flags, trailing bytes.
    fn mutate6(&mut self, f: &mut Vec<u8>) {
        if f.len() < IPV6_END {
            if !f.is_empty() {
                self.flip_byte(f);
            }
            return;
        }
        let ip = ETH_HLEN;
        let l4 = reference::parse(f).ok().map(|h| h.l4_checksum_at());
        match self.rng.below(12) {
            0 => f.truncate(self.rng.below(f.len())),
            1 => f[ip] = ((self.rng.below(16) as u8) << 4) | (f[ip] & 0x0f),
            2 => {
                let payload = payload_len6(f) as u16;
                let len = (f.len() - IPV6_END) as u16;
                let new = match self.rng.below(6) {
                    0 => self.rng.next() as u16,
                    1 => payload.saturating_sub(1 + self.rng.below(8) as u16),
                    2 => payload + 1 + self.rng.below(8) as u16,
                    3 => len,
                    4 => 0,
                    _ => self.rng.pick(&[7, 8, 19, 20, 27, 28]),
                };
                f[ip + 4..ip + 6].copy_from_slice(&new.to_be_bytes());
            }
            3 => {
                f[ip + 6] = match f[ip + 6] {
                    TCP if self.rng.chance(1, 3) => UDP,
                    UDP if self.rng.chance(1, 3) => TCP,
                    _ => self.rng.pick(&[
                        HOP_BY_HOP,
                        ROUTING,
                        FRAGMENT,
                        AUTH,
                        DEST_OPTIONS,
                        ICMPV6,
                        59, // no next header
                        1,
                        255,
                    ]),
                }
            }
            4 => {
                // A fragment header: a first, a later, or an atomic one.
                let field: u16 = match self.rng.below(5) {
                    0 => 1,
                    1 => (1 + self.rng.below(0x1fff) as u16) << 3,
                    2 => ((1 + self.rng.below(0x1fff) as u16) << 3) | 1,
                    3 => 0,
                    _ => 6, // the reserved bits: atomic still
                };
                let mut h = vec![0, 0];
                h.extend(field.to_be_bytes());
                h.extend(self.fragment_id().to_be_bytes());
                insert_ext_headers(f, &[(FRAGMENT, h)]);
            }
            5 => {
                let ethertype: u16 = self.rng.pick(&[0x0800, 0x0806, 0x8100, 0x88cc, 0x86dc]);
                f[12..14].copy_from_slice(&ethertype.to_be_bytes());
            }
            6 => {
                let headers = self.ext_headers();
                insert_ext_headers(f, &headers);
            }
            7 => {
                let at = l4.unwrap_or(ip + 2);
                self.bad_checksum(f, at);
            }
            8 => {
                for _ in 0..1 + self.rng.below(4) {
                    self.flip_byte(f);
                }
            }
            9 => match reference::parse(f) {
                // The TCP data offset and flags, anything.
                Ok(h) if h.tuple.proto == TCP => {
                    f[h.l4 + 12] = self.rng.byte();
                    f[h.l4 + 13] = self.rng.byte();
                }
                _ => f[ip + 1] = self.rng.byte(), // traffic class
            },
            10 if f.len() > IPV6_END + 1 => {
                // The first extension header's length (or whatever is there), anything.
                f[IPV6_END + 1] = self.rng.byte();
            }
            _ => {
                let n = 1 + self.rng.below(40);
                f.extend(self.rng.bytes(n));
            }
        }
    }
}

/// Puts IPv6 extension `headers` (number, bytes) in front of what follows the fixed header of
/// the frame `f`, chained in order before the header that was there, with the payload length
/// grown to match.
fn insert_ext_headers(f: &mut Vec<u8>, headers: &[(u8, Vec<u8>)]) {
    let Some((first, _)) = headers.first() else {
        return;
    };
    let mut next = f[ETH_HLEN + 6];
    let mut bytes = Vec::new();
    for (kind, h) in headers.iter().rev() {
        let mut h = h.clone();
        h[0] = next;
        next = *kind;
        bytes.splice(0..0, h);
    }
    f[ETH_HLEN + 6] = *first;
    let payload = u16::from_be_bytes([f[ETH_HLEN + 4], f[ETH_HLEN + 5]]);
    let grown = payload.wrapping_add(bytes.len() as u16);
    f[ETH_HLEN + 4..ETH_HLEN + 6].copy_from_slice(&grown.to_be_bytes());
    f.splice(IPV6_END..IPV6_END, bytes);
}

fn is_ipv6(frame: &[u8]) -> bool {
    frame.get(12..14) == Some(&[0x86, 0xdd])
}

/// The payload length an IPv6 frame's header gives.
fn payload_len6(frame: &[u8]) -> usize {
    usize::from(u16::from_be_bytes([
        frame[ETH_HLEN + 4],
        frame[ETH_HLEN + 5],
    ]))
}

fn other(prog: Prog) -> Prog {
    match prog {
        Prog::Ingress => Prog::Egress,
        Prog::Egress => Prog::Ingress,
    }
}

/// The test's own `Programs::run`, which returns the kernel's refusal of a frame (see
/// [`refused`]) instead of panicking.
fn run_program(prog: &SchedClassifier, frame: &[u8]) -> Result<(u32, Vec<u8>), String> {
    let mut out = vec![0u8; frame.len() + 256];
    let result = prog
        .test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            repeat: 1,
            ..Default::default()
        })
        .map_err(|e| format!("{e:#}: {}", std::io::Error::last_os_error()))?;
    out.truncate(result.data_size_out as usize);
    Ok((result.return_value, out))
}

/// Frames BPF_PROG_TEST_RUN does not run a program on: shorter than an Ethernet header, or
/// than the IPv4 or IPv6 header their ethertype announces.
fn refused(frame: &[u8]) -> bool {
    let needs = match frame.get(12..14) {
        None => return true,
        Some([0x08, 0x00]) => 20,
        Some([0x86, 0xdd]) => 40,
        Some(_) => 0,
    };
    frame.len() < ETH_HLEN + needs
}

/// The address `a` is, as family `A` (the caller knows it is of that family).
fn family_addr<A: Addr>(a: IpAddr) -> A {
    A::from_ip(a).expect("an address of the map's family")
}

fn ct_key<A: Addr>(t: &Tuple) -> CtKey<A> {
    CtKey {
        saddr: family_addr(t.src),
        daddr: family_addr(t.dst),
        sport: Be16::new(t.sport),
        dport: Be16::new(t.dport),
        proto: t.proto,
        pad: [0; 3],
    }
}

fn tuple<A: Addr>(k: &CtKey<A>) -> Tuple {
    Tuple {
        src: k.saddr.ip(),
        dst: k.daddr.ip(),
        sport: k.sport.get(),
        dport: k.dport.get(),
        proto: k.proto,
    }
}

/// The fields of an entry that behaviour depends on: direction, backend id, service address and
/// port, flags, sequence hint. (Not the packet counter: a statistic.)
type Fields = (u8, u32, IpAddr, u16, u8, u16);

fn kernel_fields<A: Addr>(v: &CtValue<A>) -> Fields {
    (
        v.direction,
        v.backend_id,
        v.vip.ip(),
        v.vport.get(),
        v.flags,
        v.seq_hint,
    )
}

fn model_fields(e: &Entry) -> Fields {
    let direction = match e.direction {
        Direction::Forward => CT_FORWARD,
        Direction::Reply => CT_REPLY,
    };
    let flag = |set: bool, flag: u8| if set { flag } else { 0 };
    let flags = flag(e.closing, CT_CLOSING)
        | flag(e.fin, CT_FIN)
        | flag(e.time_wait, CT_TIME_WAIT)
        | flag(e.opening, CT_OPENING)
        | flag(e.answered, CT_ANSWERED)
        | flag(e.half_closed, CT_HALF_CLOSED);
    (direction, e.backend_id, e.vip, e.vport, flags, e.seq_hint)
}

/// A family's conntrack entries as compared: the fields behaviour depends on, and the last use.
fn compared<A: Addr>(
    entries: &BTreeMap<Tuple, CtValue<A>>,
) -> impl Iterator<Item = (Tuple, (Fields, u64))> + '_ {
    (entries.iter()).map(|(t, v)| (*t, (kernel_fields(v), v.last_seen_ns)))
}

/// Keeps the kernel's conntrack times in step with the model's, and compares the two maps.
struct Clock {
    /// The kernel time written at the last check for an entry the model has idle 0 s.
    base: u64,
    /// When the last check began: a program's refresh since then is later.
    since: u64,
    /// The model's time at the last check.
    model_now: u64,
    /// Idle times beyond this many seconds cannot be written (the clock starts at boot).
    cap: u64,
    at: Instant,
}

impl Clock {
    fn new() -> Self {
        let now = monotonic_ns();
        // A multiple of the unit, so that capped ages still keep clear of every lifetime.
        let cap = (now / NS).saturating_sub(2) / AGE_UNIT * AGE_UNIT;
        Self {
            base: now,
            since: now,
            model_now: 0,
            cap,
            at: Instant::now(),
        }
    }

    /// Compares the kernel's conntrack and affinity maps (both families') with the model's: the
    /// same entries with the same fields, refreshed since the last check exactly when the
    /// model's were; then lets `advance` seconds pass in the model and writes every entry's last
    /// use to match. Returns the number of conntrack entries.
    fn check(
        &mut self,
        maps: &mut KernelMaps,
        model: &mut Model,
        advance: u64,
    ) -> Result<usize, Vec<(Option<Tuple>, String)>> {
        let t0 = monotonic_ns();
        let (v4, v6) = (maps.v4.read(), maps.v6.read());
        let conntrack: BTreeMap<Tuple, (Fields, u64)> =
            compared(&v4.0).chain(compared(&v6.0)).collect();
        let affinity: BTreeMap<Client, AffinityValue> =
            v4.1.iter().chain(&v6.1).map(|(c, v)| (*c, *v)).collect();
        let mut problems = Vec::new();
        for (t, &(fields, last_seen_ns)) in &conntrack {
            let Some(m) = model.conntrack().get(t) else {
                problems.push((Some(*t), format!("only in the kernel: {fields:?}")));
                continue;
            };
            if fields != model_fields(m) {
                let what = format!(
                    "kernel {fields:?}, model {:?} (direction, backend, service, flags)",
                    model_fields(m)
                );
                problems.push((Some(*t), what));
            }
            if let Some(what) = self.last_use_problem(m.refreshed, m.last_seen, last_seen_ns, t0) {
                problems.push((Some(*t), what));
            }
        }
        for (t, m) in model.conntrack() {
            if !conntrack.contains_key(t) {
                problems.push((
                    Some(*t),
                    format!("only in the model: {:?}", model_fields(m)),
                ));
            }
        }
        for (c, v) in &affinity {
            let Some(m) = model.affinity().get(c) else {
                problems.push((
                    None,
                    format!("{c:?}: only in the kernel: backend {}", v.backend_id),
                ));
                continue;
            };
            if v.backend_id != m.backend_id {
                let what = format!(
                    "{c:?}: backend {} in the kernel, {} in the model",
                    v.backend_id, m.backend_id
                );
                problems.push((None, what));
            }
            if let Some(what) = self.last_use_problem(m.refreshed, m.last_used, v.last_used_ns, t0)
            {
                problems.push((None, format!("{c:?}: {what}")));
            }
        }
        for (c, m) in model.affinity() {
            if !affinity.contains_key(c) {
                problems.push((
                    None,
                    format!("{c:?}: only in the model: backend {}", m.backend_id),
                ));
            }
        }
        if !problems.is_empty() {
            return Err(problems);
        }
        model.advance(advance);
        model.cap_idle(self.cap);
        model.clear_refreshed();
        // Half a second ahead: a refresh by a program is then always less idle than anything
        // written here (see the module documentation).
        let base = t0 + NS / 2;
        let written = |last: u64| base - (model.now() - last) * NS;
        maps.v4.write(model, &v4, written);
        maps.v6.write(model, &v6, written);
        *self = Self {
            base,
            since: t0,
            model_now: model.now(),
            cap: self.cap,
            at: Instant::now(),
        };
        Ok(conntrack.len())
    }

    /// What is wrong with a last use `seen` the kernel holds (at `t0`), if anything. Refreshed
    /// by the model since the last check, it must be a program's since then; otherwise exactly
    /// what the last check wrote for the model's last use `last`.
    fn last_use_problem(&self, refreshed: bool, last: u64, seen: u64, t0: u64) -> Option<String> {
        let ago = (t0 as f64 - seen as f64) / 1e9;
        if refreshed {
            (!(self.since..=t0).contains(&seen)).then(|| {
                format!("the model refreshed it, the kernel did not (last use {ago:.3} s before the check)")
            })
        } else {
            let idle = self.model_now - last;
            (seen != self.base - idle * NS).then(|| {
                format!(
                    "the kernel refreshed it (last use {ago:.3} s before the check), the model \
                     did not (idle {idle} s)"
                )
            })
        }
    }
}

/// The maps the model's state is compared with.
struct KernelMaps {
    v4: FamilyMaps<Be32>,
    v6: FamilyMaps<Be128>,
}

impl KernelMaps {
    fn open(pin_dir: &Path) -> Self {
        Self {
            v4: FamilyMaps::open(pin_dir, MAP_CONNTRACK, MAP_AFFINITY),
            v6: FamilyMaps::open(pin_dir, MAP_CONNTRACK6, MAP_AFFINITY6),
        }
    }
}

/// One family's conntrack and session affinity maps.
struct FamilyMaps<A: Addr> {
    conntrack: BpfHashMap<MapData, CtKey<A>, CtValue<A>>,
    affinity: BpfHashMap<MapData, AffinityKey<A>, AffinityValue>,
}

impl<A: Addr> FamilyMaps<A> {
    fn open(pin_dir: &Path, conntrack: &str, affinity: &str) -> Self {
        let map = |name: &str| {
            let data = MapData::from_pin(pin_dir.join(name))
                .unwrap_or_else(|e| panic!("the pin of {name}: {e}"));
            Map::LruHashMap(data)
        };
        Self {
            conntrack: map(conntrack).try_into().expect("a conntrack map"),
            affinity: map(affinity).try_into().expect("an affinity map"),
        }
    }

    fn read(&self) -> (BTreeMap<Tuple, CtValue<A>>, BTreeMap<Client, AffinityValue>) {
        let conntrack = (self.conntrack.iter())
            .map(|e| e.map(|(k, v)| (tuple(&k), v)))
            .collect::<Result<_, _>>()
            .expect("reading conntrack");
        let affinity = (self.affinity.iter())
            .map(|e| e.map(|(k, v)| (client(&k), v)))
            .collect::<Result<_, _>>()
            .expect("reading the affinity map");
        (conntrack, affinity)
    }

    /// Writes the last uses of the model's entries of this family as `written` gives them, the
    /// rest of each entry as the kernel's (`conntrack`, `affinity`) holds it.
    fn write(
        &mut self,
        model: &Model,
        (conntrack, affinity): &(BTreeMap<Tuple, CtValue<A>>, BTreeMap<Client, AffinityValue>),
        written: impl Fn(u64) -> u64,
    ) {
        let ours = |a: IpAddr| A::from_ip(a).is_some();
        for (t, m) in model.conntrack().iter().filter(|(t, _)| ours(t.src)) {
            let v = CtValue {
                last_seen_ns: written(m.last_seen),
                ..conntrack[t]
            };
            (self.conntrack.insert(ct_key::<A>(t), v, 0)).expect("writing conntrack");
        }
        for (c, m) in model.affinity().iter().filter(|(c, _)| ours(c.client)) {
            let v = AffinityValue {
                last_used_ns: written(m.last_used),
                ..affinity[c]
            };
            (self.affinity.insert(affinity_key::<A>(c), v, 0)).expect("writing the affinity map");
        }
    }
}

fn client<A: Addr>(k: &AffinityKey<A>) -> Client {
    Client {
        client: k.client.ip(),
        vip: k.vip.ip(),
        vport: k.vport.get(),
        proto: k.proto,
    }
}

fn affinity_key<A: Addr>(c: &Client) -> AffinityKey<A> {
    AffinityKey {
        client: family_addr(c.client),
        vip: family_addr(c.vip),
        vport: Be16::new(c.vport),
        proto: c.proto,
        pad: 0,
    }
}

/// Whether a packet of `u` may have met the conntrack entry of `t`: they share an end that is
/// not a service address (a client's address and port, or a backend's).
fn related(u: &Tuple, t: &Tuple) -> bool {
    let service = |a: IpAddr, p: u16| {
        (SERVICES.iter()).any(|d| {
            [false, true]
                .map(|v6| (in_family(d.vip, v6), d.port))
                .contains(&(a, p))
        })
    };
    let ends = |t: &Tuple| [(t.src, t.sport), (t.dst, t.dport)];
    u.proto == t.proto
        && ends(u)
            .iter()
            .any(|e| ends(t).contains(e) && !service(e.0, e.1))
}

fn verdict_name(verdict: u32) -> String {
    match verdict {
        TC_ACT_UNSPEC => "TC_ACT_UNSPEC (pass)".to_owned(),
        TC_ACT_SHOT => "TC_ACT_SHOT (drop)".to_owned(),
        TC_ACT_REDIRECT => "TC_ACT_REDIRECT".to_owned(),
        other => other.to_string(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The coverage class of an outcome, as the brief counts them.
fn class(o: &Outcome) -> &'static str {
    match o.event {
        Event::HairpinDrop | Event::NoLocalEndpoint => "drop",
        Event::HairpinReply => "hairpin",
        Event::NewFlow | Event::Established if o.hairpin => "hairpin",
        Event::NewFlow => "dnat",
        Event::Established => "established",
        Event::ReverseNat => "reverse-nat",
        Event::IcmpTranslated => "icmp-error",
        Event::Rejected => "reject",
        Event::Skipped(_)
        | Event::NotService
        | Event::NoBackend
        | Event::NoReply
        | Event::IcmpUnrelated
        | Event::FragmentWithoutFlow => "pass",
    }
}

#[derive(Default)]
struct Stats {
    /// By the family of the frame ([`family`]).
    classes: BTreeMap<&'static str, BTreeMap<&'static str, u64>>,
    events: BTreeMap<Event, u64>,
    notes: BTreeMap<&'static str, BTreeMap<Note, u64>>,
    kinds: BTreeMap<(Kind, Prog), u64>,
    refused: u64,
    checksums_checked: u64,
    syncs: u64,
    full_syncs: u64,
    agings: u64,
    checks: u64,
    max_entries: usize,
    /// Lapsed affinities whose old backend could have been picked again, and how many were.
    lapsed: (u64, u64),
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(
        v.parse()
            .unwrap_or_else(|_| panic!("{name}={v}: not a number")),
    )
}

/// Everything a report of a difference needs.
struct Run<'a> {
    seed: u64,
    model: Model,
    world: World,
    /// The frames since the last conntrack check (and a few before it).
    history: VecDeque<(u64, Prog, Kind, Vec<u8>)>,
    maps: KernelMaps,
    clock: Clock,
    programs: &'a mut Programs,
    stats: Stats,
}

impl Run<'_> {
    fn fail(&self, index: u64, what: &str) -> ! {
        let mut r = String::new();
        let _ = writeln!(r, "\n==== fuzz: {what}");
        let _ = writeln!(
            r,
            "seed {} frame {index} (replay: FUZZ_SEED={} FUZZ_FRAMES={})",
            self.seed,
            self.seed,
            index + 1
        );
        let _ = writeln!(r, "last map changes:");
        for l in &self.world.log {
            let _ = writeln!(r, "  {l}");
        }
        let _ = writeln!(r, "last frames (index prog kind hex):");
        for (i, prog, kind, bytes) in self.history.iter().rev().take(12).rev() {
            let _ = writeln!(r, "  {i} {} {kind:?} {}", prog.name(), hex(bytes));
        }
        let _ = writeln!(
            r,
            "model time {} s; tables: {:?}",
            self.model.now(),
            self.model.tables()
        );
        panic!("{r}");
    }

    /// The model's conntrack entries that may belong to the flow of `t`, for a report.
    fn entries_near(&self, t: &Tuple) -> String {
        let mut s = String::new();
        for (k, e) in self.model.conntrack() {
            let related = [t.src, t.dst].contains(&k.src) && [t.src, t.dst].contains(&k.dst)
                || [t.sport, t.dport].contains(&k.sport) && [t.sport, t.dport].contains(&k.dport);
            if related && k.proto == t.proto {
                let _ = writeln!(s, "  {k}: {e:?}");
            }
        }
        s
    }

    fn sync(&mut self, index: u64, rng: &mut Rng) {
        let (changed, all) = self.world.change(rng);
        let scope = if all {
            Scope::All
        } else {
            Scope::Changed(&changed)
        };
        if let Err(e) = self.programs.maps.sync(&self.world.state, scope) {
            self.fail(index, &format!("the map writer failed: {e:#}"));
        }
        let tables = match Tables::read(self.programs.bpffs.path()) {
            Ok(t) => t,
            Err(e) => self.fail(index, &format!("inconsistent maps after a sync: {e:#}")),
        };
        if let Err(e) = check_programmed(&self.world, &tables) {
            self.fail(
                index,
                &format!("the maps do not hold the desired state: {e}"),
            );
        }
        self.model.set_tables(tables);
        self.stats.syncs += 1;
        self.stats.full_syncs += u64::from(all);
    }

    fn check(&mut self, index: u64, advance: u64) {
        match self.clock.check(&mut self.maps, &mut self.model, advance) {
            Ok(n) => self.stats.max_entries = self.stats.max_entries.max(n),
            Err(problems) => {
                let mut what = "conntrack or affinity differs from the model's (checked before \
                                this frame)\n"
                    .to_owned();
                for (t, problem) in &problems {
                    match t {
                        Some(t) => writeln!(what, "{t}: {problem}"),
                        None => writeln!(what, "affinity {problem}"),
                    }
                    .unwrap();
                }
                for t in problems.iter().filter_map(|(t, _)| t.as_ref()).take(3) {
                    let _ = writeln!(what, "frames since the last check that {t} may have met:");
                    let related: Vec<_> = self
                        .history
                        .iter()
                        .filter(|(_, _, _, f)| {
                            reference::parse(f).is_ok_and(|h| related(&h.tuple, t))
                        })
                        .collect();
                    for (i, prog, kind, f) in related.iter().rev().take(20).rev() {
                        let _ = writeln!(what, "  {i} {} {kind:?} {}", prog.name(), hex(f));
                    }
                }
                self.fail(index, &what);
            }
        }
        // Keep a few frames for the report of a difference in the next one.
        while self.history.len() > 12 {
            self.history.pop_front();
        }
        self.stats.checks += 1;
    }
}

#[test]
fn the_programs_agree_with_the_reference_model() {
    if !privileged("the_programs_agree_with_the_reference_model") {
        return;
    }
    let seed = env_u64("FUZZ_SEED").unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        t.as_nanos() as u64 ^ u64::from(std::process::id()) << 32
    });
    let frames = env_u64("FUZZ_FRAMES").unwrap_or(SHORT_RUN);
    let check_every = env_u64("FUZZ_CHECK_EVERY").unwrap_or(0);
    eprintln!("fuzz: seed {seed}, {frames} frames (replay: FUZZ_SEED={seed})");

    // A drain period of zero: removed endpoints and services drain until the next full sync.
    let mut programs =
        Programs::load_draining(SIZES, Duration::ZERO).expect("loading the BPF programs");
    // An established flow's lifetime as the agent's flag sets it: short enough for the aging
    // steps to reach on a machine booted 20 minutes ago.
    programs.set_ct_lifetime(CT_STATE_TCP_ESTABLISHED, TCP_LIFETIME);
    // Changes to the cluster and steps of time draw from their own stream.
    let mut world_rng = Rng(seed ^ 0x5eed_0f3a_95c0_de11);
    let world = World::new(&mut world_rng);
    programs
        .program(&world.state)
        .expect("programming the maps");
    let tables = Tables::read(programs.bpffs.path()).expect("reading the maps");
    check_programmed(&world, &tables).expect("the first sync");
    let maps = KernelMaps::open(programs.bpffs.path());
    let mut run = Run {
        seed,
        model: {
            let mut model = Model::new(tables);
            model.set_ct_lifetime(CT_STATE_TCP_ESTABLISHED, TCP_LIFETIME.as_nanos() as u64);
            model
        },
        world,
        history: VecDeque::new(),
        maps,
        clock: Clock::new(),
        programs: &mut programs,
        stats: Stats::default(),
    };
    if run.clock.cap < 63 {
        eprintln!(
            "fuzz: the clock started {} s ago: UDP flows cannot be aged out",
            run.clock.cap
        );
    }
    // Time steps, in units: either side of the closing (10 s) and UDP (60 s) lifetimes, of the
    // affinity timeout (30 s), and of the TCP lifetime (1200 s: 1197 s and 1204 s), which idle
    // times only reach if the clock started long enough ago (otherwise they are capped below
    // it, in the model too). The same list everywhere, so that a seed means the same frames on
    // any machine.
    let aging: [u64; 13] = [1, 2, 2, 3, 4, 5, 8, 9, 9, 10, 20, 171, 172];
    if run.clock.cap < 1204 {
        eprintln!("fuzz: the clock started less than 20 min ago: TCP flows cannot be aged out");
    }

    let mut generator = Generator::new(seed);
    let started = Instant::now();
    for index in 0..frames {
        // Now and then the agent syncs a change, and time passes.
        if world_rng.chance(1, 1500) {
            run.sync(index, &mut world_rng);
        }
        if world_rng.chance(1, 4000) {
            let advance = world_rng.pick(&aging) * AGE_UNIT;
            run.check(index, advance);
            run.stats.agings += 1;
        } else if run.clock.at.elapsed() >= CHECK_INTERVAL
            || check_every > 0 && index % check_every == 0
        {
            run.check(index, 0);
        }

        // The model answers every reject; the programs pace their ICMP errors (checked by the
        // program tests): never more due here than their burst.
        if index % 32 == 0 {
            run.programs.reset_icmp_pace();
        }
        let frame = generator.next(&run.model);
        run.history
            .push_back((index, frame.prog, frame.kind, frame.bytes.clone()));
        let prog: &SchedClassifier = run
            .programs
            .ebpf
            .program(frame.prog.name())
            .unwrap()
            .try_into()
            .unwrap();
        let (verdict, out) = match run_program(prog, &frame.bytes) {
            Ok(r) => r,
            Err(e) => {
                if refused(&frame.bytes) {
                    run.stats.refused += 1;
                    continue;
                }
                run.fail(
                    index,
                    &format!("BPF_PROG_TEST_RUN refused {}: {e}", hex(&frame.bytes)),
                );
            }
        };
        // Which backend the frame's client sticks to, if its destination has session affinity
        // (for the check of lapsed affinities below).
        let stuck = reference::parse(&frame.bytes).ok().and_then(|h| {
            let client = Client::of(&h.tuple);
            Some((client, run.model.affinity().get(&client)?.backend_id))
        });
        let expected = match frame.prog {
            Prog::Ingress => run.model.ingress(&frame.bytes, |h, candidates| {
                // Which backend the program sent the new flow to, if any of these.
                let dst = destination(&out, h)?;
                candidates.iter().position(|c| (c.addr, c.port) == dst)
            }),
            Prog::Egress => Ok(run.model.egress(&frame.bytes)),
        };
        let expected = match expected {
            Ok(o) => o,
            Err(candidates) => {
                let what = format!(
                    "{} sent a new flow elsewhere than to a backend of its service\n\
                     frame   {}\nprogram {} verdict {}\ncandidates {candidates:?}",
                    frame.prog.name(),
                    hex(&frame.bytes),
                    hex(&out),
                    verdict_name(verdict),
                );
                run.fail(index, &what);
            }
        };
        if (verdict, &out) != (expected.verdict, &expected.frame) {
            let diff: Vec<usize> = (0..out.len().max(expected.frame.len()))
                .filter(|&i| out.get(i) != expected.frame.get(i))
                .collect();
            let t = reference::parse(&frame.bytes).ok().map(|h| h.tuple);
            let what = format!(
                "{} ({:?} frame) differs from the model\n\
                 frame   {}\nmodel   {} verdict {} ({:?}, {:?})\nprogram {} verdict {}\n\
                 bytes differing: {diff:?}\nflow: {}\nmodel conntrack near it (after the frame):\n{}",
                frame.prog.name(),
                frame.kind,
                hex(&frame.bytes),
                hex(&expected.frame),
                verdict_name(expected.verdict),
                expected.event,
                expected.notes,
                hex(&out),
                verdict_name(verdict),
                t.map_or("-".to_owned(), |t| t.to_string()),
                t.map_or(String::new(), |t| run.entries_near(&t)),
            );
            run.fail(index, &what);
        }
        // An independent look at the checksums (recomputed in full): a translated frame that
        // came with valid ones leaves with valid ones, and a refusal carries valid ones.
        let valid_in =
            reference::parse(&frame.bytes).is_ok_and(|h| checksums_valid(&frame.bytes, &h));
        let checked = match expected.event {
            Event::Rejected => Some(icmp_checksums_valid(&out)),
            Event::IcmpTranslated if icmp_checksums_valid(&frame.bytes) => {
                Some(icmp_checksums_valid(&out))
            }
            _ if valid_in && expected.frame != frame.bytes => {
                Some(reference::parse(&out).is_ok_and(|h| checksums_valid(&out, &h)))
            }
            _ => None,
        };
        if checked == Some(false) {
            let what = format!(
                "checksums broken (program and model agree)\nframe   {}\nprogram {}",
                hex(&frame.bytes),
                hex(&out)
            );
            run.fail(index, &what);
        }
        run.stats.checksums_checked += u64::from(checked.is_some());
        // A lapsed affinity leaves the pick to chance, which the model cannot tell from keeping
        // it: count how often the old backend comes again when others could have been taken.
        if expected.notes.contains(&Note::AffinityLapsed)
            && let Some((client, old)) = stuck
            && let Some(fe) =
                run.model
                    .tables()
                    .frontends
                    .get(&(client.vip, client.vport, client.proto))
            && fe.slots.len() >= 2
            && fe.slots.contains(&old)
        {
            run.stats.lapsed.0 += 1;
            run.stats.lapsed.1 += u64::from(run.model.affinity()[&client].backend_id == old);
        }
        let s = &mut run.stats;
        let family = family(&frame.bytes);
        *s.classes
            .entry(family)
            .or_default()
            .entry(class(&expected))
            .or_default() += 1;
        *s.events.entry(expected.event).or_default() += 1;
        for n in &expected.notes {
            *s.notes.entry(family).or_default().entry(*n).or_default() += 1;
        }
        *s.kinds.entry((frame.kind, frame.prog)).or_default() += 1;
    }
    run.check(frames, 0);
    let elapsed = started.elapsed();

    let s = &run.stats;
    let mut report = format!(
        "fuzz: {frames} frames in {elapsed:.1?} ({:.0} frames/s), seed {seed}\n",
        frames as f64 / elapsed.as_secs_f64()
    );
    for (family, classes) in &s.classes {
        let _ = writeln!(report, "  outcomes ({family}): {classes:?}");
    }
    let frames_of = |family| s.classes.get(family).map_or(0, |c| c.values().sum::<u64>());
    let served_of = |family| {
        s.classes.get(family).map_or(0, |c| {
            (c.iter())
                .filter(|(class, _)| !["pass", "drop"].contains(class))
                .map(|(_, n)| n)
                .sum::<u64>()
        })
    };
    let _ = writeln!(
        report,
        "  IPv4 frames: {}, {} translated or answered; IPv6 frames: {}, {} translated or answered",
        frames_of("IPv4"),
        served_of("IPv4"),
        frames_of("IPv6"),
        served_of("IPv6"),
    );
    let _ = writeln!(report, "  events: {:?}", s.events);
    for (family, notes) in &s.notes {
        let _ = writeln!(report, "  conntrack notes ({family}): {notes:?}");
    }
    let _ = writeln!(report, "  frames by kind: {:?}", s.kinds);
    let _ = writeln!(
        report,
        "  refused by BPF_PROG_TEST_RUN: {}; translated frames with checksums recomputed: {}",
        s.refused, s.checksums_checked
    );
    let _ = writeln!(
        report,
        "  map syncs: {} ({} full); time steps: {}; conntrack checks: {} (at most {} entries); \
         model time {} s",
        s.syncs,
        s.full_syncs,
        s.agings,
        s.checks,
        s.max_entries,
        run.model.now()
    );
    let _ = writeln!(
        report,
        "  lapsed affinities with others to pick: {}, of which to the old backend again: {}",
        s.lapsed.0, s.lapsed.1
    );
    let fragments = run.model.fragments_remembered();
    let _ = writeln!(
        report,
        "  datagrams in fragments remembered: {} IPv4, {} IPv6",
        fragments[0], fragments[1]
    );
    eprint!("{report}");
    // The model forgets no datagram: the kernel's LRUs (one a family) must never have to.
    assert!(
        fragments
            .iter()
            .all(|&n| n < proxy_common::FRAGMENTS_MAX as usize / 2),
        "seed {seed}: {fragments:?} datagrams in fragments: near FRAGMENTS' size, its LRU may \
         have evicted what the model kept; make the generator's datagrams fewer"
    );
    // Drawn at random among two or more, the old backend comes again half the time at most:
    // 90% of 40 or more is next to impossible (p < 1e-7) unless the programs kept it.
    assert!(
        s.lapsed.0 < 40 || s.lapsed.1 * 10 < s.lapsed.0 * 9,
        "seed {seed}: lapsed affinities went back to their old backend {} times of {}: the \
         programs keep an affinity past its timeout",
        s.lapsed.1,
        s.lapsed.0
    );
    for class in [
        "pass",
        "dnat",
        "established",
        "reverse-nat",
        "icmp-error",
        "hairpin",
        "drop",
        "reject",
    ] {
        let count =
            |family| (s.classes.get(family)).map_or(0, |c| c.get(class).copied().unwrap_or(0));
        assert!(
            count("IPv4") + count("IPv6") > 0,
            "seed {seed}: no frame was a {class}"
        );
        assert!(
            frames < SHORT_RUN || count("IPv6") > 0,
            "seed {seed}: no IPv6 frame was a {class}"
        );
    }
    if frames >= SHORT_RUN {
        // Paths that a run of this length always takes (a shorter one may miss some).
        for note in [
            Note::DrainKept,
            Note::DrainLeft,
            Note::BackendGone,
            Note::Expired,
            Note::Reopened,
            Note::Closed,
            Note::ClosedFollowed,
            Note::ReplyRewritten,
            Note::ReplyForgotten,
            Note::DirectSynForgot,
            Note::AffinityKept,
            Note::AffinityLapsed,
            Note::AffinityNew,
            Note::LaterFragment,
        ] {
            if note == Note::Expired && run.clock.cap < 14 {
                continue; // nothing can be idle long enough
            }
            for family in ["IPv4", "IPv6"] {
                let met = (s.notes.get(family)).and_then(|n| n.get(&note).copied());
                assert!(
                    met.is_some_and(|n| n > 0),
                    "seed {seed}: no {family} frame met {note:?}"
                );
            }
        }
    }
}

/// The family of `frame` as the stats count it, by its ethertype.
fn family(frame: &[u8]) -> &'static str {
    match frame.get(12..14) {
        Some([0x08, 0x00]) => "IPv4",
        Some([0x86, 0xdd]) => "IPv6",
        _ => "other",
    }
}

/// Where a program sent the packet `h` was read from: the destination address and port of its
/// output.
fn destination(out: &[u8], h: &Headers) -> Option<(IpAddr, u16)> {
    let dst: IpAddr = match h.tuple.dst {
        IpAddr::V4(_) => <[u8; 4]>::try_from(out.get(ETH_HLEN + 16..ETH_HLEN + 20)?)
            .ok()?
            .into(),
        IpAddr::V6(_) => <[u8; 16]>::try_from(out.get(ETH_HLEN + 24..IPV6_END)?)
            .ok()?
            .into(),
    };
    let dport = out.get(h.l4 + 2..h.l4 + 4)?;
    Some((dst, u16::from_be_bytes([dport[0], dport[1]])))
}

/// The Internet checksum of `data` (an odd length padded with a zero byte), over `pseudo` (an
/// even length) too.
fn checksum(pseudo: &[u8], data: &[u8]) -> u16 {
    let mut sum: u32 = (pseudo.chunks(2).chain(data.chunks(2)))
        .map(|w| u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// IPv6's pseudo-header for `len` bytes of `proto` in the frame's packet.
fn pseudo_header6(frame: &[u8], len: usize, proto: u8) -> Vec<u8> {
    let mut pseudo = frame[ETH_HLEN + 8..IPV6_END].to_vec();
    pseudo.extend((len as u32).to_be_bytes());
    pseudo.extend([0, 0, 0, proto]);
    pseudo
}

/// Whether the IPv4 header and ICMP checksums of an ICMP message without IP options are right,
/// or the ICMPv6 checksum of an ICMPv6 message right after the fixed IPv6 header.
fn icmp_checksums_valid(frame: &[u8]) -> bool {
    if is_ipv6(frame) {
        let len = payload_len6(frame);
        if !(8..=frame.len() - IPV6_END).contains(&len) {
            return false; // a mutant's length
        }
        let mut icmp = frame[IPV6_END..IPV6_END + len].to_vec();
        let carried = u16::from_be_bytes([icmp[2], icmp[3]]);
        icmp[2..4].fill(0);
        return checksum(&pseudo_header6(frame, len, ICMPV6), &icmp) == carried;
    }
    let ip = &frame[ETH_HLEN..];
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    if !(28..=ip.len()).contains(&total) {
        return false; // a mutant's length
    }
    let carried = u16::from_be_bytes([ip[10], ip[11]]);
    let mut icmp = ip[20..total].to_vec();
    let icmp_carried = u16::from_be_bytes([icmp[2], icmp[3]]);
    icmp[2..4].fill(0);
    packet::ip_checksum(frame) == carried && checksum(&[], &icmp) == icmp_carried
}

/// Whether the IPv4 header and TCP/UDP checksums of a parsed frame are right (a UDP checksum of
/// zero counts as right: none was sent); IPv6 has only the TCP/UDP one, past any extension
/// headers.
fn checksums_valid(frame: &[u8], h: &Headers) -> bool {
    let at = h.l4_checksum_at();
    let carried = u16::from_be_bytes([frame[at], frame[at + 1]]);
    let (ip_ok, l4) = if is_ipv6(frame) {
        let mut segment = frame[h.l4..IPV6_END + payload_len6(frame)].to_vec();
        segment[at - h.l4..at - h.l4 + 2].fill(0);
        let pseudo = pseudo_header6(frame, segment.len(), h.tuple.proto);
        let c = checksum(&pseudo, &segment);
        // UDP sends an all-zero result as all ones (zero means "no checksum").
        (
            true,
            if h.tuple.proto == UDP && c == 0 {
                0xffff
            } else {
                c
            },
        )
    } else {
        let carried_ip = u16::from_be_bytes([frame[ETH_HLEN + 10], frame[ETH_HLEN + 11]]);
        (
            packet::ip_checksum(frame) == carried_ip,
            packet::l4_checksum(frame),
        )
    };
    let l4_ok = (h.tuple.proto == UDP && carried == 0) || l4 == carried;
    ip_ok && l4_ok
}

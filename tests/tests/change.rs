//! Correct under change, under BPF_PROG_TEST_RUN: endpoints and Services that go away drain
//! instead of resetting connections, no reverse NAT outlives its flow, an address handed
//! between Services works in either name order, an update never lets a packet to a service
//! address pass untranslated, a batch of map writes that fails or writes one frontend twice
//! leaves every service serving, and pinned maps left by another release are checked.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use aya::maps::{HashMap as BpfHashMap, Map, MapData, PerCpuArray};
use proxy_common::{
    AGENT_STATE_LAYOUT, AGENT_STATE_NEXT_BACKEND_ID, Backend, DROP_NO_BACKEND, LAYOUT_VERSION,
    MAP_AGENT_STATE, MAP_BACKENDS, MAP_DROPS, MAP_SERVICES, ServiceKey, ServiceValue,
};
use proxy_tests::{
    fixtures::*,
    packet::{self, Spec, TCP},
    privileged,
    programs::{PrivateBpffs, Programs, Svc, TC_ACT_SHOT, TC_ACT_UNSPEC, add_service},
};
use proxy_userspace::{
    dataplane::Scope,
    model::{DesiredState, LbAlgorithm, Protocol, ServicePortName},
    modes::ebpf::inspect,
    modes::ebpf::{
        self, MapSizes, MapWriter, WriterConfig, bpffs::PinDirLock, writer::DEFAULT_DRAIN_PERIOD,
    },
};

const VIP2: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);

fn with_flags(spec: &Spec, tcp_flags: u8) -> Spec {
    Spec {
        tcp_flags,
        ..spec.clone()
    }
}

/// One flow of the client (its first packet: a SYN for TCP) on each backend that new flows
/// of `proto` to `vip:port` reach.
fn flows_by_backend(p: &Programs, proto: u8, vip: Ipv4Addr, port: u16) -> BTreeMap<Ipv4Addr, Spec> {
    let mut on = BTreeMap::new();
    for sport in 30000..30100 {
        let spec = Spec {
            proto,
            tcp_flags: if proto == TCP { 0x02 } else { 0 },
            ..Spec::tcp(CLIENT, sport, vip, port)
        };
        let backend = dnat(p, &spec).dst;
        on.entry(backend).or_insert(spec);
    }
    on
}

fn changed(ports: &[&ServicePortName]) -> BTreeSet<ServicePortName> {
    ports.iter().map(|p| (*p).clone()).collect()
}

/// The endpoints of the port `name` (of `protocol`) in `state`, set to `endpoints`.
fn set_endpoints(
    state: &mut DesiredState,
    name: &str,
    vip: Ipv4Addr,
    port: u16,
    protocol: Protocol,
    endpoints: &[(Ipv4Addr, u16)],
) -> ServicePortName {
    add_service(
        state,
        &Svc {
            name,
            vip,
            port,
            protocol,
            endpoints,
        },
    )
}

#[test]
fn a_removed_endpoint_keeps_its_tcp_connections_and_loses_its_udp_flows() {
    let Some((mut p, mut state)) = setup(
        "a_removed_endpoint_keeps_its_tcp_connections_and_loses_its_udp_flows",
        &[(BE1, 8080), (BE2, 8080)],
    ) else {
        return;
    };
    let tcp = flows_by_backend(&p, TCP, VIP, 80)[&BE1].clone();
    let udp = flows_by_backend(&p, packet::UDP, VIP, 80)[&BE1].clone();
    let ids_before = inspect::backends(p.bpffs.path()).unwrap();
    // BE1 turns not ready (or terminating, or leaves the slice): both ports lose it.
    let web = set_endpoints(&mut state, "web", VIP, 80, Protocol::Tcp, &[(BE2, 8080)]);
    let dns = set_endpoints(&mut state, "dns", VIP, 80, Protocol::Udp, &[(BE2, 8080)]);
    p.maps
        .sync(&state, Scope::Changed(&changed(&[&web, &dns])))
        .unwrap();
    // The established connection stays, both ways.
    let ack = with_flags(&tcp, 0x10);
    assert_eq!(
        dnat(&p, &ack).dst,
        BE1,
        "an established connection must stay"
    );
    let (_, out) = p.run("tc_egress", &reply_to(&tcp, BE1, 8080, 0x10));
    assert_eq!(
        packet::read(&out).src,
        VIP,
        "its replies are still translated"
    );
    // New connections, a new connection on the old 5-tuple, and UDP go elsewhere.
    for sport in 31000..31030 {
        assert_eq!(dnat(&p, &Spec::tcp(CLIENT, sport, VIP, 80)).dst, BE2);
    }
    assert_eq!(dnat(&p, &udp).dst, BE2, "a UDP flow moves within one sync");
    assert_eq!(dnat(&p, &tcp).dst, BE2, "a SYN picks a usable backend");
    let draining: Vec<_> = inspect::backends(p.bpffs.path())
        .unwrap()
        .into_iter()
        .filter(|b| b.draining)
        .map(|b| b.address)
        .collect();
    assert_eq!(draining, vec!["10.244.1.11:8080", "10.244.1.11:8080"]);
    // It comes back (a readiness blip): under the same ids, taking new flows again.
    set_endpoints(
        &mut state,
        "web",
        VIP,
        80,
        Protocol::Tcp,
        &[(BE1, 8080), (BE2, 8080)],
    );
    set_endpoints(
        &mut state,
        "dns",
        VIP,
        80,
        Protocol::Udp,
        &[(BE1, 8080), (BE2, 8080)],
    );
    p.maps
        .sync(&state, Scope::Changed(&changed(&[&web, &dns])))
        .unwrap();
    assert_eq!(inspect::backends(p.bpffs.path()).unwrap(), ids_before);
    assert!(flows_by_backend(&p, TCP, VIP, 80).contains_key(&BE1));
}

#[test]
fn a_deleted_service_keeps_its_established_tcp_connections_until_the_drain_ends() {
    if !privileged("a_deleted_service_keeps_its_established_tcp_connections_until_the_drain_ends") {
        return;
    }
    // A drain period of zero ends at the next full sync, as an hour would end at a later one.
    let mut p = Programs::load_draining(SMALL, Duration::ZERO).unwrap();
    let mut state = DesiredState::default();
    let web = set_endpoints(&mut state, "web", VIP, 80, Protocol::Tcp, &[(BE1, 8080)]);
    p.program(&state).unwrap();
    let tcp = Spec::tcp(CLIENT, 32000, VIP, 80);
    dnat(&p, &tcp);
    state.remove_port(&web);
    p.maps
        .sync(&state, Scope::Changed(&changed(&[&web])))
        .unwrap();
    assert_eq!(dnat(&p, &with_flags(&tcp, 0x10)).dst, BE1);
    untouched(&p, "tc_ingress", &Spec::tcp(CLIENT, 32001, VIP, 80).build());
    let rows = inspect::services(p.bpffs.path()).unwrap();
    assert!(rows.len() == 1 && rows[0].draining, "{rows:?}");
    // The drain period is over at the next full sync: nothing of the service is left.
    p.program(&state).unwrap();
    untouched(&p, "tc_ingress", &with_flags(&tcp, 0x10).build());
    assert_eq!(inspect::services(p.bpffs.path()).unwrap(), vec![]);
    assert_eq!(inspect::backends(p.bpffs.path()).unwrap(), vec![]);
}

#[test]
fn an_endpoint_leaving_one_service_keeps_the_other_services_udp_flows() {
    let Some((mut p, mut state)) = setup(
        "an_endpoint_leaving_one_service_keeps_the_other_services_udp_flows",
        &[(BE1, 8080)],
    ) else {
        return;
    };
    let other = set_endpoints(&mut state, "other", VIP2, 53, Protocol::Udp, &[(BE1, 8080)]);
    p.maps
        .sync(&state, Scope::Changed(&changed(&[&other])))
        .unwrap();
    let to_dns = Spec::udp(CLIENT, 33000, VIP, 80);
    let to_other = Spec::udp(CLIENT, 33000, VIP2, 53);
    assert_eq!(dnat(&p, &to_dns).dst, BE1);
    assert_eq!(dnat(&p, &to_other).dst, BE1);
    // BE1 leaves dns (BE2 replaces it) but stays in other.
    let dns = set_endpoints(&mut state, "dns", VIP, 80, Protocol::Udp, &[(BE2, 8080)]);
    p.maps
        .sync(&state, Scope::Changed(&changed(&[&dns])))
        .unwrap();
    assert_eq!(dnat(&p, &to_dns).dst, BE2, "dns's UDP flow must leave BE1");
    assert_eq!(dnat(&p, &to_other).dst, BE1, "other's UDP flow stays");
}

#[test]
fn a_reply_entry_never_outlives_its_flow() {
    let Some((p, _)) = setup("a_reply_entry_never_outlives_its_flow", &[(BE1, 8080)]) else {
        return;
    };
    // A connection through the service, reset by the client.
    let tcp = Spec::tcp(CLIENT, 34000, VIP, 80);
    dnat(&p, &tcp);
    dnat(&p, &with_flags(&tcp, 0x14));
    // The same client port then connects to the backend directly: its SYN clears the old
    // reply entry, so the backend's SYN-ACK reaches the client as it was sent.
    let direct = Spec::tcp(CLIENT, 34000, BE1, 8080);
    untouched(&p, "tc_ingress", &direct.build());
    untouched(&p, "tc_egress", &reply_to(&direct, BE1, 8080, 0x12));

    // Replies to a closed flow do not keep it alive: it ends 10 s after it closed.
    let tcp = Spec::tcp(CLIENT, 34001, VIP, 80);
    dnat(&p, &tcp);
    let (_, out) = p.run("tc_egress", &reply_to(&tcp, BE1, 8080, 0x04)); // the backend resets
    assert_eq!(packet::read(&out).src, VIP);
    if !age_conntrack(&p, 6) {
        return;
    }
    let (_, out) = p.run("tc_egress", &reply_to(&tcp, BE1, 8080, 0x04));
    assert_eq!(
        packet::read(&out).src,
        VIP,
        "still within the closing lifetime"
    );
    if !age_conntrack(&p, 6) {
        return;
    }
    untouched(&p, "tc_egress", &reply_to(&tcp, BE1, 8080, 0x04));

    // A reply entry whose forward entry is gone (evicted, say) translates nothing.
    let tcp = Spec::tcp(CLIENT, 34002, VIP, 80);
    dnat(&p, &tcp);
    let mut ct = p.conntrack();
    let forward = proxy_common::CtKey {
        saddr: proxy_common::Be32::from_octets(CLIENT.octets()),
        daddr: proxy_common::Be32::from_octets(VIP.octets()),
        sport: proxy_common::Be16::new(34002),
        dport: proxy_common::Be16::new(80),
        proto: TCP,
        pad: [0; 3],
    };
    ct.remove(&forward).unwrap();
    untouched(&p, "tc_egress", &reply_to(&tcp, BE1, 8080, 0x12));
}

#[test]
fn an_address_handed_between_services_works_in_either_name_order() {
    for (old_name, new_name) in [("a-dns", "b-dns"), ("b-dns", "a-dns")] {
        let Some((mut p, _)) = setup(
            "an_address_handed_between_services_works_in_either_name_order",
            &[],
        ) else {
            return;
        };
        let mut state = DesiredState::default();
        let old = set_endpoints(&mut state, old_name, VIP, 53, Protocol::Tcp, &[(BE1, 53)]);
        p.program(&state).unwrap();
        let established = Spec::tcp(CLIENT, 35000, VIP, 53);
        dnat(&p, &established);
        // One sync: the old Service goes, the new one takes its address.
        state.remove_port(&old);
        let new = set_endpoints(&mut state, new_name, VIP, 53, Protocol::Tcp, &[(BE2, 53)]);
        p.maps
            .sync(&state, Scope::Changed(&changed(&[&old, &new])))
            .unwrap();
        for sport in 35001..35011 {
            assert_eq!(
                dnat(&p, &Spec::tcp(CLIENT, sport, VIP, 53)).dst,
                BE2,
                "{old_name} -> {new_name}: new connections go to the new service"
            );
        }
        assert_eq!(
            dnat(&p, &with_flags(&established, 0x10)).dst,
            BE1,
            "{old_name} -> {new_name}: the old service's connection drains"
        );
        let rows: Vec<_> = inspect::services(p.bpffs.path())
            .unwrap()
            .into_iter()
            .filter(|r| r.address.ends_with(":53"))
            .collect();
        assert!(
            rows.len() == 1 && !rows[0].draining && rows[0].backends.len() == 1,
            "{old_name} -> {new_name}: {rows:?}"
        );
    }
}

fn services_map(p: &Programs) -> BpfHashMap<MapData, ServiceKey, ServiceValue> {
    let data = MapData::from_pin(p.bpffs.path().join(MAP_SERVICES)).unwrap();
    Map::HashMap(data).try_into().unwrap()
}

fn key(vip: Ipv4Addr, port: u16, slot: u16) -> ServiceKey {
    ServiceKey::new(
        proxy_common::Be32::from_octets(vip.octets()),
        proxy_common::Be16::new(port),
        TCP,
        slot,
    )
}

#[test]
fn a_packet_to_a_service_is_never_passed_untranslated_during_an_update() {
    let Some((p, _)) = setup(
        "a_packet_to_a_service_is_never_passed_untranslated_during_an_update",
        &[(BE1, 8080)],
    ) else {
        return;
    };
    // What a packet can see while the agent shrinks a service: a head counting slots that
    // are already gone.
    let mut services = services_map(&p);
    let head = services.get(&key(VIP, 80, 0), 0).unwrap();
    services
        .insert(key(VIP, 80, 0), ServiceValue { count: 4, ..head }, 0)
        .unwrap();
    let mut dropped = 0;
    for sport in 36000..36100 {
        let frame = Spec::tcp(CLIENT, sport, VIP, 80).build();
        let (verdict, out) = p.run("tc_ingress", &frame);
        match verdict {
            TC_ACT_SHOT => dropped += 1,
            TC_ACT_UNSPEC => assert_eq!(packet::read(&out).dst, BE1, "sport {sport}"),
            other => panic!("verdict {other}"),
        }
    }
    // A miss is tried once more: (3/4)^2 of the packets find no slot.
    assert!((30..=85).contains(&dropped), "{dropped} of 100 dropped");
    let drops: PerCpuArray<_, u64> =
        Map::PerCpuArray(MapData::from_pin(p.bpffs.path().join(MAP_DROPS)).unwrap())
            .try_into()
            .unwrap();
    let counted: u64 = drops.get(&DROP_NO_BACKEND, 0).unwrap().iter().sum();
    assert_eq!(counted, dropped, "every drop is counted");
}

#[test]
fn recovery_rewrites_a_damaged_service() {
    let Some((mut p, state)) = setup(
        "recovery_rewrites_a_damaged_service",
        &[(BE1, 8080), (BE2, 8080)],
    ) else {
        return;
    };
    services_map(&p).remove(&key(VIP, 80, 1)).unwrap();
    restart(&mut p, SMALL, DEFAULT_DRAIN_PERIOD);
    p.program(&state).unwrap();
    let web = inspect::services(p.bpffs.path()).unwrap();
    let web = web.iter().find(|r| r.protocol == "TCP").unwrap();
    let addresses: Vec<&str> = web.backends.iter().map(|b| b.address.as_str()).collect();
    assert_eq!(addresses, vec!["10.244.1.11:8080", "10.244.1.12:8080"]);
    assert_eq!(
        flows_by_backend(&p, TCP, VIP, 80)
            .into_keys()
            .collect::<Vec<_>>(),
        vec![BE1, BE2]
    );
}

/// After a restart, a recovered frontend whose reprogramming fails halfway (its endpoints' ids
/// taken over by its port, the new endpoint's refused by a backends map that others filled)
/// keeps serving its endpoints, and the UDP routes still name them: the sockets connected
/// through them are not stale.
#[test]
fn a_recovered_frontend_whose_reprogramming_failed_keeps_its_udp_routes() {
    let Some((mut p, mut state)) = setup(
        "a_recovered_frontend_whose_reprogramming_failed_keeps_its_udp_routes",
        &[(BE1, 8080), (BE2, 8080)],
    ) else {
        return;
    };
    // Maglev tables are written at once, not in a batch: the failure comes in the middle of
    // reprogramming dns (batched, it would come after, when the batch is written).
    restart_with(
        &mut p,
        SMALL,
        WriterConfig {
            lb_algorithm: LbAlgorithm::Maglev,
            ..WriterConfig::default()
        },
    );
    let mut backends: BpfHashMap<MapData, u32, Backend> =
        Map::HashMap(MapData::from_pin(p.bpffs.path().join(MAP_BACKENDS)).unwrap())
            .try_into()
            .unwrap();
    let mut foreign = 0x8000_0000u32;
    while backends.insert(foreign, Backend::default(), 0).is_ok() {
        foreign += 1;
    }
    add_service(
        &mut state,
        &Svc {
            name: "dns",
            vip: VIP,
            port: 80,
            protocol: Protocol::Udp,
            endpoints: &[(BE1, 8080), (BE2, 8080), (BE3, 8080)],
        },
    );
    p.program(&state).expect_err("the backends map is full");
    assert_eq!(
        flows_by_backend(&p, packet::UDP, VIP, 80)
            .into_keys()
            .collect::<Vec<_>>(),
        vec![BE1, BE2],
        "dns keeps serving what it had"
    );
    let routes = p.maps.udp_routes();
    for be in [BE1, BE2] {
        let route = (IpAddr::from(VIP), 80, IpAddr::from(be), 8080);
        assert!(routes.contains(&route), "no route {route:?} in {routes:?}");
    }
}

/// Creates and pins a map by hand, as another release of the agent might have left it.
fn pin_map(path: &std::path::Path, map_type: u32, key: u32, value: u32, entries: u32) -> i32 {
    #[repr(C)]
    struct Create {
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        flags: u32,
        rest: [u8; 108],
    }
    #[repr(C)]
    struct Pin {
        pathname: u64,
        fd: u32,
        flags: u32,
        rest: [u8; 112],
    }
    let create = Create {
        map_type,
        key_size: key,
        value_size: value,
        max_entries: entries,
        flags: 0,
        rest: [0; 108],
    };
    // SAFETY: the bpf syscall with a zero-padded attribute of the size we pass.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            0, // BPF_MAP_CREATE
            &create as *const Create,
            size_of::<Create>(),
        )
    } as i32;
    assert!(
        fd >= 0,
        "creating a map: {}",
        std::io::Error::last_os_error()
    );
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let pin = Pin {
        pathname: c_path.as_ptr() as u64,
        fd: fd as u32,
        flags: 0,
        rest: [0; 112],
    };
    // SAFETY: as above; c_path outlives the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            6, /* BPF_OBJ_PIN */
            &pin as *const Pin,
            size_of::<Pin>(),
        )
    };
    assert_eq!(r, 0, "pinning a map: {}", std::io::Error::last_os_error());
    fd
}

#[test]
fn pinned_maps_of_another_layout_are_migrated_or_recreated() {
    if !privileged("pinned_maps_of_another_layout_are_migrated_or_recreated") {
        return;
    }
    let bpffs = PrivateBpffs::new().unwrap();
    let dir = bpffs.path();
    // Layout 1's AGENT_STATE (one entry: the next backend id), and a services map whose value
    // has another size.
    const BPF_MAP_TYPE_HASH: u32 = 1;
    const BPF_MAP_TYPE_ARRAY: u32 = 2;
    pin_map(&dir.join(MAP_AGENT_STATE), BPF_MAP_TYPE_ARRAY, 4, 8, 1);
    {
        let data = MapData::from_pin(dir.join(MAP_AGENT_STATE)).unwrap();
        let mut old: aya::maps::Array<_, u64> = Map::Array(data).try_into().unwrap();
        old.set(0, 5000, 0).unwrap();
    }
    pin_map(&dir.join(MAP_SERVICES), BPF_MAP_TYPE_HASH, 12, 12, 64);

    let mut loaded = ebpf::load(dir, SMALL).expect("maps of another layout must not stop a load");
    // So the agent attaches the programs only once its first sync has filled the new maps.
    assert!(loaded.recreated);
    let info = aya::maps::MapInfo::from_pin(dir.join(MAP_SERVICES)).unwrap();
    assert_eq!(
        (info.key_size() as usize, info.value_size() as usize),
        (size_of::<ServiceKey>(), size_of::<ServiceValue>()),
        "the services map is recreated in this layout"
    );
    let data = MapData::from_pin(dir.join(MAP_AGENT_STATE)).unwrap();
    let state: aya::maps::Array<_, u64> = Map::Array(data).try_into().unwrap();
    assert_eq!(state.get(&AGENT_STATE_NEXT_BACKEND_ID, 0).unwrap(), 5000);
    assert_eq!(state.get(&AGENT_STATE_LAYOUT, 0).unwrap(), LAYOUT_VERSION);
    // New backends get ids above the carried-over counter.
    let mut maps = MapWriter::take_from(&mut loaded.ebpf, WriterConfig::default()).unwrap();
    let mut desired = DesiredState::default();
    set_endpoints(&mut desired, "web", VIP, 80, Protocol::Tcp, &[(BE1, 8080)]);
    maps.sync(&desired, Scope::All).unwrap();
    let ids: Vec<u32> = inspect::backends(dir)
        .unwrap()
        .iter()
        .map(|b| b.id)
        .collect();
    assert_eq!(ids, vec![5000]);
}

#[test]
fn a_second_agent_on_the_same_pins_is_refused() {
    if !privileged("a_second_agent_on_the_same_pins_is_refused") {
        return;
    }
    let bpffs = PrivateBpffs::new().unwrap();
    let first = PinDirLock::acquire(bpffs.path()).unwrap();
    let err = PinDirLock::acquire(bpffs.path())
        .err()
        .expect("a second lock must fail");
    assert!(
        format!("{err:#}").contains("another agent is using"),
        "{err:#}"
    );
    drop(first);
    PinDirLock::acquire(bpffs.path()).expect("free again once the first agent is gone");
}

/// Every head in the services map counts slots that exist, each naming a backend that exists:
/// what a packet needs to be translated, whatever the writer was doing.
fn assert_every_head_complete(p: &Programs) {
    let services = services_map(p);
    let backends: BpfHashMap<MapData, u32, Backend> =
        Map::HashMap(MapData::from_pin(p.bpffs.path().join(MAP_BACKENDS)).unwrap())
            .try_into()
            .unwrap();
    for head in services.keys().map(Result::unwrap).filter(|k| k.slot == 0) {
        let count = services.get(&head, 0).unwrap().count;
        for slot in 1..=count {
            let id = services
                .get(&ServiceKey { slot, ..head }, 0)
                .unwrap_or_else(|e| panic!("{head:?} counts {count} slots, slot {slot}: {e}"))
                .backend_id;
            backends
                .get(&id, 0)
                .unwrap_or_else(|e| panic!("{head:?} slot {slot} names backend {id}: {e}"));
        }
    }
}

#[test]
fn a_failed_batch_of_writes_leaves_every_service_serving_and_later_syncs_complete() {
    let test = "a_failed_batch_of_writes_leaves_every_service_serving_and_later_syncs_complete";
    if !privileged(test) {
        return;
    }
    let written = failed_batch(SMALL, 40);
    assert!(
        written.contains("writing service slots (60 of 121 written)"),
        "{written}"
    );
}

/// As above, where the batch that fails is written on a thread of its own while the next one
/// is prepared: the sync fails once it has waited for that write (when the next batch is full).
#[test]
fn a_batch_written_while_the_next_is_prepared_fails_the_same_way() {
    if !privileged("a_batch_written_while_the_next_is_prepared_fails_the_same_way") {
        return;
    }
    let sizes = MapSizes {
        services: 16384,
        backends: 16384,
        ..SMALL
    };
    // Two backends and three entries of the services map a service: 20k writes, where a batch
    // holds 8192; the first one fails.
    let written = failed_batch(sizes, 4000);
    let of: usize = (written.split_once("writing service slots (60 of "))
        .and_then(|(_, rest)| rest.split_once(' ')?.0.parse().ok())
        .unwrap_or_else(|| panic!("{written}"));
    assert!(of < 8192, "{written}");
}

/// A sync that moves web to another endpoint and adds `count` services of two endpoints (three
/// entries of the services map each), where entries the writer does not know of (as another
/// agent on the same pins would leave) leave room for 60: it fails, the maps are read back,
/// every service keeps serving, and once there is room the next syncs write everything.
/// Returns the failed sync's error.
fn failed_batch(sizes: MapSizes, count: usize) -> String {
    let mut p = Programs::load_draining(sizes, Duration::ZERO).unwrap();
    let mut state = DesiredState::default();
    set_web(&mut state, &[(BE1, 8080)]);
    p.program(&state).unwrap();
    set_web(&mut state, &[(BE2, 8080)]);
    let names: Vec<String> = (0..count).map(|i| format!("svc{i}")).collect();
    let vip = |i: usize| Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 1, 0)) + i as u32);
    for (i, name) in names.iter().enumerate() {
        add_service(
            &mut state,
            &Svc {
                name,
                vip: vip(i),
                port: 80,
                protocol: Protocol::Tcp,
                endpoints: &[(BE1, 8080), (BE3, 8080)],
            },
        );
    }
    let mut services = services_map(&p);
    let foreign: Vec<ServiceKey> = (0..sizes.services as usize - 60 - services.keys().count())
        .map(|i| key(Ipv4Addr::from(0xc000_0000 + i as u32), 80, 0))
        .collect();
    for k in &foreign {
        services.insert(k, ServiceValue::default(), 0).unwrap();
    }
    let err = format!("{:#}", p.program(&state).unwrap_err());
    assert!(err.contains("read back"), "{err}");
    assert_every_head_complete(&p);
    let web = dnat(&p, &Spec::tcp(CLIENT, 40000, VIP, 80)).dst;
    assert!(web == BE1 || web == BE2, "web goes to {web}");
    // Room again: the next syncs write everything (the first may find the map still counted
    // full: the entries it does not know of drain, for a period of 0 here, after it).
    for k in &foreign {
        services.remove(k).unwrap();
    }
    let synced = (0..3).any(|_| p.program(&state).is_ok());
    assert!(synced, "{:#}", p.program(&state).unwrap_err());
    assert_every_head_complete(&p);
    assert_eq!(dnat(&p, &Spec::tcp(CLIENT, 40001, VIP, 80)).dst, BE2);
    // The first and last services, and a few between.
    for i in (0..count).step_by(count.div_ceil(40)).chain([count - 1]) {
        let to = dnat(&p, &Spec::tcp(CLIENT, 40002, vip(i), 80)).dst;
        assert!(to == BE1 || to == BE3, "service {i} goes to {to}");
    }
    err
}

#[test]
fn a_frontend_two_services_program_in_one_sync_keeps_every_slot_it_counts() {
    if !privileged("a_frontend_two_services_program_in_one_sync_keeps_every_slot_it_counts") {
        return;
    }
    let mut p = Programs::load(SMALL).unwrap();
    let mut state = DesiredState::default();
    let svc = |name, endpoints| Svc {
        name,
        vip: VIP,
        port: 80,
        protocol: Protocol::Tcp,
        endpoints,
    };
    add_service(
        &mut state,
        &svc("three", &[(BE1, 8080), (BE2, 8080), (BE3, 8080)]),
    );
    p.program(&state).unwrap();
    // Another Service takes the same address (as two Services may with an external IP): in
    // name order, "one" shrinks the frontend to one slot, then "three" grows it back.
    add_service(&mut state, &svc("one", &[(BE1, 8080)]));
    for _ in 0..2 {
        p.program(&state).unwrap();
        assert_every_head_complete(&p);
        assert_eq!(
            flows_by_backend(&p, TCP, VIP, 80)
                .into_keys()
                .collect::<Vec<_>>(),
            vec![BE1, BE2, BE3]
        );
    }
}

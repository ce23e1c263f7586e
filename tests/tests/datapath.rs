//! The tc programs under BPF_PROG_TEST_RUN: crafted frames in, verdict and rewritten bytes out,
//! both checksums checked by recomputing them.
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::Duration,
};

use proxy_common::{
    Be16, Be32, CT_FORWARD, CT_NETFILTER, CT_STATE_TCP_ESTABLISHED, CT_STATE_TCP_HALF_CLOSED,
    CT_STATE_TCP_OPENING, CT_STATE_UDP, CtKey, CtValue, DROP_ICMP_RATE_LIMITED,
    DROP_INVALID_SOURCE, HAIRPIN_ADDR6, ICMP_ERRORS_BURST, ICMP_ERRORS_PER_SEC,
};

use proxy_tests::{
    NS_PREFIX,
    fixtures::*,
    packet::{self, ETH_HLEN, Spec, TCP, UDP},
    privileged,
    programs::{
        Programs, Svc, TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC, add_service, ready_endpoint,
    },
};
use proxy_userspace::{
    dataplane::{NotProgrammable, Scope},
    model::{DesiredState, Protocol},
    modes::ebpf::inspect,
    modes::ebpf::{MapSizes, writer::DEFAULT_DRAIN_PERIOD},
};

#[test]
fn tcp_syn_to_vip_is_dnated_with_valid_checksums() {
    let Some((p, _)) = setup(
        "tcp_syn_to_vip_is_dnated_with_valid_checksums",
        &[(BE1, 8080)],
    ) else {
        return;
    };
    let seen = dnat(&p, &Spec::tcp(CLIENT, 40000, VIP, 80));
    assert_eq!((seen.dst, seen.dport), (BE1, 8080));
    // An ACK of the same flow goes to the same place.
    let ack = Spec {
        tcp_flags: 0x10,
        ..Spec::tcp(CLIENT, 40000, VIP, 80)
    };
    assert_eq!(dnat(&p, &ack).dst, BE1);
}

#[test]
fn replies_are_reverse_nated() {
    let Some((p, _)) = setup("replies_are_reverse_nated", &[(BE1, 8080)]) else {
        return;
    };
    for spec in [
        Spec::tcp(CLIENT, 40001, VIP, 80),
        Spec::udp(CLIENT, 40001, VIP, 80),
    ] {
        dnat(&p, &spec);
        let reply = Spec {
            tcp_flags: 0x12,
            ..spec.clone()
        };
        let reply = Spec {
            src: BE1.into(),
            sport: 8080,
            dst: CLIENT.into(),
            dport: 40001,
            ..reply
        };
        let frame = reply.build();
        let (verdict, out) = p.run("tc_egress", &frame);
        assert_eq!(verdict, TC_ACT_UNSPEC);
        let seen = packet::read(&out);
        assert_eq!(
            (seen.src, seen.sport, seen.dst, seen.dport),
            (VIP, 80, CLIENT, 40001)
        );
        packet::assert_checksums(&out, false);
    }
}

#[test]
fn udp_checksums_including_zero() {
    let Some((p, _)) = setup("udp_checksums_including_zero", &[(BE1, 5353)]) else {
        return;
    };
    let seen = dnat(&p, &Spec::udp(CLIENT, 41000, VIP, 80));
    assert_eq!((seen.dst, seen.dport), (BE1, 5353));
    let zero = Spec {
        udp_zero_checksum: true,
        ..Spec::udp(CLIENT, 41001, VIP, 80)
    };
    let seen = dnat(&p, &zero);
    assert_eq!((seen.dst, seen.dport, seen.l4_csum), (BE1, 5353, 0));
    // The reply with no checksum keeps none.
    let reply = Spec {
        src: BE1.into(),
        sport: 5353,
        dst: CLIENT.into(),
        dport: 41001,
        ..zero
    };
    let (_, out) = p.run("tc_egress", &reply.build());
    assert_eq!(packet::read(&out).src, VIP);
    packet::assert_checksums(&out, true);
}

#[test]
fn ip_options_are_handled() {
    let Some((p, _)) = setup("ip_options_are_handled", &[(BE1, 8080)]) else {
        return;
    };
    for words in 1..=10 {
        // NOPs, then an end-of-options byte.
        let mut options = vec![1u8; words * 4];
        *options.last_mut().unwrap() = 0;
        let spec = Spec {
            ip_options: options,
            ..Spec::tcp(CLIENT, 42000 + words as u16, VIP, 80)
        };
        assert_eq!(dnat(&p, &spec).dst, BE1, "{words} option words");
    }
}

#[test]
fn a_flow_sticks_and_new_flows_spread() {
    let eps = [(BE1, 8080), (BE2, 8080), (BE3, 8080)];
    let Some((p, _)) = setup("a_flow_sticks_and_new_flows_spread", &eps) else {
        return;
    };
    for proto in [TCP, UDP] {
        let mut chosen = BTreeSet::new();
        for sport in 43000..43060 {
            let spec = Spec {
                proto,
                ..Spec::tcp(CLIENT, sport, VIP, 80)
            };
            let first = dnat(&p, &spec).dst;
            for _ in 0..5 {
                assert_eq!(
                    dnat(&p, &spec).dst,
                    first,
                    "flow {sport}/{proto} changed backend"
                );
            }
            chosen.insert(first);
        }
        assert_eq!(
            chosen,
            BTreeSet::from([BE1, BE2, BE3]),
            "60 flows should reach all 3 backends"
        );
    }
}

/// A bridge CNI (flannel's `cni0`, k3s, the `bridge` plugin) delivers a pod's frame to the
/// bridge device after its port: the SYN, already translated, meets a tc program a second time
/// as a connection straight to the endpoint. The flow's reply entry must survive that, or the
/// SYN-ACK is not translated back and the pod's connection is reset. A bare SYN straight to the
/// endpoint on a finished flow's 5-tuple still forgets that flow's reply entry.
#[test]
fn a_translated_syn_seen_again_keeps_its_flow() {
    let Some((p, _)) = setup("a_translated_syn_seen_again_keeps_its_flow", &[(BE1, 8080)]) else {
        return;
    };
    let syn = Spec::tcp(CLIENT, 40010, VIP, 80);
    let seen = dnat(&p, &syn);
    assert_eq!((seen.dst, seen.dport), (BE1, 8080));
    // The second pass: the translated SYN, at the bridge.
    let again = Spec::tcp(CLIENT, 40010, BE1, 8080).build();
    untouched(&p, "tc_ingress", &again);
    let syn_ack = Spec {
        tcp_flags: 0x12,
        ..Spec::tcp(BE1, 8080, CLIENT, 40010)
    };
    let (verdict, out) = p.run("tc_egress", &syn_ack.build());
    assert_eq!(verdict, TC_ACT_UNSPEC);
    let back = packet::read(&out);
    assert_eq!(
        (back.src, back.sport),
        (VIP, 80),
        "the SYN-ACK is translated back"
    );
    // The flow ends (a RST from the client), then the client reuses its port straight to the
    // endpoint: that connection's replies are its own.
    let rst = Spec {
        tcp_flags: 0x04,
        ..Spec::tcp(CLIENT, 40010, VIP, 80)
    };
    dnat(&p, &rst);
    untouched(&p, "tc_ingress", &again);
    untouched(&p, "tc_egress", &syn_ack.build());
}

#[test]
fn non_service_traffic_passes_untouched() {
    let Some((p, _)) = setup("non_service_traffic_passes_untouched", &[(BE1, 8080)]) else {
        return;
    };
    for spec in [
        Spec::tcp(CLIENT, 40000, BE2, 80), // not a VIP
        Spec::tcp(CLIENT, 40000, VIP, 81), // the VIP, another port
        Spec::udp(CLIENT, 40000, Ipv4Addr::new(8, 8, 8, 8), 53),
        Spec {
            proto: UDP,
            ..Spec::tcp(CLIENT, 40000, VIP, 443)
        },
    ] {
        let frame = spec.build();
        untouched(&p, "tc_ingress", &frame);
        untouched(&p, "tc_egress", &frame);
    }
    // A reply-shaped packet with no flow behind it.
    untouched(
        &p,
        "tc_egress",
        &Spec::tcp(BE1, 8080, CLIENT, 40000).build(),
    );
    // Not IPv4 (an ARP frame).
    let mut arp = vec![0u8; 60];
    arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    untouched(&p, "tc_ingress", &arp);
}

#[test]
fn malformed_and_truncated_frames_pass_untouched() {
    let Some((p, _)) = setup(
        "malformed_and_truncated_frames_pass_untouched",
        &[(BE1, 8080)],
    ) else {
        return;
    };
    let good = Spec::tcp(CLIENT, 40000, VIP, 80).build();
    // Every truncation the test run accepts (it refuses IPv4 frames shorter than the fixed
    // IPv4 header, so the programs' own check for those is covered only by the verifier).
    const IPV4_MIN: usize = ETH_HLEN + 20;
    for len in IPV4_MIN..good.len() {
        untouched(&p, "tc_ingress", &good[..len]);
    }
    let udp = Spec::udp(CLIENT, 40000, VIP, 80).build();
    for len in IPV4_MIN..udp.len() {
        untouched(&p, "tc_ingress", &udp[..len]);
    }
    let mutate = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut frame = Spec::tcp(CLIENT, 40002, VIP, 80).build();
        f(&mut frame);
        frame
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("IHL below 5", mutate(&|f| f[ETH_HLEN] = 0x44)),
        ("IHL beyond the packet", mutate(&|f| f[ETH_HLEN] = 0x4f)),
        (
            "IP version 6 in an IPv4 frame",
            mutate(&|f| f[ETH_HLEN] = 0x65),
        ),
        (
            "total length below the headers",
            mutate(&|f| f[ETH_HLEN + 2..ETH_HLEN + 4].copy_from_slice(&30u16.to_be_bytes())),
        ),
        (
            "total length beyond the frame",
            mutate(&|f| f[ETH_HLEN + 2..ETH_HLEN + 4].copy_from_slice(&1500u16.to_be_bytes())),
        ),
        (
            "a later fragment whose first one was never seen",
            mutate(&|f| f[ETH_HLEN + 7] = 0x10),
        ),
        ("ICMP to the VIP", mutate(&|f| f[ETH_HLEN + 9] = 1)),
    ];
    for (what, frame) in cases {
        let (verdict, out) = p.run("tc_ingress", &frame);
        assert_eq!(
            (verdict, &out),
            (TC_ACT_UNSPEC, &frame),
            "{what}: must pass untouched"
        );
    }
}

#[test]
fn endpoint_changes_apply_to_established_flows_only_when_their_backend_goes() {
    let Some((mut p, mut state)) = setup(
        "endpoint_changes_apply_to_established_flows_only_when_their_backend_goes",
        &[(BE1, 8080), (BE2, 8080)],
    ) else {
        return;
    };
    // Find a flow on BE1 and one on BE2.
    let mut on = std::collections::BTreeMap::new();
    for sport in 44000..44100 {
        let spec = Spec::tcp(CLIENT, sport, VIP, 80);
        on.entry(dnat(&p, &spec).dst).or_insert(spec);
    }
    let (on_be1, on_be2) = (on[&BE1].clone(), on[&BE2].clone());
    // BE1 leaves: its flow moves to BE2, the BE2 flow stays, new flows go to BE2 only.
    let web = set_web(&mut state, &[(BE2, 8080)]);
    p.maps
        .sync(&state, Scope::Changed(&BTreeSet::from([web.clone()])))
        .unwrap();
    assert_eq!(dnat(&p, &on_be1).dst, BE2);
    assert_eq!(dnat(&p, &on_be2).dst, BE2);
    for sport in 45000..45020 {
        assert_eq!(dnat(&p, &Spec::tcp(CLIENT, sport, VIP, 80)).dst, BE2);
    }
    // The service goes away: even established flows pass untouched (the VIP is not routed).
    state.remove_port(&web);
    p.maps
        .sync(&state, Scope::Changed(&BTreeSet::from([web])))
        .unwrap();
    untouched(&p, "tc_ingress", &on_be2.build());
    untouched(&p, "tc_ingress", &Spec::tcp(CLIENT, 46000, VIP, 80).build());
}

#[test]
fn a_service_without_endpoints_is_refused_at_once() {
    let Some((p, _)) = setup("a_service_without_endpoints_is_refused_at_once", &[]) else {
        return;
    };
    const TC_ACT_REDIRECT: u32 = 7;
    for spec in [
        Spec::tcp(CLIENT, 40000, VIP, 80),
        Spec::udp(CLIENT, 40000, VIP, 80),
        Spec {
            payload: vec![7; 1400],
            ..Spec::udp(CLIENT, 40001, VIP, 80)
        },
    ] {
        let frame = spec.build();
        let (verdict, out) = p.run("tc_ingress", &frame);
        assert_eq!(verdict, TC_ACT_REDIRECT, "sent back to the pod");
        packet::assert_port_unreachable(&out, &frame);
    }
    // With IP options the quote does not fit the reply's fixed layout: passed as before.
    let with_options = Spec {
        ip_options: vec![1, 1, 1, 0],
        ..Spec::tcp(CLIENT, 40002, VIP, 80)
    };
    untouched(&p, "tc_ingress", &with_options.build());
}

/// Rejects are paced per CPU as the kernel paces its ICMP errors: a burst, then about one a
/// millisecond; what comes faster is dropped unanswered, counted.
#[test]
fn rejects_are_paced() {
    let Some((p, _)) = setup("rejects_are_paced", &[]) else {
        return;
    };
    // On one CPU, so that its pace alone decides.
    // SAFETY: a zeroed cpu_set_t with one CPU set, for this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set),
            0
        );
    }
    let started = std::time::Instant::now();
    let mut answered = 0u64;
    for sport in 0..400u16 {
        let (verdict, _) = p.run(
            "tc_ingress",
            &Spec::tcp(CLIENT, 30000 + sport, VIP, 80).build(),
        );
        match verdict {
            TC_ACT_SHOT => {}
            _ => answered += 1,
        }
    }
    let elapsed_ms = started.elapsed().as_millis() as u64;
    let limited = p.drops(DROP_ICMP_RATE_LIMITED);
    assert_eq!(answered + limited, 400);
    let most = ICMP_ERRORS_BURST + 1 + elapsed_ms * ICMP_ERRORS_PER_SEC / 1000 + 1;
    assert!(
        answered > ICMP_ERRORS_BURST && answered <= most,
        "{answered} answered in {elapsed_ms} ms (the burst is {ICMP_ERRORS_BURST})"
    );
    // Once the pace has caught up, answered again.
    std::thread::sleep(Duration::from_millis(100));
    let (verdict, _) = p.run("tc_ingress", &Spec::tcp(CLIENT, 31000, VIP, 80).build());
    assert_ne!(verdict, TC_ACT_SHOT);
}

#[test]
fn maps_hold_what_inspect_shows_and_survive_a_restart() {
    let Some((mut p, mut state)) = setup(
        "maps_hold_what_inspect_shows_and_survive_a_restart",
        &[(BE1, 8080), (BE2, 8080)],
    ) else {
        return;
    };
    let shown =
        proxy_userspace::inspect::services_table(&inspect::services(p.bpffs.path()).unwrap());
    assert_eq!(
        shown,
        "SERVICE                  PROTO KIND         BACKENDS (id address)\n\
         10.96.0.10:80            TCP   ClusterIP    3 10.244.1.11:8080, 4 10.244.1.12:8080\n\
         10.96.0.10:80            UDP   ClusterIP    1 10.244.1.11:8080, 2 10.244.1.12:8080\n"
    );
    // A new map writer (an agent restart) recovers the ids and prunes what is no longer wanted.
    // Loading again reuses the pinned maps, as a restarted agent does.
    // A drain period of zero: what is no longer wanted goes at once.
    restart(&mut p, SMALL, Duration::ZERO);
    state.retain_ports(|k| k.protocol == Protocol::Tcp);
    set_web(&mut state, &[(BE2, 8080), (BE3, 8080)]);
    p.maps.sync(&state, Scope::All).unwrap();
    let rows = inspect::services(p.bpffs.path()).unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    let ids: Vec<(u32, String)> = rows[0]
        .backends
        .iter()
        .map(|b| (b.id, b.address.clone()))
        .collect();
    // Ids are given in service-port order (default/dns before default/web) and kept; a new
    // backend after the restart gets an id past the block the first agent reserved.
    assert_eq!(
        ids,
        vec![
            (4, "10.244.1.12:8080".to_owned()),
            (1025, "10.244.2.11:8080".to_owned())
        ]
    );
    let backends = inspect::backends(p.bpffs.path()).unwrap();
    assert_eq!(
        backends.len(),
        2,
        "unused backends must be deleted: {backends:?}"
    );
}

#[test]
fn a_full_map_fails_clearly_and_keeps_the_rest() {
    if !privileged("a_full_map_fails_clearly_and_keeps_the_rest") {
        return;
    }
    let mut p = Programs::load(MapSizes {
        services: 8,
        backends: 64,
        conntrack: 64,
        conntrack6: 64,
    })
    .unwrap();
    let mut state = DesiredState::default();
    let eps: Vec<(Ipv4Addr, u16)> = (1..=3)
        .map(|i| (Ipv4Addr::new(10, 244, 1, i), 80))
        .collect();
    add_service(
        &mut state,
        &Svc {
            name: "a",
            vip: Ipv4Addr::new(10, 96, 0, 1),
            port: 80,
            protocol: Protocol::Tcp,
            endpoints: &eps,
        },
    );
    let many: Vec<(Ipv4Addr, u16)> = (1..=10)
        .map(|i| (Ipv4Addr::new(10, 244, 2, i), 80))
        .collect();
    add_service(
        &mut state,
        &Svc {
            name: "b",
            vip: Ipv4Addr::new(10, 96, 0, 2),
            port: 80,
            protocol: Protocol::Tcp,
            endpoints: &many,
        },
    );
    let err = p
        .program(&state)
        .expect_err("11 slots cannot fit next to 4 in 8");
    assert!(
        err.is::<NotProgrammable>(),
        "a full map is not worth retrying: {err:#}"
    );
    let err = err.to_string();
    assert!(
        err.contains("services map full") && err.contains("--bpf-services-max"),
        "{err}"
    );
    let rows = inspect::services(p.bpffs.path()).unwrap();
    assert_eq!(
        rows.len(),
        1,
        "service a must still be programmed: {rows:?}"
    );
    assert_eq!(rows[0].address, "10.96.0.1:80");
}

#[test]
fn closed_and_idle_flows_expire() {
    let Some((p, _)) = setup("closed_and_idle_flows_expire", &[(BE1, 8080)]) else {
        return;
    };
    let tcp = Spec::tcp(CLIENT, 47000, VIP, 80);
    let udp = Spec::udp(CLIENT, 47000, VIP, 80);
    dnat(&p, &tcp);
    dnat(&p, &udp);
    // The client resets the TCP connection: both of its entries get the closing lifetime.
    dnat(
        &p,
        &Spec {
            tcp_flags: 0x14,
            ..tcp.clone()
        },
    );
    let flows = inspect::conntrack(p.bpffs.path()).unwrap();
    let tcp_flows: Vec<_> = flows.iter().filter(|f| f.protocol == "TCP").collect();
    assert_eq!(tcp_flows.len(), 2);
    assert!(
        tcp_flows.iter().all(|f| f.closing && !f.expired),
        "{tcp_flows:?}"
    );
    // 11 s later the TCP flow is over; the UDP flow (60 s) is not yet.
    if !age_conntrack(&p, 11) {
        return;
    }
    untouched(&p, "tc_egress", &reply_to(&tcp, BE1, 8080, 0x12));
    let (_, out) = p.run("tc_egress", &reply_to(&udp, BE1, 8080, 0));
    assert_eq!(packet::read(&out).src, VIP, "the UDP flow is still live");
    // 61 s after that, the UDP flow is over too; a new packet on its 5-tuple starts a new flow.
    if !age_conntrack(&p, 61) {
        return;
    }
    untouched(&p, "tc_egress", &reply_to(&udp, BE1, 8080, 0));
    assert_eq!(dnat(&p, &udp).dst, BE1);
    let (_, out) = p.run("tc_egress", &reply_to(&udp, BE1, 8080, 0));
    assert_eq!(packet::read(&out).src, VIP);
}

/// A TCP flow lives by where it stands, as netfilter's states do: one being opened (no reply,
/// or no client packet after the first reply) a minute, so that unanswered SYNs free their
/// entries soon; an open one hours; a half-closed one (a FIN one way) an hour.
/// The states inspect shows for the entries of the flow from the client's port `sport`.
fn flow_states(p: &Programs, sport: u16) -> Vec<&'static str> {
    let port = format!(":{sport}");
    inspect::conntrack(p.bpffs.path())
        .unwrap()
        .into_iter()
        .filter(|f| f.source.ends_with(&port) || f.destination.ends_with(&port))
        .map(|f| f.state)
        .collect()
}

#[test]
fn tcp_flows_live_by_their_state() {
    let Some((p, _)) = setup("tcp_flows_live_by_their_state", &[(BE1, 8080)]) else {
        return;
    };
    let states = flow_states;
    let syn = |sport| Spec::tcp(CLIENT, sport, VIP, 80);
    let ack = |sport| Spec {
        tcp_flags: 0x10,
        ..syn(sport)
    };
    // Unanswered.
    dnat(&p, &syn(48000));
    // Answered, never acknowledged (SYN_RECV).
    dnat(&p, &syn(48001));
    p.run("tc_egress", &reply_to(&syn(48001), BE1, 8080, 0x12));
    // The whole handshake.
    dnat(&p, &syn(48002));
    p.run("tc_egress", &reply_to(&syn(48002), BE1, 8080, 0x12));
    dnat(&p, &ack(48002));
    // Open, then half-closed by the client.
    dnat(&p, &syn(48003));
    p.run("tc_egress", &reply_to(&syn(48003), BE1, 8080, 0x12));
    dnat(&p, &ack(48003));
    dnat(
        &p,
        &Spec {
            tcp_flags: 0x11,
            ..syn(48003)
        },
    );
    let expect = |when: &str, wants: [&str; 4]| {
        for (sport, want) in (48000..).zip(wants) {
            assert_eq!(states(&p, sport), vec![want; 2], "port {sport}, {when}");
        }
    };
    expect("at once", ["opening", "opening", "open", "half-closed"]);
    if !age_conntrack(&p, 61) {
        return;
    }
    expect("61 s on", ["expired", "expired", "open", "half-closed"]);
    // The retransmitted SYN of an expired opening starts the flow anew.
    assert_eq!(dnat(&p, &syn(48000)).dst, BE1);
    assert_eq!(states(&p, 48000), vec!["opening"; 2]);
    if !age_conntrack(&p, 3600) {
        return;
    }
    assert_eq!(states(&p, 48002), vec!["open"; 2], "an hour on");
    assert_eq!(states(&p, 48003), vec!["expired"; 2], "an hour on");
}

/// Source validation (`--bpf-source-validation`): a pod's packet that could start or change a
/// Service flow is dropped unless its source is routed back through the interface it came in
/// on, or that interface's bridge; a pod cannot open flows as another, nor close or re-balance
/// another's. Route lookups are made in a namespace of pod interfaces: pod-a (CLIENT/32),
/// pod-b (10.244.1.20/32), and pod-c, a port of br0 (10.244.9.0/24).
#[test]
fn a_pods_spoofed_packets_change_no_flow() {
    let Some((p, _)) = setup("a_pods_spoofed_packets_change_no_flow", &[(BE1, 8080)]) else {
        return;
    };
    let ns = proxy_tests::Netns::create(&format!("{NS_PREFIX}{}-src", std::process::id()))
        .expect("creating the namespace");
    let lines = [
        "link add pod-a type veth peer name pod-a-p",
        "link add pod-b type veth peer name pod-b-p",
        "link add pod-c type veth peer name pod-c-p",
        "link add br0 type bridge",
        "link set pod-c master br0",
        "link set pod-a up",
        "link set pod-b up",
        "link set pod-c up",
        "link set br0 up",
        "route add 10.244.1.10/32 dev pod-a",
        "route add 10.244.1.20/32 dev pod-b",
        "route add 10.244.9.0/24 dev br0",
    ];
    ns.ip_batch(&lines.map(String::from))
        .expect("building the namespace");
    // Route lookups for forwarding answer only where forwarding is on.
    ns.exec("sysctl", &["-q", "-w", "net.ipv4.conf.all.forwarding=1"])
        .expect("enabling forwarding");
    let index = |name: &str| {
        let name = std::ffi::CString::new(name).unwrap();
        // SAFETY: a plain C string.
        ns.run(|| unsafe { libc::if_nametoindex(name.as_ptr()) })
    };
    let (pod_a, pod_b, pod_c, br0) = (index("pod-a"), index("pod-b"), index("pod-c"), index("br0"));
    for (iface, route_back) in [(pod_a, pod_a), (pod_b, pod_b), (pod_c, br0)] {
        p.set_source_iface(iface, route_back);
    }
    let run = |frame: &[u8], ifindex| ns.run(|| p.run_on("tc_ingress", frame, ifindex));
    let syn = |src, sport| Spec::tcp(src, sport, VIP, 80);
    let pod_b_addr = Ipv4Addr::new(10, 244, 1, 20);

    // Each pod's own address passes, a bridge port's by its bridge's route.
    let (verdict, out) = run(&syn(CLIENT, 49000).build(), pod_a);
    assert_eq!((verdict, packet::read(&out).dst), (TC_ACT_UNSPEC, BE1));
    let (verdict, out) = run(&syn(Ipv4Addr::new(10, 244, 9, 5), 49001).build(), pod_c);
    assert_eq!((verdict, packet::read(&out).dst), (TC_ACT_UNSPEC, BE1));
    // Another pod's address, one routed nowhere, and a new flow's first UDP datagram: dropped.
    let spoofs = [
        syn(pod_b_addr, 49002),
        syn(Ipv4Addr::new(10, 250, 0, 1), 49003),
        Spec::udp(pod_b_addr, 49004, VIP, 80),
    ];
    for spec in &spoofs {
        assert_eq!(
            run(&spec.build(), pod_a).0,
            TC_ACT_SHOT,
            "{spec:?} from pod-a"
        );
    }
    assert_eq!(p.drops(DROP_INVALID_SOURCE), spoofs.len() as u64);
    // pod-b resets, finishes or re-opens pod-a's flow with pod-a's address: nothing changes.
    p.run("tc_egress", &reply_to(&syn(CLIENT, 49000), BE1, 8080, 0x12));
    let before = flow_states(&p, 49000);
    for tcp_flags in [0x04, 0x11, 0x02] {
        let spec = Spec {
            tcp_flags,
            ..syn(CLIENT, 49000)
        };
        assert_eq!(
            run(&spec.build(), pod_b).0,
            TC_ACT_SHOT,
            "flags {tcp_flags:#x}"
        );
        assert_eq!(flow_states(&p, 49000), before, "flags {tcp_flags:#x}");
    }
    // An interface the agent did not list is not checked.
    assert_eq!(run(&syn(pod_b_addr, 49005).build(), br0).0, TC_ACT_UNSPEC);
}

/// The lifetimes the agent's flags write (`--conntrack-tcp-timeout-established`,
/// `--bpf-ct-timeout-tcp-syn`, `--conntrack-tcp-timeout-close-wait`, `--bpf-ct-timeout-udp`)
/// replace the defaults, for the programs and for inspect alike.
#[test]
fn configured_lifetimes_replace_the_defaults() {
    let Some((p, _)) = setup("configured_lifetimes_replace_the_defaults", &[(BE1, 8080)]) else {
        return;
    };
    for (state, secs) in [
        (CT_STATE_TCP_ESTABLISHED, 120),
        (CT_STATE_TCP_OPENING, 20),
        (CT_STATE_TCP_HALF_CLOSED, 40),
        (CT_STATE_UDP, 10),
    ] {
        p.set_ct_lifetime(state, Duration::from_secs(secs));
    }
    let syn = |sport| Spec::tcp(CLIENT, sport, VIP, 80);
    let with_flags = |sport, tcp_flags| Spec {
        tcp_flags,
        ..syn(sport)
    };
    // Open; being opened; half-closed by the client; UDP.
    for sport in [48100, 48102] {
        dnat(&p, &syn(sport));
        p.run("tc_egress", &reply_to(&syn(sport), BE1, 8080, 0x12));
        dnat(&p, &with_flags(sport, 0x10));
    }
    dnat(&p, &syn(48101));
    dnat(&p, &with_flags(48102, 0x11));
    dnat(&p, &Spec::udp(CLIENT, 48103, VIP, 80));
    let expect = |when: &str, wants: [&str; 4]| {
        for (sport, want) in (48100..).zip(wants) {
            assert_eq!(
                flow_states(&p, sport),
                vec![want; 2],
                "port {sport}, {when}"
            );
        }
    };
    expect("at once", ["open", "opening", "half-closed", "open"]);
    // Each step passes one configured lifetime, and none of the defaults (60 s, 1 h, 24 h).
    for (secs, when, wants) in [
        (11, "11 s on", ["open", "opening", "half-closed", "expired"]),
        (10, "21 s on", ["open", "expired", "half-closed", "expired"]),
        (20, "41 s on", ["open", "expired", "expired", "expired"]),
        (80, "121 s on", ["expired", "expired", "expired", "expired"]),
    ] {
        if !age_conntrack(&p, secs) {
            return;
        }
        expect(when, wants);
    }
    // The programs agree: the expired open flow's next SYN starts it anew.
    assert_eq!(dnat(&p, &syn(48100)).dst, BE1);
    assert_eq!(flow_states(&p, 48100), vec!["opening"; 2]);
}

#[test]
fn a_backend_closing_marks_both_directions() {
    let Some((p, _)) = setup("a_backend_closing_marks_both_directions", &[(BE1, 8080)]) else {
        return;
    };
    let tcp = Spec::tcp(CLIENT, 47100, VIP, 80);
    dnat(&p, &tcp);
    let (_, out) = p.run("tc_egress", &reply_to(&tcp, BE1, 8080, 0x04)); // RST from the backend
    assert_eq!(packet::read(&out).src, VIP);
    let flows = inspect::conntrack(p.bpffs.path()).unwrap();
    assert!(
        flows.len() == 2 && flows.iter().all(|f| f.closing),
        "{flows:?}"
    );
}

#[test]
fn a_reply_entry_evicted_alone_is_recreated() {
    let Some((p, _)) = setup("a_reply_entry_evicted_alone_is_recreated", &[(BE1, 8080)]) else {
        return;
    };
    let tcp = Spec {
        tcp_flags: 0x10,
        ..Spec::tcp(CLIENT, 47200, VIP, 80)
    };
    dnat(&p, &tcp);
    let mut ct = p.conntrack();
    let reply: Vec<CtKey> = ct
        .iter()
        .map(Result::unwrap)
        .filter(|(_, v)| v.direction == proxy_common::CT_REPLY)
        .map(|(k, _)| k)
        .collect();
    assert_eq!(reply.len(), 1);
    ct.remove(&reply[0]).unwrap();
    untouched(&p, "tc_egress", &reply_to(&tcp, BE1, 8080, 0x10));
    // The client's next packets put it back: a forward packet looks at the reply entry every
    // 32 packets of the flow (and after a quiet second), not at each.
    for _ in 0..32 {
        dnat(&p, &tcp);
    }
    let (_, out) = p.run("tc_egress", &reply_to(&tcp, BE1, 8080, 0x10));
    assert_eq!(packet::read(&out).src, VIP);
}

#[test]
fn backend_ids_are_not_reused_after_a_restart() {
    let Some((mut p, mut state)) = setup(
        "backend_ids_are_not_reused_after_a_restart",
        &[(BE1, 8080), (BE2, 8080)],
    ) else {
        return;
    };
    // Ids 1-4 are handed out (dns: 1, 2; web: 3, 4); web goes away, and with it ids 3 and 4,
    // which conntrack entries may still name.
    state.retain_ports(|k| k.protocol == Protocol::Udp);
    p.program(&state).unwrap();
    // They drain, and the restarted agent's period of zero ends that at its first sync.
    restart(&mut p, SMALL, Duration::ZERO);
    set_web(&mut state, &[(BE3, 8080)]);
    p.program(&state).unwrap();
    let ids: Vec<u32> = inspect::backends(p.bpffs.path())
        .unwrap()
        .iter()
        .map(|b| b.id)
        .collect();
    assert_eq!(
        ids,
        vec![1, 2, 1025],
        "ids 3 and 4 must not be handed out again (ids are reserved 1024 at a time)"
    );
}

#[test]
fn a_restart_recovers_maps_larger_than_one_batch_read() {
    if !privileged("a_restart_recovers_maps_larger_than_one_batch_read") {
        return;
    }
    // 2000 services of 3 endpoints: 8000 service entries and 6000 backends, more than one
    // batch read (4096 entries) of each map.
    let sizes = MapSizes {
        services: 16384,
        backends: 16384,
        ..SMALL
    };
    let mut p = Programs::load(sizes).unwrap();
    let mut state = DesiredState::default();
    for i in 0..2000u32 {
        let endpoints: Vec<(Ipv4Addr, u16)> = (0..3)
            .map(|k| (Ipv4Addr::from(0x0af4_0000 + i * 3 + k), 8080))
            .collect();
        add_service(
            &mut state,
            &Svc {
                name: &format!("s{i}"),
                vip: Ipv4Addr::from(0x0a60_0000 + i),
                port: 80,
                protocol: Protocol::Tcp,
                endpoints: &endpoints,
            },
        );
    }
    let ids = |p: &Programs| -> std::collections::HashSet<(u32, String)> {
        let rows = inspect::backends(p.bpffs.path()).unwrap();
        rows.into_iter().map(|b| (b.id, b.address)).collect()
    };
    p.program(&state).unwrap();
    let before = ids(&p);
    assert_eq!(before.len(), 6000);
    // Recovered whole, the same state is programmed with the same ids: a backend the recovery
    // missed would get a new one.
    restart(&mut p, sizes, Duration::ZERO);
    p.program(&state).unwrap();
    let after = ids(&p);
    let moved = before.difference(&after).count();
    assert_eq!((moved, after.len()), (0, 6000), "backends given new ids");
    assert_eq!(inspect::services(p.bpffs.path()).unwrap().len(), 2000);
}

#[test]
fn a_restart_into_a_full_map_keeps_serving_the_old_backends() {
    let Some((mut p, mut state)) = setup(
        "a_restart_into_a_full_map_keeps_serving_the_old_backends",
        &[(BE1, 8080)],
    ) else {
        return;
    };
    state.retain_ports(|k| k.protocol == Protocol::Tcp);
    p.program(&state).unwrap();
    // While the agent was down the service grew beyond what the map can hold.
    restart(&mut p, SMALL, DEFAULT_DRAIN_PERIOD);
    let many: Vec<(Ipv4Addr, u16)> = (1..=2000)
        .map(|i| (Ipv4Addr::from(0x0af4_0000 + i), 8080))
        .collect();
    set_web(&mut state, &many);
    let err = p
        .program(&state)
        .expect_err("2001 slots do not fit in 1024");
    assert!(err.is::<NotProgrammable>(), "{err:#}");
    assert_eq!(
        dnat(&p, &Spec::tcp(CLIENT, 48000, VIP, 80)).dst,
        BE1,
        "the old backend must stay"
    );
    // And it is still owned: a later change that fits replaces it cleanly.
    set_web(&mut state, &[(BE2, 8080)]);
    p.program(&state).unwrap();
    assert_eq!(dnat(&p, &Spec::tcp(CLIENT, 48001, VIP, 80)).dst, BE2);
}

#[test]
fn a_pod_reaching_itself_goes_out_and_back_through_its_own_interface() {
    let Some((p, _)) = setup(
        "a_pod_reaching_itself_goes_out_and_back_through_its_own_interface",
        &[(CLIENT, 8080)],
    ) else {
        return;
    };
    const TC_ACT_REDIRECT: u32 = 7;
    let hairpin = Ipv4Addr::new(169, 254, 42, 1);
    for spec in [
        Spec::tcp(CLIENT, 49000, VIP, 80),
        Spec::udp(CLIENT, 49000, VIP, 80),
    ] {
        let frame = spec.build();
        let (verdict, out) = p.run("tc_ingress", &frame);
        assert_eq!(
            verdict, TC_ACT_REDIRECT,
            "sent back out of the pod's interface"
        );
        let seen = packet::read(&out);
        assert_eq!(
            (seen.src, seen.sport, seen.dst, seen.dport),
            (hairpin, 49000, CLIENT, 8080)
        );
        assert_eq!(
            (&out[0..6], &out[6..12]),
            (&frame[6..12], &frame[0..6]),
            "MACs swapped"
        );
        packet::assert_checksums(&out, false);
        // The pod answers the hairpin address; that comes back to it from the service.
        let reply = Spec {
            src: CLIENT.into(),
            sport: 8080,
            dst: hairpin.into(),
            dport: 49000,
            tcp_flags: 0x12,
            ..spec.clone()
        };
        let (verdict, out) = p.run("tc_ingress", &reply.build());
        assert_eq!(verdict, TC_ACT_REDIRECT);
        let seen = packet::read(&out);
        assert_eq!(
            (seen.src, seen.sport, seen.dst, seen.dport),
            (VIP, 80, CLIENT, 49000)
        );
        packet::assert_checksums(&out, false);
        // The flow sticks like any other.
        assert_eq!(p.run("tc_ingress", &frame).0, TC_ACT_REDIRECT);
    }
    // A packet to the hairpin address with no flow behind it must not leave the node.
    let (verdict, _) = p.run(
        "tc_ingress",
        &Spec::tcp(CLIENT, 8080, hairpin, 40000).build(),
    );
    assert_eq!(verdict, TC_ACT_SHOT);
}

#[test]
fn blind_resets_and_fins_change_no_flow() {
    let Some((p, _)) = setup("blind_resets_and_fins_change_no_flow", &[(BE1, 8080)]) else {
        return;
    };
    let states = |p: &Programs| -> Vec<&'static str> {
        inspect::conntrack(p.bpffs.path())
            .unwrap()
            .into_iter()
            .filter(|f| f.protocol == "TCP")
            .map(|f| f.state)
            .collect()
    };
    // The client's numbers start at 0x4000_0000, the backend's at 0x7000_0000.
    let client = |flags: u8, seq: u32, ack: u32| Spec {
        tcp_flags: flags,
        seq,
        ack,
        ..Spec::tcp(CLIENT, 48100, VIP, 80)
    };
    let backend = |flags: u8, seq: u32, ack: u32| {
        Spec {
            src: BE1.into(),
            sport: 8080,
            dst: CLIENT.into(),
            dport: 48100,
            ..client(flags, seq, ack)
        }
        .build()
    };
    dnat(&p, &client(0x02, 0x4000_0000, 0));
    p.run("tc_egress", &backend(0x12, 0x7000_0000, 0x4000_0001));
    // An ACK that does not acknowledge the backend's SYN (a blind guess) opens nothing.
    dnat(&p, &client(0x10, 0x4000_0001, 0x1234_5678));
    assert_eq!(states(&p), vec!["opening"; 2], "a blind ACK");
    dnat(&p, &client(0x10, 0x4000_0001, 0x7000_0001));
    assert_eq!(states(&p), vec!["open"; 2]);
    // Blind RSTs and FINs, from either side, out of the sender's window: nothing changes.
    for far in [0x9000_0000, 0x3ffe_0000, 0x4009_0000] {
        dnat(&p, &client(0x04, far, 0));
        dnat(&p, &client(0x11, far, 0x7000_0001));
        p.run("tc_egress", &backend(0x14, far, 0x4000_0001));
        assert_eq!(states(&p), vec!["open"; 2], "seq {far:#x}");
    }
    // Data moves the window on (2 MiB in 64 KiB segments): the old numbers are out of it now.
    for unit in 1..=32u32 {
        dnat(&p, &client(0x18, 0x4000_0001 + (unit << 16), 0x7000_0001));
    }
    dnat(&p, &client(0x04, 0x4000_0001, 0));
    assert_eq!(states(&p), vec!["open"; 2], "a RST behind the window");
    // The sender's own RST, at its next sequence number, closes the flow.
    dnat(&p, &client(0x04, 0x4021_0001, 0));
    assert_eq!(states(&p), vec!["closing"; 2]);
}

#[test]
fn a_flow_has_one_lifetime_and_closes_on_fins_from_both_sides() {
    let Some((p, _)) = setup(
        "a_flow_has_one_lifetime_and_closes_on_fins_from_both_sides",
        &[(BE1, 8080)],
    ) else {
        return;
    };
    // TCP: a half-close (the client's FIN) keeps the flow; the backend's FIN closes it.
    let tcp = Spec {
        tcp_flags: 0x10,
        ..Spec::tcp(CLIENT, 49501, VIP, 80)
    };
    dnat(&p, &tcp);
    dnat(
        &p,
        &Spec {
            tcp_flags: 0x11,
            ..tcp.clone()
        },
    );
    let closing = |p: &Programs| {
        inspect::conntrack(p.bpffs.path())
            .unwrap()
            .into_iter()
            .filter(|f| f.protocol == "TCP")
            .map(|f| f.closing)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        closing(&p),
        vec![false, false],
        "a half-closed connection is still open"
    );
    let (_, out) = p.run("tc_egress", &reply_to(&tcp, BE1, 8080, 0x11));
    assert_eq!(packet::read(&out).src, VIP);
    assert_eq!(closing(&p), vec![true, true]);
    // A new connection on the same 5-tuple is a new flow, with the full lifetime.
    dnat(
        &p,
        &Spec {
            tcp_flags: 0x02,
            ..tcp.clone()
        },
    );
    assert_eq!(closing(&p), vec![false, false]);

    // UDP: the client speaks every 50 s, the backend answers only after 100 s. Each client
    // packet keeps the whole flow alive, so the late answer is still translated.
    let udp = Spec::udp(CLIENT, 49500, VIP, 80);
    dnat(&p, &udp);
    if !age_conntrack(&p, 50) {
        return;
    }
    dnat(&p, &udp);
    if !age_conntrack(&p, 50) {
        return;
    }
    let (_, out) = p.run("tc_egress", &reply_to(&udp, BE1, 8080, 0));
    assert_eq!(
        packet::read(&out).src,
        VIP,
        "the reply entry expired on its own"
    );
}

#[test]
fn an_address_handed_to_another_service_stays_served() {
    let Some((mut p, mut state)) = setup(
        "an_address_handed_to_another_service_stays_served",
        &[(BE1, 8080)],
    ) else {
        return;
    };
    // kube-dns is replaced by coredns on the same cluster IP, in one sync...
    let svc = |state: &mut DesiredState, name, backend| {
        let endpoints = [(backend, 53)];
        let svc = Svc {
            name,
            vip: VIP,
            port: 53,
            protocol: Protocol::Udp,
            endpoints: &endpoints,
        };
        add_service(state, &svc)
    };
    let old = svc(&mut state, "kube-dns", BE1);
    p.program(&state).unwrap();
    state.remove_port(&old);
    let new = svc(&mut state, "coredns", BE2);
    p.maps
        .sync(
            &state,
            Scope::Changed(&BTreeSet::from([old.clone(), new.clone()])),
        )
        .unwrap();
    assert_eq!(dnat(&p, &Spec::udp(CLIENT, 50000, VIP, 53)).dst, BE2);
    // ...and back, in two syncs: the newcomer first, then the old one's removal.
    let back = svc(&mut state, "kube-dns", BE3);
    p.maps
        .sync(&state, Scope::Changed(&BTreeSet::from([back.clone()])))
        .unwrap();
    state.remove_port(&new);
    p.maps
        .sync(&state, Scope::Changed(&BTreeSet::from([new])))
        .unwrap();
    assert_eq!(dnat(&p, &Spec::udp(CLIENT, 50001, VIP, 53)).dst, BE3);
}

/// ICMP errors about a pod's packets to a service reach it as about the service: the quoted
/// packet's destination (and its checksums, and the ICMP checksum) back to the service address,
/// and an error from the endpoint itself from there too; a router's stays a router's. Over TCP
/// and UDP, quoting 8 bytes (a router's least) or the whole TCP header. Errors about no flow,
/// or about a connection straight to a pod, pass untouched, and none counts as traffic.
#[test]
fn icmp_errors_about_a_service_flow_reach_the_pod_as_about_the_service() {
    let Some((p, _)) = setup(
        "icmp_errors_about_a_service_flow_reach_the_pod_as_about_the_service",
        &[(BE1, 8080)],
    ) else {
        return;
    };
    let router = Ipv4Addr::new(10, 244, 9, 1);
    let unreachable = (packet::ICMP_DEST_UNREACH, packet::ICMP_PORT_UNREACH);
    let too_big = (packet::ICMP_DEST_UNREACH, packet::ICMP_FRAG_NEEDED);
    let expired = (packet::ICMP_TIME_EXCEEDED, 0);
    let error = |from, (kind, code): (u8, u8), quoted: &Spec, quote| {
        packet::icmp_error(from, kind, code, &quoted.build(), quote)
    };
    let cases = [(TCP, 8), (TCP, 20), (UDP, 8)];
    for (i, (proto, quote)) in cases.into_iter().enumerate() {
        let sport = 40200 + i as u16;
        let spec = match proto {
            TCP => Spec::tcp(CLIENT, sport, VIP, 80),
            _ => Spec::udp(CLIENT, sport, VIP, 80),
        };
        dnat(&p, &spec);
        let sent = Spec {
            dst: BE1.into(),
            dport: 8080,
            ..spec.clone()
        };
        let last_seen = |p: &Programs| -> Vec<u64> {
            let mut seen: Vec<_> = p
                .conntrack()
                .iter()
                .map(|e| e.unwrap().1.last_seen_ns)
                .collect();
            seen.sort();
            seen
        };
        let before = last_seen(&p);
        for (from, kind, want_from) in [
            (router, too_big, router),
            (router, expired, router),
            (BE1, unreachable, VIP),
        ] {
            let (verdict, out) = p.run("tc_egress", &error(from, kind, &sent, quote));
            assert_eq!(verdict, TC_ACT_UNSPEC);
            packet::assert_icmp_error(&out, &error(want_from, kind, &spec, quote));
        }
        assert_eq!(last_seen(&p), before, "an ICMP error refreshed a flow");
    }
    let straight = Spec::tcp(CLIENT, 40300, BE1, 8080);
    untouched(&p, "tc_ingress", &straight.build());
    untouched(&p, "tc_egress", &error(BE1, unreachable, &straight, 8));
    untouched(
        &p,
        "tc_egress",
        &error(router, too_big, &Spec::udp(CLIENT, 40301, BE1, 8080), 8),
    );
}

/// A datagram in fragments follows its first fragment, both ways, over TCP and UDP: the first is
/// translated as a whole packet is (its L4 checksum covers the whole datagram), the later one
/// gets the same addresses in its IP header and nothing else changes: each piece is what
/// fragmenting the translated datagram gives. A later fragment whose first one was never seen
/// passes untouched and starts no flow.
#[test]
fn fragments_follow_their_first_fragment() {
    let Some((p, _)) = setup("fragments_follow_their_first_fragment", &[(BE1, 8080)]) else {
        return;
    };
    for spec in [
        Spec::udp(CLIENT, 40400, VIP, 80),
        Spec {
            tcp_flags: 0x10,
            ..Spec::tcp(CLIENT, 40400, VIP, 80)
        },
    ] {
        let spec = Spec {
            payload: vec![7; 40],
            ..spec
        };
        let (first, later) = packet::fragments(&spec.build(), 24);
        let sent = Spec {
            dst: BE1.into(),
            dport: 8080,
            ..spec.clone()
        };
        let (want_first, want_later) = packet::fragments(&sent.build(), 24);
        for (piece, want) in [(&first, &want_first), (&later, &want_later)] {
            let (verdict, out) = p.run("tc_ingress", piece);
            assert_eq!((verdict, &out), (TC_ACT_UNSPEC, want), "{spec:?}");
        }
        let reply = Spec {
            src: BE1.into(),
            sport: 8080,
            dst: CLIENT.into(),
            dport: 40400,
            ..spec.clone()
        };
        let (first, later) = packet::fragments(&reply.build(), 24);
        let back = Spec {
            src: VIP.into(),
            sport: 80,
            ..reply
        };
        let (want_first, want_later) = packet::fragments(&back.build(), 24);
        for (piece, want) in [(&first, &want_first), (&later, &want_later)] {
            let (verdict, out) = p.run("tc_egress", piece);
            assert_eq!((verdict, &out), (TC_ACT_UNSPEC, want), "reply {spec:?}");
        }
    }
    let flows = p.conntrack().keys().count();
    let mut orphan = Spec {
        payload: vec![7; 40],
        ..Spec::udp(CLIENT, 40401, VIP, 80)
    }
    .build();
    packet::set_ip_id(&mut orphan, 0x4242);
    let (_, later) = packet::fragments(&orphan, 16);
    untouched(&p, "tc_ingress", &later);
    assert_eq!(
        p.conntrack().keys().count(),
        flows,
        "a later fragment started a flow"
    );
}

/// A connection opened through kube-proxy's rules before the programs took over, which the agent
/// leaves to netfilter (`modes::ebpf::netfilter_flows`: an entry on each of its 5-tuples),
/// passes untouched both ways, whichever endpoint netfilter sent it to; a bare SYN on its
/// 5-tuple is a new connection, which the programs serve.
#[test]
fn a_connection_left_to_netfilter_passes_untouched_until_a_new_syn() {
    let Some((p, _)) = setup(
        "a_connection_left_to_netfilter_passes_untouched_until_a_new_syn",
        &[(BE1, 8080)],
    ) else {
        return;
    };
    let key = |src, dst| ct_key(src, dst, TCP);
    let (client, vip, endpoint) = ((CLIENT, 48200), (VIP, 80), (BE2, 8080));
    let left = CtValue {
        vip: Be32::from_octets(VIP.octets()),
        vport: Be16::new(80),
        direction: CT_NETFILTER,
        last_seen_ns: inspect::monotonic_ns(),
        ..CtValue::default()
    };
    let mut ct = p.conntrack();
    ct.insert(key(client, vip), left, 0).unwrap();
    ct.insert(key(endpoint, client), left, 0).unwrap();
    let ack = |src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16)| {
        Spec {
            tcp_flags: 0x10,
            ..Spec::tcp(src.0, src.1, dst.0, dst.1)
        }
        .build()
    };
    // The client's packet (netfilter sends it on), the endpoint's reply as it leaves its pod,
    // and the reply netfilter translated back, on its way to the client.
    untouched(&p, "tc_ingress", &ack(client, vip));
    untouched(&p, "tc_ingress", &ack(endpoint, client));
    untouched(&p, "tc_egress", &ack(vip, client));
    assert_eq!(ct.get(&key(client, vip), 0).unwrap().packets, 1);
    // The client's next connection on the same port.
    let seen = dnat(&p, &Spec::tcp(client.0, client.1, vip.0, vip.1));
    assert_eq!((seen.dst, seen.dport), (BE1, 8080));
    assert_eq!(ct.get(&key(client, vip), 0).unwrap().direction, CT_FORWARD);
}

// IPv6: the same programs, on the IPv6 maps.

const CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 0x10);
const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x10);
const BE6_1: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 0x11);
const BE6_2: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 2, 0, 0, 0, 0x11);

/// The programs with an IPv6 web (TCP) and dns (UDP) service on [`VIP6`] port 80, and an IPv4
/// one on [`VIP`] beside them.
fn setup6(test: &str, endpoints: &[(Ipv6Addr, u16)]) -> Option<Programs> {
    let (mut p, mut state) = setup(test, &[(BE1, 8080)])?;
    for (name, protocol) in [("web6", Protocol::Tcp), ("dns6", Protocol::Udp)] {
        let spn = add_service(
            &mut state,
            &Svc {
                name,
                vip: Ipv4Addr::UNSPECIFIED,
                port: 80,
                protocol,
                endpoints: &[],
            },
        );
        let mut port = state.port(&spn).unwrap().clone();
        port.cluster_ips = [VIP6.into()].into();
        state.insert_port(spn.clone(), port);
        let endpoints = endpoints
            .iter()
            .map(|(ip, port)| ready_endpoint((*ip).into(), *port))
            .collect();
        state.set_endpoints(spn, endpoints);
    }
    p.program(&state).expect("programming the maps");
    Some(p)
}

/// Runs ingress on an IPv6 frame to [`VIP6`]: passed on, the same length, its destination
/// rewritten, its source kept, its checksum right; the new destination.
fn dnat6(p: &Programs, spec: &Spec) -> (IpAddr, u16) {
    let frame = spec.build();
    let (verdict, out) = p.run("tc_ingress", &frame);
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(out.len(), frame.len(), "length must not change");
    let (src, sport, dst, dport) = packet::tuple(&out);
    assert_eq!(
        (src, sport),
        (spec.src, spec.sport),
        "source must not change"
    );
    packet::assert_checksums(&out, false);
    (dst, dport)
}

#[test]
fn ipv6_flows_are_translated_both_ways_with_valid_checksums() {
    let Some(p) = setup6(
        "ipv6_flows_are_translated_both_ways_with_valid_checksums",
        &[(BE6_1, 8080)],
    ) else {
        return;
    };
    for spec in [
        Spec::tcp(CLIENT6, 40000, VIP6, 80),
        Spec::udp(CLIENT6, 40000, VIP6, 80),
    ] {
        assert_eq!(dnat6(&p, &spec), (BE6_1.into(), 8080), "{spec:?}");
        // The next packet of the flow follows it.
        assert_eq!(dnat6(&p, &spec), (BE6_1.into(), 8080), "{spec:?}");
        let reply = Spec {
            src: BE6_1.into(),
            sport: 8080,
            dst: spec.src,
            dport: spec.sport,
            tcp_flags: 0x12,
            ..spec.clone()
        }
        .build();
        let (verdict, out) = p.run("tc_egress", &reply);
        assert_eq!(verdict, TC_ACT_UNSPEC);
        assert_eq!(
            packet::tuple(&out),
            (VIP6.into(), 80, CLIENT6.into(), 40000),
            "{spec:?}"
        );
        packet::assert_checksums(&out, false);
    }
    // The IPv4 service beside it is untouched by IPv6's maps.
    assert_eq!(dnat(&p, &Spec::tcp(CLIENT, 40000, VIP, 80)).dst, BE1);
}

#[test]
fn ipv6_new_flows_spread_over_the_endpoints() {
    let Some(p) = setup6(
        "ipv6_new_flows_spread_over_the_endpoints",
        &[(BE6_1, 8080), (BE6_2, 8080)],
    ) else {
        return;
    };
    let seen: BTreeSet<IpAddr> = (0..64)
        .map(|i| dnat6(&p, &Spec::tcp(CLIENT6, 41000 + i, VIP6, 80)).0)
        .collect();
    assert_eq!(seen, BTreeSet::from([BE6_1.into(), BE6_2.into()]));
}

/// An 8-byte destination options header (PadN only) inserted after the IPv6 header of `frame`.
fn with_destination_options(frame: &[u8]) -> Vec<u8> {
    let ip = ETH_HLEN;
    let mut f = frame[..ip + 40].to_vec();
    let next = f[ip + 6];
    f[ip + 6] = 60;
    let len = u16::from_be_bytes([f[ip + 4], f[ip + 5]]) + 8;
    f[ip + 4..ip + 6].copy_from_slice(&len.to_be_bytes());
    f.extend_from_slice(&[next, 0, 1, 4, 0, 0, 0, 0]);
    f.extend_from_slice(&frame[ip + 40..]);
    f
}

/// `frame` with the 8-byte extension header after its IPv6 header taken out again.
fn without_extension_header(frame: &[u8]) -> Vec<u8> {
    let ip = ETH_HLEN;
    let mut f = frame[..ip + 40].to_vec();
    f[ip + 6] = frame[ip + 40];
    let len = u16::from_be_bytes([f[ip + 4], f[ip + 5]]) - 8;
    f[ip + 4..ip + 6].copy_from_slice(&len.to_be_bytes());
    f.extend_from_slice(&frame[ip + 48..]);
    f
}

#[test]
fn ipv6_extension_headers_and_fragments_are_followed() {
    let Some(p) = setup6(
        "ipv6_extension_headers_and_fragments_are_followed",
        &[(BE6_1, 8080)],
    ) else {
        return;
    };
    for spec in [
        Spec::tcp(CLIENT6, 42000, VIP6, 80),
        Spec::udp(CLIENT6, 42000, VIP6, 80),
    ] {
        let frame = with_destination_options(&spec.build());
        let (verdict, out) = p.run("tc_ingress", &frame);
        assert_eq!(verdict, TC_ACT_UNSPEC);
        assert_eq!(out.len(), frame.len());
        assert_eq!(
            &out[ETH_HLEN + 40..ETH_HLEN + 48],
            &frame[ETH_HLEN + 40..ETH_HLEN + 48]
        );
        let out = without_extension_header(&out);
        assert_eq!(
            packet::tuple(&out),
            (CLIENT6.into(), 42000, BE6_1.into(), 8080),
            "{spec:?}"
        );
        packet::assert_checksums(&out, false);
    }
    // A datagram in two fragments: both go to the first one's endpoint, and put back together
    // its checksum is right.
    let spec = Spec {
        payload: vec![7; 64],
        ..Spec::udp(CLIENT6, 42001, VIP6, 80)
    };
    let frame = spec.build();
    let (first, later) = packet::fragments(&frame, 32);
    let (v1, first) = p.run("tc_ingress", &first);
    let (v2, later) = p.run("tc_ingress", &later);
    assert_eq!((v1, v2), (TC_ACT_UNSPEC, TC_ACT_UNSPEC));
    let dst =
        |f: &[u8]| IpAddr::from(<[u8; 16]>::try_from(&f[ETH_HLEN + 24..ETH_HLEN + 40]).unwrap());
    assert_eq!((dst(&first), dst(&later)), (BE6_1.into(), BE6_1.into()));
    let mut whole = without_extension_header(&first);
    whole.extend_from_slice(&later[ETH_HLEN + 48..]);
    let len = (whole.len() - ETH_HLEN - 40) as u16;
    whole[ETH_HLEN + 4..ETH_HLEN + 6].copy_from_slice(&len.to_be_bytes());
    assert_eq!(
        packet::tuple(&whole),
        (CLIENT6.into(), 42001, BE6_1.into(), 8080)
    );
    packet::assert_checksums(&whole, false);
}

#[test]
fn an_ipv6_service_without_endpoints_is_refused_with_icmpv6() {
    let Some(p) = setup6(
        "an_ipv6_service_without_endpoints_is_refused_with_icmpv6",
        &[],
    ) else {
        return;
    };
    for spec in [
        Spec::tcp(CLIENT6, 43000, VIP6, 80),
        Spec::udp(CLIENT6, 43000, VIP6, 80),
    ] {
        let offending = spec.build();
        let (verdict, out) = p.run("tc_ingress", &offending);
        assert_eq!(verdict, TC_ACT_REDIRECT, "sent back out of its interface");
        let want = packet::icmp_error(
            VIP6,
            packet::ICMPV6_DEST_UNREACH,
            packet::ICMPV6_PORT_UNREACH,
            &offending,
            8,
        );
        assert_eq!(out[..12], want[..12], "Ethernet addresses swapped");
        assert_eq!(out[ETH_HLEN..], want[ETH_HLEN..], "{spec:?}");
    }
}

#[test]
fn ipv6_neighbour_discovery_and_other_traffic_pass_untouched() {
    let Some(p) = setup6(
        "ipv6_neighbour_discovery_and_other_traffic_pass_untouched",
        &[(BE6_1, 8080)],
    ) else {
        return;
    };
    // A neighbour solicitation for the service address: ICMPv6, never a flow.
    let mut solicitation = Spec::udp(CLIENT6, 0, VIP6, 0).build();
    solicitation[ETH_HLEN + 6] = packet::ICMPV6;
    solicitation[ETH_HLEN + 40] = 135;
    let other_port = Spec::tcp(CLIENT6, 44000, VIP6, 81).build();
    let to_a_pod = Spec::tcp(CLIENT6, 44000, BE6_2, 80).build();
    let truncated = &Spec::tcp(CLIENT6, 44000, VIP6, 80).build()[..ETH_HLEN + 40 + 10];
    for frame in [&solicitation[..], &other_port, &to_a_pod, truncated] {
        untouched(&p, "tc_ingress", frame);
        untouched(&p, "tc_egress", frame);
    }
}

#[test]
fn an_ipv6_pod_reaching_itself_goes_out_and_back() {
    let Some(p) = setup6(
        "an_ipv6_pod_reaching_itself_goes_out_and_back",
        &[(CLIENT6, 8080)],
    ) else {
        return;
    };
    let spec = Spec::tcp(CLIENT6, 45000, VIP6, 80);
    let (verdict, out) = p.run("tc_ingress", &spec.build());
    assert_eq!(verdict, TC_ACT_REDIRECT, "bounced back to the pod");
    let hairpin = IpAddr::from(HAIRPIN_ADDR6.octets());
    assert_eq!(packet::tuple(&out), (hairpin, 45000, CLIENT6.into(), 8080));
    packet::assert_checksums(&out, false);
    // The pod's reply, to the hairpin address, comes back from the service.
    let reply = Spec {
        src: CLIENT6.into(),
        sport: 8080,
        dst: hairpin,
        dport: 45000,
        tcp_flags: 0x12,
        ..spec
    };
    let (verdict, out) = p.run("tc_ingress", &reply.build());
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(
        packet::tuple(&out),
        (VIP6.into(), 80, CLIENT6.into(), 45000)
    );
    packet::assert_checksums(&out, false);
}

/// ICMPv6 errors about a pod's packets to an IPv6 service reach it as about the service, as
/// over IPv4: the quoted destination (and the quoted checksum, and the ICMPv6 checksum, whose
/// pseudo-header holds the outer addresses) back to the service address, an endpoint's own
/// error from there too, a router's still a router's. A packet too big about a datagram's first
/// fragment is translated through its fragment header (its sender finds the socket by the ports
/// behind it); errors about a connection straight to a pod pass untouched.
#[test]
fn icmpv6_errors_about_a_service_flow_reach_the_pod_as_about_the_service() {
    let Some(p) = setup6(
        "icmpv6_errors_about_a_service_flow_reach_the_pod_as_about_the_service",
        &[(BE6_1, 8080)],
    ) else {
        return;
    };
    let router = Ipv6Addr::new(0xfd00, 0x10, 0x244, 9, 0, 0, 0, 1);
    let unreachable = (packet::ICMPV6_DEST_UNREACH, packet::ICMPV6_PORT_UNREACH);
    let too_big = (packet::ICMPV6_PACKET_TOO_BIG, 0);
    let error = |from: Ipv6Addr, (kind, code): (u8, u8), quoted: &[u8], quote| {
        packet::icmp_error(from, kind, code, quoted, quote)
    };
    let translated = |frame: &[u8]| {
        let (verdict, out) = p.run("tc_ingress", frame);
        assert_eq!(verdict, TC_ACT_UNSPEC);
        out
    };
    for (i, (proto, quote)) in [(TCP, 8), (TCP, 20), (UDP, 8)].into_iter().enumerate() {
        let sport = 40200 + i as u16;
        let spec = match proto {
            TCP => Spec::tcp(CLIENT6, sport, VIP6, 80),
            _ => Spec::udp(CLIENT6, sport, VIP6, 80),
        };
        let original = spec.build();
        let sent = translated(&original);
        for (from, kind, want_from) in [(router, too_big, router), (BE6_1, unreachable, VIP6)] {
            let (verdict, out) = p.run("tc_egress", &error(from, kind, &sent, quote));
            assert_eq!(verdict, TC_ACT_UNSPEC);
            let want = error(want_from, kind, &original, quote);
            assert_eq!(out[ETH_HLEN..], want[ETH_HLEN..], "{spec:?} {kind:?}");
        }
    }
    // A datagram's first fragment, quoted with its fragment header and 8 bytes behind it.
    let datagram = Spec {
        payload: vec![7; 64],
        ..Spec::udp(CLIENT6, 40300, VIP6, 80)
    };
    let (first, _) = packet::fragments(&datagram.build(), 32);
    let sent = translated(&first);
    let (verdict, out) = p.run("tc_egress", &error(router, too_big, &sent, 16));
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(
        out[ETH_HLEN..],
        error(router, too_big, &first, 16)[ETH_HLEN..]
    );
    let straight = Spec::tcp(CLIENT6, 40301, BE6_2, 8080).build();
    untouched(&p, "tc_ingress", &straight);
    untouched(&p, "tc_egress", &error(BE6_2, unreachable, &straight, 8));
}

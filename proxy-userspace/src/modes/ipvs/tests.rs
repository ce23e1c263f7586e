//! The mode against the kernel, each test in a network namespace of its own thread (IPVS,
//! ipsets, iptables and `kube-ipvs0` are all per namespace). This machine's kernel may have no
//! IPVS: then the tests say so loudly and pass; `cargo xtask vm-test`'s VM (Debian's 6.1
//! kernel) has it.
use std::{
    collections::BTreeSet,
    io::Write as _,
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream},
    process::Command,
    time::{Duration, Instant},
};

use super::*;
use crate::{
    model::{NamespacedName, Protocol, ServicePortName},
    node::NodePortAddresses,
    testing::fixture,
};

/// Set to 1 to make the kernel tests fail instead of skipping (as the sandbox tests').
const NO_SKIP_ENV: &str = "SANDBOX_NO_SKIP";

const FIXTURE: &str = crate::testing::SERVICES;

/// Runs `test` in a new network namespace on a thread of its own if IPVS can be used there
/// (root, the kernel's IPVS); otherwise prints a loud `SKIPPED <name>: <reason>` to stderr.
/// With `SANDBOX_NO_SKIP=1` a missing privilege fails the test, but a kernel without IPVS
/// still skips it (as the scenario suite does): `cargo xtask vm-test` runs these tests on a
/// kernel that has it, with `SANDBOX_NEED_IPVS` set, which makes a kernel without it fail.
fn in_netns(name: &str, test: impl FnOnce() + Send + 'static) {
    let name = name.to_owned();
    std::thread::spawn(move || {
        // (why, whether SANDBOX_NO_SKIP makes it a failure)
        // SAFETY: geteuid has no preconditions.
        let skip = if unsafe { libc::geteuid() } != 0 {
            Some(("not running as root".to_string(), true))
        } else {
            // Loaded here (outside the test's namespace) as the agent does, where it can be.
            let _ = Command::new("modprobe").args(["-q", "ip_vs"]).status();
            // SAFETY: unshare has no memory preconditions; it changes this thread only.
            assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
            match Ipvs::open() {
                Ok(_) => None,
                Err(OpenError::NoIpvs) => Some((
                    "IPVS is not in this kernel (cargo xtask vm-test runs this test on one that \
                     has it; by hand: VM_MEM=1536 vmtest/vmrun.sh 'modprobe ip_vs; \
                     target/debug/deps/proxy_userspace-<hash> ipvs --test-threads 1')"
                        .to_string(),
                    std::env::var_os("SANDBOX_NEED_IPVS").is_some(),
                )),
                Err(OpenError::Other(e)) => Some((format!("{e:#}"), true)),
            }
        };
        if let Some((reason, must_run)) = skip {
            if must_run && std::env::var(NO_SKIP_ENV).is_ok_and(|v| v == "1") {
                panic!("{name} cannot run: {reason} ({NO_SKIP_ENV}=1)");
            }
            // Straight to fd 2: `eprintln!` would be captured by the test harness.
            let _ = writeln!(std::io::stderr(), "\nSKIPPED {name}: {reason}\n");
            return;
        }
        sh("ip link set lo up");
        test();
    })
    .join()
    .unwrap();
}

/// Runs a shell command in the calling thread's namespace, returning its stdout.
fn sh(cmd: &str) -> String {
    let out = Command::new("sh").args(["-c", cmd]).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn config() -> IpvsConfig {
    IpvsConfig {
        scheduler: DEFAULT_SCHEDULER.into(),
        strict_arp: true,
        exclude_cidrs: vec![Cidr::v4(Ipv4Addr::new(172, 31, 0, 0), 16)],
        timeouts: netlink::Timeouts {
            tcp: 600,
            tcp_fin: 0,
            udp: 60,
        },
        // Nothing installed in the test's namespace: the node's iptables.
        backend: Backend::detect(|_| 0).unwrap(),
        netfilter: NetfilterConfig {
            cluster_cidrs: vec![Cidr::v4(Ipv4Addr::new(10, 244, 0, 0), 16)],
            masquerade_all: false,
            node_port_addresses: NodePortAddresses::Cidrs(vec![Cidr::v4(
                Ipv4Addr::new(192, 0, 2, 0),
                24,
            )]),
            // Outside shop/local's source range: the node's own connections to its load
            // balancer address are dropped (the `-m ipvs` rule is written).
            primary: vec![IpAddr::V4(Ipv4Addr::new(198, 18, 0, 1))],
        },
    }
}

fn spn(ns: &str, name: &str, port: &str, protocol: Protocol) -> ServicePortName {
    ServicePortName::new(NamespacedName::new(ns, name), port, protocol)
}

fn key(addr: [u8; 4], protocol: i32, port: u16) -> ServiceKey {
    ServiceKey {
        addr: Ipv4Addr::from(addr).into(),
        protocol: protocol as u8,
        port,
    }
}

/// The virtual servers the kernel has.
fn virtual_servers(ipvs: &mut Ipvs) -> BTreeSet<ServiceKey> {
    ipvs.services()
        .unwrap()
        .into_iter()
        .map(|s| s.key)
        .collect()
}

/// The destinations of `key` as the kernel reports them: address:port -> (weight, connections).
fn dests(ipvs: &mut Ipvs, key: &ServiceKey) -> BTreeMap<String, (u32, u32)> {
    ipvs.dests(key)
        .unwrap()
        .into_iter()
        .map(|d| {
            (
                SocketAddr::new(d.addr, d.port).to_string(),
                (d.weight, d.active_conns + d.inactive_conns),
            )
        })
        .collect()
}

/// The dataplane as the agent drives it: a full sync programs the virtual servers, the
/// addresses, the sets and the rules; a partial one follows a change; a full one repairs
/// what someone else changed (and leaves the excluded ranges); cleanup removes what is the
/// mode's.
#[test]
fn ipvs_dataplane_syncs_and_cleans_up() {
    in_netns(
        "modes::ipvs::tests::ipvs_dataplane_syncs_and_cleans_up",
        || {
            sh(
                "ip link add eth0 type dummy && ip addr add 192.0.2.11/24 dev eth0 && ip link set eth0 up",
            );
            assert!(!installed());
            cleanup().unwrap();
            // --ipvs-scheduler: every virtual server gets it.
            let mut dp = IpvsDataplane::new(IpvsConfig {
                scheduler: "lc".into(),
                ..config()
            })
            .unwrap();
            assert_eq!(
                std::fs::read_to_string("/proc/sys/net/ipv4/vs/conntrack")
                    .unwrap()
                    .trim(),
                "1"
            );
            let mut state = fixture(FIXTURE);
            dp.sync(&state, Scope::All).unwrap();
            assert!(installed());

            let mut ipvs = Ipvs::open().unwrap();
            let services: BTreeMap<ServiceKey, Service> = ipvs
                .services()
                .unwrap()
                .into_iter()
                .map(|s| (s.key, s))
                .collect();
            let settings = dp.settings(Family::V4).unwrap();
            assert_eq!(settings.node_port_ips, [IpAddr::from([192, 0, 2, 11])]);
            let plan = rules::plan(&state, &settings);
            assert_eq!(
                services.keys().collect::<Vec<_>>(),
                plan.virtual_servers.keys().collect::<Vec<_>>()
            );
            let web = key([10, 96, 0, 10], libc::IPPROTO_TCP, 80);
            assert!(
                services.values().all(|s| s.scheduler == "lc"),
                "{services:?}"
            );
            assert_eq!(
                dests(&mut ipvs, &web).keys().collect::<Vec<_>>(),
                ["10.244.1.11:8080", "10.244.1.12:8080", "10.244.2.11:8080"]
            );
            let dns = key([10, 96, 0, 53], libc::IPPROTO_UDP, 53);
            assert_eq!(
                (services[&dns].flags, services[&dns].timeout),
                (netlink::FLAG_PERSISTENT, 10800)
            );
            // The NodePort of eTP Local shop/local on the node address: the local endpoint only.
            let local_np = key([192, 0, 2, 11], libc::IPPROTO_TCP, 30081);
            assert_eq!(
                dests(&mut ipvs, &local_np).keys().collect::<Vec<_>>(),
                ["10.244.1.13:8080"]
            );
            if let Ok(o) = Command::new("ipvsadm").arg("-Ln").output() {
                let timeouts = sh("ipvsadm -L --timeout");
                assert!(
                    timeouts.contains("Timeout (tcp tcpfin udp): 600 120 60"),
                    "{timeouts}"
                );
                let listed = String::from_utf8_lossy(&o.stdout);
                assert!(listed.contains("TCP  10.96.0.10:80 lc"), "{listed}");
                assert!(
                    listed.contains("UDP  10.96.0.53:53 lc persistent 10800"),
                    "{listed}"
                );
                assert!(listed.contains("-> 10.244.1.11:8080"), "{listed}");
            }
            let bound = dummy_addresses().unwrap();
            assert!(bound.contains(&IpAddr::from([10, 96, 0, 10])), "{bound:?}");
            assert!(
                bound.contains(&IpAddr::from([203, 0, 113, 11])),
                "{bound:?}"
            );
            let set = sh("ipset list KUBE-CLUSTER-IP");
            assert!(set.contains("10.96.0.10,tcp:80"), "{set}");
            let set = sh("ipset list KUBE-NODE-PORT-LOCAL-TCP");
            assert!(set.contains("30081"), "{set}");
            let nat = sh(&format!(
                "{} -t nat",
                config().backend.tool("iptables-save")
            ));
            assert!(
                nat.contains("-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT"),
                "{nat}"
            );
            assert!(nat.contains("-j KUBE-SERVICES"), "{nat}");
            let filter = sh(&format!(
                "{} -t filter",
                config().backend.tool("iptables-save")
            ));
            assert!(filter.contains("--vaddr 203.0.113.11"), "{filter}");

            // A partial sync: shop/web goes; kube-system/dns's affinity changes.
            let web_spn = spn("shop", "web", "http", Protocol::Tcp);
            let dns_spn = spn("kube-system", "dns", "dns", Protocol::Udp);
            state.remove_port(&web_spn);
            state.port_mut(&dns_spn).unwrap().session_affinity_timeout =
                std::num::NonZeroU32::new(60);
            dp.sync(&state, Scope::Changed(&BTreeSet::from([web_spn, dns_spn])))
                .unwrap();
            let services: BTreeMap<ServiceKey, Service> = ipvs
                .services()
                .unwrap()
                .into_iter()
                .map(|s| (s.key, s))
                .collect();
            assert!(!services.contains_key(&web));
            assert_eq!(services[&dns].timeout, 60);
            assert!(
                !dummy_addresses()
                    .unwrap()
                    .contains(&IpAddr::from([10, 96, 0, 10]))
            );
            assert!(!sh("ipset list KUBE-CLUSTER-IP").contains("10.96.0.10,tcp:80"));

            // Someone else deletes a virtual server and a destination, adds a virtual server, one in
            // the excluded range and an address: a full sync puts back ours and removes theirs,
            // except the excluded one.
            ipvs.delete_service(&dns).unwrap();
            let front = key([10, 96, 0, 20], libc::IPPROTO_TCP, 80);
            ipvs.delete_dest(&front, IpAddr::from([10, 244, 1, 12]), 8080)
                .unwrap();
            let foreign = |addr| Service {
                key: key(addr, libc::IPPROTO_TCP, 99),
                scheduler: "rr".into(),
                flags: 0,
                timeout: 0,
                netmask: u32::MAX,
            };
            ipvs.add_service(&foreign([10, 1, 2, 3])).unwrap();
            ipvs.add_service(&foreign([172, 31, 0, 1])).unwrap();
            sh("ip addr add 10.1.2.3/32 dev kube-ipvs0");
            dp.sync(&state, Scope::All).unwrap();
            let keys = virtual_servers(&mut ipvs);
            assert!(keys.contains(&dns));
            assert!(!keys.contains(&foreign([10, 1, 2, 3]).key));
            assert!(keys.contains(&foreign([172, 31, 0, 1]).key));
            assert!(dests(&mut ipvs, &front).contains_key("10.244.1.12:8080"));
            assert!(
                !dummy_addresses()
                    .unwrap()
                    .contains(&IpAddr::from([10, 1, 2, 3]))
            );

            drop(dp);
            cleanup().unwrap();
            assert!(
                !installed(),
                "{}",
                sh("ipset list -n; ip link; ipvsadm -Ln || true")
            );
            // The mode's virtual servers (NodePorts included) are gone; another load balancer's
            // stays.
            assert_eq!(
                virtual_servers(&mut ipvs),
                BTreeSet::from([foreign([172, 31, 0, 1]).key])
            );
            let filter = sh(&format!(
                "{} -t filter",
                config().backend.tool("iptables-save")
            ));
            assert!(!filter.contains("KUBE-IPVS-FILTER"), "{filter}");
            // Nothing there: nothing done.
            cleanup().unwrap();
        },
    );
}

/// A TCP real server that leaves while IPVS counts connections for it: weight 0 at once (no
/// new connections), deleted by housekeeping once they are gone; back before that, it gets its
/// weight back. A UDP one is deleted at once.
/// Both families: the IPv6 proxier's virtual servers, real servers, sets (`KUBE-6-...`) and
/// ip6tables rules beside IPv4's, its addresses usable on `kube-ipvs0` (down), and cleanup of
/// both.
#[test]
fn ipvs_dataplane_serves_both_families() {
    in_netns(
        "modes::ipvs::tests::ipvs_dataplane_serves_both_families",
        || {
            sh(
                "ip link add eth0 type dummy && ip addr add 192.0.2.11/24 dev eth0 \
                && ip addr add 2001:db8:192:2::11/64 dev eth0 nodad && ip link set eth0 up",
            );
            let mut dual = config();
            dual.netfilter.node_port_addresses = NodePortAddresses::Primary;
            dual.netfilter.primary = vec![
                IpAddr::from([192, 0, 2, 11]),
                "2001:db8:192:2::11".parse().unwrap(),
            ];
            dual.netfilter
                .cluster_cidrs
                .push("fd00:10:244::/56".parse().unwrap());
            let mut dp = IpvsDataplane::new(dual).unwrap();
            assert_eq!(dp.families(), Family::ALL);
            let state = fixture(crate::testing::DUAL_STACK);
            dp.sync(&state, Scope::All).unwrap();
            let mut ipvs = Ipvs::open().unwrap();
            let v6 = |s: &str| -> IpAddr { s.parse().unwrap() };
            let front6 = ServiceKey {
                addr: v6("fd00:10:96::20"),
                protocol: libc::IPPROTO_TCP as u8,
                port: 80,
            };
            let keys = virtual_servers(&mut ipvs);
            assert!(keys.contains(&front6), "{keys:?}");
            assert!(keys.contains(&key([10, 96, 0, 20], libc::IPPROTO_TCP, 80)));
            let node_port6 = ServiceKey {
                port: 30080,
                addr: v6("2001:db8:192:2::11"),
                ..front6
            };
            assert!(keys.contains(&node_port6), "{keys:?}");
            assert_eq!(
                dests(&mut ipvs, &front6).keys().collect::<Vec<_>>(),
                ["[fd00:10:244:1::12]:8080", "[fd00:10:244:2::11]:8080"]
            );
            // Bound without DAD: local at once, though kube-ipvs0 is down.
            assert!(dummy_addresses().unwrap().contains(&front6.addr));
            let local = sh("ip -6 route show table local");
            assert!(
                local.contains("local fd00:10:96::20 dev kube-ipvs0"),
                "{local}"
            );
            let set = sh("ipset list KUBE-6-CLUSTER-IP");
            assert!(
                set.contains("fd00:10:96::20,tcp:80") && set.contains("inet6"),
                "{set}"
            );
            let nat6 = sh(&format!(
                "{} -t nat",
                dp.tables(Family::V6).tool("iptables-save")
            ));
            assert!(nat6.contains("--match-set KUBE-6-CLUSTER-IP"), "{nat6}");
            assert!(nat6.contains("-j KUBE-SERVICES"), "{nat6}");
            let rows = inspect::services(&inspect::virtual_servers().unwrap(), &sh("ipset save"));
            assert!(
                rows.iter()
                    .any(|r| r.address == "[fd00:10:96::20]:80" && r.kind == "ClusterIP"),
                "{rows:?}"
            );

            drop(dp);
            cleanup().unwrap();
            assert!(!installed(), "{}", sh("ipset list -n; ip link"));
            assert!(!virtual_servers(&mut ipvs).contains(&front6));
            let tables6 = Tables {
                backend: config().backend,
                family: Family::V6,
            };
            let nat6 = sh(&format!("{} -t nat", tables6.tool("iptables-save")));
            assert!(!nat6.contains("KUBE-"), "{nat6}");
        },
    );
}

#[test]
fn ipvs_real_servers_terminate_gracefully() {
    in_netns(
        "modes::ipvs::tests::ipvs_real_servers_terminate_gracefully",
        || {
            // The endpoints are this namespace's own addresses: IPVS hands connections to them to
            // the local stack unchanged, which refuses them (nothing listens on the service port),
            // and each leaves a connection entry that expires seconds later.
            sh("ip link add pods type dummy && ip link set pods up && \
            ip addr add 10.244.1.11/32 dev pods && ip addr add 10.244.1.12/32 dev pods && \
            ip addr add 10.244.2.11/32 dev pods");
            let mut dp = IpvsDataplane::new(config()).unwrap();
            let mut state = fixture(FIXTURE);
            dp.sync(&state, Scope::All).unwrap();
            let mut ipvs = Ipvs::open().unwrap();
            let web = key([10, 96, 0, 10], libc::IPPROTO_TCP, 80);
            let vip: SocketAddr = "10.96.0.10:80".parse().unwrap();
            for _ in 0..6 {
                let _ = TcpStream::connect_timeout(&vip, Duration::from_millis(300));
            }
            let before = dests(&mut ipvs, &web);
            assert!(
                before.values().all(|(_, conns)| *conns > 0),
                "every destination got connections: {before:?}"
            );

            let web_spn = spn("shop", "web", "http", Protocol::Tcp);
            let dns_spn = spn("kube-system", "dns", "dns", Protocol::Udp);
            let keep = |eps: &mut Vec<crate::model::Endpoint>, ip: &str| {
                eps.retain(|ep| ep.ip.to_string() != ip);
            };
            state.edit_endpoints(&web_spn, |eps| keep(eps, "10.244.1.11"));
            state.edit_endpoints(&dns_spn, |eps| keep(eps, "10.244.1.53"));
            let changed = BTreeSet::from([web_spn.clone(), dns_spn.clone()]);
            dp.sync(&state, Scope::Changed(&changed)).unwrap();
            let now = dests(&mut ipvs, &web);
            assert_eq!(
                now["10.244.1.11:8080"].0, 0,
                "weight 0 while terminating: {now:?}"
            );
            assert_eq!(now["10.244.1.12:8080"].0, 1);
            let dns = key([10, 96, 0, 53], libc::IPPROTO_UDP, 53);
            assert!(
                !dests(&mut ipvs, &dns).contains_key("10.244.1.53:53"),
                "UDP: deleted at once"
            );

            // Back while terminating: weight 1 again, not terminating any more.
            let s0 = fixture(FIXTURE);
            state.set_endpoints(web_spn.clone(), s0.endpoints_of(&web_spn).to_vec());
            dp.sync(&state, Scope::Changed(&BTreeSet::from([web_spn.clone()])))
                .unwrap();
            assert_eq!(dests(&mut ipvs, &web)["10.244.1.11:8080"].0, 1);
            assert!(dp.terminating.is_empty());

            // Gone again: housekeeping deletes it once its connection entries expired.
            state.edit_endpoints(&web_spn, |eps| keep(eps, "10.244.1.11"));
            dp.sync(&state, Scope::Changed(&BTreeSet::from([web_spn.clone()])))
                .unwrap();
            assert_eq!(dests(&mut ipvs, &web)["10.244.1.11:8080"].0, 0);
            let started = Instant::now();
            while dests(&mut ipvs, &web).contains_key("10.244.1.11:8080") {
                assert!(
                    started.elapsed() < Duration::from_secs(180),
                    "still there: {:?}",
                    dests(&mut ipvs, &web)
                );
                std::thread::sleep(Duration::from_secs(1));
                dp.housekeeping().unwrap();
            }
            assert!(dp.terminating.is_empty());
            assert_eq!(dests(&mut ipvs, &web).len(), 2);
            drop(dp);
            cleanup().unwrap();
        },
    );
}

/// Runs `f` on a thread in the named network namespace `name` (`ip netns add`).
fn in_named<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    use std::os::fd::AsRawFd as _;
    let ns = std::fs::File::open(format!("/run/netns/{name}")).unwrap();
    std::thread::spawn(move || {
        // SAFETY: setns on a descriptor we own; it changes this thread only.
        assert_eq!(
            unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) },
            0
        );
        f()
    })
}

/// Connects to `addr` and reads what the server says (the address it saw us from).
fn ask(addr: &str) -> std::io::Result<String> {
    use std::io::Read as _;
    let mut stream = TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut said = String::new();
    stream.read_to_string(&mut said)?;
    Ok(said)
}

/// Traffic through what a sync programs, between this namespace (the node) and a pod behind a
/// veth: the node reaches a cluster IP (its source masqueraded), the pod reaches itself
/// through it (hairpin: masqueraded, so the reply comes back through IPVS) and through a
/// NodePort, another port of
/// the cluster IP is refused (KUBE-IPVS-FILTER), and a Service without endpoints is refused
/// at once (IPVS's port unreachable).
#[test]
fn ipvs_serves_traffic() {
    in_netns("modes::ipvs::tests::ipvs_serves_traffic", || {
        let pod = format!("ipvs-test-pod-{}", std::process::id());
        sh(&format!(
            "ip netns add {pod} && \
             ip link add veth-n type veth peer name veth-p netns {pod} && \
             ip addr add 10.244.1.1/24 dev veth-n && ip link set veth-n up && \
             ip -n {pod} link set lo up && ip -n {pod} link set veth-p up && \
             ip -n {pod} addr add 10.244.1.11/24 dev veth-p && \
             ip -n {pod} route add default via 10.244.1.1 && \
             sysctl -qw net.ipv4.conf.all.send_redirects=0 net.ipv4.conf.veth-n.send_redirects=0"
        ));
        // No redirects for the hairpin's replies (forwarded out the interface they came in
        // on): they would use up the pod's ICMP rate limit, and the port unreachable below
        // would come a second late.
        let server = in_named(&pod, || {
            let listener = std::net::TcpListener::bind("0.0.0.0:8080").unwrap();
            for stream in listener.incoming().take(3) {
                let mut stream = stream.unwrap();
                let peer = stream.peer_addr().unwrap().ip().to_string();
                let _ = stream.write_all(peer.as_bytes());
            }
        });
        let mut state = fixture(FIXTURE);
        let web = spn("shop", "web", "http", Protocol::Tcp);
        state.edit_endpoints(&web, |eps| {
            eps.retain(|ep| ep.ip.to_string() == "10.244.1.11")
        });
        state.port_mut(&web).unwrap().node_port = Some(30090);
        sh(
            "ip link add eth0 type dummy && ip addr add 192.0.2.11/24 dev eth0 && ip link set eth0 up",
        );
        let mut dp = IpvsDataplane::new(config()).unwrap();
        dp.sync(&state, Scope::All).unwrap();

        // The node: its connection's source is the cluster IP (bound to kube-ipvs0), which is
        // outside the cluster CIDR: masqueraded to the node's address towards the pod.
        let diagnose = || {
            sh(&format!(
                "ipvsadm -Ln --stats; ipvsadm -Lnc; conntrack -L 2>&1; ip route show table local; \
                 ip addr; {} -c; ip -n {pod} -s link",
                config().backend.tool("iptables-save")
            ))
        };
        let seen = ask("10.96.0.10:80");
        assert_eq!(
            seen.as_deref().ok(),
            Some("10.244.1.1"),
            "{seen:?}\n{}",
            diagnose()
        );
        // The pod through its own Service: masqueraded (KUBE-LOOP-BACK).
        let hairpin = in_named(&pod, || ask("10.96.0.10:80")).join().unwrap();
        assert_eq!(
            hairpin.as_deref().ok(),
            Some("10.244.1.1"),
            "{hairpin:?}\n{}",
            diagnose()
        );
        // A NodePort on the node's address, from the pod: masqueraded (KUBE-NODE-PORT-TCP).
        let node_port = in_named(&pod, || ask("192.0.2.11:30090")).join().unwrap();
        assert_eq!(
            node_port.as_deref().ok(),
            Some("10.244.1.1"),
            "{node_port:?}\n{}",
            diagnose()
        );
        server.join().unwrap();

        let refused = |addr: &str| {
            let started = Instant::now();
            let e = ask(addr).expect_err(addr);
            assert_eq!(
                e.kind(),
                std::io::ErrorKind::ConnectionRefused,
                "{addr}: {e}"
            );
            let took = started.elapsed();
            assert!(
                took < Duration::from_secs(1),
                "{addr}: refused after {took:?}"
            );
        };
        refused("10.96.0.10:81");
        refused("10.96.0.23:80");
        // shop/empty has no endpoints.
        in_named(&pod, move || {
            refused("10.96.0.10:81");
            refused("10.96.0.23:80");
        })
        .join()
        .unwrap();
        drop(dp);
        cleanup().unwrap();
        sh(&format!("ip netns del {pod}"));
    });
}

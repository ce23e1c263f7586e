//! Attaching the tc programs to pod-facing interfaces, including those of pods that start
//! later, and the external programs (XDP and tc) to the node's uplinks (see
//! [`Attacher::uplinks`] and external.rs), so that they stay attached when the agent exits: a
//! restarting agent (a rollout, a crash) must not leave pods without service translation. A new
//! agent swaps its programs in atomically where the old ones were.
//!
//! Kernels 6.6 and later attach through tcx links, pinned in `<pin dir>/links/` (a link lives
//! while its pin does). Older kernels attach cls_bpf filters through netlink at a fixed
//! priority and handle, replaced in place; such filters outlive the process by themselves.
//! Both by the interface's index (tc_link.rs), which a rename does not change.
//!
//! A new pod's first packets (typically its first DNS query) must already be translated, so
//! the programs are attached as the kernel announces the interface (see [`AttachThread`]), on
//! a thread of their own that never waits for a sync of the maps.
use std::{
    collections::{HashMap, HashSet},
    ffi::{CStr, CString},
    io,
    net::IpAddr,
    os::{
        fd::{AsFd, AsRawFd},
        unix::net::UnixStream,
    },
    path::{Path, PathBuf},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use aya::{
    Ebpf,
    maps::{Array, HashMap as BpfHashMap, MapData},
    programs::{
        ProgramError, SchedClassifier, TcAttachType, Xdp, XdpMode as AttachMode,
        links::{FdLink, LinkError, PinnedLink},
        tc::{self, SchedClassifierLink},
        xdp::XdpLink,
    },
    sys::SyscallError,
};
use proxy_common::{
    Addr, Be32, Be128, CONFIG_SNAT_ADDR, CONFIG_SNAT_PORT_MAX, CONFIG_SNAT_PORT_MIN, ExternalIface,
    IFACE_XDP_FORWARD, MAP_CONFIG, MAP_EXTERNAL_IFACES, MAP_NODE_ADDRS, MAP_NODE_ADDRS6,
    MAP_PRIMARY_ADDR6, MAP_SOURCE_IFACES, NODE_ADDR_SNAT_ONLY,
};

use super::{
    PROG_EGRESS, PROG_EXT_EGRESS, PROG_EXT_INGRESS, PROG_INGRESS, PROG_XDP,
    external::{self, SnatPorts, XdpMode},
    link_events::{self, LinkEvent, LinkEvents},
    pod_interfaces::{BRIDGE_DRIVER, Link, PodInterfaces},
    tc_link,
};
use crate::{
    model::Family,
    node::{self, DefaultRoutes, InterfaceAddr, NodePortAddresses},
};

/// How often the interfaces are listed anyway: a safety net for attachments that failed and
/// for notifications lost without the kernel saying so (when it says so, they are listed at
/// once).
const RESCAN_PERIOD: Duration = Duration::from_secs(10);

const DIRECTIONS: [(&str, TcAttachType, &str); 2] = [
    (PROG_INGRESS, TcAttachType::Ingress, "ingress"),
    (PROG_EGRESS, TcAttachType::Egress, "egress"),
];

/// The tc programs of external interfaces (beside XDP).
const EXTERNAL_DIRECTIONS: [(&str, TcAttachType, &str); 2] = [
    (PROG_EXT_INGRESS, TcAttachType::Ingress, "ext-ingress"),
    (PROG_EXT_EGRESS, TcAttachType::Egress, "ext-egress"),
];

/// What external traffic is served on (`--nodeport-addresses`, `--xdp-mode`).
#[derive(Clone, Debug)]
pub struct ExternalConfig {
    pub addresses: NodePortAddresses,
    /// The Node object's addresses (API source), for `primary`.
    pub primary: Vec<std::net::IpAddr>,
    pub mode: XdpMode,
    /// `--bpf-snat-port-range`.
    pub snat_ports: SnatPorts,
}

/// An interface of the node that gets the external programs (see [`Attacher::uplinks`]).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Uplink {
    name: String,
    index: u32,
    /// It carries addresses NodePorts answer on: XDP as `--xdp-mode` says (else the tc
    /// programs only, for the replies of flows sent out of it).
    node_ports: bool,
    /// The addresses flows sent out of it to other nodes' endpoints leave from, one a family
    /// at most (IPv4's first).
    snat_addrs: Vec<IpAddr>,
}

impl Uplink {
    /// Its SNAT address of the family of `A` (unspecified: none).
    fn snat_addr<A: Addr>(&self) -> A {
        self.snat_addrs
            .iter()
            .find_map(|ip| A::from_ip(*ip))
            .unwrap_or_default()
    }
}

/// The BPF object (its programs) and the [`Attacher`], on a thread of their own: a matching
/// interface gets the programs within a millisecond or so of appearing, whatever the rest of
/// the agent is doing (a long sync, say). Dropping this stops the thread (the programs stay
/// attached).
pub struct AttachThread {
    /// Closing `stop` wakes the thread up, and it ends.
    stop: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
}

/// What the attach thread starts with, made ready (and checked) before the maps are filled:
/// the programs, the attacher, and the link notifications, subscribed to already.
pub struct PreparedAttach {
    pub ebpf: Ebpf,
    attacher: Attacher,
    events: LinkEvents,
}

impl AttachThread {
    /// Gets ready to attach the programs of `ebpf` to the pod interfaces `pods` selects and
    /// to the external ones `external` does, attaching nothing yet.
    pub fn prepare(
        ebpf: Ebpf,
        pods: &PodInterfaces,
        external: ExternalConfig,
        pin_dir: &Path,
        validate_sources: bool,
    ) -> anyhow::Result<PreparedAttach> {
        // Subscribed before listing: an interface appearing meanwhile is in one or the other.
        let events = LinkEvents::subscribe().context("subscribing to link notifications")?;
        let mut attacher = Attacher::new(pods, pin_dir, validate_sources)?;
        if let Ok(ephemeral) = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            && let Some(warning) = external.snat_ports.ephemeral_overlap(&ephemeral)
        {
            tracing::warn!("{warning}");
        }
        attacher.external = Some(external);
        Ok(PreparedAttach {
            ebpf,
            attacher,
            events,
        })
    }

    /// Attaches the programs to the interfaces there are (failing if listing them fails),
    /// then starts the thread that attaches them to those that appear (or are renamed, or
    /// lose their node address) later.
    pub fn start(prepared: PreparedAttach) -> anyhow::Result<Self> {
        let PreparedAttach {
            mut ebpf,
            mut attacher,
            events,
        } = prepared;
        attacher.scan(&mut ebpf)?;
        let (stop, stopped) = UnixStream::pair()?;
        let thread = std::thread::Builder::new()
            .name("attach".into())
            .spawn(move || attach_loop(ebpf, attacher, events, stopped))
            .context("starting the attach thread")?;
        Ok(Self {
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// An error once the thread has ended, which it does only by panicking: pods that start
    /// from then on are not served.
    pub fn check(&self) -> anyhow::Result<()> {
        if self.thread.as_ref().is_none_or(|t| t.is_finished()) {
            bail!(
                "the attach thread stopped: new pod interfaces get no programs; restart the agent"
            );
        }
        Ok(())
    }
}

impl Drop for AttachThread {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The attach thread: link notifications as they come, a full listing now and then.
fn attach_loop(mut ebpf: Ebpf, mut attacher: Attacher, mut events: LinkEvents, stop: UnixStream) {
    let mut batch = Vec::new();
    let mut next_scan = Instant::now() + RESCAN_PERIOD;
    loop {
        let pollfd = |fd: std::os::fd::BorrowedFd<'_>| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let mut fds = [pollfd(events.as_fd()), pollfd(stop.as_fd())];
        // Rounded up: waking up a little early would only loop.
        let wait = next_scan.saturating_duration_since(Instant::now());
        let timeout = wait.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
        // SAFETY: poll(2) on two pollfds we own, for the duration of the call.
        if unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) } < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                tracing::warn!("waiting for link notifications: {e}");
                std::thread::sleep(Duration::from_secs(1));
            }
            continue;
        }
        if fds[1].revents != 0 {
            return; // the dataplane is gone
        }
        let mut rescan = Instant::now() >= next_scan;
        if fds[0].revents != 0 {
            if let Err(e) = events.read(&mut batch) {
                // ENOBUFS: the kernel's queue overflowed (a burst of interfaces).
                tracing::warn!("link notifications lost ({e}); listing the interfaces again");
                rescan = true;
                if e.raw_os_error() != Some(libc::ENOBUFS) {
                    // Something else, which might come back at once: the listings every
                    // second carry on meanwhile, rather than a busy loop.
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
            for event in batch.drain(..) {
                attacher.handle(&mut ebpf, event);
            }
        }
        if rescan {
            if let Err(e) = attacher.scan(&mut ebpf) {
                tracing::warn!("listing the interfaces to attach to: {e:#}");
            }
            next_scan = Instant::now() + RESCAN_PERIOD;
        }
    }
}

/// The pod interfaces `--pod-interfaces` selects, and the ifindex each was attached at (a pod
/// that restarts gets an interface of the same name with a new index); the external interfaces
/// likewise.
pub struct Attacher {
    pods: PodInterfaces,
    pin_dir: PathBuf,
    links_dir: PathBuf,
    tcx: bool,
    attached: HashMap<String, u32>,
    /// None: pod interfaces only (tests of the pod path).
    external: Option<ExternalConfig>,
    external_attached: HashMap<String, Uplink>,
    /// The node addresses last written to NODE_ADDRS (None: not yet written).
    node_addrs: Option<Vec<InterfaceAddr>>,
    /// The uplinks whose addresses were last written to NODE_ADDRS.
    uplinks_written: Vec<Uplink>,
    /// Interfaces with NodePort addresses that cannot be served, already warned about.
    warned_not_ethernet: HashSet<String>,
    /// `--bpf-source-validation`: pod interfaces are written to SOURCE_IFACES.
    validate_sources: bool,
}

impl Attacher {
    pub fn new(
        pods: &PodInterfaces,
        pin_dir: &Path,
        validate_sources: bool,
    ) -> anyhow::Result<Self> {
        let links_dir = pin_dir.join("links");
        std::fs::create_dir_all(&links_dir)
            .with_context(|| format!("creating {}", links_dir.display()))?;
        Ok(Self {
            pods: pods.clone(),
            pin_dir: pin_dir.to_owned(),
            links_dir,
            tcx: tcx_supported(),
            attached: HashMap::new(),
            external: None,
            external_attached: HashMap::new(),
            node_addrs: None,
            uplinks_written: Vec::new(),
            warned_not_ethernet: HashSet::new(),
            validate_sources,
        })
    }

    /// Finds the node addresses and attaches the external programs (see [`Self::scan_external`]),
    /// then both pod programs to every pod interface not yet attached. Interfaces that went away
    /// are forgotten (the kernel detached their programs), and so are their pins.
    pub fn scan(&mut self, ebpf: &mut Ebpf) -> anyhow::Result<()> {
        let all = interfaces()?;
        if let Err(e) = self.scan_external(ebpf, &all) {
            tracing::warn!("serving external traffic: {e:#}");
        }
        self.scan_pods(ebpf, &all);
        self.forget_gone_pins(&all)
    }

    /// Attaches the pod programs to the pod interfaces among `all` that lack them, and detaches
    /// them from attached ones that are pod interfaces no more (one that now carries a node
    /// address: a node's uplink may be a veth, configured after it appeared).
    fn scan_pods(&mut self, ebpf: &mut Ebpf, all: &[(String, u32)]) {
        let routes = DefaultRoutes::of_this_node();
        let present: HashMap<String, u32> = all
            .iter()
            .filter(|(name, _)| self.is_pod_interface(name, &routes))
            .cloned()
            .collect();
        let stale: Vec<(String, u32)> = self
            .attached
            .iter()
            .filter(|(name, index)| present.get(*name) != Some(index))
            .map(|(name, index)| (name.clone(), *index))
            .collect();
        for (name, index) in stale {
            self.attached.remove(&name);
            Self::forget_source_iface(ebpf, index);
            if all.iter().any(|(n, i)| *n == name && *i == index) {
                self.detach_pod(&name, index);
            }
        }
        for (name, index) in present {
            if !self.attached.contains_key(&name) {
                self.attach_and_record(ebpf, name, index);
            }
        }
    }

    /// Whether `--pod-interfaces` selects the interface `name`.
    fn is_pod_interface(&self, name: &str, routes: &DefaultRoutes) -> bool {
        let driver = if self.pods.by_kind() {
            node::driver(name)
        } else {
            None
        };
        let carries_node_address = self
            .node_addrs
            .iter()
            .flatten()
            .any(|a| a.interface == name);
        self.pods.selects(&Link {
            name,
            driver: driver.as_deref(),
            node_facing: carries_node_address || routes.hold(name),
        })
    }

    /// Writes where the route back to the sources of the pod interface `index` must go out of
    /// (source.rs): the bridge it is a port of (`master`), or itself.
    fn write_source_iface(
        &self,
        ebpf: &mut Ebpf,
        interface: &str,
        index: u32,
        master: Option<u32>,
    ) {
        if !self.validate_sources {
            return;
        }
        let written = ebpf
            .map_mut(MAP_SOURCE_IFACES)
            .context("map SOURCE_IFACES missing")
            .and_then(|map| Ok(BpfHashMap::<_, u32, u32>::try_from(map)?))
            .and_then(|mut map| Ok(map.insert(index, master.unwrap_or(index), 0)?));
        if let Err(e) = written {
            // Its packets' sources go unchecked; the next scan tries again.
            tracing::warn!(interface, "cannot enable source validation: {e:#}");
        }
    }

    fn forget_source_iface(ebpf: &mut Ebpf, index: u32) {
        if let Some(map) = ebpf.map_mut(MAP_SOURCE_IFACES)
            && let Ok(mut map) = BpfHashMap::<_, u32, u32>::try_from(map)
        {
            let _ = map.remove(&index);
        }
    }

    /// An interface that is no pod interface any more loses the pod programs.
    fn detach_pod(&self, interface: &str, index: u32) {
        for (prog, attach_type, direction) in DIRECTIONS {
            let _ = std::fs::remove_file(self.pin(index, direction));
            if !self.tcx {
                let _ = tc::qdisc_detach_program(interface, attach_type, prog);
            }
        }
        tracing::info!(
            interface,
            "detached tc programs (no pod interface any more)"
        );
    }

    /// Finds the node addresses (see external.rs) and the node's uplinks ([`Uplink`]), writes
    /// them for the programs, and attaches the external programs to the uplinks (detaching them
    /// from interfaces that are uplinks no more).
    fn scan_external(&mut self, ebpf: &mut Ebpf, all: &[(String, u32)]) -> anyhow::Result<()> {
        let Some(config) = self.external.clone() else {
            return Ok(());
        };
        let routes = DefaultRoutes::of_this_node();
        let addresses = node::interface_addresses()?;
        let selected =
            node::node_addresses(&config.addresses, &config.primary, &routes, &addresses);
        let uplinks = self.uplinks(all, &addresses, &selected, &config.primary, &routes);
        if self.node_addrs.as_ref() != Some(&selected) || self.uplinks_written != uplinks {
            self.write_node_addrs(ebpf, &selected, &uplinks, &routes)?;
        }
        let gone: Vec<(String, u32)> = self
            .external_attached
            .iter()
            .filter(|(name, was)| {
                !uplinks
                    .iter()
                    .any(|u| u.name == **name && u.index == was.index)
            })
            .map(|(n, was)| (n.clone(), was.index))
            .collect();
        for (name, index) in gone {
            self.external_attached.remove(&name);
            self.detach_external(ebpf, &name, index);
        }
        for uplink in uplinks {
            if self.external_attached.get(&uplink.name) == Some(&uplink) {
                continue;
            }
            // Without NodePort addresses, the tc programs alone: for the replies of flows
            // sent out of it.
            let mode = if uplink.node_ports {
                config.mode
            } else {
                XdpMode::Tc
            };
            match self.attach_external(ebpf, &uplink, mode) {
                Ok(mode) => {
                    let mode = mode.name();
                    let role = if uplink.node_ports {
                        "NodePorts"
                    } else {
                        "replies to flows sent out of it"
                    };
                    tracing::info!(
                        interface = %uplink.name,
                        mode,
                        role,
                        snat_addresses = ?uplink.snat_addrs,
                        "attached external programs"
                    );
                    self.external_attached.insert(uplink.name.clone(), uplink);
                }
                Err(e) => {
                    tracing::warn!(interface = %uplink.name, "cannot attach external programs: {e:#}")
                }
            }
        }
        Ok(())
    }

    /// The interfaces that get the external programs: those carrying the addresses NodePorts
    /// answer on (`selected`), and every other one flows sent on to other nodes' endpoints may
    /// leave by: an Ethernet interface with an address that is neither a pod interface nor
    /// a pods' bridge (a bridge is an uplink only with a NodePort address or the default route,
    /// as a node's `br0`), the loopback interface aside. Devices without Ethernet headers
    /// (WireGuard, IPIP) are left out: the programs parse Ethernet frames.
    fn uplinks(
        &mut self,
        all: &[(String, u32)],
        addresses: &[InterfaceAddr],
        selected: &[InterfaceAddr],
        node_ips: &[std::net::IpAddr],
        routes: &DefaultRoutes,
    ) -> Vec<Uplink> {
        let mut out = Vec::new();
        for (name, index) in all {
            let node_port_addrs: Vec<InterfaceAddr> = selected
                .iter()
                .filter(|a| a.interface == *name)
                .cloned()
                .collect();
            let node_ports = !node_port_addrs.is_empty();
            let own: Vec<InterfaceAddr> = addresses
                .iter()
                .filter(|a| a.interface == *name && !a.addr.is_loopback())
                .cloned()
                .collect();
            if !node_ports
                && (own.is_empty()
                    || name == "lo"
                    || self.is_pod_interface(name, routes)
                    || (node::driver(name).as_deref() == Some(BRIDGE_DRIVER) && !routes.hold(name)))
            {
                continue;
            }
            if !node::has_ethernet_headers(name) {
                if node_ports && self.warned_not_ethernet.insert(name.clone()) {
                    tracing::warn!(
                        interface = %name,
                        "NodePort addresses on an interface without Ethernet headers are not \
                         served by the ebpf mode"
                    );
                }
                continue;
            }
            let candidates = if node_ports { &node_port_addrs } else { &own };
            // The family's primary address among them, else any of them (an address on lo,
            // say, which primary_ip passes over); never an IPv6 link-local one, meaningful on
            // one link only.
            let snat_addrs: Vec<IpAddr> = [Family::V4, Family::V6]
                .into_iter()
                .filter_map(|family| {
                    node::primary_ip(family, node_ips, routes.of(family), candidates).or(candidates
                        .iter()
                        .map(|a| a.addr)
                        .find(|ip| family.has(*ip) && !node::is_link_local(*ip)))
                })
                .collect();
            if snat_addrs.is_empty() {
                continue;
            }
            out.push(Uplink {
                name: name.clone(),
                index: *index,
                node_ports,
                snat_addrs,
            });
        }
        out
    }

    fn write_node_addrs(
        &mut self,
        ebpf: &mut Ebpf,
        selected: &[InterfaceAddr],
        uplinks: &[Uplink],
        routes: &DefaultRoutes,
    ) -> anyhow::Result<()> {
        write_family_node_addrs::<Be32>(ebpf, MAP_NODE_ADDRS, selected, uplinks)?;
        write_family_node_addrs::<Be128>(ebpf, MAP_NODE_ADDRS6, selected, uplinks)?;
        // Flows to other nodes' endpoints through a LoadBalancer or external IP leave from the
        // node's primary address (of their family) among the selected ones where the route to
        // the endpoint goes out of an interface without the external programs (one on the
        // loopback interface only when nothing else is selected).
        let node_ips = self
            .external
            .as_ref()
            .map_or(&[][..], |e| e.primary.as_slice());
        let primary = |family| {
            node::primary_ip(family, node_ips, routes.of(family), selected).or(selected
                .iter()
                .map(|a| a.addr)
                .find(|ip| family.has(*ip) && !node::is_link_local(*ip)))
        };
        let primary4: Be32 = primary(Family::V4)
            .and_then(Be32::from_ip)
            .unwrap_or_default();
        let primary6: Be128 = primary(Family::V6)
            .and_then(Be128::from_ip)
            .unwrap_or_default();
        let mut config: Array<_, u32> =
            aya::maps::Map::Array(MapData::from_pin(self.pin_dir.join(MAP_CONFIG))?).try_into()?;
        config
            .set(CONFIG_SNAT_ADDR, primary4.raw(), 0)
            .context("writing the SNAT address")?;
        let mut primary_addr6: Array<_, Be128> =
            aya::maps::Map::Array(MapData::from_pin(self.pin_dir.join(MAP_PRIMARY_ADDR6))?)
                .try_into()?;
        primary_addr6
            .set(0, primary6, 0)
            .context("writing the IPv6 SNAT address")?;
        let ports = self
            .external
            .as_ref()
            .map(|e| e.snat_ports)
            .unwrap_or_default();
        config
            .set(CONFIG_SNAT_PORT_MIN, u32::from(ports.first), 0)
            .and_then(|()| config.set(CONFIG_SNAT_PORT_MAX, u32::from(ports.last), 0))
            .context("writing the SNAT port range")?;
        let shown: Vec<String> = selected
            .iter()
            .map(|a| format!("{} ({})", a.addr, a.interface))
            .collect();
        if selected.is_empty() {
            tracing::warn!(
                "no node address matches --nodeport-addresses: NodePorts are not served (with \
                 `primary` and the manifest source, the node needs a default route)"
            );
        } else {
            tracing::info!(addresses = %shown.join(", "), "NodePorts answer on these addresses");
        }
        self.node_addrs = Some(selected.to_vec());
        self.uplinks_written = uplinks.to_vec();
        Ok(())
    }

    /// Attaches XDP (unless `mode` is tc) and the external tc programs to `interface`; returns
    /// the mode it runs in (generic where native XDP is refused).
    fn attach_external(
        &self,
        ebpf: &mut Ebpf,
        uplink: &Uplink,
        mode: XdpMode,
    ) -> anyhow::Result<XdpMode> {
        let (interface, index) = (uplink.name.as_str(), uplink.index);
        self.attach_tc(ebpf, interface, index, &EXTERNAL_DIRECTIONS)?;
        let running = match mode {
            XdpMode::Tc => {
                self.remove_xdp_pins(index, None);
                XdpMode::Tc
            }
            XdpMode::Generic | XdpMode::Native => {
                match self.attach_xdp(ebpf, interface, index, mode) {
                    Ok(()) => mode,
                    Err(e) if mode == XdpMode::Native => {
                        tracing::info!(
                            interface,
                            "native XDP not available ({e:#}); running generic XDP"
                        );
                        self.attach_xdp(ebpf, interface, index, XdpMode::Generic)?;
                        XdpMode::Generic
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        let may_transmit = external::xdp_may_transmit(running, interface);
        let mut ifaces: BpfHashMap<_, u32, ExternalIface> = ebpf
            .map_mut(MAP_EXTERNAL_IFACES)
            .context("map EXTERNAL_IFACES missing")?
            .try_into()?;
        let value = ExternalIface {
            flags: if may_transmit { IFACE_XDP_FORWARD } else { 0 },
            snat_addr: uplink.snat_addr(),
            snat_addr6: uplink.snat_addr(),
        };
        ifaces
            .insert(index, value, 0)
            .context("writing EXTERNAL_IFACES")?;
        if running == XdpMode::Native && !may_transmit {
            tracing::info!(
                interface,
                "a veth in native XDP mode: forwarded packets go through the tc program (XDP \
                 frames sent into a veth are dropped unless its peer has NAPI, which the agent \
                 cannot check); --xdp-mode generic transmits from XDP"
            );
        }
        Ok(running)
    }

    /// Attaches the XDP program to `interface` in `mode` (native or generic) through a link
    /// pinned as `xdp-<index>-<mode>`, replacing the program of such a link in place; a link of
    /// the other mode goes first (a link's mode is fixed).
    fn attach_xdp(
        &self,
        ebpf: &mut Ebpf,
        interface: &str,
        index: u32,
        mode: XdpMode,
    ) -> anyhow::Result<()> {
        let (name, flags) = match mode {
            XdpMode::Native => ("native", AttachMode::Driver),
            _ => ("generic", AttachMode::Skb),
        };
        self.remove_xdp_pins(index, Some(name));
        let pin = self.links_dir.join(format!("xdp-{index}-{name}"));
        let prog: &mut Xdp = ebpf
            .program_mut(PROG_XDP)
            .context("program missing")?
            .try_into()?;
        let updated = update_pinned_link(&pin, |link: XdpLink| {
            let id = prog.attach_to_link(link)?;
            prog.take_link(id).map(drop)
        })?;
        if updated {
            return Ok(());
        }
        let id = prog
            .attach_to_if_index(index, flags)
            .with_context(|| format!("attaching {PROG_XDP} to {interface} ({name})"))?;
        pin_link(prog.take_link(id)?.try_into()?, &pin)
    }

    /// Removes the XDP link pins of interface `index` (detaching them), but for `keep`'s.
    fn remove_xdp_pins(&self, index: u32, keep: Option<&str>) {
        for mode in ["native", "generic"] {
            if Some(mode) != keep {
                let _ = std::fs::remove_file(self.links_dir.join(format!("xdp-{index}-{mode}")));
            }
        }
    }

    /// An interface that no longer carries a node address loses the external programs.
    fn detach_external(&self, ebpf: &mut Ebpf, interface: &str, index: u32) {
        self.remove_xdp_pins(index, None);
        for (prog, attach_type, direction) in EXTERNAL_DIRECTIONS {
            let _ = std::fs::remove_file(self.pin(index, direction));
            if !self.tcx {
                let _ = tc::qdisc_detach_program(interface, attach_type, prog);
            }
        }
        if let Ok(mut ifaces) = ebpf
            .map_mut(MAP_EXTERNAL_IFACES)
            .context("map EXTERNAL_IFACES missing")
            .and_then(|m| BpfHashMap::<_, u32, ExternalIface>::try_from(m).map_err(Into::into))
        {
            let _ = ifaces.remove(&index);
        }
        tracing::info!(interface, "detached external programs (no uplink any more)");
    }

    /// Follows a link notification: attaches to an interface that appeared, or got a
    /// matching name (CNI plugins often make a veth under a temporary name, or in the pod's
    /// namespace, then rename it or move it here); forgets one that went away.
    pub fn handle(&mut self, ebpf: &mut Ebpf, event: LinkEvent) {
        match event {
            LinkEvent::Changed {
                index,
                name,
                master,
            } => {
                // Most notifications are about an interface we know (going up, say, or
                // joining its bridge after the programs were attached).
                if self.attached.get(&name) == Some(&index) {
                    self.write_source_iface(ebpf, &name, index, master);
                    return;
                }
                // Renamed: its old name no longer designates it (its programs stay).
                self.attached.retain(|_, i| *i != index);
                if self.is_pod_interface(&name, &DefaultRoutes::of_this_node()) {
                    self.attach_and_record(ebpf, name, index);
                }
            }
            LinkEvent::Removed { index } => {
                self.attached.retain(|_, i| *i != index);
                Self::forget_source_iface(ebpf, index);
                self.external_attached.retain(|_, u| u.index != index);
                // Its links died with it; their pins go too.
                for (_, _, direction) in DIRECTIONS.iter().chain(&EXTERNAL_DIRECTIONS) {
                    let _ = std::fs::remove_file(self.pin(index, direction));
                }
                self.remove_xdp_pins(index, None);
            }
            LinkEvent::Addresses => match interfaces() {
                Ok(all) => {
                    if let Err(e) = self.scan_external(ebpf, &all) {
                        tracing::warn!("serving external traffic: {e:#}");
                    }
                    // Which interfaces carry node addresses may have changed.
                    self.scan_pods(ebpf, &all);
                }
                Err(e) => tracing::warn!("listing the interfaces: {e:#}"),
            },
        }
    }

    fn attach_and_record(&mut self, ebpf: &mut Ebpf, name: String, index: u32) {
        // The name must still be this interface's: it was chosen by that name (renamed or
        // deleted since it was listed, the next notification says). A rename from here on
        // does not stop the attach, which goes by index.
        if ifindex(&name) != Some(index) {
            tracing::debug!(interface = %name, index, "no longer there under that name");
            return;
        }
        // Before the programs: they must not see the interface's packets as spoofed.
        match link_events::master(index) {
            Ok(master) => self.write_source_iface(ebpf, &name, index, master),
            Err(e) => tracing::warn!(interface = %name, "cannot find the interface's bridge: {e}"),
        }
        match self.attach(ebpf, &name, index) {
            Ok(()) => {
                tracing::info!(interface = %name, "attached tc programs");
                self.attached.insert(name, index);
            }
            // The interface may vanish between listing and attaching (a pod deleted).
            Err(e) => tracing::warn!(interface = %name, "cannot attach tc programs: {e:#}"),
        }
    }

    fn pin(&self, index: u32, direction: &str) -> PathBuf {
        self.links_dir.join(format!("tc-{index}-{direction}"))
    }

    fn attach(&self, ebpf: &mut Ebpf, interface: &str, index: u32) -> anyhow::Result<()> {
        self.attach_tc(ebpf, interface, index, &DIRECTIONS)
    }

    fn attach_tc(
        &self,
        ebpf: &mut Ebpf,
        interface: &str,
        index: u32,
        directions: &[(&str, TcAttachType, &str)],
    ) -> anyhow::Result<()> {
        for &(name, attach_type, direction) in directions {
            let prog: &mut SchedClassifier = ebpf
                .program_mut(name)
                .context("program missing")?
                .try_into()?;
            if self.tcx {
                attach_tcx(prog, index, attach_type, &self.pin(index, direction))
            } else {
                let fd = prog.fd()?.as_fd();
                tc_link::set_filter(index, attach_type, fd, name).map_err(Into::into)
            }
            .with_context(|| format!("attaching {name} to {interface}"))?;
        }
        Ok(())
    }

    /// Removes the pins of links whose interface is gone (the link died with it).
    fn forget_gone_pins(&self, interfaces: &[(String, u32)]) -> anyhow::Result<()> {
        for entry in std::fs::read_dir(&self.links_dir)? {
            let entry = entry?;
            let name = entry.file_name();
            let index = name.to_str().and_then(|n| {
                n.strip_prefix("tc-")
                    .or_else(|| n.strip_prefix("xdp-"))?
                    .split('-')
                    .next()?
                    .parse::<u32>()
                    .ok()
            });
            if index.is_some_and(|i| !interfaces.iter().any(|(_, present)| *present == i)) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        Ok(())
    }
}

fn tcx_supported() -> bool {
    // Probed at load, before anything is attached.
    super::features::Features::of_this_kernel().is_ok_and(|f| f.has(&super::features::TCX))
}

/// Swaps `prog` into the link pinned at `pin` (atomically, for packets in flight; the pin stays
/// throughout, so a crash halfway leaves the old program serving), or makes a new link there.
fn attach_tcx(
    prog: &mut SchedClassifier,
    index: u32,
    attach_type: TcAttachType,
    pin: &Path,
) -> anyhow::Result<()> {
    let updated = update_pinned_link(pin, |link: SchedClassifierLink| {
        // Our fd goes with the taken link; the pin keeps the link.
        let id = prog.attach_to_link(link)?;
        prog.take_link(id).map(drop)
    })?;
    if updated {
        return Ok(());
    }
    tc_link::pin_tcx_link(index, attach_type, prog.fd()?.as_fd(), pin)
        .with_context(|| format!("linking and pinning at {}", pin.display()))
}

/// Puts a new program into the link pinned at `pin` through `update`: true when done; false
/// when there is no pin, or its link cannot take it (the link of an interface that went away,
/// its index now reused: the pin is removed), so the caller makes a new link.
fn update_pinned_link<L>(
    pin: &Path,
    update: impl FnOnce(L) -> Result<(), ProgramError>,
) -> anyhow::Result<bool>
where
    L: TryFrom<FdLink, Error = LinkError>,
{
    let pinned = match PinnedLink::from_pin(pin) {
        Ok(pinned) => pinned,
        Err(LinkError::SyscallError(SyscallError { io_error, .. }))
            if io_error.kind() == io::ErrorKind::NotFound =>
        {
            return Ok(false);
        }
        Err(e) => {
            return Err(e).with_context(|| format!("opening the pinned link {}", pin.display()));
        }
    };
    match update(L::try_from(FdLink::from(pinned))?) {
        Ok(()) => Ok(true),
        Err(e) => {
            tracing::debug!(pin = %pin.display(), "pinned link not updatable: {e}");
            std::fs::remove_file(pin)?;
            Ok(false)
        }
    }
}

/// Pins a new link at `pin`: it then outlives the agent.
fn pin_link(link: FdLink, pin: &Path) -> anyhow::Result<()> {
    link.pin(pin)
        .with_context(|| format!("pinning the link at {}", pin.display()))?;
    Ok(())
}

/// Detaches the programs from every interface and removes the link pins: `agent --cleanup`,
/// for going back to kube-proxy.
pub fn detach_all(pin_dir: &Path) -> anyhow::Result<usize> {
    let mut detached = 0;
    let links_dir = pin_dir.join("links");
    if links_dir.exists() {
        detached += unpin_links(&links_dir)?;
    }
    if !tcx_supported() {
        for (name, _) in interfaces()? {
            // Any interface may have them (pods and the node's addresses may have moved since);
            // only the programs of these names are detached.
            for (prog, attach_type, _) in EXTERNAL_DIRECTIONS.iter().chain(&DIRECTIONS) {
                if tc::qdisc_detach_program(&name, *attach_type, prog).is_ok() {
                    detached += 1;
                }
            }
        }
    }
    Ok(detached)
}

/// Removes every link pinned in `dir`, and waits until the kernel has detached them: the pin
/// holds a link's last reference, and the kernel releases a link in a work queue, after the
/// unlink returns (so a program could still translate packets for a moment after `--cleanup`).
pub(crate) fn unpin_links(dir: &Path) -> anyhow::Result<usize> {
    let mut ids = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if let Ok(link) = PinnedLink::from_pin(&path)
            && let Ok(info) = FdLink::from(link).info()
        {
            ids.push(info.id());
        }
        std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left: Vec<u32> = aya::programs::loaded_links()
            .filter_map(|l| l.ok().map(|l| l.id()))
            .filter(|id| ids.contains(id))
            .collect();
        if left.is_empty() {
            return Ok(ids.len());
        }
        if Instant::now() > deadline {
            tracing::warn!(?left, "links unpinned 5 s ago are still attached");
            return Ok(ids.len());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The index of the interface called `name`, if there is one.
fn ifindex(name: &str) -> Option<u32> {
    let name = CString::new(name).ok()?;
    // SAFETY: if_nametoindex reads a NUL-terminated string.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    (index != 0).then_some(index)
}

/// The interfaces of this network namespace, by name with their index.
fn interfaces() -> anyhow::Result<Vec<(String, u32)>> {
    // SAFETY: if_nameindex returns an array terminated by a zero entry, freed below.
    let list = unsafe { libc::if_nameindex() };
    if list.is_null() {
        return Err(std::io::Error::last_os_error()).context("listing network interfaces");
    }
    let mut out = Vec::new();
    let mut p = list;
    unsafe {
        while (*p).if_index != 0 {
            let name = CStr::from_ptr((*p).if_name).to_string_lossy().into_owned();
            out.push((name, (*p).if_index));
            p = p.add(1);
        }
        libc::if_freenameindex(list);
    }
    Ok(out)
}

/// Writes the node addresses of `A`'s family (see [`Attacher::write_node_addrs`]) to its map,
/// `name`: the uplinks' SNAT addresses first (their flows' replies come to them), should the
/// map not hold them all, then those NodePorts answer on (`selected`).
fn write_family_node_addrs<A: Addr + aya::Pod>(
    ebpf: &mut Ebpf,
    name: &str,
    selected: &[InterfaceAddr],
    uplinks: &[Uplink],
) -> anyhow::Result<()> {
    let mut map: BpfHashMap<_, A, u32> = ebpf
        .map_mut(name)
        .with_context(|| format!("map {name} missing"))?
        .try_into()?;
    let selected: Vec<A> = selected.iter().filter_map(|a| A::from_ip(a.addr)).collect();
    let mut wanted: Vec<(A, u32)> = Vec::new();
    for addr in uplinks.iter().map(Uplink::snat_addr::<A>) {
        let flags = match selected.contains(&addr) {
            true => 0,
            false => NODE_ADDR_SNAT_ONLY,
        };
        if addr != A::default() && !wanted.iter().any(|(k, _)| *k == addr) {
            wanted.push((addr, flags));
        }
    }
    for addr in selected {
        if !wanted.iter().any(|(k, _)| *k == addr) {
            wanted.push((addr, 0));
        }
    }
    // Stale ones out first, to make room.
    let stale: Vec<A> = map
        .keys()
        .filter_map(Result::ok)
        .filter(|k| !wanted.iter().any(|(w, _)| w == k))
        .collect();
    for k in stale {
        let _ = map.remove(&k);
    }
    // A full map leaves some addresses out, and the rest of the set-up goes on.
    let unwritten: Vec<IpAddr> = wanted
        .iter()
        .filter(|(k, flags)| map.insert(k, flags, 0).is_err())
        .map(|(k, _)| k.ip())
        .collect();
    if !unwritten.is_empty() {
        tracing::warn!(
            unwritten = ?unwritten,
            capacity = map.keys().count(),
            "the node-address map is full: these addresses get no NodePorts and no flows \
             sent from them; narrow --nodeport-addresses"
        );
    }
    Ok(())
}

//! The two-node cluster in network namespaces (see DESIGN.md, "The sandbox").

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Once;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};

use crate::netns::{NETNS_DIR, Netns, describe, ip_batches, run, run_parallel};

/// Every namespace the sandbox creates is named `pxt<pid>-<counter>-<role>`.
pub const NS_PREFIX: &str = "pxt";
/// The external client's address on the node network.
pub const EXT_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 100);
pub const NODE1_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 11);
pub const NODE2_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 12);
/// The node network (the bridge in the fabric namespace).
pub const NODE_CIDR: &str = "192.0.2.0/24";
/// Pod addresses of all nodes; node N has 10.244.N.0/24.
pub const POD_CIDR: &str = "10.244.0.0/16";
/// The Service (ClusterIP) range.
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// Load balancer addresses (status.loadBalancer.ingress), routed by ext to node1.
pub const LB_CIDR: &str = "203.0.113.0/24";
/// External IPs (spec.externalIPs), routed by ext to node1.
pub const EXTERNAL_IP_CIDR: &str = "198.51.100.0/24";
/// The node's interface on the node network (in each node namespace).
pub const NODE_IF: &str = "eth0";
/// The sandbox is dual-stack: every address above has an IPv6 twin, whose last group reads as
/// the IPv4 address's last octet (hex digits that look decimal: 192.0.2.11 is
/// 2001:db8:192:2::11, pod 10.244.1.11 is fd00:10:244:1::11).
pub const EXT_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x192, 0x2, 0, 0, 0, 0x100);
pub const NODE1_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x192, 0x2, 0, 0, 0, 0x11);
pub const NODE2_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x192, 0x2, 0, 0, 0, 0x12);
pub const NODE_CIDR6: &str = "2001:db8:192:2::/64";
/// Node N has fd00:10:244:N::/64.
pub const POD_CIDR6: &str = "fd00:10:244::/56";
pub const SERVICE_CIDR6: &str = "fd00:10:96::/112";
pub const LB_CIDR6: &str = "2001:db8:203:113::/64";
pub const EXTERNAL_IP_CIDR6: &str = "2001:db8:198:51::/64";
/// The port the tests conventionally run the backends on.
pub const BACKEND_PORT: u16 = 8080;
/// Environment variable that overrides where `sandbox-backend` is found.
pub const BACKEND_BIN_ENV: &str = "SANDBOX_BACKEND_BIN";

/// (pod name, node number, last octet): node N's pods are 10.244.N.x.
const PODS: &[(&str, u8, u8)] = &[
    ("client", 1, 10),
    ("be1", 1, 11),
    ("be2", 1, 12),
    ("be3", 1, 13),
    ("be4", 2, 11),
];

/// How pods are wired to their node, and the nodes to each other: the shapes real CNIs and
/// data centres build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// Routed veths named `veth-<pod>`, each holding the pod's gateway (Calico-like).
    Routed,
    /// Veths named `veth<hash>` as ports of a `cni0` bridge that holds the pods' gateway
    /// (flannel's default, k3s, the `bridge` plugin).
    Bridge,
    /// Routed veths named `eni<hash>` (the AWS VPC CNI's), which no name pattern of another
    /// CNI matches.
    Eni,
    /// Bridged pods as [`Shape::Bridge`], the nodes' pod ranges reached through a VXLAN tunnel
    /// (`flannel.1`, MTU 1450) while the pods keep 1500: flannel's vxlan backend, Calico's
    /// VXLAN mode.
    Overlay,
    /// Routed veths named after the pod (`<pod>-<hash>`, as Antrea and OVN-Kubernetes name
    /// them) on nodes with two uplinks: the node network (`eth0`: the node's address as a /32,
    /// NodePorts, the clients outside) and a management network (`eth1`) with the default
    /// route and the routes to the other node (its address and pods), so replies to outside
    /// clients and flows to the other node leave by another interface than the one traffic
    /// came in on.
    MultiHomed,
}

/// The VXLAN device of [`Shape::Overlay`] and its MTU (flannel's names and sizes).
pub const TUNNEL: &str = "flannel.1";
const TUNNEL_MTU: u16 = 1450;
/// The second uplink of [`Shape::MultiHomed`], and the management network it is on: a node
/// has its node address's last octet there ([`mgmt_ip`]), ext (its router) 198.18.0.1.
pub const MGMT_IF: &str = "eth1";
const MGMT_ROUTER: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
const MGMT_ROUTER6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x198, 0x18, 0, 0, 0, 1);

impl Shape {
    pub const ALL: [Shape; 5] = [
        Shape::Routed,
        Shape::Bridge,
        Shape::Eni,
        Shape::Overlay,
        Shape::MultiHomed,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Shape::Routed => "routed",
            Shape::Bridge => "bridge",
            Shape::Eni => "eni",
            Shape::Overlay => "overlay",
            Shape::MultiHomed => "multihomed",
        }
    }

    /// Pods are ports of the node's [`BRIDGE`].
    fn bridged(self) -> bool {
        matches!(self, Shape::Bridge | Shape::Overlay)
    }

    /// The node-side interface of pod `pod`, named as this shape's CNI names it.
    fn host_if(self, pod: &str) -> String {
        // FNV-1a: a stable stand-in for the CNIs' hashes of the container id.
        let hash = pod.bytes().fold(0x811c_9dc5u32, |h, b| {
            (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
        });
        match self {
            Shape::Routed => format!("veth-{pod}"),
            Shape::Bridge | Shape::Overlay => format!("veth{hash:08x}"),
            Shape::Eni => format!("eni{hash:08x}"),
            Shape::MultiHomed => format!("{pod}-{:04x}", hash & 0xffff),
        }
    }

    /// The node interface that carries traffic between the nodes' pods.
    pub fn inter_node_link(self) -> &'static str {
        match self {
            Shape::Routed | Shape::Bridge | Shape::Eni => NODE_IF,
            Shape::Overlay => TUNNEL,
            Shape::MultiHomed => MGMT_IF,
        }
    }

    /// What an operator gives every mode's agent on such a node: on a multi-homed one, the
    /// network NodePorts answer on (`primary`, with the manifest source, would be the default
    /// route's interface: the management network).
    pub fn agent_args(self) -> &'static [&'static str] {
        match self {
            // NODE_CIDR and NODE_CIDR6.
            Shape::MultiHomed => &["--nodeport-addresses", "192.0.2.0/24,2001:db8:192:2::/64"],
            _ => &[],
        }
    }
}

/// The bridge of [`Shape::Bridge`] in each node.
pub const BRIDGE: &str = "cni0";

/// A pod: its own namespace, wired to its node by a veth pair (see [`Shape`]).
#[derive(Debug)]
pub struct Pod {
    pub name: String,
    pub ns: Netns,
    pub ip: Ipv4Addr,
    /// Its IPv6 address, fd00:10:244:N::<octet>.
    pub ip6: Ipv6Addr,
    /// "node1" or "node2".
    pub node: String,
    /// The node-side veth (in the node's namespace): where tc programs go.
    pub host_if: String,
    /// The pod's default gateway, 10.244.N.1 (the address of `host_if`, or of the bridge).
    pub gateway: Ipv4Addr,
    /// Its IPv6 default gateway, fd00:10:244:N::1.
    pub gateway6: Ipv6Addr,
    pub shape: Shape,
}

impl Pod {
    /// Pod `name` on node `n` (1 or 2), 10.244.N.`octet` and fd00:10:244:N::`octet`.
    fn new(name: &str, ns: Netns, n: u8, octet: u8, shape: Shape) -> Pod {
        Pod {
            name: name.to_string(),
            ns,
            ip: Ipv4Addr::new(10, 244, n, octet),
            ip6: pod_ip6(n, octet),
            node: format!("node{n}"),
            host_if: shape.host_if(name),
            gateway: Ipv4Addr::new(10, 244, n, 1),
            gateway6: pod_ip6(n, 1),
            shape,
        }
    }

    pub fn addr(&self, port: u16) -> SocketAddr {
        (self.ip, port).into()
    }

    /// [`Pod::addr`] on its IPv6 address.
    pub fn addr6(&self, port: u16) -> SocketAddr {
        (self.ip6, port).into()
    }

    /// `ip` lines for the node side, run in the node once `host_if` is there.
    fn host_side(&self) -> Vec<String> {
        let hif = &self.host_if;
        if self.shape.bridged() {
            // Hairpin on, as the bridge plugin's `hairpinMode` and flannel set it: a pod
            // reaching itself through a Service gets its frame back through its own port.
            vec![
                format!("link set {hif} master {BRIDGE} up"),
                format!("link set {hif} type bridge_slave hairpin on"),
            ]
        } else {
            vec![
                format!("link set {hif} up"),
                format!("addr add {}/32 dev {hif}", self.gateway),
                format!("route add {}/32 dev {hif} scope link", self.ip),
                format!("addr add {}/128 dev {hif}", self.gateway6),
                format!("route add {}/128 dev {hif}", self.ip6),
            ]
        }
    }

    /// `ip` lines for the pod side, run in the pod once its `eth0` is there.
    fn pod_side(&self) -> Vec<String> {
        let mut lines = vec!["link set lo up".to_string()];
        if self.shape.bridged() {
            lines.extend([
                format!("addr add {}/24 dev eth0", self.ip),
                format!("addr add {}/64 dev eth0", self.ip6),
                "link set eth0 up".to_string(),
            ]);
        } else {
            lines.extend([
                format!("addr add {}/32 dev eth0", self.ip),
                format!("addr add {}/128 dev eth0", self.ip6),
                "link set eth0 up".to_string(),
                format!("route add {} dev eth0 scope link", self.gateway),
                format!("route add {} dev eth0", self.gateway6),
            ]);
        }
        lines.push(format!("route add default via {} dev eth0", self.gateway));
        lines.push(format!("route add default via {} dev eth0", self.gateway6));
        lines
    }
}

/// Sysctls of every namespace, set before its interfaces exist (new ones copy `default`).
const COMMON_SYSCTLS: [&str; 5] = [
    "net.ipv4.conf.all.rp_filter=0",
    "net.ipv4.conf.default.rp_filter=0",
    "net.ipv6.conf.all.accept_dad=0",
    "net.ipv6.conf.default.accept_dad=0",
    "net.ipv6.conf.default.router_solicitations=0",
];

struct Proc {
    label: String,
    /// Backend server of this pod (killed by `stop_backend`).
    backend_of: Option<String>,
    child: Child,
    /// SIGTERM first (and some time to clean up) instead of SIGKILL.
    graceful: bool,
}

/// The whole cluster. Dropping it kills every process it started, then deletes its
/// namespaces (also while unwinding from a panic).
pub struct Sandbox {
    /// `pxt<pid>-<counter>`: the prefix of every namespace of this sandbox.
    pub prefix: String,
    pub ext: Netns,
    pub fabric: Netns,
    pub node1: Netns,
    pub node2: Netns,
    pub pods: Vec<Pod>,
    pub shape: Shape,
    procs: Vec<Proc>,
    backend_bin: Option<PathBuf>,
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

impl Sandbox {
    /// Builds the whole topology (about 9 namespaces), pods routed; takes some tens of
    /// milliseconds.
    pub fn build() -> Result<Sandbox> {
        Self::build_shaped(Shape::Routed)
    }

    /// [`Sandbox::build`], the pods wired as `shape` says.
    pub fn build_shaped(shape: Shape) -> Result<Sandbox> {
        static CLEANUP: Once = Once::new();
        CLEANUP.call_once(cleanup_stale);

        let prefix = format!(
            "{NS_PREFIX}{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let name = |role: &str| format!("{prefix}-{role}");
        // Owned handles first: whatever gets created is deleted if a later step fails.
        let sb = Sandbox {
            ext: Netns::adopt(&name("ext")),
            fabric: Netns::adopt(&name("fabric")),
            node1: Netns::adopt(&name("node1")),
            node2: Netns::adopt(&name("node2")),
            pods: PODS
                .iter()
                .map(|&(pod, node, octet)| {
                    Pod::new(pod, Netns::adopt(&name(pod)), node, octet, shape)
                })
                .collect(),
            shape,
            prefix,
            procs: Vec::new(),
            backend_bin: None,
        };
        sb.wire()
            .with_context(|| format!("build sandbox {}", sb.prefix))?;
        Ok(sb)
    }

    fn all_ns(&self) -> impl Iterator<Item = &Netns> {
        [&self.ext, &self.fabric, &self.node1, &self.node2]
            .into_iter()
            .chain(self.pods.iter().map(|p| &p.ns))
    }

    fn wire(&self) -> Result<()> {
        // 1. The namespaces, in one `ip` process.
        let adds = self
            .all_ns()
            .map(|ns| format!("netns add {}", ns.name))
            .collect();
        ip_batches(&[(None, adds)])?;

        // 2. Sysctls, before any interface exists (new interfaces copy `default`). A bridge
        // node needs br_netfilter for its bridge-nf-call sysctl (built in here; a module on
        // Debian's kernels, which kubeadm has the admin load): loaded if it can be.
        if self.shape.bridged() {
            let _ = std::process::Command::new("modprobe")
                .args(["-q", "br_netfilter"])
                .status();
        }
        let sysctls = self
            .all_ns()
            .map(|ns| {
                let mut cmd = ns.cmd("sysctl");
                cmd.args(["-q", "-w"]).args(COMMON_SYSCTLS);
                if ns.name == self.node1.name || ns.name == self.node2.name {
                    cmd.args(["net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"]);
                    if self.shape.bridged() {
                        // What kube-proxy needs of a bridge node (kubeadm checks it): bridged
                        // frames meet netfilter, so a reply from a pod on the same bridge is
                        // translated back.
                        cmd.args([
                            "net.bridge.bridge-nf-call-iptables=1",
                            "net.bridge.bridge-nf-call-ip6tables=1",
                        ]);
                    }
                }
                cmd
            })
            .collect();
        run_parallel(sysctls)?;

        // 3. Links, made from the namespace that keeps the host side, peers created
        // straight into their own namespace.
        // A network of the fabric: a bridge, and a veth from it to each node and ext, named
        // `<prefix>-<role>` here and `interface` there.
        let network = |bridge: &str, prefix: &str, interface: &str| {
            let mut lines = vec![
                format!("link add {bridge} type bridge"),
                format!("link set {bridge} up"),
            ];
            for ns in [&self.node1, &self.node2, &self.ext] {
                let role = &ns.name[self.prefix.len() + 1..];
                lines.push(format!(
                    "link add {prefix}-{role} type veth peer name {interface} netns {}",
                    ns.name
                ));
                lines.push(format!("link set {prefix}-{role} master {bridge} up"));
            }
            lines
        };
        let mut fabric = vec!["link set lo up".to_string()];
        fabric.extend(network("br0", "fab", NODE_IF));
        if self.shape == Shape::MultiHomed {
            fabric.extend(network("br1", "mgt", MGMT_IF));
        }
        let mut node_links = [Vec::new(), Vec::new()];
        if self.shape.bridged() {
            for (n, lines) in node_links.iter_mut().enumerate() {
                lines.extend([
                    format!("link add {BRIDGE} type bridge"),
                    format!("addr add 10.244.{}.1/24 dev {BRIDGE}", n + 1),
                    format!("addr add {}/64 dev {BRIDGE}", pod_ip6(n as u8 + 1, 1)),
                    format!("link set {BRIDGE} up"),
                ]);
            }
        }
        for pod in &self.pods {
            let lines = &mut node_links[if pod.node == "node1" { 0 } else { 1 }];
            let (hif, pns) = (&pod.host_if, &pod.ns.name);
            lines.push(format!(
                "link add {hif} type veth peer name eth0 netns {pns}"
            ));
            lines.extend(pod.host_side());
        }
        let [n1, n2] = node_links;
        ip_batches(&[
            (Some(&self.fabric.name), fabric),
            (Some(&self.node1.name), n1),
            (Some(&self.node2.name), n2),
        ])?;

        // 4. Addresses and routes on the far ends.
        let mut batches = vec![
            (Some(self.node1.name.as_str()), self.node_side(1)),
            (Some(self.node2.name.as_str()), self.node_side(2)),
            (Some(self.ext.name.as_str()), self.ext_side()),
        ];
        for pod in &self.pods {
            batches.push((Some(pod.ns.name.as_str()), pod.pod_side()));
        }
        ip_batches(&batches)
    }

    /// `ip` lines of node `n` (1 or 2) once its uplinks are there: its addresses, the route to
    /// the other node's pods, and the default route, as the shape has them.
    fn node_side(&self, n: u8) -> Vec<String> {
        let other = 3 - n;
        let ip = Sandbox::node_ip(&format!("node{n}"));
        let other_ip = Sandbox::node_ip(&format!("node{other}"));
        let other_pods = format!("10.244.{other}.0/24");
        let (ip6, other_ip6) = (Sandbox::node_ip6(n), Sandbox::node_ip6(other));
        let other_pods6 = format!("{}/64", pod_ip6(other, 0));
        let mut lines = vec!["link set lo up".to_string()];
        if self.shape == Shape::MultiHomed {
            // The node address alone (no connected route): replies to clients on the node
            // network go by the default route, through the management network.
            let (mgmt, other_mgmt) = (mgmt_ip(ip), mgmt_ip(other_ip));
            let (mgmt6, other_mgmt6) = (mgmt_ip6(n), mgmt_ip6(other));
            lines.extend([
                format!("addr add {ip}/32 dev {NODE_IF}"),
                format!("addr add {ip6}/128 dev {NODE_IF}"),
                format!("link set {NODE_IF} up"),
                format!("addr add {mgmt}/24 dev {MGMT_IF}"),
                format!("addr add {mgmt6}/64 dev {MGMT_IF}"),
                format!("link set {MGMT_IF} up"),
                // The nodes reach each other's addresses and pods over the management
                // network.
                format!("route add {other_ip}/32 via {other_mgmt} dev {MGMT_IF}"),
                format!("route add {other_pods} via {other_mgmt} dev {MGMT_IF}"),
                format!("route add default via {MGMT_ROUTER} dev {MGMT_IF}"),
                format!("route add {other_ip6}/128 via {other_mgmt6} dev {MGMT_IF}"),
                format!("route add {other_pods6} via {other_mgmt6} dev {MGMT_IF}"),
                format!("route add default via {MGMT_ROUTER6} dev {MGMT_IF}"),
            ]);
            return lines;
        }
        lines.extend([
            format!("addr add {ip}/24 dev {NODE_IF}"),
            format!("addr add {ip6}/64 dev {NODE_IF}"),
            format!("link set {NODE_IF} up"),
        ]);
        if self.shape == Shape::Overlay {
            // flannel's vxlan backend: the tunnel holds the node's pod range's .0, and the
            // other node's is reached through it, its VTEP's MAC known statically.
            let (mac, other_mac) = (vtep_mac(n), vtep_mac(other));
            lines.extend([
                // Two nodes: the other's VTEP is the tunnel's one remote end (flannel writes
                // an FDB entry per node instead).
                format!(
                    "link add {TUNNEL} type vxlan id 1 local {ip} remote {other_ip} dev {NODE_IF} \
                     dstport 8472 nolearning"
                ),
                format!("link set {TUNNEL} address {mac} mtu {TUNNEL_MTU} up"),
                format!("addr add 10.244.{n}.0/32 dev {TUNNEL}"),
                format!("route add {other_pods} via 10.244.{other}.0 dev {TUNNEL} onlink"),
                format!("neigh add 10.244.{other}.0 lladdr {other_mac} dev {TUNNEL} nud permanent"),
                // IPv6 inside the same tunnel, the VTEP's address ::ffff of the pod range.
                format!("addr add {}/128 dev {TUNNEL}", tunnel_ip6(n)),
                format!(
                    "route add {other_pods6} via {} dev {TUNNEL} onlink",
                    tunnel_ip6(other)
                ),
                format!(
                    "neigh add {} lladdr {other_mac} dev {TUNNEL} nud permanent",
                    tunnel_ip6(other)
                ),
            ]);
        } else {
            lines.push(format!("route add {other_pods} via {other_ip}"));
            lines.push(format!("route add {other_pods6} via {other_ip6}"));
        }
        // The node network's router (ext) has the default route: the interface that holds it
        // carries the node's primary address (--nodeport-addresses).
        lines.push(format!("route add default via {EXT_IP}"));
        lines.push(format!("route add default via {EXT_IP6}"));
        lines
    }

    /// `ip` lines of ext, the clients outside and the node network's router.
    fn ext_side(&self) -> Vec<String> {
        let mut lines = vec![
            "link set lo up".to_string(),
            format!("addr add {EXT_IP}/24 dev {NODE_IF}"),
            format!("addr add {EXT_IP6}/64 dev {NODE_IF}"),
            format!("link set {NODE_IF} up"),
        ];
        // Load balancer and external IPs are routed to a node, as a cloud load balancer or
        // the network's router would, and so are the Service and pod ranges.
        for (range, via) in [
            (SERVICE_CIDR, NODE1_IP.to_string()),
            (POD_CIDR, NODE1_IP.to_string()),
            (LB_CIDR, NODE1_IP.to_string()),
            (EXTERNAL_IP_CIDR, NODE1_IP.to_string()),
            (SERVICE_CIDR6, NODE1_IP6.to_string()),
            (POD_CIDR6, NODE1_IP6.to_string()),
            (LB_CIDR6, NODE1_IP6.to_string()),
            (EXTERNAL_IP_CIDR6, NODE1_IP6.to_string()),
        ] {
            lines.push(format!("route add {range} via {via}"));
        }
        if self.shape == Shape::MultiHomed {
            lines.extend([
                format!("addr add {MGMT_ROUTER}/24 dev {MGMT_IF}"),
                format!("addr add {MGMT_ROUTER6}/64 dev {MGMT_IF}"),
                format!("link set {MGMT_IF} up"),
            ]);
        }
        lines
    }

    /// Adds a pod to the running sandbox the way CNI plugins wire one the kubelet starts: the
    /// veth pair is made in the pod's namespace, its node side moved to the node under a
    /// temporary name and renamed as the sandbox's shape names it there (`veth-<name>` when
    /// routed), then both sides get their addresses and
    /// routes. Returns as soon as the pod can send. `name` has at most 10 characters (interface
    /// names have 15); the pod is 10.244.N.`octet` on node N.
    pub fn add_pod(&mut self, name: &str, node: &str, octet: u8) -> Result<&Pod> {
        let n = match node {
            "node1" => 1,
            "node2" => 2,
            _ => bail!("no node {node:?} in the sandbox"),
        };
        let ns = Netns::create(&format!("{}-{name}", self.prefix))?;
        // Kept from here on, so that the namespace goes with the sandbox even if a step fails.
        self.pods.push(Pod::new(name, ns, n, octet, self.shape));
        let pod = self.pods.last().expect("just added");
        let node_ns = self.node(node);
        let tmp = format!("tmp-{name}");
        run(pod.ns.cmd("sysctl").args(["-q", "-w"]).args(COMMON_SYSCTLS))?;
        pod.ns.ip_batch(&[
            format!("link add eth0 type veth peer name {tmp}"),
            format!("link set {tmp} netns {}", node_ns.name),
        ])?;
        let mut host = vec![format!("link set {tmp} name {}", pod.host_if)];
        host.extend(pod.host_side());
        node_ns.ip_batch(&host)?;
        pod.ns.ip_batch(&pod.pod_side())?;
        Ok(pod)
    }

    /// Deletes a pod: its node-side interface (at once, so that its name is free again; a
    /// deleted namespace releases its interfaces a little later), then its namespace.
    pub fn remove_pod(&mut self, name: &str) -> Result<()> {
        let i = self
            .pods
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| anyhow!("no pod {name:?} in the sandbox"))?;
        let pod = self.pods.remove(i);
        self.node(&pod.node).ip(&["link", "del", &pod.host_if])?;
        drop(pod); // deletes the namespace
        Ok(())
    }

    /// Resolves the neighbours on every path between a node and a pod (both ways, both
    /// families): one ping from each node to each pod address, all at once. A running
    /// cluster's caches are warm; the sandbox's first contact of a node with another node's
    /// pod sometimes waits for one neighbour resolution retransmission (1 s; IPv4 and IPv6
    /// alike, seen about once in 40 fresh sandboxes on a loaded machine, cause not found),
    /// which the userspace mode's UDP sessions (kube-proxy's 250 ms `--udp-timeout`) do not
    /// outlive.
    pub fn resolve_neighbours(&self) -> Result<()> {
        let pings: Vec<_> = [&self.node1, &self.node2]
            .into_iter()
            .flat_map(|node| self.pods.iter().map(move |pod| (node, pod)))
            .flat_map(|(node, pod)| {
                [("-4", IpAddr::from(pod.ip)), ("-6", IpAddr::from(pod.ip6))]
                    .map(|(family, ip)| (node, family, ip))
            })
            .map(|(node, family, ip)| {
                let mut ping = node.cmd("ping");
                ping.args([family, "-c1", "-W3", &ip.to_string()])
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null());
                let child = ping
                    .spawn()
                    .with_context(|| format!("pinging {ip} from {}", node.name));
                (node, ip, child)
            })
            .collect();
        for (node, ip, child) in pings {
            let status = child?.wait()?;
            ensure!(
                status.success(),
                "{ip} does not answer {}: {status}",
                node.name
            );
        }
        Ok(())
    }

    /// The pod named `name`; panics if there is none.
    pub fn pod(&self, name: &str) -> &Pod {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no pod {name:?} in the sandbox"))
    }

    /// The backend pods (all but `client`).
    pub fn backends(&self) -> impl Iterator<Item = &Pod> {
        self.pods.iter().filter(|p| p.name != "client")
    }

    /// The namespace of "node1" or "node2"; panics otherwise.
    pub fn node(&self, name: &str) -> &Netns {
        match name {
            "node1" => &self.node1,
            "node2" => &self.node2,
            _ => panic!("no node {name:?} in the sandbox"),
        }
    }

    /// The node-network address of "node1" or "node2".
    pub fn node_ip(name: &str) -> Ipv4Addr {
        match name {
            "node1" => NODE1_IP,
            "node2" => NODE2_IP,
            _ => panic!("no node {name:?} in the sandbox"),
        }
    }

    /// The IPv6 node-network address of node `n` (1 or 2).
    pub fn node_ip6(n: u8) -> Ipv6Addr {
        match n {
            1 => NODE1_IP6,
            _ => NODE2_IP6,
        }
    }

    /// Every address of node "node1" or "node2" (on the node network, and on the management
    /// network of a multi-homed one).
    pub fn node_addrs(&self, name: &str) -> Vec<Ipv4Addr> {
        let mut addrs = vec![Sandbox::node_ip(name)];
        if self.shape == Shape::MultiHomed {
            addrs.push(mgmt_ip(Sandbox::node_ip(name)));
        }
        addrs
    }

    /// The node-side pod interfaces of a node.
    pub fn host_ifs(&self, node: &str) -> Vec<&str> {
        self.pods
            .iter()
            .filter(|p| p.node == node)
            .map(|p| p.host_if.as_str())
            .collect()
    }

    /// Uses this `sandbox-backend` binary instead of looking for one (see [`backend_bin`]).
    pub fn set_backend_bin(&mut self, path: impl Into<PathBuf>) {
        self.backend_bin = Some(path.into());
    }

    /// Starts the backend server in every pod except `client`, each answering with its pod
    /// name on `port` (TCP and UDP); returns once all are listening. Killed on drop.
    pub fn start_backends(&mut self, port: u16) -> Result<()> {
        let names: Vec<String> = self.backends().map(|p| p.name.clone()).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        self.start_backends_on(&names, port)
    }

    /// Starts the backend server in one pod (e.g. again after [`Sandbox::stop_backend`]).
    pub fn start_backend(&mut self, pod: &str, port: u16) -> Result<()> {
        self.start_backends_on(&[pod], port)
    }

    fn start_backends_on(&mut self, pods: &[&str], port: u16) -> Result<()> {
        let bin = match &self.backend_bin {
            Some(bin) => bin.clone(),
            None => backend_bin()?,
        };
        let mut started = Vec::new();
        for &name in pods {
            let pod = self.pod(name);
            let mut cmd = Command::new(&bin);
            cmd.args(["--name", name, "--port", &port.to_string()])
                .args(["--bind", "0.0.0.0", "--bind", "::"])
                .stdin(Stdio::null())
                .stdout(Stdio::null());
            pod.ns.enter(&mut cmd)?;
            let child = cmd
                .spawn()
                .with_context(|| format!("start `{}` in {}", describe(&cmd), pod.ns.name))?;
            started.push(self.procs.len());
            self.procs.push(Proc {
                label: format!("sandbox-backend {name}:{port}"),
                backend_of: Some(name.to_string()),
                child,
                graceful: false,
            });
        }
        // Wait until every one accepts connections (it binds UDP before TCP).
        let deadline = Instant::now() + crate::patience(Duration::from_secs(10));
        for i in started {
            let pod = self.procs[i].backend_of.clone().expect("backend");
            let ns = &self.pods.iter().find(|p| p.name == pod).expect("pod").ns;
            loop {
                if let Some(status) = self.procs[i].child.try_wait()? {
                    bail!("{} in {} exited: {status}", self.procs[i].label, ns.name);
                }
                let up = ns.try_run(|| {
                    TcpStream::connect_timeout(
                        &(Ipv4Addr::LOCALHOST, port).into(),
                        Duration::from_millis(200),
                    )
                    .is_ok()
                })?;
                if up {
                    break;
                }
                if Instant::now() > deadline {
                    bail!(
                        "{} in {} is not listening after 10 s",
                        self.procs[i].label,
                        ns.name
                    );
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        Ok(())
    }

    /// Kills the backend server(s) of one pod.
    pub fn stop_backend(&mut self, pod: &str) {
        let (stop, keep) = std::mem::take(&mut self.procs)
            .into_iter()
            .partition(|p| p.backend_of.as_deref() == Some(pod));
        self.procs = keep;
        stop_all(stop);
    }

    /// Runs `cmd` (a plain command, e.g. the agent) inside `ns` (entered with setns, so
    /// the host's mounts such as /sys/fs/bpf stay visible) and keeps it; it is stopped on
    /// drop (SIGTERM, then SIGKILL after 5 s). Returns its pid.
    pub fn spawn(&mut self, ns: &Netns, mut cmd: Command) -> Result<u32> {
        ns.enter(&mut cmd)?;
        let child = cmd
            .spawn()
            .with_context(|| format!("start `{}` in {}", describe(&cmd), ns.name))?;
        let pid = child.id();
        self.procs.push(Proc {
            label: describe(&cmd),
            backend_of: None,
            child,
            graceful: true,
        });
        Ok(pid)
    }

    /// The child started by [`Sandbox::spawn`] (e.g. to take its stdout or poll it).
    pub fn child(&mut self, pid: u32) -> Option<&mut Child> {
        self.procs
            .iter_mut()
            .find(|p| p.child.id() == pid)
            .map(|p| &mut p.child)
    }

    /// Stops a spawned process now (SIGTERM, SIGKILL after 5 s) and returns how it ended.
    pub fn stop(&mut self, pid: u32) -> Result<ExitStatus> {
        let i = self
            .procs
            .iter()
            .position(|p| p.child.id() == pid)
            .ok_or_else(|| anyhow!("no process {pid} in the sandbox"))?;
        let mut proc = self.procs.remove(i);
        terminate(&mut proc);
        Ok(reap(
            &mut proc,
            Instant::now() + crate::patience(Duration::from_secs(5)),
        ))
    }
}

fn terminate(proc: &mut Proc) {
    if proc.graceful {
        // SAFETY: plain kill(2) on our own child, which has not been reaped yet.
        unsafe { libc::kill(proc.child.id() as libc::pid_t, libc::SIGTERM) };
    } else {
        let _ = proc.child.kill();
    }
}

/// Waits for `proc` until `deadline`, then SIGKILLs it.
fn reap(proc: &mut Proc, deadline: Instant) -> ExitStatus {
    loop {
        match proc.child.try_wait() {
            Ok(Some(status)) => return status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            _ => {
                eprintln!("sandbox: killing `{}` (did not exit)", proc.label);
                let _ = proc.child.kill();
                return proc
                    .child
                    .wait()
                    .unwrap_or_else(|_| std::os::unix::process::ExitStatusExt::from_raw(0));
            }
        }
    }
}

fn stop_all(mut procs: Vec<Proc>) {
    procs.iter_mut().for_each(terminate);
    let deadline = Instant::now() + crate::patience(Duration::from_secs(5));
    for proc in &mut procs {
        reap(proc, deadline);
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        stop_all(std::mem::take(&mut self.procs));
        // One `ip` for all namespaces; whatever survives is retried by each Netns's drop.
        let dels: Vec<String> = self
            .all_ns()
            .filter(|ns| ns.exists())
            .map(|ns| format!("netns del {}", ns.name))
            .collect();
        if !dels.is_empty() {
            let mut cmd = Command::new("ip");
            cmd.args(["-force", "-batch", "-"]);
            if let Ok(child) = crate::netns::spawn_with_input(&mut cmd, &dels.join("\n")) {
                let _ = child.wait_with_output();
            }
        }
        let mut all: Vec<&mut Netns> = vec![
            &mut self.ext,
            &mut self.fabric,
            &mut self.node1,
            &mut self.node2,
        ];
        all.extend(self.pods.iter_mut().map(|p| &mut p.ns));
        for ns in all {
            if !ns.exists() {
                ns.disarm();
            }
        }
    }
}

/// The management network address of the node whose node-network address is `node_ip`
/// ([`Shape::MultiHomed`]): the same last octet.
fn mgmt_ip(node_ip: Ipv4Addr) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, node_ip.octets()[3])
}

/// Node `n`'s IPv6 address on the management network.
fn mgmt_ip6(n: u8) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 0xdb8, 0x198, 0x18, 0, 0, 0, decimal_looking(10 + n))
}

/// fd00:10:244:`n`::`last`, the last group's hex digits reading as `last` in decimal.
pub fn pod_ip6(n: u8, last: u8) -> Ipv6Addr {
    let group = |v: u8| decimal_looking(v);
    Ipv6Addr::new(0xfd00, 0x10, 0x244, group(n), 0, 0, 0, group(last))
}

/// The IPv6 twin of a sandbox IPv4 address (see [`EXT_IP6`]): pods, nodes, ext, the
/// management network, and the Service, load balancer and external IP ranges.
pub fn twin(ip: Ipv4Addr) -> Ipv6Addr {
    let [a, b, c, d] = ip.octets();
    let dl = decimal_looking;
    let prefix: [u16; 4] = match [a, b, c] {
        [10, 244, n] => return pod_ip6(n, d),
        [10, 96, 0] => [0xfd00, 0x10, 0x96, 0],
        [192, 0, 2] => [0x2001, 0xdb8, 0x192, 0x2],
        [203, 0, 113] => [0x2001, 0xdb8, 0x203, 0x113],
        [198, 51, 100] => [0x2001, 0xdb8, 0x198, 0x51],
        [198, 18, 0] => [0x2001, 0xdb8, 0x198, 0x18],
        _ => panic!("{ip} has no IPv6 twin in the sandbox"),
    };
    let [p0, p1, p2, p3] = prefix;
    Ipv6Addr::new(p0, p1, p2, p3, 0, 0, 0, dl(d))
}

/// The IPv6 twin of a range of the sandbox (`192.0.2.100/32`, `10.244.0.0/16`): a host's
/// twin, a /24's /64, the pod and Service ranges' ([`POD_CIDR6`], [`SERVICE_CIDR6`]), and
/// 10.0.0.0/8's fd00::/8 (both hold the pods and not ext).
pub fn twin_cidr(cidr: &str) -> String {
    match cidr {
        POD_CIDR => POD_CIDR6.to_owned(),
        SERVICE_CIDR => SERVICE_CIDR6.to_owned(),
        "10.0.0.0/8" => "fd00::/8".to_owned(),
        _ => {
            let (ip, len) = cidr.split_once('/').unwrap_or((cidr, "32"));
            let ip: Ipv4Addr = ip.parse().unwrap_or_else(|_| panic!("{cidr}: not a range"));
            match len {
                "32" => format!("{}/128", twin(ip)),
                "24" => {
                    let s = twin(ip).segments();
                    format!("{}/64", Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
                }
                _ => panic!("{cidr} has no IPv6 twin in the sandbox"),
            }
        }
    }
}

/// The address node `n`'s VXLAN device has in its IPv6 pod range.
fn tunnel_ip6(n: u8) -> Ipv6Addr {
    let pods = pod_ip6(n, 0).segments();
    Ipv6Addr::new(pods[0], pods[1], pods[2], pods[3], 0, 0, 0, 0xffff)
}

/// The hex number whose digits are `v`'s decimal ones (11 -> 0x11), so that an IPv6 group
/// reads as the IPv4 octet it stands for.
fn decimal_looking(v: u8) -> u16 {
    u16::from_str_radix(&v.to_string(), 16).expect("decimal digits are hex digits")
}

/// The MAC address of node `n`'s VXLAN device.
fn vtep_mac(n: u8) -> String {
    format!("0a:58:0a:f4:{n:02x}:00")
}

/// Deletes namespaces left behind by sandboxes of processes that no longer exist
/// (`pxt<pid>-...` with no /proc/<pid>), e.g. after a test binary was killed.
pub fn cleanup_stale() {
    let Ok(entries) = std::fs::read_dir(NETNS_DIR) else {
        return;
    };
    let stale: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|name| {
            let Some(rest) = name.strip_prefix(NS_PREFIX) else {
                return false;
            };
            let Some((pid, _)) = rest.split_once('-') else {
                return false;
            };
            !pid.is_empty()
                && pid.bytes().all(|b| b.is_ascii_digit())
                && !Path::new("/proc").join(pid).exists()
        })
        .map(|name| format!("netns del {name}"))
        .collect();
    if !stale.is_empty() {
        let mut cmd = Command::new("ip");
        cmd.args(["-force", "-batch", "-"]);
        if let Ok(child) = crate::netns::spawn_with_input(&mut cmd, &stale.join("\n")) {
            let _ = child.wait_with_output();
        }
    }
}

/// Finds the `sandbox-backend` binary (see [`find_bin`]).
pub fn backend_bin() -> Result<PathBuf> {
    find_bin("sandbox-backend", BACKEND_BIN_ENV)
}

/// Finds one of the workspace's binaries: `$<env>` if set, else next to the current
/// executable (target/<profile>/), or one directory up for test executables in deps/.
pub fn find_bin(name: &str, env: &str) -> Result<PathBuf> {
    if let Some(path) = std::env::var_os(env) {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!("{env}={} does not exist", path.display());
        }
        return Ok(path);
    }
    let exe = std::env::current_exe().context("current_exe")?;
    let mut tried = Vec::new();
    let mut dir = exe.parent();
    for _ in 0..2 {
        let Some(d) = dir else { break };
        let candidate = d.join(name);
        if candidate.is_file() {
            return Ok(candidate);
        }
        tried.push(candidate.display().to_string());
        dir = d.parent();
    }
    bail!(
        "{name} not found (tried {}); run `cargo build --workspace --bins` or set {env}",
        tried.join(", ")
    )
}

/// Runs `ip netns list` and returns the names (first column).
pub fn netns_list() -> Result<Vec<String>> {
    let out = run(Command::new("ip").args(["netns", "list"]))?;
    Ok(out
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect())
}

use std::{io::IsTerminal, path::PathBuf, time::Duration};

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum, builder::TypedValueParser as _};
use proxy_userspace::{
    agent::{self, AgentConfig, Source},
    dataplane::Dataplane,
    duration::parse_duration,
    inspect,
    model::Cidr,
    model::LbAlgorithm,
    modes::ebpf::maglev,
    modes::ebpf::{
        EbpfDataplane, ExternalConfig, MapSizes, WriterConfig,
        external::{SnatPorts, XdpMode},
    },
    modes::iptables::{self, IptablesConfig, IptablesDataplane},
    modes::ipvs::{self, IpvsConfig, IpvsDataplane},
    modes::nftables::{self, NftablesDataplane},
    modes::userspace::{self, UserspaceConfig, UserspaceDataplane},
    netfilter::{iptables::Backend, rules::NetfilterConfig},
    node::NodePortAddresses,
};

/// An eBPF dataplane for Kubernetes Services: a drop-in replacement for kube-proxy.
#[derive(Parser)]
#[command(version)]
struct Cli {
    /// Log format (kube-proxy's flag): `text` for people, `json` for log pipelines. The
    /// level comes from RUST_LOG (default info).
    #[arg(long, global = true, value_enum, default_value = "text")]
    logging_format: LoggingFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LoggingFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Program this node so that Services reach their endpoints.
    Agent(Box<AgentArgs>),
    /// Print what the node's proxy mode has programmed (the pinned maps, the rules).
    Inspect(InspectArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ProxyMode {
    /// The first of ebpf, nftables and iptables that starts on this node (each is tried for
    /// real: the BPF programs loaded, the nftables table written).
    Auto,
    /// tc and XDP programs with BPF maps.
    Ebpf,
    /// kube-proxy's nftables mode (`table ip kube-proxy`), for nodes where BPF cannot run.
    Nftables,
    /// kube-proxy's iptables rules (NAT chains), for nodes without BPF or nftables.
    Iptables,
    /// kube-proxy's IPVS mode: the kernel's IP Virtual Server balances, with ipsets and a few
    /// iptables rules (needs the ip_vs modules).
    Ipvs,
    /// kube-proxy's first mode: the agent itself proxies each Service port, which iptables
    /// rules redirect to it (endpoints see the node's address).
    Userspace,
}

impl ProxyMode {
    /// What `auto` tries, in order.
    const AUTO: [ProxyMode; 3] = [ProxyMode::Ebpf, ProxyMode::Nftables, ProxyMode::Iptables];

    fn name(self) -> &'static str {
        match self {
            ProxyMode::Auto => "auto",
            ProxyMode::Ebpf => "ebpf",
            ProxyMode::Nftables => "nftables",
            ProxyMode::Iptables => "iptables",
            ProxyMode::Ipvs => "ipvs",
            ProxyMode::Userspace => "userspace",
        }
    }
}

const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/kube-proxy-ebpf";

#[derive(clap::Args)]
struct AgentArgs {
    /// Which proxy mode to use (kube-proxy's flag).
    #[arg(long, value_enum, default_value = "auto")]
    proxy_mode: ProxyMode,
    /// Read Services and EndpointSlices from this file of Kubernetes YAML (multi-document or a
    /// List, watched for changes) instead of the API server.
    #[arg(long, conflicts_with = "kubeconfig")]
    manifest: Option<PathBuf>,
    /// Path to a kubeconfig file (kube-proxy's flag). Without it and without --manifest, the
    /// in-cluster service account is used.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// This node's name (kube-proxy's flag); defaults to $NODE_NAME, else the hostname.
    #[arg(long)]
    hostname_override: Option<String>,
    /// Address of the /healthz and /livez server (kube-proxy's flag); empty to disable.
    #[arg(long, default_value = "0.0.0.0:10256")]
    healthz_bind_address: String,
    /// Address of the /metrics server (kube-proxy's flag and default); empty to disable.
    #[arg(long, default_value = "127.0.0.1:10249")]
    metrics_bind_address: String,
    /// The minimum interval between syncs: changes arriving faster are batched (kube-proxy's flag).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    min_sync_period: Duration,
    /// The interval of periodic syncs (kube-proxy's flag); one an hour is a full one.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    sync_period: Duration,
    /// bpffs directory where the maps are pinned (mounted if it is not on bpffs).
    #[arg(long, default_value = DEFAULT_PIN_DIR)]
    bpf_pin_dir: PathBuf,
    /// A cgroup v2 directory for the socket programs that let host-network clients (this
    /// network namespace's) reach services; they see the sockets of every process below it.
    /// cgroup2 is mounted there if the directory is empty or missing (Cilium's cgroup-root, which
    /// works on unified and hybrid hosts alike). Empty: host-network clients are not served.
    #[arg(long, default_value = "/run/kube-proxy-ebpf/cgroupv2")]
    bpf_cgroup_path: PathBuf,
    /// Interfaces facing pods, by name (`*` matches any run; comma-separated patterns).
    #[arg(long, default_value = "veth*,cali*,lxc*,cni*")]
    pod_interfaces: String,
    /// The node addresses NodePorts answer on (kube-proxy's flag): comma-separated CIDRs (every
    /// address of the node within them), or `primary`: the Node object's InternalIP and
    /// ExternalIP with the API source, the addresses of the default route's interface with
    /// --manifest. Never loopback. The interfaces carrying them get the external programs.
    #[arg(long, default_value = "primary")]
    nodeport_addresses: NodePortAddresses,
    /// How external traffic (NodePort, LoadBalancer, external IPs) is processed on those
    /// interfaces: `native` XDP (in the driver; generic where the driver has none), `generic`
    /// XDP, or `tc` only (the same logic on tc ingress, for NICs or kernels where XDP fails).
    #[arg(long, value_enum, default_value = "native")]
    xdp_mode: XdpMode,
    /// Source ports of external flows sent to another node's endpoint (from this node's
    /// address): FIRST-LAST, outside the node's ephemeral ports (ip_local_port_range). A port
    /// is held per endpoint while its flow lives, and a second after it closes (a minute if the
    /// endpoint closed first), so the width bounds the new connections a second to one endpoint.
    #[arg(long, default_value_t = SnatPorts::default())]
    bpf_snat_port_range: SnatPorts,
    /// Size of the services map (one entry per service port and one per backend of each).
    #[arg(long, default_value_t = MapSizes::default().services)]
    bpf_services_max: u32,
    /// Size of the backends map (one entry per distinct endpoint address, port and protocol).
    #[arg(long, default_value_t = MapSizes::default().backends)]
    bpf_backends_max: u32,
    /// Size of the conntrack map (two entries per flow; the least recently used are evicted).
    #[arg(long, default_value_t = MapSizes::default().conntrack)]
    bpf_ct_max: u32,
    /// How long an endpoint that left its Service (not ready, terminating, or removed), or a
    /// deleted Service, keeps serving the TCP connections established through it (new
    /// connections and UDP go to the usable endpoints at once). An endpoint still listed in its
    /// EndpointSlice drains for as long as it is listed; this period counts from its removal.
    #[arg(long, default_value = "1h", value_parser = parse_duration)]
    bpf_drain_period: Duration,
    /// How new flows pick an endpoint: `random`, or `maglev` (consistent hashing: the same
    /// endpoint for a flow on every node). A Service overrides it with the annotation
    /// `service.kube-proxy-ebpf.io/lb-algorithm`.
    #[arg(long, default_value = "random", value_parser = lb_algorithm())]
    lb_algorithm: LbAlgorithm,
    /// Entries of each Maglev table: a prime (Cilium's sizes: 251 ... 16381 ... 131071). Larger
    /// tables spread flows more evenly and cost 4 bytes an entry per Service using Maglev.
    #[arg(long, default_value_t = maglev::DEFAULT_TABLE_SIZE, value_parser = maglev::parse_table_size)]
    lb_maglev_table_size: u32,
    /// The cluster's pod range (kube-proxy's flag), with the iptables, nftables and ipvs modes:
    /// connections to a cluster IP from outside it are masqueraded, and pods reaching an
    /// externalTrafficPolicy Local frontend get any endpoint. Empty: neither.
    #[arg(long, value_parser = parse_cidr)]
    cluster_cidr: Option<Cidr>,
    /// Masquerade every connection to a cluster IP (kube-proxy's flag, iptables, nftables and
    /// ipvs modes).
    #[arg(long)]
    masquerade_all: bool,
    /// How long a UDP session of the userspace mode lives without traffic (kube-proxy's flag).
    #[arg(long, default_value = "250ms", value_parser = parse_udp_timeout)]
    udp_timeout: Duration,
    /// Which iptables the iptables, ipvs and userspace modes write to: `legacy`, `nft`
    /// (nf_tables), or `auto`: the one already holding kube-proxy's rules, else the node's
    /// `iptables` (as kube-proxy's image picks). Legacy is far faster with thousands of
    /// Services.
    #[arg(long, value_enum, default_value = "auto")]
    iptables_backend: IptablesBackend,
    /// The IPVS scheduler of the ipvs mode (kube-proxy's flag): rr, wrr, lc, wlc, lblc, lblcr,
    /// dh, sh, sed, nq, mh... (the kernel's ip_vs_<name> module); empty is rr.
    #[arg(long, default_value = "")]
    ipvs_scheduler: String,
    /// The ipvs mode sets arp_ignore=1 and arp_announce=2 on all interfaces, so that the node
    /// does not answer ARP for the service addresses on kube-ipvs0 (kube-proxy's flag).
    #[arg(long)]
    ipvs_strict_arp: bool,
    /// Comma-separated CIDRs whose IPVS virtual servers the ipvs mode leaves alone when it
    /// removes what it does not know (kube-proxy's flag).
    #[arg(long, value_delimiter = ',', value_parser = parse_cidr)]
    ipvs_exclude_cidrs: Vec<Cidr>,
    /// IPVS's idle timeout of established TCP connections (kube-proxy's flag); 0 leaves the
    /// kernel's (900s).
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    ipvs_tcp_timeout: Duration,
    /// IPVS's timeout of TCP connections after a FIN (kube-proxy's flag); 0 leaves the
    /// kernel's (120s).
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    ipvs_tcpfin_timeout: Duration,
    /// IPVS's idle timeout of UDP flows (kube-proxy's flag); 0 leaves the kernel's (300s).
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    ipvs_udp_timeout: Duration,
    /// Remove what the agent installed (its tc programs on the pod interfaces, its socket
    /// programs on the cgroup, the pinned maps and links) and exit (kube-proxy's flag), e.g.
    /// before going back to kube-proxy.
    #[arg(long)]
    cleanup: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum IptablesBackend {
    Auto,
    Legacy,
    Nft,
}

impl IptablesBackend {
    /// The backend named, or for `auto` the one `detect` picks.
    fn or(self, detect: fn() -> anyhow::Result<Backend>) -> anyhow::Result<Backend> {
        match self {
            IptablesBackend::Auto => detect(),
            IptablesBackend::Legacy => Ok(Backend::Legacy),
            IptablesBackend::Nft => Ok(Backend::Nft),
        }
    }
}

#[derive(clap::Args)]
struct InspectArgs {
    #[arg(value_enum)]
    what: InspectWhat,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Whose state to read; by default the mode installed on this node (in this network
    /// namespace): the ebpf mode's pins in --bpf-pin-dir, else the one mode whose rules are here.
    #[arg(long, value_enum)]
    proxy_mode: Option<inspect::Mode>,
    #[arg(long, default_value = DEFAULT_PIN_DIR)]
    bpf_pin_dir: PathBuf,
}

/// What `inspect` prints.
type InspectWhat = inspect::What;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging(cli.logging_format);
    match cli.command {
        Command::Agent(args) => run_agent(*args),
        Command::Inspect(args) => run_inspect(args),
    }
}

/// Logs go to stderr, coloured only when it is a terminal: a file, a pipe or a container runtime
/// capturing the output gets plain text. Setting our own colour choice overrides
/// tracing-subscriber's NO_COLOR check, so that check is repeated here.
fn init_logging(format: LoggingFormat) {
    let colour = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(colour);
    match format {
        LoggingFormat::Text => logs.init(),
        LoggingFormat::Json => logs.json().init(),
    }
}

fn run_agent(args: AgentArgs) -> anyhow::Result<()> {
    if args.cleanup {
        return cleanup(&args);
    }
    // One malloc arena for every thread: glibc gives each thread its own, and what a thread
    // frees there (the BPF object's parse, a list's JSON) stays resident beside the others'
    // (at 30k Services, 100 MiB resident with one a thread, 89 MiB with one in all). The agent
    // allocates from one thread at a time, mostly, so they do not contend.
    // SAFETY: mallopt has no preconditions; no other thread runs yet.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let source = match args.manifest.clone() {
        Some(path) => Source::File(path),
        None => Source::Kubernetes {
            kubeconfig: args.kubeconfig.clone(),
        },
    };
    let config = AgentConfig {
        source,
        node_name: node_name(args.hostname_override.clone())?,
        min_sync_period: args.min_sync_period,
        sync_period: args.sync_period,
        healthz_bind_address: Some(args.healthz_bind_address.clone()).filter(|a| !a.is_empty()),
        metrics_bind_address: Some(args.metrics_bind_address.clone()).filter(|a| !a.is_empty()),
    };
    let mut ebpf = EbpfStart::default();
    if matches!(args.proxy_mode, ProxyMode::Ebpf | ProxyMode::Auto) {
        ebpf.preload(&args);
    }
    let make_dataplane = |node_ips: &[std::net::IpAddr]| -> anyhow::Result<Box<dyn Dataplane>> {
        if args.proxy_mode != ProxyMode::Auto {
            return start_mode(args.proxy_mode, &args, node_ips, &mut ebpf);
        }
        let mut unavailable = Vec::new();
        for mode in ProxyMode::AUTO {
            match start_mode(mode, &args, node_ips, &mut ebpf) {
                Ok(dataplane) => {
                    tracing::info!(
                        mode = mode.name(),
                        unavailable = ?unavailable,
                        "--proxy-mode auto: using the first mode that works here"
                    );
                    return Ok(dataplane);
                }
                Err(e) => {
                    tracing::warn!(
                        "--proxy-mode auto: the {} mode cannot run here: {e:#}",
                        mode.name()
                    );
                    unavailable.push(format!("{}: {e:#}", mode.name()));
                }
            }
        }
        anyhow::bail!(
            "no proxy mode can run on this node:\n{}",
            unavailable.join("\n")
        )
    };
    runtime.block_on(agent::run(config, make_dataplane))
}

/// Whether a mode's state is here.
type Installed = fn() -> bool;
/// Removes what a mode installed.
type Cleanup = fn() -> anyhow::Result<()>;

/// The fallback modes' state: whether it is here, and what removes it. IPVS first: its jumps
/// go to chains the iptables mode's cleanup deletes.
const LEFTOVERS: [(ProxyMode, Installed, Cleanup); 4] = [
    (ProxyMode::Ipvs, ipvs::installed, ipvs::cleanup),
    (ProxyMode::Iptables, iptables::installed, iptables::cleanup),
    (ProxyMode::Nftables, nftables::installed, nftables::cleanup),
    (
        ProxyMode::Userspace,
        userspace::installed,
        userspace::cleanup,
    ),
];

/// The ebpf mode's start: the pin directory's lock (held until the agent exits: a second agent
/// on the same pins fails), and the programs loaded ahead.
#[derive(Default)]
struct EbpfStart {
    lock: Option<proxy_userspace::modes::ebpf::bpffs::PinDirLock>,
    preloaded: Option<std::thread::JoinHandle<anyhow::Result<aya::Ebpf>>>,
}

impl EbpfStart {
    /// Locks the pin directory and loads the programs on a thread of their own, while the
    /// source lists (the verifier and the maps take about 0.4 s, which the list of 30k
    /// Services hides). Loading attaches nothing and removes nothing: the node's traffic is
    /// touched only once the source's first view is in. A failure here is met again, and
    /// reported, when the mode starts.
    fn preload(&mut self, args: &AgentArgs) {
        let Ok(lock) = lock_pin_dir(args) else {
            return;
        };
        self.lock = Some(lock);
        let (pin_dir, sizes) = (args.bpf_pin_dir.clone(), map_sizes(args));
        self.preloaded = Some(std::thread::spawn(move || {
            proxy_userspace::modes::ebpf::load(&pin_dir, sizes)
        }));
    }

    /// The loaded programs: those loaded ahead, else loaded now.
    fn load(&mut self, args: &AgentArgs) -> anyhow::Result<aya::Ebpf> {
        if self.lock.is_none() {
            self.lock = Some(lock_pin_dir(args)?);
        }
        let Some(thread) = self.preloaded.take() else {
            return proxy_userspace::modes::ebpf::load(&args.bpf_pin_dir, map_sizes(args));
        };
        thread
            .join()
            .map_err(|_| anyhow::anyhow!("loading the BPF programs panicked"))?
    }
}

fn map_sizes(args: &AgentArgs) -> MapSizes {
    MapSizes {
        services: args.bpf_services_max,
        backends: args.bpf_backends_max,
        conntrack: args.bpf_ct_max,
    }
}

/// Starts `mode` after removing what the other modes left (it would serve stale state beside
/// this one's).
fn start_mode(
    mode: ProxyMode,
    args: &AgentArgs,
    node_ips: &[std::net::IpAddr],
    ebpf: &mut EbpfStart,
) -> anyhow::Result<Box<dyn Dataplane>> {
    for (other, installed, cleanup) in LEFTOVERS {
        if other != mode && installed() {
            tracing::warn!(
                "removing the rules of an earlier {}-mode run (or of kube-proxy: stop it \
                 before starting this agent)",
                other.name()
            );
            cleanup()?;
        }
    }
    if mode != ProxyMode::Ebpf && args.bpf_pin_dir.join(proxy_common::MAP_SERVICES).exists() {
        tracing::info!("removing the eBPF programs of an earlier ebpf-mode run");
        cleanup_ebpf(args)?;
    }
    let netfilter = || NetfilterConfig {
        cluster_cidr: args.cluster_cidr,
        masquerade_all: args.masquerade_all,
        node_port_addresses: args.nodeport_addresses.clone(),
        primary: node_ips.to_vec(),
    };
    let warn_without_cluster_cidr = || {
        if args.cluster_cidr.is_none() && !args.masquerade_all {
            tracing::warn!(
                "no --cluster-cidr: connections to cluster IPs from outside the pod network are \
                 not masqueraded"
            );
        }
    };
    match mode {
        ProxyMode::Auto => unreachable!("auto tries the other modes"),
        ProxyMode::Ebpf => {
            let started = ebpf.load(args).and_then(|loaded| {
                EbpfDataplane::new(
                    loaded,
                    &args.bpf_pin_dir,
                    WriterConfig {
                        drain_period: args.bpf_drain_period,
                        lb_algorithm: args.lb_algorithm,
                        maglev_table_size: args.lb_maglev_table_size,
                    },
                    &args.pod_interfaces,
                    ExternalConfig {
                        addresses: args.nodeport_addresses.clone(),
                        primary: node_ips.to_vec(),
                        mode: args.xdp_mode,
                        snat_ports: args.bpf_snat_port_range,
                    },
                    &args.bpf_cgroup_path,
                )
            });
            let dp = match started {
                Ok(dp) => dp,
                Err(e) => {
                    // Whatever was attached before the failure goes: another mode may follow.
                    if let Err(cleanup) = proxy_userspace::modes::ebpf::cleanup(
                        &args.bpf_pin_dir,
                        &args.pod_interfaces,
                    ) {
                        tracing::warn!("removing the partly started ebpf mode: {cleanup:#}");
                    }
                    return Err(e);
                }
            };
            tracing::info!(pin_dir = %args.bpf_pin_dir.display(), "ebpf dataplane loaded");
            Ok(Box::new(dp))
        }
        ProxyMode::Nftables => {
            let dp = NftablesDataplane::new(netfilter())?;
            warn_without_cluster_cidr();
            tracing::info!("nftables dataplane ready");
            Ok(Box::new(dp))
        }
        ProxyMode::Userspace => {
            let backend = args.iptables_backend.or(userspace::detect_backend)?;
            let dp = UserspaceDataplane::new(UserspaceConfig {
                backend,
                node_port_addresses: args.nodeport_addresses.clone(),
                primary: node_ips.to_vec(),
                udp_timeout: args.udp_timeout,
            })?;
            tracing::info!(backend = backend.name(), "userspace dataplane ready");
            Ok(Box::new(dp))
        }
        ProxyMode::Ipvs => {
            let backend = args.iptables_backend.or(iptables::detect_backend)?;
            let secs = |d: Duration| u32::try_from(d.as_secs()).unwrap_or(u32::MAX);
            let scheduler = match args.ipvs_scheduler.as_str() {
                "" => ipvs::DEFAULT_SCHEDULER.to_owned(),
                name => name.to_owned(),
            };
            let dp = IpvsDataplane::new(IpvsConfig {
                scheduler: scheduler.clone(),
                strict_arp: args.ipvs_strict_arp,
                exclude_cidrs: args.ipvs_exclude_cidrs.clone(),
                timeouts: ipvs::netlink::Timeouts {
                    tcp: secs(args.ipvs_tcp_timeout),
                    tcp_fin: secs(args.ipvs_tcpfin_timeout),
                    udp: secs(args.ipvs_udp_timeout),
                },
                backend,
                netfilter: netfilter(),
            })?;
            warn_without_cluster_cidr();
            tracing::info!(backend = backend.name(), scheduler, "ipvs dataplane ready");
            Ok(Box::new(dp))
        }
        ProxyMode::Iptables => {
            let backend = args.iptables_backend.or(iptables::detect_backend)?;
            let dp = IptablesDataplane::new(IptablesConfig {
                backend,
                netfilter: netfilter(),
            })?;
            warn_without_cluster_cidr();
            tracing::info!(backend = backend.name(), "iptables dataplane ready");
            Ok(Box::new(dp))
        }
    }
}

/// `--cleanup` (kube-proxy's semantics): removes what any mode installed, then exits.
fn cleanup(args: &AgentArgs) -> anyhow::Result<()> {
    for (_, _, cleanup) in LEFTOVERS {
        cleanup()?;
    }
    cleanup_ebpf(args)
}

fn cleanup_ebpf(args: &AgentArgs) -> anyhow::Result<()> {
    let _lock = lock_pin_dir(args)?;
    proxy_userspace::modes::ebpf::cleanup(&args.bpf_pin_dir, &args.pod_interfaces)
}

/// The pin directory (bpffs mounted there when missing), locked against a second agent.
fn lock_pin_dir(
    args: &AgentArgs,
) -> anyhow::Result<proxy_userspace::modes::ebpf::bpffs::PinDirLock> {
    proxy_userspace::modes::ebpf::bpffs::ensure(&args.bpf_pin_dir)?;
    proxy_userspace::modes::ebpf::bpffs::PinDirLock::acquire(&args.bpf_pin_dir)
}

/// A duration above zero (kube-proxy's validation of `--udp-timeout`).
fn parse_udp_timeout(s: &str) -> Result<Duration, String> {
    let timeout = parse_duration(s)?;
    if timeout.is_zero() {
        return Err("must be greater than 0".into());
    }
    Ok(timeout)
}

/// `--lb-algorithm`: the model's names, listed in `--help`.
fn lb_algorithm() -> impl clap::builder::TypedValueParser<Value = LbAlgorithm> {
    let names = LbAlgorithm::NAMES.map(|(name, _)| name);
    clap::builder::PossibleValuesParser::new(names).map(|name| {
        name.parse::<LbAlgorithm>()
            .expect("a name from LbAlgorithm::NAMES")
    })
}

/// An IPv4 CIDR, like 10.244.0.0/16 (the IPv4 one of a dual-stack pair).
fn parse_cidr(s: &str) -> Result<Cidr, String> {
    s.split(',')
        .map(str::trim)
        .find(|c| !c.contains(':'))
        .ok_or_else(|| format!("{s:?} has no IPv4 CIDR"))?
        .parse()
}

/// kube-proxy's rule: the override, else the hostname, lower-cased.
fn node_name(hostname_override: Option<String>) -> anyhow::Result<String> {
    let name = match hostname_override.or_else(|| std::env::var("NODE_NAME").ok()) {
        Some(name) => name,
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .context("reading the hostname; pass --hostname-override")?,
    };
    let name = name.trim().to_lowercase();
    anyhow::ensure!(
        !name.is_empty(),
        "the node name is empty; pass --hostname-override"
    );
    Ok(name)
}

fn run_inspect(args: InspectArgs) -> anyhow::Result<()> {
    let mode = match args.proxy_mode {
        Some(mode) => mode,
        None => inspect::detect(&args.bpf_pin_dir)?,
    };
    let out = inspect::show(mode, args.what, &args.bpf_pin_dir, args.json)?;
    println!("{}", out.trim_end());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Makes `log_child` log, in the child process `logs_to_a_pipe_are_plain` starts.
    const CHILD_FORMAT: &str = "PROXY_USERSPACE_TEST_LOG_FORMAT";

    #[test]
    fn log_child() {
        let Ok(format) = std::env::var(CHILD_FORMAT) else {
            return;
        };
        init_logging(LoggingFormat::from_str(&format, false).unwrap());
        tracing::warn!(service = "default/web", "test line");
    }

    #[test]
    fn logs_to_a_pipe_are_plain() {
        for format in ["text", "json"] {
            // This test binary again, running only `log_child`, its stderr a pipe.
            let output = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "tests::log_child", "--nocapture"])
                .env(CHILD_FORMAT, format)
                .env("RUST_LOG", "info")
                .env_remove("NO_COLOR")
                .output()
                .unwrap();
            assert!(output.status.success(), "{output:?}");
            let logs = String::from_utf8(output.stderr).unwrap();
            let line = logs
                .lines()
                .find(|l| l.contains("test line"))
                .unwrap_or_else(|| panic!("{format}: no log line in {logs:?}"));
            assert!(!line.contains('\x1b'), "{format}: colour codes in {line:?}");
            if format == "json" {
                let event: serde_json::Value = serde_json::from_str(line).unwrap();
                assert_eq!(event["fields"]["service"], "default/web");
            }
        }
    }
}

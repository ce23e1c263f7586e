use std::{io::IsTerminal, net::IpAddr, path::PathBuf, time::Duration};

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand, ValueEnum, builder::TypedValueParser as _};
use proxy_userspace::{
    agent::{self, AgentConfig, Source},
    dataplane::Dataplane,
    duration::parse_duration,
    inspect, kube_proxy,
    model::{Cidr, Family, LbAlgorithm},
    modes::{
        self, CtLifetimes, Installation, ProxyMode, StartConfig,
        ebpf::{
            self, DEFAULT_PIN_DIR, MapSizes, WriterConfig,
            external::{SnatPorts, XdpMode},
            features::{self, Features},
            maglev,
            pod_interfaces::PodInterfaces,
        },
        ipvs::netlink::Timeouts,
    },
    netfilter::{conntrack_tuning::ConntrackTuning, iptables::Backend},
    node::NodePortAddresses,
    rows::{Rows, What},
};

/// An eBPF dataplane for Kubernetes Services: a drop-in replacement for kube-proxy.
#[derive(Parser)]
// A flag given twice counts once, the last: kube-proxy's --config file becomes flags that the
// command line may give again.
#[command(version, args_override_self = true)]
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

/// `--proxy-mode`: one mode, or `auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ModeFlag {
    Auto,
    Only(ProxyMode),
}

/// `auto`, then every mode, in the registry's order.
const MODE_FLAGS: [ModeFlag; 1 + ProxyMode::ALL.len()] = {
    let mut flags = [ModeFlag::Auto; 1 + ProxyMode::ALL.len()];
    let mut i = 0;
    while i < ProxyMode::ALL.len() {
        flags[i + 1] = ModeFlag::Only(ProxyMode::ALL[i]);
        i += 1;
    }
    flags
};

impl ValueEnum for ModeFlag {
    fn value_variants<'a>() -> &'a [Self] {
        &MODE_FLAGS
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        match self {
            ModeFlag::Auto => {
                let tried: Vec<&str> = ProxyMode::AUTO.iter().map(|m| m.name()).collect();
                Some(clap::builder::PossibleValue::new("auto").help(format!(
                    "The first of {} that starts on this node (each is tried for real: the BPF \
                     programs loaded and, on maps pinned already, attached; the nftables table \
                     written)",
                    tried.join(", ")
                )))
            }
            ModeFlag::Only(mode) => mode.to_possible_value(),
        }
    }
}

#[derive(clap::Args)]
struct AgentArgs {
    /// Which proxy mode to use (kube-proxy's flag).
    #[arg(long, value_enum, default_value = "auto")]
    proxy_mode: ModeFlag,
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
    /// works on unified and hybrid hosts alike). Empty: host-network clients are not served
    /// (and the socket programs are not loaded).
    #[arg(long, default_value = "/run/kube-proxy-ebpf/cgroupv2", value_parser = path_or_empty)]
    bpf_cgroup_path: PathBuf,
    /// Whose connections the socket programs send to an endpoint at connect(), so that their
    /// packets need no NAT: `host-network` clients only, or `all`: pods' TCP connections too
    /// (Cilium's socket LB; a pod's service-mesh sidecar then sees the endpoint, not the
    /// Service). See the README's "Socket load balancing for pods".
    #[arg(long, value_enum, default_value = "host-network")]
    bpf_socket_lb: ebpf::cgroup::SocketLb,
    /// Interfaces facing pods: `auto`, every veth or netkit device of the node that carries no
    /// node address (bridge ports included, whatever the CNI names them), and/or name patterns
    /// (`*` matches any run; comma-separated); `!pattern` excludes. A bridge device never gets
    /// the programs: a pod's packets would meet them twice.
    #[arg(long, default_value = "auto")]
    pod_interfaces: PodInterfaces,
    /// The node addresses NodePorts answer on (kube-proxy's flag): comma-separated CIDRs (every
    /// address of the node within them), or `primary`: the Node object's InternalIP and
    /// ExternalIP (from the API, or a Node in the --manifest file), else the addresses of each
    /// family's default route's interface. Never loopback. The interfaces carrying them get the
    /// external programs.
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
    /// Drop a pod's packets that could start or change a Service flow (a new flow's first, a
    /// TCP SYN, FIN or RST) when their source is not routed back through the pod's interface
    /// or its bridge (a strict rp_filter check), so that a pod cannot close or re-balance
    /// another's connections. `false` for CNIs whose pods send from addresses routed elsewhere.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    bpf_source_validation: bool,
    /// How long an idle established TCP connection stays in conntrack (kube-proxy's flag and
    /// default): the ebpf mode's flows, netfilter's in the other modes (0 leaves netfilter's
    /// as it is; the ebpf mode's default).
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    conntrack_tcp_timeout_established: Duration,
    /// How long an idle TCP connection that one side closed stays in conntrack (kube-proxy's
    /// flag and default, netfilter's CLOSE_WAIT; 0 as above).
    #[arg(long, default_value = "1h", value_parser = parse_duration)]
    conntrack_tcp_timeout_close_wait: Duration,
    /// netfilter's conntrack table size, per CPU (kube-proxy's flag and default): nf_conntrack_max
    /// is raised to this many a CPU, and at least --conntrack-min, in every mode (netfilter
    /// tracks the node's traffic whatever programs the Services); a larger value is kept, and
    /// 0 leaves it. Only the node's own network namespace can raise it.
    #[arg(long, default_value_t = 32768)]
    conntrack_max_per_core: u32,
    /// The least nf_conntrack_max that --conntrack-max-per-core asks for (kube-proxy's flag and
    /// default).
    #[arg(long, default_value_t = 131072)]
    conntrack_min: u32,
    /// netfilter's conntrack does not mark out-of-window TCP packets INVALID (kube-proxy's flag).
    #[arg(long)]
    conntrack_tcp_be_liberal: bool,
    /// netfilter's timeout of UDP flows (kube-proxy's flag); 0 leaves the kernel's.
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    conntrack_udp_timeout: Duration,
    /// netfilter's timeout of UDP flows that saw traffic both ways (kube-proxy's flag); 0
    /// leaves the kernel's.
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    conntrack_udp_timeout_stream: Duration,
    /// How long the ebpf mode keeps a TCP flow that is not yet open (a SYN unanswered, or
    /// answered but never acknowledged): short, so that a SYN flood frees conntrack and SNAT
    /// ports in a minute (Cilium's default).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    bpf_ct_timeout_tcp_syn: Duration,
    /// How long the ebpf mode keeps an idle UDP flow (and its endpoint).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    bpf_ct_timeout_udp: Duration,
    /// Size of the services map (one entry per service port and one per backend of each).
    #[arg(long, default_value_t = MapSizes::default().services)]
    bpf_services_max: u32,
    /// Size of the backends map (one entry per distinct endpoint address, port and protocol).
    #[arg(long, default_value_t = MapSizes::default().backends)]
    bpf_backends_max: u32,
    /// Size of the conntrack map (two entries per flow; the least recently used are evicted).
    #[arg(long, default_value_t = MapSizes::default().conntrack)]
    bpf_ct_max: u32,
    /// Size of the IPv6 conntrack map (two entries per IPv6 flow; preallocated, about 144 bytes
    /// an entry): raise it on IPv6 and dual-stack clusters with many flows.
    #[arg(long, default_value_t = MapSizes::default().conntrack6)]
    bpf_ct6_max: u32,
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
    /// The cluster's pod range, or a dual-stack pair of them (kube-proxy's flag), with the
    /// iptables, nftables and ipvs modes: connections to a cluster IP from outside it are
    /// masqueraded, and pods reaching an externalTrafficPolicy Local frontend get any endpoint.
    /// Empty: neither.
    #[arg(long, value_parser = parse_cluster_cidrs)]
    cluster_cidr: Option<ClusterCidrs>,
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
    /// The agent's OOM score adjustment, -1000 to 1000 (kube-proxy's flag; its default, -999,
    /// is tried when not given): the kernel's OOM killer spares the agent before the pods it
    /// serves. Needs CAP_SYS_RESOURCE, which the DaemonSet leaves out: there the kubelet's
    /// adjustment of a system-node-critical pod (-997) holds.
    #[arg(long, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i32).range(-1000..=1000))]
    oom_score_adj: Option<i32>,
    /// Make the node's conntrack settings (--conntrack-*) and exit (kube-proxy's flag, for an
    /// init container that prepares the node).
    #[arg(long)]
    init_only: bool,
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
    /// The backend named; None for `auto` (each mode detects its own).
    fn named(self) -> Option<Backend> {
        match self {
            IptablesBackend::Auto => None,
            IptablesBackend::Legacy => Some(Backend::Legacy),
            IptablesBackend::Nft => Some(Backend::Nft),
        }
    }
}

#[derive(clap::Args)]
struct InspectArgs {
    #[arg(value_enum)]
    what: Inspected,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Whose state to read; by default the mode installed on this node (in this network
    /// namespace): the ebpf mode's pins in --bpf-pin-dir, else the one mode whose rules are here.
    #[arg(long, value_enum)]
    proxy_mode: Option<ProxyMode>,
    #[arg(long, default_value = DEFAULT_PIN_DIR)]
    bpf_pin_dir: PathBuf,
}

/// What `inspect` prints: a mode's state, or this node's kernel as the ebpf mode sees it.
#[derive(Clone, Copy)]
enum Inspected {
    State(What),
    Features,
}

impl ValueEnum for Inspected {
    fn value_variants<'a>() -> &'a [Self] {
        static ALL: std::sync::OnceLock<Vec<Inspected>> = std::sync::OnceLock::new();
        ALL.get_or_init(|| {
            let states = What::value_variants().iter().copied().map(Inspected::State);
            states.chain([Inspected::Features]).collect()
        })
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        match self {
            Inspected::State(what) => what.to_possible_value(),
            Inspected::Features => Some(clap::builder::PossibleValue::new("features").help(
                "The kernel features the ebpf mode uses, whether this node's kernel has each (probed: \
                 needs CAP_BPF) and what the mode does without it",
            )),
        }
    }
}

fn main() -> anyhow::Result<()> {
    // kube-proxy's command line and --config file become the agent's (kube_proxy.rs).
    let cli = cli_definition();
    let line = kube_proxy::command_line(std::env::args_os().collect(), |name| {
        agent_flag_takes_value(&cli, name)
    })?;
    let cli = Cli::parse_from(&line.args);
    init_logging(cli.logging_format, line.verbosity);
    for warning in &line.warnings {
        tracing::warn!("{warning}");
    }
    match cli.command {
        Command::Agent(args) => run_agent(*args, line.config_file),
        Command::Inspect(args) => run_inspect(args),
    }
}

/// The command line's definition, built (global flags given to the subcommands).
fn cli_definition() -> clap::Command {
    let mut cli = Cli::command();
    cli.build();
    cli
}

/// Whether the agent's flag `name` (long, or a one-letter short one) takes a value; None if the
/// agent has no such flag.
fn agent_flag_takes_value(cli: &clap::Command, name: &str) -> Option<bool> {
    let agent = cli.find_subcommand("agent")?;
    let mut short = name.chars();
    let short = match (short.next(), short.next()) {
        (Some(c), None) => Some(c),
        _ => None,
    };
    agent
        .get_arguments()
        .find(|a| a.get_long() == Some(name) || (short.is_some() && a.get_short() == short))
        .map(|a| a.get_action().takes_values())
}

/// Logs go to stderr, coloured only when it is a terminal: a file, a pipe or a container runtime
/// capturing the output gets plain text. Setting our own colour choice overrides
/// tracing-subscriber's NO_COLOR check, so that check is repeated here. The level is RUST_LOG's,
/// else kube-proxy's `-v` (klog verbosity), else info.
fn init_logging(format: LoggingFormat, verbosity: Option<u32>) {
    let colour = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let level = kube_proxy::log_filter(verbosity.unwrap_or(0));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(colour);
    match format {
        LoggingFormat::Text => logs.init(),
        LoggingFormat::Json => logs.json().init(),
    }
}

fn run_agent(args: AgentArgs, config_file: Option<kube_proxy::ConfigFile>) -> anyhow::Result<()> {
    if args.cleanup {
        return modes::cleanup_all(&Installation::at(&args.bpf_pin_dir));
    }
    let conntrack = ConntrackTuning {
        max_per_core: args.conntrack_max_per_core,
        min: args.conntrack_min,
        tcp_established: args.conntrack_tcp_timeout_established,
        tcp_close_wait: args.conntrack_tcp_timeout_close_wait,
        tcp_be_liberal: args.conntrack_tcp_be_liberal,
        udp: args.conntrack_udp_timeout,
        udp_stream: args.conntrack_udp_timeout_stream,
    };
    if args.init_only {
        // kube-proxy's init container's work: the node's settings, then exit.
        conntrack.apply();
        tracing::info!("--init-only: the node's conntrack settings are made; exiting");
        return Ok(());
    }
    set_oom_score_adj(args.oom_score_adj);
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
        config_file,
    };
    let mut start = start_config(&args);
    if matches!(
        args.proxy_mode,
        ModeFlag::Only(ProxyMode::Ebpf) | ModeFlag::Auto
    ) {
        let prepare = start.ebpf.prepare_config();
        start.ebpf.preload.start(prepare);
    }
    let proxy_mode = args.proxy_mode;
    let make_dataplane = move |node_ips: &[IpAddr]| -> anyhow::Result<Box<dyn Dataplane>> {
        start.node_ips = node_ips.to_vec();
        let (dataplane, mode) = match proxy_mode {
            ModeFlag::Only(mode) => (mode.start(&mut start)?, mode),
            ModeFlag::Auto => start_first(&mut start)?,
        };
        // Once the mode runs: a netfilter mode's rules have loaded conntrack by then.
        conntrack.apply();
        mode.export(match proxy_mode {
            ModeFlag::Auto => "auto",
            ModeFlag::Only(mode) => mode.name(),
        });
        Ok(dataplane)
    };
    runtime.block_on(agent::run(config, make_dataplane))
}

/// `--oom-score-adj`, as kube-proxy sets it (-999 when not given): the kernel's OOM killer
/// spares the agent before the pods it serves. Not being allowed to is not fatal, and said
/// only when it was asked for.
fn set_oom_score_adj(asked: Option<i32>) {
    let adj = asked.unwrap_or(-999);
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", adj.to_string()) {
        match asked {
            Some(_) => {
                tracing::warn!("--oom-score-adj {adj} not set (it needs CAP_SYS_RESOURCE): {e}")
            }
            None => tracing::debug!("kube-proxy's OOM score adjustment {adj} not set: {e}"),
        }
    }
}

/// `--proxy-mode auto`: the first of [`ProxyMode::AUTO`] that starts.
fn start_first(start: &mut StartConfig) -> anyhow::Result<(Box<dyn Dataplane>, ProxyMode)> {
    let mut unavailable = Vec::new();
    for mode in ProxyMode::AUTO {
        match mode.start(start) {
            Ok(dataplane) => {
                tracing::info!(
                    mode = mode.name(),
                    unavailable = ?unavailable,
                    "--proxy-mode auto: using the first mode that works here"
                );
                return Ok((dataplane, mode));
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
}

/// The flags the modes start with (the Node object's addresses come later, from the source).
fn start_config(args: &AgentArgs) -> StartConfig {
    let secs = |d: Duration| u32::try_from(d.as_secs()).unwrap_or(u32::MAX);
    StartConfig {
        node_ips: Vec::new(),
        cluster_cidrs: args.cluster_cidr.clone().map(|c| c.0).unwrap_or_default(),
        masquerade_all: args.masquerade_all,
        node_port_addresses: args.nodeport_addresses.clone(),
        iptables_backend: args.iptables_backend.named(),
        ipvs_scheduler: args.ipvs_scheduler.clone(),
        ipvs_strict_arp: args.ipvs_strict_arp,
        ipvs_exclude_cidrs: args.ipvs_exclude_cidrs.clone(),
        ipvs_timeouts: Timeouts {
            tcp: secs(args.ipvs_tcp_timeout),
            tcp_fin: secs(args.ipvs_tcpfin_timeout),
            udp: secs(args.ipvs_udp_timeout),
        },
        udp_timeout: args.udp_timeout,
        ct_lifetimes: CtLifetimes {
            tcp_established: args.conntrack_tcp_timeout_established,
            tcp_opening: args.bpf_ct_timeout_tcp_syn,
            tcp_half_closed: args.conntrack_tcp_timeout_close_wait,
            udp: args.bpf_ct_timeout_udp,
        },
        ebpf: ebpf::StartConfig {
            pin_dir: args.bpf_pin_dir.clone(),
            sizes: MapSizes {
                services: args.bpf_services_max,
                backends: args.bpf_backends_max,
                conntrack: args.bpf_ct_max,
                conntrack6: args.bpf_ct6_max,
            },
            writer: WriterConfig {
                drain_period: args.bpf_drain_period,
                lb_algorithm: args.lb_algorithm,
                maglev_table_size: args.lb_maglev_table_size,
            },
            pod_interfaces: args.pod_interfaces.clone(),
            xdp_mode: args.xdp_mode,
            snat_ports: args.bpf_snat_port_range,
            validate_sources: args.bpf_source_validation,
            cgroup_path: args.bpf_cgroup_path.clone(),
            socket_lb: args.bpf_socket_lb,
            preload: ebpf::Preload::default(),
            remove_replaced: None,
        },
    }
}

/// A path, or nothing (clap's own path parser refuses an empty value).
fn path_or_empty(s: &str) -> Result<PathBuf, String> {
    Ok(PathBuf::from(s))
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
    let values = LbAlgorithm::NAMES
        .map(|(name, algorithm)| clap::builder::PossibleValue::new(name).help(algorithm.about()));
    clap::builder::PossibleValuesParser::new(values).map(|name| {
        name.parse::<LbAlgorithm>()
            .expect("a name from LbAlgorithm::NAMES")
    })
}

/// A CIDR of either family, like 10.244.0.0/16 or fd00:10:244::/56.
fn parse_cidr(s: &str) -> Result<Cidr, String> {
    s.trim().parse()
}

/// `--cluster-cidr`: a range, or a dual-stack pair (one range a family).
#[derive(Clone, Debug)]
struct ClusterCidrs(Vec<Cidr>);

fn parse_cluster_cidrs(s: &str) -> Result<ClusterCidrs, String> {
    let cidrs: Vec<Cidr> = (s.split(',').map(str::trim).filter(|c| !c.is_empty()))
        .map(parse_cidr)
        .collect::<Result<_, _>>()?;
    for family in Family::ALL {
        if cidrs.iter().filter(|c| c.family() == family).count() > 1 {
            return Err(format!(
                "{s:?} has more than one {family} range: give one range, or a dual-stack pair \
                 (like 10.244.0.0/16,fd00:10:244::/56)"
            ));
        }
    }
    Ok(ClusterCidrs(cidrs))
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
    let rows = match args.what {
        Inspected::Features => Rows::Features(features::rows(Features::of_this_kernel()?)),
        Inspected::State(what) => {
            let at = Installation::at(&args.bpf_pin_dir);
            let mode = match args.proxy_mode {
                Some(mode) => mode,
                None => modes::detect(&at)?,
            };
            mode.inspect(what, &at)?
        }
    };
    let out = inspect::show(&rows, args.json)?;
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
        init_logging(LoggingFormat::from_str(&format, false).unwrap(), None);
        tracing::warn!(service = "default/web", "test line");
    }

    /// kube-proxy's DaemonSet command line with each configuration file of kube_proxy.rs's
    /// tests, as the agent parses it (the golden files there show what it becomes).
    #[test]
    fn kube_proxys_command_lines_parse() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/kube_proxy/testdata");
        let cli = cli_definition();
        let agent = |line: &[String]| {
            let line = kube_proxy::command_line(line.iter().map(Into::into).collect(), |name| {
                agent_flag_takes_value(&cli, name)
            })
            .unwrap();
            match Cli::try_parse_from(&line.args).map(|cli| cli.command) {
                Ok(Command::Agent(args)) => *args,
                Ok(_) => panic!("not the agent command: {line:?}"),
                Err(e) => panic!("{e}: {line:?}"),
            }
        };
        for (file, mode) in [
            ("kubeadm", ModeFlag::Auto),
            ("ipvs", ModeFlag::Only(ProxyMode::Ipvs)),
            ("nftables", ModeFlag::Only(ProxyMode::Nftables)),
        ] {
            let args = agent(&[
                "/usr/local/bin/kube-proxy".into(),
                format!("--config={dir}/{file}.conf"),
                "--hostname-override=node1".into(),
            ]);
            assert_eq!(args.proxy_mode, mode, "{file}");
            assert_eq!(args.hostname_override.as_deref(), Some("node1"), "{file}");
        }
        let ipvs = agent(&["kube-proxy".into(), format!("--config={dir}/ipvs.conf")]);
        assert_eq!(ipvs.ipvs_scheduler, "lc");
        assert!(ipvs.ipvs_strict_arp);
        assert_eq!(ipvs.sync_period, Duration::from_secs(15));
        assert_eq!(
            ipvs.conntrack_tcp_timeout_established,
            Duration::from_secs(7200)
        );
        let nftables = agent(&["kube-proxy".into(), format!("--config={dir}/nftables.conf")]);
        assert!(nftables.masquerade_all);
        assert_eq!(nftables.oom_score_adj, Some(-500));
        assert_eq!(nftables.hostname_override.as_deref(), Some("from-the-file"));
        // The file's setting given again by this agent's own flag: the flag's holds.
        let again = agent(&[
            "kube-proxy".into(),
            format!("--config={dir}/ipvs.conf"),
            "--min-sync-period=0s".into(),
        ]);
        assert_eq!(again.min_sync_period, Duration::ZERO);
        let kubeadm = agent(&["kube-proxy".into(), format!("--config={dir}/kubeadm.conf")]);
        assert_eq!(
            kubeadm.kubeconfig.as_deref(),
            Some(std::path::Path::new("/var/lib/kube-proxy/kubeconfig.conf"))
        );
        assert_eq!(kubeadm.oom_score_adj, None, "kube-proxy's default");
    }

    #[test]
    fn an_empty_cgroup_path_serves_no_host_clients() {
        for args in [
            ["proxy-userspace", "agent", "--bpf-cgroup-path", ""].as_slice(),
            ["proxy-userspace", "agent", "--bpf-cgroup-path="].as_slice(),
        ] {
            let Command::Agent(agent) = Cli::try_parse_from(args).unwrap().command else {
                panic!("not the agent command");
            };
            assert_eq!(agent.bpf_cgroup_path, PathBuf::new(), "{args:?}");
        }
    }

    #[test]
    fn inspect_takes_each_state_and_features() {
        for (arg, want) in [
            ("services", Some(What::Services)),
            ("affinity", Some(What::Affinity)),
            ("features", None),
        ] {
            let cli = Cli::try_parse_from(["proxy-userspace", "inspect", arg]).unwrap();
            let Command::Inspect(args) = cli.command else {
                panic!("not the inspect command");
            };
            let got = match args.what {
                Inspected::State(what) => Some(what),
                Inspected::Features => None,
            };
            assert_eq!(got, want, "{arg}");
        }
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

//! kube-proxy's command line and configuration file, as an operator who swaps kube-proxy's
//! image for this one passes them: the binary answers to the name `kube-proxy` (as if `agent`
//! had been given), `--config` reads a `KubeProxyConfiguration`, every kube-proxy flag is
//! accepted (those without a meaning here with one warning each), and `-v` sets the log level.
//!
//! It all becomes the agent's own command line, which clap then parses: what the file sets is
//! given as the flags of the same meaning, so both are checked and defaulted alike. Precedence
//! is kube-proxy's: with `--config` the file decides, kube-proxy's flags beside it are ignored
//! (with a warning), except the logging ones, `--hostname-override` and the options that are no
//! settings (`--cleanup`, `--init-only`); this agent's own flags (`--manifest`, `--bpf-*`, ...)
//! combine with the file, and `--manifest` replaces the file's API server.
use std::{
    collections::BTreeMap,
    ffi::OsString,
    path::{Path, PathBuf},
};

use anyhow::{Context, bail};
use serde::Deserialize;
use serde_yaml::Value;

/// What becomes of one of kube-proxy's flags here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Meaning {
    /// The agent has it, with kube-proxy's meaning.
    Same,
    /// `--iptables-sync-period` and its kind: the sync periods of the mode named (`ipvs` or
    /// any other), the agent's `--sync-period` / `--min-sync-period` when that mode runs.
    SyncPeriod { ipvs: bool, min: bool },
    /// Accepted and ignored, with this reason.
    Nothing(&'static str),
}

use Meaning::{Nothing, Same, SyncPeriod};

const LOGS: &str = "klog's output settings: logs go to stderr, formatted by --logging-format";
const API: &str = "the API client's settings: kube-rs's defaults apply";
const LOCAL: &str = "pods are told apart by --cluster-cidr (or, in the ebpf mode, by their \
                     interfaces)";
const DEBUG: &str = "no profiling or hidden metrics here";

/// kube-proxy's flags (v1.32): name, whether it takes a value, and what it means here.
#[rustfmt::skip]
const KUBE_PROXY_FLAGS: &[(&str, bool, Meaning)] = &[
    ("add_dir_header", false, Nothing(LOGS)),
    ("alsologtostderr", false, Nothing(LOGS)),
    ("bind-address", true, Nothing("the address kube-proxy's servers bind without a port: \
        --healthz-bind-address and --metrics-bind-address say where this agent's serve")),
    ("bind-address-hard-fail", false, Nothing("a failure to serve the health or metrics \
        port is always logged and retried")),
    ("boot_id_file", true, Nothing(LOGS)),
    ("cleanup", false, Same),
    ("cluster-cidr", true, Same),
    ("config-sync-period", true, Nothing("the watches never resynchronise from a cache")),
    ("conntrack-max-per-core", true, Same),
    ("conntrack-min", true, Same),
    ("conntrack-tcp-be-liberal", false, Same),
    ("conntrack-tcp-timeout-close-wait", true, Same),
    ("conntrack-tcp-timeout-established", true, Same),
    ("conntrack-udp-timeout", true, Same),
    ("conntrack-udp-timeout-stream", true, Same),
    ("detect-local-mode", true, Nothing(LOCAL)),
    ("feature-gates", true, Nothing("kube-proxy's feature gates select behaviour this agent \
        has always, or does not have")),
    ("healthz-bind-address", true, Same),
    ("healthz-port", true, Nothing("the port is part of --healthz-bind-address")),
    ("hostname-override", true, Same),
    ("init-only", false, Same),
    ("iptables-localhost-nodeports", false, Nothing("NodePorts are never served on \
        127.0.0.1 (CVE-2020-8558)")),
    ("iptables-masquerade-bit", true, Nothing("the masquerade mark is kube-proxy's default, \
        0x4000")),
    ("iptables-min-sync-period", true, SyncPeriod { ipvs: false, min: true }),
    ("iptables-sync-period", true, SyncPeriod { ipvs: false, min: false }),
    ("ipvs-exclude-cidrs", true, Same),
    ("ipvs-min-sync-period", true, SyncPeriod { ipvs: true, min: true }),
    ("ipvs-scheduler", true, Same),
    ("ipvs-strict-arp", false, Same),
    ("ipvs-sync-period", true, SyncPeriod { ipvs: true, min: false }),
    ("ipvs-tcp-timeout", true, Same),
    ("ipvs-tcpfin-timeout", true, Same),
    ("ipvs-udp-timeout", true, Same),
    ("kube-api-burst", true, Nothing(API)),
    ("kube-api-content-type", true, Nothing(API)),
    ("kube-api-qps", true, Nothing(API)),
    ("kubeconfig", true, Same),
    ("log-flush-frequency", true, Nothing(LOGS)),
    ("log-json-info-buffer-size", true, Nothing(LOGS)),
    ("log-json-split-stream", false, Nothing(LOGS)),
    ("log-text-info-buffer-size", true, Nothing(LOGS)),
    ("log-text-split-stream", false, Nothing(LOGS)),
    ("log_backtrace_at", true, Nothing(LOGS)),
    ("log_dir", true, Nothing(LOGS)),
    ("log_file", true, Nothing(LOGS)),
    ("log_file_max_size", true, Nothing(LOGS)),
    ("logging-format", true, Same),
    ("logtostderr", false, Nothing(LOGS)),
    ("masquerade-all", false, Same),
    ("master", true, Nothing("the API server is the kubeconfig's (or the pod's service \
        account's)")),
    ("metrics-bind-address", true, Same),
    ("metrics-port", true, Nothing("the port is part of --metrics-bind-address")),
    ("nodeport-addresses", true, Same),
    ("one_output", false, Nothing(LOGS)),
    ("oom-score-adj", true, Same),
    ("pod-bridge-interface", true, Nothing(LOCAL)),
    ("pod-interface-name-prefix", true, Nothing(LOCAL)),
    ("profiling", false, Nothing(DEBUG)),
    ("proxy-mode", true, Same),
    ("proxy-port-range", true, Nothing("the userspace mode's proxy ports are chosen by the \
        kernel")),
    ("show-hidden-metrics-for-version", true, Nothing(DEBUG)),
    ("skip_headers", false, Nothing(LOGS)),
    ("skip_log_headers", false, Nothing(LOGS)),
    ("stderrthreshold", true, Nothing(LOGS)),
    ("vmodule", true, Nothing(LOGS)),
    ("write-config-to", true, Nothing("there is no default configuration file to write: \
        the flags' defaults are the README's")),
];

fn kube_proxy_flag(name: &str) -> Option<(bool, Meaning)> {
    KUBE_PROXY_FLAGS
        .iter()
        .find(|(n, ..)| *n == name)
        .map(|&(_, value, meaning)| (value, meaning))
}

/// The agent's command line, ready for clap, and what to say about how it was made.
#[derive(Debug, Default, PartialEq)]
pub struct CommandLine {
    pub args: Vec<OsString>,
    /// What was accepted without effect, or overridden: one warning each.
    pub warnings: Vec<String>,
    /// `-v`: klog's verbosity (0 info, 4 debug, 6 and up trace), for when RUST_LOG is unset.
    pub verbosity: Option<u32>,
    /// `--config`: the file the agent must restart for when it changes (as kube-proxy does).
    pub config_file: Option<ConfigFile>,
}

/// The `--config` file and what it held when it was read.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ConfigFile {
    pub path: PathBuf,
    pub content: Vec<u8>,
}

/// A flag as given: its name, its value (inline after `=`, or the next argument), and the
/// arguments it was given as.
struct Flag {
    name: String,
    value: Option<String>,
    raw: Vec<OsString>,
}

/// One argument after `agent`: a flag, or anything else (kept as it is).
enum Arg {
    Flag(Flag),
    Other(OsString),
}

/// Turns the process's arguments into the agent's: `agent_takes_value(name)` says whether the
/// agent's own flag `name` takes a value (None: the agent has no such flag).
pub fn command_line(
    argv: Vec<OsString>,
    agent_takes_value: impl Fn(&str) -> Option<bool>,
) -> anyhow::Result<CommandLine> {
    let mut argv = argv.into_iter();
    let program = argv.next().unwrap_or_else(|| "kube-proxy".into());
    let mut rest: Vec<OsString> = argv.collect();
    let named_kube_proxy = Path::new(&program)
        .file_name()
        .is_some_and(|name| name == "kube-proxy");
    let subcommand = rest.first().and_then(|a| a.to_str());
    let root_flag = matches!(subcommand, Some("--version" | "-V" | "--help" | "-h"));
    if named_kube_proxy && !root_flag && !matches!(subcommand, Some("agent" | "inspect" | "help")) {
        rest.insert(0, "agent".into());
    }
    let mut out = CommandLine::default();
    if rest.first().and_then(|a| a.to_str()) != Some("agent") {
        out.args = std::iter::once(program).chain(rest).collect();
        return Ok(out);
    }
    let args = split(&rest[1..], &agent_takes_value)?;
    let mut kept = Vec::new();
    let mut sync_periods = Vec::new();
    let mut config_path = None;
    for arg in args {
        let flag = match arg {
            Arg::Flag(flag) => flag,
            Arg::Other(other) => {
                kept.push(Arg::Other(other));
                continue;
            }
        };
        match (flag.name.as_str(), kube_proxy_flag(&flag.name)) {
            ("v", _) => {
                let value = flag.value.unwrap_or_default();
                out.verbosity = Some(value.parse().with_context(|| {
                    format!("-v={value}: the log verbosity is a number (0 info, 4 debug)")
                })?);
            }
            ("config", _) => {
                let value = flag.value.context("--config needs a file")?;
                config_path = Some(PathBuf::from(value));
            }
            ("write-config-to", _) => bail!(
                "--write-config-to: this agent has no configuration file of its own to write (its \
                 flags' defaults are kube-proxy's where they share a meaning; see the README)"
            ),
            (_, Some((_, SyncPeriod { ipvs, min }))) => sync_periods.push((ipvs, min, flag)),
            (name, Some((_, Nothing(why)))) => out.warnings.push(format!(
                "--{name} is kube-proxy's and has no effect here: {why}"
            )),
            _ => kept.push(Arg::Flag(flag)),
        }
    }
    let mut file_flags = Vec::new();
    if let Some(path) = config_path {
        let content = std::fs::read(&path)
            .with_context(|| format!("cannot read the --config file {}", path.display()))?;
        let config = KubeProxyConfiguration::parse(&String::from_utf8_lossy(&content))
            .with_context(|| format!("the --config file {}", path.display()))?;
        out.config_file = Some(ConfigFile { path, content });
        file_flags = config.flags(&mut out.warnings);
        // -v on the command line wins over the file's (kube-proxy's rule for logging).
        out.verbosity = out.verbosity.or(config.verbosity()).filter(|v| *v > 0);
        let given_on_command_line = |name: &str| {
            kept.iter()
                .any(|a| matches!(a, Arg::Flag(f) if f.name == name))
        };
        // The command line's --hostname-override wins over the file's (kube-proxy's rule), and
        // --manifest is the source instead of the file's API server.
        for (given, from_file) in [
            ("hostname-override", "hostname-override"),
            ("logging-format", "logging-format"),
            ("manifest", "kubeconfig"),
        ] {
            if given_on_command_line(given) {
                file_flags.retain(|(name, _)| name != from_file);
            }
        }
        kept.retain(|arg| match arg {
            Arg::Flag(f) if is_kube_proxys(&f.name) && !COMMAND_ONLY.contains(&f.name.as_str()) => {
                out.warnings.push(format!(
                    "--{} is ignored: with --config, kube-proxy's settings come from the file \
                     (as kube-proxy takes them); set it there",
                    f.name
                ));
                false
            }
            _ => true,
        });
        for (_, _, flag) in sync_periods.drain(..) {
            out.warnings.push(format!(
                "--{} is ignored: with --config, the sync periods come from the file",
                flag.name
            ));
        }
    }
    // The mode's own sync periods, as kube-proxy picks them.
    let mode = file_flags
        .iter()
        .rev()
        .find(|(name, _)| name == "proxy-mode")
        .map(|(_, v)| v.clone())
        .or_else(|| {
            kept.iter().rev().find_map(|a| match a {
                Arg::Flag(f) if f.name == "proxy-mode" => f.value.clone(),
                _ => None,
            })
        });
    let ipvs_mode = mode.as_deref() == Some("ipvs");
    for (ipvs, min, flag) in sync_periods {
        if ipvs != ipvs_mode {
            out.warnings.push(format!(
                "--{} is ignored: it is for the {} mode",
                flag.name,
                if ipvs {
                    "ipvs"
                } else {
                    "iptables and nftables"
                }
            ));
            continue;
        }
        let ours = if min {
            "min-sync-period"
        } else {
            "sync-period"
        };
        let value = flag
            .value
            .with_context(|| format!("--{} needs a value", flag.name))?;
        file_flags.push((ours.to_owned(), value));
    }
    // The file's flags (and the mode's sync periods) first: one given again later on the
    // command line wins (clap takes the last).
    out.args = vec![program, "agent".into()];
    for (name, value) in file_flags {
        let raw = vec![OsString::from(format!("--{name}={value}"))];
        out.args.extend(as_agent_takes_it(
            &name,
            Some(value),
            raw,
            &agent_takes_value,
        )?);
    }
    for arg in kept {
        match arg {
            Arg::Flag(flag) => out.args.extend(as_agent_takes_it(
                &flag.name,
                flag.value,
                flag.raw,
                &agent_takes_value,
            )?),
            Arg::Other(other) => out.args.push(other),
        }
    }
    Ok(out)
}

/// A flag as the agent takes it: a switch of the agent's given a value in Go's way
/// (`--masquerade-all=true`) is given as the bare switch, or not at all when false.
fn as_agent_takes_it(
    name: &str,
    value: Option<String>,
    raw: Vec<OsString>,
    agent_takes_value: &impl Fn(&str) -> Option<bool>,
) -> anyhow::Result<Vec<OsString>> {
    if agent_takes_value(name) != Some(false) {
        return Ok(raw);
    }
    let Some(value) = value else {
        return Ok(raw);
    };
    match value.as_str() {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(vec![format!("--{name}").into()]),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(Vec::new()),
        _ => bail!("--{name}={value}: not true or false"),
    }
}

/// kube-proxy's flags that hold beside `--config` (kube-proxy's options that are not in the
/// file, the logging flags, and `--hostname-override`, which wins over the file's).
const COMMAND_ONLY: &[&str] = &[
    "hostname-override",
    "cleanup",
    "init-only",
    "logging-format",
];

/// Whether `name` is one of kube-proxy's flags (this agent's own ones are not).
fn is_kube_proxys(name: &str) -> bool {
    kube_proxy_flag(name).is_some()
}

/// The arguments after `agent`, as flags (Go's forms: `--name`, `--name=value`, `--name value`
/// for flags that take one, and the same with one dash) and other arguments.
fn split(
    args: &[OsString],
    agent_takes_value: &impl Fn(&str) -> Option<bool>,
) -> anyhow::Result<Vec<Arg>> {
    let mut out = Vec::new();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let Some(text) = arg.to_str().filter(|t| t.starts_with('-') && t.len() > 1) else {
            out.push(Arg::Other(arg.clone()));
            continue;
        };
        if text == "--" {
            out.push(Arg::Other(arg.clone()));
            out.extend(args.by_ref().cloned().map(Arg::Other));
            break;
        }
        let body = text.trim_start_matches('-');
        let (name, inline) = match body.split_once('=') {
            Some((name, value)) => (name, Some(value.to_owned())),
            None => (body, None),
        };
        // The agent's own flags first: clap knows them (and their short forms).
        let takes_value = match name {
            "v" | "config" => Some(true),
            _ => agent_takes_value(name).or_else(|| kube_proxy_flag(name).map(|(v, _)| v)),
        };
        let Some(takes_value) = takes_value else {
            // Unknown to both: clap says so.
            out.push(Arg::Other(arg.clone()));
            continue;
        };
        // Go's single-dash long form (`-proxy-mode=ipvs`) given as clap takes it.
        let single_dash_long = !text.starts_with("--") && name.len() > 1;
        let mut raw = vec![match single_dash_long {
            true => OsString::from(format!("-{text}")),
            false => arg.clone(),
        }];
        let value = match inline {
            Some(value) => Some(value),
            None if takes_value => {
                let next = args
                    .next()
                    .with_context(|| format!("--{name} needs a value"))?;
                raw.push(next.clone());
                Some(next.to_string_lossy().into_owned())
            }
            None => None,
        };
        out.push(Arg::Flag(Flag {
            name: name.to_owned(),
            value,
            raw,
        }));
    }
    Ok(out)
}

/// kube-proxy's configuration file (`kubeproxy.config.k8s.io/v1alpha1`): the fields that mean
/// something here; every other one is kept to be named in a warning when it is set.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    api_version: Option<String>,
    kind: Option<String>,
    mode: Option<String>,
    client_connection: Option<ClientConnection>,
    hostname_override: Option<String>,
    healthz_bind_address: Option<String>,
    metrics_bind_address: Option<String>,
    #[serde(rename = "clusterCIDR")]
    cluster_cidr: Option<String>,
    node_port_addresses: Option<Vec<String>>,
    sync_period: Option<String>,
    min_sync_period: Option<String>,
    iptables: Option<NetfilterSection>,
    nftables: Option<NetfilterSection>,
    ipvs: Option<IpvsSection>,
    conntrack: Option<ConntrackSection>,
    logging: Option<LoggingSection>,
    oom_score_adj: Option<i32>,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ClientConnection {
    kubeconfig: Option<String>,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NetfilterSection {
    masquerade_all: Option<bool>,
    sync_period: Option<String>,
    min_sync_period: Option<String>,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct IpvsSection {
    scheduler: Option<String>,
    #[serde(rename = "strictARP")]
    strict_arp: Option<bool>,
    #[serde(rename = "excludeCIDRs")]
    exclude_cidrs: Option<Vec<String>>,
    tcp_timeout: Option<String>,
    tcp_fin_timeout: Option<String>,
    udp_timeout: Option<String>,
    sync_period: Option<String>,
    min_sync_period: Option<String>,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ConntrackSection {
    max_per_core: Option<u32>,
    min: Option<u32>,
    tcp_established_timeout: Option<String>,
    tcp_close_wait_timeout: Option<String>,
    tcp_be_liberal: Option<bool>,
    udp_timeout: Option<String>,
    udp_stream_timeout: Option<String>,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct LoggingSection {
    format: Option<String>,
    verbosity: Option<u32>,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";

impl KubeProxyConfiguration {
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let config: Self = serde_yaml::from_str(text)
            .context("not a KubeProxyConfiguration (kube-proxy's configuration file)")?;
        if config.kind.as_deref() != Some("KubeProxyConfiguration")
            || config.api_version.as_deref() != Some(API_VERSION)
        {
            bail!(
                "kind {:?}, apiVersion {:?}: expected KubeProxyConfiguration, {API_VERSION}",
                config.kind.as_deref().unwrap_or(""),
                config.api_version.as_deref().unwrap_or("")
            );
        }
        Ok(config)
    }

    /// The agent's flags (name, value) that say what the file says. A field left at its zero
    /// value (kube-proxy's "default": `""`, `0s`, `null`) gives none; a field set that has no
    /// meaning here gives a warning.
    pub fn flags(&self, warnings: &mut Vec<String>) -> Vec<(String, String)> {
        let mut flags = Vec::new();
        let mut set = |name: &str, value: Option<String>| {
            if let Some(value) = value.filter(|v| !is_zero(v)) {
                flags.push((name.to_owned(), value));
            }
        };
        set(
            "proxy-mode",
            self.mode.clone().map(|m| match m.as_str() {
                // kube-proxy's default mode, left to this agent's.
                "" => String::new(),
                _ => m,
            }),
        );
        let client = self.client_connection.as_ref();
        set("kubeconfig", client.and_then(|c| c.kubeconfig.clone()));
        set("hostname-override", self.hostname_override.clone());
        // kube-proxy takes an address without a port as on its default port.
        let with_port = |address: &Option<String>, port: u16| {
            address
                .as_deref()
                .map(|a| match a.parse::<std::net::IpAddr>() {
                    Ok(ip) => std::net::SocketAddr::new(ip, port).to_string(),
                    Err(_) => a.to_owned(),
                })
        };
        set(
            "healthz-bind-address",
            with_port(&self.healthz_bind_address, 10256),
        );
        set(
            "metrics-bind-address",
            with_port(&self.metrics_bind_address, 10249),
        );
        if let Some(cidrs) = &self.cluster_cidr {
            // One range a family, as the flag takes them (a dual-stack pair).
            let (v4, v6): (Vec<&str>, Vec<&str>) = cidrs
                .split(',')
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .partition(|c| !c.contains(':'));
            for (family, listed) in [("IPv4", &v4), ("IPv6", &v6)] {
                if listed.len() > 1 {
                    warnings.push(format!(
                        "clusterCIDR: one {family} range is used, {}; the others are left out",
                        listed[0]
                    ));
                }
            }
            let pair: Vec<&str> = v4.first().into_iter().chain(v6.first()).copied().collect();
            set(
                "cluster-cidr",
                Some(pair.join(",")).filter(|p| !p.is_empty()),
            );
        }
        set(
            "nodeport-addresses",
            self.node_port_addresses.as_ref().map(|a| a.join(",")),
        );
        let ipvs = self.ipvs.as_ref();
        // The running mode's section's sync periods, unless the top-level fields (newer
        // kube-proxy's) are set.
        let netfilter = |s: Option<&NetfilterSection>| {
            (
                s.and_then(|s| s.sync_period.clone()),
                s.and_then(|s| s.min_sync_period.clone()),
            )
        };
        let (sync, min_sync) = match self.mode.as_deref() {
            Some("ipvs") => (
                ipvs.and_then(|s| s.sync_period.clone()),
                ipvs.and_then(|s| s.min_sync_period.clone()),
            ),
            Some("nftables") => netfilter(self.nftables.as_ref()),
            _ => netfilter(self.iptables.as_ref()),
        };
        set(
            "sync-period",
            self.sync_period.clone().filter(|v| !is_zero(v)).or(sync),
        );
        set(
            "min-sync-period",
            self.min_sync_period
                .clone()
                .filter(|v| !is_zero(v))
                .or(min_sync),
        );
        // The running mode's (the iptables section's also for ipvs, as kube-proxy reads it).
        let masquerade_all = match self.mode.as_deref() {
            Some("nftables") => self.nftables.as_ref(),
            _ => self.iptables.as_ref(),
        }
        .is_some_and(|s| s.masquerade_all == Some(true));
        set("masquerade-all", masquerade_all.then(|| "true".to_owned()));
        set("ipvs-scheduler", ipvs.and_then(|s| s.scheduler.clone()));
        set(
            "ipvs-strict-arp",
            ipvs.and_then(|s| s.strict_arp)
                .filter(|s| *s)
                .map(|_| "true".to_owned()),
        );
        set(
            "ipvs-exclude-cidrs",
            ipvs.and_then(|s| s.exclude_cidrs.as_ref())
                .map(|c| c.join(",")),
        );
        set("ipvs-tcp-timeout", ipvs.and_then(|s| s.tcp_timeout.clone()));
        set(
            "ipvs-tcpfin-timeout",
            ipvs.and_then(|s| s.tcp_fin_timeout.clone()),
        );
        set("ipvs-udp-timeout", ipvs.and_then(|s| s.udp_timeout.clone()));
        let conntrack = self.conntrack.as_ref();
        set(
            "conntrack-tcp-be-liberal",
            conntrack
                .and_then(|c| c.tcp_be_liberal)
                .filter(|l| *l)
                .map(|_| "true".to_owned()),
        );
        set(
            "conntrack-udp-timeout",
            conntrack.and_then(|c| c.udp_timeout.clone()),
        );
        set(
            "conntrack-udp-timeout-stream",
            conntrack.and_then(|c| c.udp_stream_timeout.clone()),
        );
        let logging = self.logging.as_ref();
        set("logging-format", logging.and_then(|l| l.format.clone()));
        // Fields where null is kube-proxy's default and 0 a value (left as the kernel has it,
        // an adjustment of 0).
        let exact = [
            (
                "conntrack-max-per-core",
                conntrack
                    .and_then(|c| c.max_per_core)
                    .map(|n| n.to_string()),
            ),
            (
                "conntrack-min",
                conntrack.and_then(|c| c.min).map(|n| n.to_string()),
            ),
            (
                "conntrack-tcp-timeout-established",
                conntrack.and_then(|c| c.tcp_established_timeout.clone()),
            ),
            (
                "conntrack-tcp-timeout-close-wait",
                conntrack.and_then(|c| c.tcp_close_wait_timeout.clone()),
            ),
            ("oom-score-adj", self.oom_score_adj.map(|a| a.to_string())),
        ];
        for (name, value) in exact {
            if let Some(value) = value {
                flags.push((name.to_owned(), value));
            }
        }
        // What is set and means nothing here.
        let sections: [(&str, Option<&BTreeMap<String, Value>>); 7] = [
            ("", Some(&self.other)),
            ("clientConnection.", client.map(|c| &c.other)),
            ("iptables.", self.iptables.as_ref().map(|s| &s.other)),
            ("nftables.", self.nftables.as_ref().map(|s| &s.other)),
            ("ipvs.", ipvs.map(|s| &s.other)),
            ("conntrack.", conntrack.map(|s| &s.other)),
            ("logging.", logging.map(|s| &s.other)),
        ];
        for (prefix, fields) in sections {
            for (name, value) in fields.into_iter().flatten() {
                // kube-proxy's default, which kubeadm writes out.
                let default =
                    prefix.is_empty() && name == "bindAddress" && value.as_str() == Some("0.0.0.0");
                if !is_zero_value(value) && !default {
                    warnings.push(format!(
                        "{prefix}{name} in the --config file has no effect here"
                    ));
                }
            }
        }
        flags
    }

    /// `logging.verbosity`.
    pub fn verbosity(&self) -> Option<u32> {
        self.logging.as_ref()?.verbosity
    }
}

/// A scalar kube-proxy reads as "not set".
fn is_zero(value: &str) -> bool {
    matches!(value, "" | "0" | "0s")
}

/// A field value kube-proxy reads as "not set": null, empty, zero, false, or a map of those.
fn is_zero_value(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => is_zero(s),
        Value::Sequence(items) => items.is_empty(),
        Value::Mapping(fields) => fields.values().all(is_zero_value),
        Value::Tagged(tagged) => is_zero_value(&tagged.value),
    }
}

/// The log filter klog's verbosity `v` stands for: kube-proxy logs its syncs at 2 and what
/// each sync writes at 4 and up.
pub fn log_filter(v: u32) -> &'static str {
    match v {
        0..=3 => "info",
        4..=5 => "debug",
        _ => "trace",
    }
}

/// Returns (an error saying so) once the content of the `--config` file differs from what was
/// read at start: the agent then exits, as kube-proxy does, and its DaemonSet starts it again
/// with the new file (a ConfigMap volume's atomic update included). Also returns an error if
/// it cannot watch.
pub async fn changed(file: &ConfigFile) -> anyhow::Result<()> {
    use crate::source::file::{concerns, settle, watched_dir};
    use notify::{RecursiveMode, Watcher};

    let path = &file.path;
    let file_name = path
        .file_name()
        .with_context(|| format!("--config {} does not name a file", path.display()))?
        .to_owned();
    let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |event| {
        let _ = events_tx.send(event);
    })
    .context("creating a watcher for the --config file")?;
    let dir = watched_dir(path);
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .with_context(|| format!("watching {} for changes to --config", dir.display()))?;
    // Compared first, for a change made before the watch began; then after each event.
    loop {
        if std::fs::read(path).ok().as_ref() != Some(&file.content) {
            bail!(
                "the --config file {} changed: exiting so that the agent starts again with it \
                 (as kube-proxy does)",
                path.display()
            );
        }
        loop {
            let event = events
                .recv()
                .await
                .context("the --config file's watcher stopped")?;
            if concerns(&event, &file_name) {
                break;
            }
        }
        settle(&mut events).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The agent's own flags the tests use (clap knows them all; main.rs checks the results
    /// parse), and its switches.
    fn agent_takes_value(name: &str) -> Option<bool> {
        match name {
            "manifest" | "bpf-pin-dir" | "sync-period" | "min-sync-period" => Some(true),
            "masquerade-all" | "ipvs-strict-arp" | "cleanup" | "init-only" | "h" => Some(false),
            _ => kube_proxy_flag(name).map(|(value, _)| value),
        }
    }

    fn args(line: &[&str]) -> Vec<OsString> {
        line.iter().map(OsString::from).collect()
    }

    /// What a command line becomes, as the golden files show it.
    fn shown(line: &CommandLine) -> String {
        let mut out = String::from("args:\n");
        for arg in &line.args[1..] {
            out += &format!("  {}\n", arg.to_string_lossy());
        }
        out += "warnings:\n";
        for warning in &line.warnings {
            out += &format!("  {warning}\n");
        }
        out += &format!("verbosity: {:?}\n", line.verbosity);
        out
    }

    fn testdata(name: &str) -> String {
        format!(
            "{}/src/kube_proxy/testdata/{name}",
            env!("CARGO_MANIFEST_DIR")
        )
    }

    /// kube-proxy's DaemonSet command line (kubeadm's) with each configuration file, under
    /// the name `kube-proxy`, with one of this agent's own flags beside it.
    #[test]
    fn kube_proxys_daemonset_command_line_and_config_files() {
        for name in ["kubeadm", "ipvs", "nftables"] {
            let config = testdata(&format!("{name}.conf"));
            let line = command_line(
                args(&[
                    "/usr/local/bin/kube-proxy",
                    &format!("--config={config}"),
                    "--hostname-override=node1",
                    "--manifest",
                    "/etc/services.yaml",
                ]),
                agent_takes_value,
            )
            .unwrap();
            assert_eq!(
                line.config_file.as_ref().map(|f| f.path.as_path()),
                Some(Path::new(&config))
            );
            crate::testing::golden("kube_proxy", &format!("{name}.golden"), &shown(&line));
        }
    }

    /// Without --config: kube-proxy's flags as kube-proxy takes them, those without a meaning
    /// here with a warning each, the sync period of the mode that runs.
    #[test]
    fn kube_proxys_flags_alone() {
        let line = command_line(
            args(&[
                "proxy-userspace",
                "agent",
                "--v=2",
                "--proxy-mode",
                "iptables",
                "--iptables-sync-period=10s",
                "--ipvs-sync-period",
                "20s",
                "--conntrack-max-per-core=0",
                "--detect-local-mode=NodeCIDR",
                "--masquerade-all=true",
                "--profiling",
                "-h",
            ]),
            agent_takes_value,
        )
        .unwrap();
        assert_eq!(
            line.args,
            args(&[
                "proxy-userspace",
                "agent",
                "--sync-period=10s",
                "--proxy-mode",
                "iptables",
                "--conntrack-max-per-core=0",
                "--masquerade-all",
                "-h",
            ])
        );
        assert_eq!(line.verbosity, Some(2));
        assert_eq!(line.warnings.len(), 3, "{:?}", line.warnings);
        // `inspect` and the agent's own command lines are left alone.
        let inspect = args(&["proxy-userspace", "inspect", "services", "--v=2"]);
        assert_eq!(
            command_line(inspect.clone(), agent_takes_value)
                .unwrap()
                .args,
            inspect
        );
    }

    /// With --config, kube-proxy's flags beside it give way to the file (but
    /// --hostname-override and -v), with a warning each.
    #[test]
    fn the_config_file_wins_over_kube_proxys_flags() {
        let config = testdata("nftables.conf");
        let line = command_line(
            args(&[
                "kube-proxy",
                "--config",
                &config,
                "--proxy-mode=iptables",
                "--hostname-override=node1",
                "--iptables-sync-period=5s",
                "-v",
                "5",
            ]),
            agent_takes_value,
        )
        .unwrap();
        let given: Vec<String> = line
            .args
            .iter()
            .map(|a| a.to_string_lossy().into())
            .collect();
        assert!(
            given.contains(&"--proxy-mode=nftables".to_owned()),
            "{given:?}"
        );
        assert!(
            !given.contains(&"--proxy-mode=iptables".to_owned()),
            "{given:?}"
        );
        assert!(
            given.contains(&"--hostname-override=node1".to_owned()),
            "{given:?}"
        );
        assert!(
            !given.iter().any(|a| a.contains("from-the-file")),
            "{given:?}"
        );
        assert!(!given.iter().any(|a| a.contains("5s")), "{given:?}");
        assert_eq!(line.verbosity, Some(5));
        assert!(
            line.warnings
                .iter()
                .any(|w| w.starts_with("--proxy-mode is ignored"))
        );
    }

    /// kube-proxy's readings that differ from "zero is the default": bind addresses without a
    /// port, zeros that mean "leave the kernel's", the running mode's masquerade setting.
    #[test]
    fn kube_proxys_defaults_and_zeros() {
        let config = KubeProxyConfiguration::parse(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
healthzBindAddress: 0.0.0.0
metricsBindAddress: '::'
clusterCIDR: 10.244.0.0/16,10.245.0.0/16
conntrack: {maxPerCore: 0, min: null, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: null}
oomScoreAdj: 0
iptables: {masqueradeAll: true}
",
        )
        .unwrap();
        let mut warnings = Vec::new();
        let flags = config.flags(&mut warnings);
        let flags: Vec<String> = flags.iter().map(|(n, v)| format!("--{n}={v}")).collect();
        assert_eq!(
            flags,
            [
                "--proxy-mode=nftables",
                "--healthz-bind-address=0.0.0.0:10256",
                "--metrics-bind-address=[::]:10249",
                "--cluster-cidr=10.244.0.0/16",
                "--conntrack-max-per-core=0",
                "--conntrack-tcp-timeout-established=0s",
                "--oom-score-adj=0",
            ]
        );
        assert_eq!(warnings.len(), 1, "{warnings:?}");
    }

    /// Go's flag forms and kube-proxy's root flags under the name kube-proxy.
    #[test]
    fn go_flag_forms() {
        let line = command_line(
            args(&["kube-proxy", "-proxy-mode=ipvs", "-v", "3"]),
            agent_takes_value,
        )
        .unwrap();
        assert_eq!(
            line.args,
            args(&["kube-proxy", "agent", "--proxy-mode=ipvs"])
        );
        assert_eq!(line.verbosity, Some(3));
        let version = args(&["kube-proxy", "--version"]);
        assert_eq!(
            command_line(version.clone(), agent_takes_value)
                .unwrap()
                .args,
            version
        );
        let e = command_line(
            args(&["kube-proxy", "--write-config-to=/tmp/x"]),
            agent_takes_value,
        )
        .unwrap_err();
        assert!(
            format!("{e:#}").contains("no configuration file of its own"),
            "{e:#}"
        );
        // A flag after `--` is nobody's: what kube-proxy's flags become goes before it.
        let line = command_line(
            args(&["kube-proxy", "--iptables-sync-period=5s", "--", "x"]),
            agent_takes_value,
        )
        .unwrap();
        assert_eq!(
            line.args,
            args(&["kube-proxy", "agent", "--sync-period=5s", "--", "x"])
        );
    }

    #[test]
    fn what_is_not_a_kube_proxy_configuration_is_refused() {
        let wrong = "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n";
        let e = KubeProxyConfiguration::parse(wrong).unwrap_err();
        assert!(
            format!("{e:#}").contains("expected KubeProxyConfiguration"),
            "{e:#}"
        );
        assert!(KubeProxyConfiguration::parse("mode: [").is_err());
        let e = command_line(args(&["kube-proxy", "--v=loud"]), agent_takes_value).unwrap_err();
        assert!(format!("{e:#}").contains("verbosity"), "{e:#}");
        let e = command_line(
            args(&["kube-proxy", "--config=/nonexistent/config.conf"]),
            agent_takes_value,
        )
        .unwrap_err();
        assert!(
            format!("{e:#}").contains("cannot read the --config file"),
            "{e:#}"
        );
    }
}

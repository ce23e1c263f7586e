//! The flows of the netfilter modes: the kernel's conntrack table (`conntrack -L -o extended`,
//! one flow a line, `key=value` words: the original tuple, then the reply tuple), reduced to
//! the flows sent to a Service frontend and translated there.
use std::{collections::HashMap, net::SocketAddrV4};

use crate::rows::{ConntrackRow, ServiceRow, protocol};

/// One direction of a flow.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Tuple {
    src: String,
    dst: String,
    sport: Option<u16>,
    dport: Option<u16>,
    packets: Option<u64>,
}

/// One line of `conntrack -L`.
#[derive(Debug, PartialEq, Eq)]
struct Entry {
    protocol: &'static str,
    timeout_seconds: u64,
    /// TCP's state (ESTABLISHED, TIME_WAIT...).
    state: Option<String>,
    replied: bool,
    original: Tuple,
    reply: Tuple,
}

/// The lines of `conntrack -L` (with or without `-o extended`) that it can read; the others
/// (ICMP, lines it does not know) are skipped.
fn parse(text: &str) -> Vec<Entry> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Entry> {
    let words: Vec<&str> = line.split_whitespace().collect();
    // `[ipv4 2] tcp 6 431999 ESTABLISHED src=...`: the protocol is the word before its number.
    let at = words
        .windows(2)
        .position(|w| w[1].parse::<u8>().is_ok() && protocol(w[0]) != "?")?;
    let proto = protocol(words[at]);
    let timeout_seconds = words.get(at + 2)?.parse().ok()?;
    let mut entry = Entry {
        protocol: proto,
        timeout_seconds,
        state: None,
        replied: true,
        original: Tuple::default(),
        reply: Tuple::default(),
    };
    let mut tuples = 0;
    for word in &words[at + 3..] {
        let Some((key, value)) = word.split_once('=') else {
            match *word {
                "[UNREPLIED]" => entry.replied = false,
                w if !w.starts_with('[') && tuples == 0 => entry.state = Some(w.to_owned()),
                _ => {}
            }
            continue;
        };
        if key == "src" {
            tuples += 1;
        }
        let tuple = match tuples {
            1 => &mut entry.original,
            2 => &mut entry.reply,
            _ => continue,
        };
        match key {
            "src" => tuple.src = value.to_owned(),
            "dst" => tuple.dst = value.to_owned(),
            "sport" => tuple.sport = value.parse().ok(),
            "dport" => tuple.dport = value.parse().ok(),
            "packets" => tuple.packets = value.parse().ok(),
            _ => {}
        }
    }
    (tuples >= 2 && !entry.original.dst.is_empty()).then_some(entry)
}

fn at(addr: &str, port: Option<u16>) -> String {
    match port {
        Some(port) => crate::rows::host_port(addr, port),
        None => addr.to_owned(),
    }
}

/// The flows of `text` (`conntrack -L`) whose original destination is one of the frontends of
/// `rows` (a NodePort's on any node address) and that were translated there, to an endpoint
/// (or, in the userspace mode, to the proxy port).
pub fn flows(text: &str, rows: &[ServiceRow]) -> Vec<ConntrackRow> {
    let frontends: HashMap<(String, &str), &ServiceRow> = rows
        .iter()
        .map(|r| ((r.address.clone(), r.protocol), r))
        .collect();
    let mut out = Vec::new();
    for entry in parse(text) {
        let (original, reply) = (&entry.original, &entry.reply);
        let destination = at(&original.dst, original.dport);
        // Where the replies come from: the translated destination.
        let translated = at(&reply.src, reply.sport);
        if translated == destination {
            continue;
        }
        let node_port = original.dport.map(|p| format!("*:{p}"));
        let Some(row) = frontends
            .get(&(destination.clone(), entry.protocol))
            .or_else(|| frontends.get(&(node_port?, entry.protocol)))
        else {
            continue;
        };
        out.push(ConntrackRow {
            direction: "forward",
            protocol: entry.protocol,
            source: at(&original.src, original.sport),
            destination,
            service: row.address.clone(),
            external: row.kind != "ClusterIP",
            translated,
            packets: original.packets,
            state: entry.state.clone().unwrap_or_else(|| {
                match entry.replied {
                    true => "replied",
                    false => "unreplied",
                }
                .to_owned()
            }),
            expires_seconds: entry.timeout_seconds,
        });
    }
    out.sort_by(|a, b| (&a.service, &a.source).cmp(&(&b.service, &b.source)));
    out
}

/// The kernel's conntrack table, both families.
pub(crate) fn conntrack_list() -> anyhow::Result<String> {
    let list = |family| {
        let args = ["-L", "-f", family, "-o", "extended"];
        crate::command::run("conntrack", &args, "conntrack")
    };
    Ok(list("ipv4")? + &list("ipv6")?)
}

/// The kernel's conntrack entries of flows to `frontends`.
pub(crate) fn service_flows(frontends: &[ServiceRow]) -> anyhow::Result<Vec<ConntrackRow>> {
    Ok(flows(&conntrack_list()?, frontends))
}

/// A TCP connection netfilter translated to another destination (DNAT, with or without SNAT):
/// its addresses as the client sends them and as the endpoint answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TranslatedFlow {
    /// Client -> frontend.
    pub original: (SocketAddrV4, SocketAddrV4),
    /// Endpoint -> client (or the address and port netfilter sent the flow from).
    pub reply: (SocketAddrV4, SocketAddrV4),
}

/// The IPv4 TCP connections of `text` (`conntrack -L -p tcp --dst-nat`) that are open: answered,
/// not closed (TIME_WAIT, CLOSE).
fn open_translated(text: &str) -> Vec<TranslatedFlow> {
    let addr = |t: &Tuple, src: bool| -> Option<SocketAddrV4> {
        let (ip, port) = match src {
            true => (&t.src, t.sport?),
            false => (&t.dst, t.dport?),
        };
        Some(SocketAddrV4::new(ip.parse().ok()?, port))
    };
    parse(text)
        .into_iter()
        .filter(|e| e.protocol == "TCP" && e.replied)
        .filter(|e| !matches!(e.state.as_deref(), Some("TIME_WAIT" | "CLOSE")))
        .filter_map(|e| {
            Some(TranslatedFlow {
                original: (addr(&e.original, true)?, addr(&e.original, false)?),
                reply: (addr(&e.reply, true)?, addr(&e.reply, false)?),
            })
        })
        .filter(|f| f.original.1 != f.reply.0)
        .collect()
}

/// The open TCP connections the kernel's netfilter translates to another destination (those
/// kube-proxy's rules sent to an endpoint, among others).
pub(crate) fn translated_tcp_flows() -> anyhow::Result<Vec<TranslatedFlow>> {
    let text = crate::command::run("conntrack", &["-L", "-p", "tcp", "--dst-nat"], "conntrack")?;
    Ok(open_translated(&text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rows::{backend, row};

    #[test]
    fn flows_to_frontends_only() {
        let text = "\
ipv4     2 tcp      6 431999 ESTABLISHED src=10.244.1.10 dst=10.96.0.10 sport=40000 dport=80 packets=5 bytes=300 src=10.244.1.11 dst=10.244.1.10 sport=8080 dport=40000 packets=4 bytes=250 [ASSURED] mark=0 use=1
ipv4     2 udp      17 29 src=10.244.1.10 dst=10.96.0.53 sport=40001 dport=53 [UNREPLIED] src=10.244.1.53 dst=10.244.1.10 sport=53 dport=40001 mark=0 use=1
tcp      6 117 TIME_WAIT src=192.0.2.1 dst=192.0.2.11 sport=50000 dport=30080 src=10.244.2.11 dst=192.0.2.11 sport=8080 dport=50000 [ASSURED] mark=0 use=1
tcp      6 300 ESTABLISHED src=10.244.1.10 dst=10.244.1.11 sport=40002 dport=8080 src=10.244.1.11 dst=10.244.1.10 sport=8080 dport=40002 [ASSURED] mark=0 use=1
ipv4     2 tcp      6 300 ESTABLISHED src=10.244.1.10 dst=10.96.0.99 sport=40003 dport=80 src=10.244.1.12 dst=10.244.1.10 sport=8080 dport=40003 mark=0 use=1
ipv4     2 icmp     1 29 src=10.244.1.10 dst=10.96.0.10 type=8 code=0 id=1 src=10.96.0.10 dst=10.244.1.10 type=0 code=0 id=1 mark=0 use=1
conntrack v1.4.7 (conntrack-tools): 6 flow entries have been shown.
";
        let web = {
            let mut r = row("10.96.0.10:80".into(), "TCP", "ClusterIP");
            r.backends = vec![backend("10.244.1.11:8080".into(), "TCP")];
            r
        };
        let rows = [
            web,
            row("10.96.0.53:53".into(), "UDP", "ClusterIP"),
            row("*:30080".into(), "TCP", "NodePort"),
        ];
        let got = flows(text, &rows);
        assert_eq!(
            got,
            [
                ConntrackRow {
                    direction: "forward",
                    protocol: "TCP",
                    source: "192.0.2.1:50000".into(),
                    destination: "192.0.2.11:30080".into(),
                    service: "*:30080".into(),
                    external: true,
                    translated: "10.244.2.11:8080".into(),
                    packets: None,
                    state: "TIME_WAIT".into(),
                    expires_seconds: 117,
                },
                ConntrackRow {
                    direction: "forward",
                    protocol: "TCP",
                    source: "10.244.1.10:40000".into(),
                    destination: "10.96.0.10:80".into(),
                    service: "10.96.0.10:80".into(),
                    external: false,
                    translated: "10.244.1.11:8080".into(),
                    packets: Some(5),
                    state: "ESTABLISHED".into(),
                    expires_seconds: 431999,
                },
                ConntrackRow {
                    direction: "forward",
                    protocol: "UDP",
                    source: "10.244.1.10:40001".into(),
                    destination: "10.96.0.53:53".into(),
                    service: "10.96.0.53:53".into(),
                    external: false,
                    translated: "10.244.1.53:53".into(),
                    packets: None,
                    state: "unreplied".into(),
                    expires_seconds: 29,
                },
            ]
        );
    }

    #[test]
    fn open_translated_tcp_flows_only() {
        let text = "\
tcp      6 431999 ESTABLISHED src=10.244.1.10 dst=10.96.0.10 sport=40000 dport=80 src=10.244.1.11 dst=10.244.1.10 sport=8080 dport=40000 [ASSURED] mark=0 use=1
tcp      6 431999 CLOSE_WAIT src=192.0.2.100 dst=192.0.2.11 sport=50000 dport=30080 src=10.244.2.11 dst=192.0.2.11 sport=8080 dport=50000 [ASSURED] mark=0 use=1
tcp      6 117 TIME_WAIT src=10.244.1.10 dst=10.96.0.10 sport=40001 dport=80 src=10.244.1.12 dst=10.244.1.10 sport=8080 dport=40001 [ASSURED] mark=0 use=1
tcp      6 119 SYN_SENT src=10.244.1.10 dst=10.96.0.10 sport=40002 dport=80 [UNREPLIED] src=10.244.1.12 dst=10.244.1.10 sport=8080 dport=40002 mark=0 use=1
tcp      6 300 ESTABLISHED src=10.244.1.10 dst=10.244.1.11 sport=40003 dport=8080 src=10.244.1.11 dst=10.244.1.10 sport=8080 dport=40003 [ASSURED] mark=0 use=1
udp      17 29 src=10.244.1.10 dst=10.96.0.53 sport=40004 dport=53 src=10.244.1.53 dst=10.244.1.10 sport=53 dport=40004 mark=0 use=1
tcp      6 300 ESTABLISHED src=fd00::10 dst=fd00:96::10 sport=40005 dport=80 src=fd00::11 dst=fd00::10 sport=8080 dport=40005 [ASSURED] mark=0 use=1
conntrack v1.4.7 (conntrack-tools): 7 flow entries have been shown.
";
        let at = |s: &str| s.parse::<SocketAddrV4>().unwrap();
        assert_eq!(
            open_translated(text),
            [
                TranslatedFlow {
                    original: (at("10.244.1.10:40000"), at("10.96.0.10:80")),
                    reply: (at("10.244.1.11:8080"), at("10.244.1.10:40000")),
                },
                TranslatedFlow {
                    original: (at("192.0.2.100:50000"), at("192.0.2.11:30080")),
                    reply: (at("10.244.2.11:8080"), at("192.0.2.11:50000")),
                },
            ]
        );
    }
}

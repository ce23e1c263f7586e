//! A packet tracer over the rules the iptables and nftables modes render (as kube-proxy's
//! proxier tests trace theirs): a model of the netfilter hooks a new connection's first packet
//! passes, fed with the rule text itself, that says where the packet goes (the endpoints it can
//! be DNATed to, dropped, rejected, or untouched) and whether it is masqueraded. The cases in
//! `modes/testdata/packet_flows/` carry the Services and packet flows of kube-proxy's own
//! proxier tests, with the outcomes kube-proxy's tests expect; `modes/packet_flows.rs` runs
//! them through both modes.
//!
//! What the model knows of netfilter: hooks in kernel order (a packet from one of the node's
//! addresses takes OUTPUT and POSTROUTING and, when it stays on the node, PREROUTING and INPUT
//! through the loopback; any other takes PREROUTING, then INPUT or FORWARD after DNAT, then
//! POSTROUTING when it leaves), base chains by priority, destination NAT chains only until the
//! connection's destination is decided, DNAT and MASQUERADE terminal, a drop or reject final,
//! an accept ending only its base chain. Random choices (`statistic`, `numgen`) are followed
//! both ways with their probabilities, so a trace lists every endpoint a packet can reach and
//! how often. Affinity sets are empty (a first packet). Anything in the rules the model does
//! not know, or that the kernel would refuse, fails the test: a new construct in the renderers
//! has to be taught to it.
mod iptables;
mod nftables;

use std::{
    collections::BTreeMap,
    fmt,
    net::{IpAddr, SocketAddr},
};

use crate::model::Cidr;
pub(crate) use iptables::Iptables;
pub(crate) use nftables::Nftables;

/// A netfilter hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Hook {
    Prerouting,
    Input,
    Forward,
    Output,
    Postrouting,
}

/// The first packet of a connection, as the rules see it at some point of its way.
#[derive(Clone, Debug)]
pub(crate) struct Packet {
    pub source: IpAddr,
    /// `tcp`, `udp` or `sctp`.
    pub protocol: &'static str,
    pub destination: IpAddr,
    pub port: u16,
    pub mark: u32,
    /// Where DNAT sent it.
    pub dnat: Option<SocketAddr>,
    /// Whether a MASQUERADE rule took it.
    pub masqueraded: bool,
    /// Whether an accept rule took it.
    pub accepted: bool,
}

impl Packet {
    pub fn new(source: IpAddr, protocol: &'static str, destination: IpAddr, port: u16) -> Self {
        Self {
            source,
            protocol,
            destination,
            port,
            mark: 0,
            dnat: None,
            masqueraded: false,
            accepted: false,
        }
    }

    pub fn translate(&mut self, to: SocketAddr) {
        self.destination = to.ip();
        self.port = to.port();
        self.dnat = Some(to);
    }

    /// Its source address (`source`) or its destination.
    pub fn address(&self, source: bool) -> IpAddr {
        if source {
            self.source
        } else {
            self.destination
        }
    }
}

/// What a rule or a chain decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Go on: with the next rule, or in the calling chain at the end of a chain.
    Continue,
    /// End this chain, going on in the one that called it (`return`, and the end of a chain
    /// entered by `goto`).
    Return,
    /// This base chain is done (`accept`, and a NAT statement).
    Accept,
    Drop,
    Reject,
}

/// The addresses the node owns: `addrtype LOCAL`, `fib ... type local`, and the way a packet
/// takes through the hooks.
#[derive(Clone, Debug)]
pub(crate) struct Node {
    pub addresses: Vec<IpAddr>,
}

impl Node {
    pub fn is_local(&self, ip: IpAddr) -> bool {
        ip.is_loopback() || self.addresses.contains(&ip)
    }
}

/// The choices of one way through the rules, and the next way to try: a depth-first walk over
/// every random choice the rules make.
#[derive(Default)]
pub(crate) struct Choices {
    taken: Vec<bool>,
    at: usize,
    /// How likely the way walked now is.
    probability: f64,
}

impl Choices {
    /// Whether this way takes the random branch met now, which the kernel takes with
    /// `probability` (first yes, then no).
    pub fn take(&mut self, probability: f64) -> bool {
        assert!(
            (0.0..=1.0).contains(&probability),
            "a probability of {probability}"
        );
        if self.at == self.taken.len() {
            self.taken.push(true);
        }
        self.at += 1;
        let taken = self.taken[self.at - 1];
        self.probability *= if taken {
            probability
        } else {
            1.0 - probability
        };
        taken
    }

    fn start(&mut self) {
        self.at = 0;
        self.probability = 1.0;
    }

    /// Moves on to the next way; false when every way was walked.
    fn next(&mut self) -> bool {
        while let Some(last) = self.taken.pop() {
            if last {
                self.taken.push(false);
                return true;
            }
        }
        false
    }
}

/// Rules that the tracer can walk: the chains of one hook, in the order the kernel runs them.
/// `nat`: whether destination NAT chains run (not once the connection's destination is
/// decided); source NAT at POSTROUTING always does.
pub(crate) trait Rules {
    fn hook(
        &self,
        hook: Hook,
        nat: bool,
        node: &Node,
        packet: &mut Packet,
        choices: &mut Choices,
    ) -> Verdict;
}

/// Runs the base chains of one hook in the kernel's order (`chains`: whether each is a NAT
/// chain, and the chain): NAT chains only where `nat` says so; a drop or reject ends the hook,
/// an accept only its chain.
pub(crate) fn run_base_chains<C>(
    chains: impl IntoIterator<Item = (bool, C)>,
    nat: bool,
    mut run: impl FnMut(C) -> Verdict,
) -> Verdict {
    for (is_nat, chain) in chains {
        if is_nat && !nat {
            continue;
        }
        match run(chain) {
            Verdict::Continue | Verdict::Return | Verdict::Accept => {}
            end => return end,
        }
    }
    Verdict::Continue
}

/// Where one way through the rules ends.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Fate {
    Dropped,
    Rejected,
    /// Accepted by a filter rule, untouched.
    Accepted,
    /// Let through, to where DNAT sent it (None: untouched), and whether it was masqueraded.
    Passed(Option<SocketAddr>, bool),
}

/// Every way a packet can take through `rules`, with its probability.
pub(crate) fn trace(rules: &dyn Rules, node: &Node, packet: &Packet) -> Trace {
    let mut fates = BTreeMap::new();
    let mut choices = Choices::default();
    loop {
        choices.start();
        let fate = walk(rules, node, packet.clone(), &mut choices);
        *fates.entry(fate).or_insert(0.0) += choices.probability;
        if !choices.next() {
            return Trace(fates);
        }
    }
}

fn walk(rules: &dyn Rules, node: &Node, mut packet: Packet, choices: &mut Choices) -> Fate {
    let mut run =
        |hook, nat, packet: &mut Packet| match rules.hook(hook, nat, node, packet, choices) {
            Verdict::Drop => Err(Fate::Dropped),
            Verdict::Reject => Err(Fate::Rejected),
            Verdict::Continue | Verdict::Return | Verdict::Accept => Ok(()),
        };
    let outcome = (|| {
        let masqueraded = if node.is_local(packet.source) {
            run(Hook::Output, true, &mut packet)?;
            run(Hook::Postrouting, true, &mut packet)?;
            if node.is_local(packet.destination) {
                // Back in through the loopback: its destination is decided already.
                run(Hook::Prerouting, false, &mut packet)?;
                run(Hook::Input, false, &mut packet)?;
            }
            packet.masqueraded
        } else {
            run(Hook::Prerouting, true, &mut packet)?;
            if node.is_local(packet.destination) {
                run(Hook::Input, false, &mut packet)?;
                // Delivered here, it never meets POSTROUTING: the mark says what it would do
                // (as kube-proxy's tracers report it).
                packet.mark & MASQ_BIT != 0
            } else {
                run(Hook::Forward, false, &mut packet)?;
                run(Hook::Postrouting, true, &mut packet)?;
                packet.masqueraded
            }
        };
        Ok(masqueraded)
    })();
    match outcome {
        Err(fate) => fate,
        Ok(_) if packet.accepted && packet.dnat.is_none() => Fate::Accepted,
        Ok(masqueraded) => Fate::Passed(packet.dnat, masqueraded),
    }
}

/// The masquerade mark's bit (`MASQ_MARK`).
const MASQ_BIT: u32 = 0x4000;

/// A mark as the renderers write it (`0x4000`, `0`).
pub(crate) fn mark(text: &str) -> u32 {
    let parsed = match text.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => text.parse(),
    };
    parsed.unwrap_or_else(|_| panic!("{text:?}: not a mark"))
}

/// Every way a packet can end, with its probability.
#[derive(Debug)]
pub(crate) struct Trace(BTreeMap<Fate, f64>);

impl Trace {
    /// kube-proxy's tracer's words for it: the endpoints (`10.180.0.1:80, [fd00::1]:80`),
    /// `DROP`, `REJECT`, `ACCEPT`, or nothing for a packet left untouched.
    pub fn output(&self) -> String {
        let words: std::collections::BTreeSet<String> = (self.0.keys())
            .map(|fate| match fate {
                Fate::Dropped => "DROP".to_owned(),
                Fate::Rejected => "REJECT".to_owned(),
                Fate::Accepted => "ACCEPT".to_owned(),
                Fate::Passed(to, _) => to.map(|to| to.to_string()).unwrap_or_default(),
            })
            .collect();
        words.into_iter().collect::<Vec<_>>().join(", ")
    }

    /// Whether the packets let through are masqueraded; None when some are and some not.
    pub fn masquerade(&self) -> Option<bool> {
        let masq: std::collections::BTreeSet<bool> = (self.0.keys())
            .filter_map(|fate| match fate {
                Fate::Passed(_, masq) => Some(*masq),
                _ => None,
            })
            .collect();
        match masq.len() {
            0 => Some(false),
            1 => masq.first().copied(),
            _ => None,
        }
    }

    /// Whether every endpoint the packet can be sent to gets the same share of such packets.
    pub fn even(&self) -> bool {
        let mut shares: BTreeMap<SocketAddr, f64> = BTreeMap::new();
        for (fate, p) in &self.0 {
            if let Fate::Passed(Some(to), _) = fate {
                *shares.entry(*to).or_default() += p;
            }
        }
        let (min, max) =
            (shares.values()).fold((f64::MAX, 0.0f64), |(lo, hi), p| (lo.min(*p), hi.max(*p)));
        shares.is_empty() || max - min < 1e-6
    }
}

impl fmt::Display for Trace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let masq = match self.masquerade() {
            Some(true) => "masqueraded",
            Some(false) => "not masqueraded",
            None => "masqueraded on some ways only",
        };
        write!(f, "{:?}, {masq}", self.output())?;
        if !self.even() {
            write!(f, ", endpoints chosen unevenly: {:?}", self.0)?;
        }
        Ok(())
    }
}

/// Whether `ip` is in `range` (an address, or a range `a.b.c.d/len`, `fd00::/len`): never one
/// of the other family.
pub(crate) fn in_range(range: &str, ip: IpAddr) -> bool {
    let cidr: Cidr = match range.contains('/') {
        true => range.parse(),
        false => range
            .parse::<IpAddr>()
            .map_err(|e| e.to_string())
            .map(|addr| Cidr {
                addr,
                len: if addr.is_ipv4() { 32 } else { 128 },
            }),
    }
    .unwrap_or_else(|e| panic!("{range:?} is no address range: {e}"));
    cidr.contains(ip)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NODE_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(192, 0, 2, 1);

    fn node() -> Node {
        Node {
            addresses: vec![NODE_IP.into()],
        }
    }

    fn packet(source: [u8; 4], destination: [u8; 4], port: u16) -> Packet {
        Packet::new(source.into(), "tcp", destination.into(), port)
    }

    fn nft(rules: &str) -> Nftables {
        let mut tables = Nftables::default();
        tables.apply(&format!(
            "add table ip t\n\
             add chain ip t pre {{ type nat hook prerouting priority -100 ; }}\n\
             add chain ip t out {{ type nat hook output priority -100 ; }}\n\
             add chain ip t fwd {{ type filter hook forward priority 0 ; }}\n\
             add chain ip t post {{ type nat hook postrouting priority 100 ; }}\n\
             add chain ip t a\nadd chain ip t b\n{rules}"
        ));
        tables
    }

    /// `goto` goes on in the caller's caller, `jump` and `return` in the caller.
    #[test]
    fn nft_jump_goto_and_return() {
        let through = [10, 0, 0, 1];
        let jumped =
            nft("add rule ip t fwd jump a\nadd rule ip t fwd drop\nadd rule ip t a return");
        let traced = trace(&jumped, &node(), &packet(through, [10, 0, 0, 2], 80));
        assert_eq!(traced.output(), "DROP");
        let gone = nft("add rule ip t fwd jump a\nadd rule ip t fwd drop\n\
                        add rule ip t a goto b\nadd rule ip t a accept\nadd rule ip t b return");
        let traced = trace(&gone, &node(), &packet(through, [10, 0, 0, 2], 80));
        assert_eq!(
            traced.output(),
            "DROP",
            "after the goto, a's accept is skipped"
        );
    }

    /// Every random choice is followed; the node's own packets take the output hook.
    #[test]
    fn every_endpoint_and_the_nodes_own_way() {
        let tables = nft("add rule ip t out ip daddr 10.96.0.1 goto a\n\
             add rule ip t a numgen random mod 3 == 0 dnat to 10.1.0.1:80\n\
             add rule ip t a numgen random mod 2 == 0 dnat to 10.1.0.2:80\n\
             add rule ip t a dnat to 10.1.0.3:80");
        let from_node = packet(NODE_IP.octets(), [10, 96, 0, 1], 80);
        let traced = trace(&tables, &node(), &from_node);
        assert_eq!(traced.output(), "10.1.0.1:80, 10.1.0.2:80, 10.1.0.3:80");
        assert_eq!(traced.masquerade(), Some(false));
        let from_outside = packet([10, 0, 0, 1], [10, 96, 0, 1], 80);
        assert_eq!(trace(&tables, &node(), &from_outside).output(), "");
    }

    fn iptables(nat: &str) -> Iptables {
        let mut tables = Iptables::default();
        tables.restore(&format!(
            "*nat\n:PREROUTING ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n:SVC - [0:0]\n:MASQ - [0:0]\n\
             -A MASQ -j MARK --or-mark 0x4000\n{nat}COMMIT\n"
        ));
        tables
    }

    /// Masquerading is what POSTROUTING does, not the mark: a mark left set by a wrong rule
    /// there is no masquerade.
    #[test]
    fn iptables_masquerade_in_postrouting() {
        let rules = |postrouting: &str| {
            iptables(&format!(
                "-A PREROUTING -d 10.96.0.1 -m statistic --mode random --probability 0.5 -j DNAT --to-destination 10.1.0.1:80\n\
                 -A PREROUTING -d 10.96.0.1 -j MASQ\n\
                 -A PREROUTING -d 10.96.0.1 -j DNAT --to-destination 10.1.0.2:80\n\
                 -A POSTROUTING -m mark {postrouting} --mark 0x4000/0x4000 -j RETURN\n\
                 -A POSTROUTING -j MASQUERADE\n"
            ))
        };
        let from = packet([10, 0, 0, 1], [10, 96, 0, 1], 80);
        let traced = trace(&rules("!"), &node(), &from);
        assert_eq!(traced.output(), "10.1.0.1:80, 10.1.0.2:80");
        assert!(traced.even());
        assert_eq!(
            traced.masquerade(),
            None,
            "one way is masqueraded, the other not"
        );
        let inverted = trace(&rules(""), &node(), &from);
        assert!(
            inverted
                .to_string()
                .contains("masqueraded on some ways only"),
            "{inverted}"
        );
        assert_ne!(
            inverted.0, traced.0,
            "the inverted check masquerades the other way"
        );
    }

    /// Probabilities that do not give each endpoint its share are seen.
    #[test]
    fn uneven_choices() {
        let rules = |p: &str| {
            iptables(&format!(
                "-A PREROUTING -j SVC\n\
                 -A SVC -m statistic --mode random --probability {p} -j DNAT --to-destination 10.1.0.1:80\n\
                 -A SVC -m statistic --mode random --probability 0.5000000000 -j DNAT --to-destination 10.1.0.2:80\n\
                 -A SVC -j DNAT --to-destination 10.1.0.3:80\n"
            ))
        };
        let from = packet([10, 0, 0, 1], [10, 96, 0, 1], 80);
        assert!(trace(&rules("0.3333333333"), &node(), &from).even());
        assert!(!trace(&rules("0.5000000000"), &node(), &from).even());
    }

    #[test]
    #[should_panic(expected = "missing chain")]
    fn a_jump_to_a_missing_chain_fails() {
        iptables("-A PREROUTING -j KUBE-SVC-TYPO\n");
    }

    #[test]
    #[should_panic(expected = "does not know")]
    fn what_the_model_does_not_know_fails() {
        let tables = nft("add rule ip t fwd meta skuid 0 drop");
        trace(&tables, &node(), &packet([10, 0, 0, 1], [10, 0, 0, 2], 80));
    }
}

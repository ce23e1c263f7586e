//! The nftables model: tables of chains, sets and verdict maps, written with the `nft -f`
//! transactions the nftables mode renders, and walked as the kernel walks them.
use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddrV4,
};

use super::{Choices, Hook, Node, Packet, Rules, Verdict, in_range};
use crate::netfilter::iptables_save::split_words;

#[derive(Default)]
struct Table {
    chains: HashMap<String, Chain>,
    /// Sets and maps: each element's key (words joined by one space) and, in a map, its
    /// verdict.
    sets: HashMap<String, BTreeMap<String, String>>,
}

#[derive(Default)]
struct Chain {
    /// Type, hook and priority of a base chain.
    base: Option<(String, Hook, i32)>,
    rules: Vec<Vec<String>>,
}

/// The tables, by family and name (`ip kube-proxy`).
#[derive(Default)]
pub(crate) struct Nftables {
    tables: BTreeMap<String, Table>,
}

impl Nftables {
    /// Applies an `nft -f` transaction.
    pub fn apply(&mut self, text: &str) {
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let words = split_words(line);
            let words: Vec<&str> = words.iter().map(String::as_str).collect();
            let (op, kind, table, rest) = match words.as_slice() {
                [op, kind, family, name, rest @ ..] => {
                    (*op, *kind, format!("{family} {name}"), rest)
                }
                _ => panic!("the tracer does not know the command {line:?}"),
            };
            match (op, kind) {
                ("add", "table") => {
                    self.tables.entry(table).or_default();
                }
                ("delete", "table") => {
                    self.tables
                        .remove(&table)
                        .expect("delete of a missing table");
                }
                (_, _) => self.apply_in(&table, op, kind, rest, line),
            }
        }
    }

    fn apply_in(&mut self, table: &str, op: &str, kind: &str, rest: &[&str], line: &str) {
        let t = (self.tables.get_mut(table)).unwrap_or_else(|| panic!("no table for {line:?}"));
        let name = rest[0].to_owned();
        match (op, kind) {
            ("add", "chain") => {
                let chain = t.chains.entry(name).or_default();
                if let ["{", "type", kind, "hook", hook, "priority", priority, ..] = rest[1..] {
                    chain.base = Some((kind.to_owned(), hook_of(hook), priority.parse().unwrap()));
                }
            }
            ("flush", "chain") => found(t.chains.get_mut(&name), line).rules.clear(),
            ("delete", "chain") => {
                let chain = found(t.chains.remove(&name), line);
                assert!(chain.rules.is_empty(), "{line:?}: the chain has rules");
                let used = (t.chains.values().flat_map(|c| &c.rules).flatten())
                    .chain(t.sets.values().flat_map(|s| s.values()))
                    .any(|w| w.split(' ').any(|w| w == name));
                assert!(!used, "{line:?}: the chain is still referred to");
            }
            ("add", "set" | "map") => {
                t.sets.entry(name).or_default();
            }
            ("flush", "set" | "map") => found(t.sets.get_mut(&name), line).clear(),
            ("delete", "set" | "map") => {
                found(t.sets.remove(&name), line);
            }
            ("add", "rule") => {
                let rule = rest[1..].iter().map(|w| w.to_string()).collect();
                found(t.chains.get_mut(&name), line).rules.push(rule);
            }
            ("add" | "delete", "element") => {
                let set = found(t.sets.get_mut(&name), line);
                for (key, verdict) in elements(&rest[1..]) {
                    if op == "add" {
                        set.insert(key, verdict);
                    } else {
                        found(set.remove(&key), line);
                    }
                }
            }
            _ => panic!("the tracer does not know the command {line:?}"),
        }
    }

    /// Runs `chain` of `table`: its verdict (Continue when it ran to its end or returned).
    fn run(
        &self,
        table: &Table,
        chain: &str,
        node: &Node,
        packet: &mut Packet,
        choices: &mut Choices,
    ) -> Verdict {
        let chain = (table.chains.get(chain)).unwrap_or_else(|| panic!("no chain {chain}"));
        for rule in &chain.rules {
            match self.rule(table, rule, node, packet, choices) {
                Verdict::Continue => {}
                Verdict::Return => return Verdict::Continue,
                end => return end,
            }
        }
        Verdict::Continue
    }

    /// Runs one rule: Continue when it did not match or ended without a verdict.
    fn rule(
        &self,
        table: &Table,
        rule: &[String],
        node: &Node,
        packet: &mut Packet,
        choices: &mut Choices,
    ) -> Verdict {
        let words: Vec<&str> = rule.iter().map(String::as_str).collect();
        let mut w = words.as_slice();
        loop {
            // Each arm matches one statement: Some(rest) when the packet matches it.
            let rest: &[&str] = match w {
                [] | ["comment", _] => return Verdict::Continue,
                ["ct", "state", state, rest @ ..] => {
                    if !state.split(',').any(|s| s == "new") {
                        return Verdict::Continue;
                    }
                    rest
                }
                // A concatenation looked up in a verdict map.
                [_, _, ".", ..] => {
                    let at = (w.iter().position(|x| *x == "vmap")).expect("a vmap lookup");
                    let key = concat(&w[..at], packet);
                    let map = w[at + 1].strip_prefix('@').expect("vmap @map");
                    let map = (table.sets.get(map)).unwrap_or_else(|| panic!("no map {map}"));
                    let Some(verdict) = map.get(&key) else {
                        return Verdict::Continue;
                    };
                    let verdict: Vec<&str> = verdict.split(' ').collect();
                    return self.verdict(table, &verdict, node, packet, choices);
                }
                ["ip", field @ ("saddr" | "daddr"), rest @ ..] => {
                    let ip = match *field {
                        "saddr" => packet.source,
                        _ => packet.destination,
                    };
                    let (negated, rest) = match rest {
                        ["!=", rest @ ..] => (true, rest),
                        rest => (false, rest),
                    };
                    let (set, rest) = set_of(rest);
                    let hit = match set.as_slice() {
                        [named] if named.starts_with('@') => {
                            let set = &table.sets[&named[1..]];
                            set.keys().any(|k| in_range(k, ip))
                        }
                        ranges => ranges.iter().any(|r| in_range(r, ip)),
                    };
                    if hit == negated {
                        return Verdict::Continue;
                    }
                    rest
                }
                [proto @ ("tcp" | "udp" | "sctp"), "dport", port, rest @ ..] => {
                    if packet.protocol != *proto || port.parse() != Ok(packet.port) {
                        return Verdict::Continue;
                    }
                    rest
                }
                ["meta", "l4proto", proto, rest @ ..] => {
                    if packet.protocol != *proto {
                        return Verdict::Continue;
                    }
                    rest
                }
                [
                    "fib",
                    field @ ("saddr" | "daddr"),
                    "type",
                    "local",
                    rest @ ..,
                ] => {
                    let ip = match *field {
                        "saddr" => packet.source,
                        _ => packet.destination,
                    };
                    if !node.is_local(ip) {
                        return Verdict::Continue;
                    }
                    rest
                }
                ["numgen", "random", "mod", _, "==", "0", rest @ ..] => {
                    if !choices.take() {
                        return Verdict::Continue;
                    }
                    rest
                }
                ["mark", "and", value, op @ ("==" | "!="), want, rest @ ..] => {
                    let hit = packet.mark & mark(value) == mark(want);
                    if hit != (*op == "==") {
                        return Verdict::Continue;
                    }
                    rest
                }
                ["mark", "set", "mark", op @ ("or" | "xor"), value, rest @ ..] => {
                    match *op {
                        "or" => packet.mark |= mark(value),
                        _ => packet.mark ^= mark(value),
                    }
                    rest
                }
                // Affinity: the first packet adds its client; nothing to trace.
                ["update", set, "{", "ip", "saddr", "}", rest @ ..] if set.starts_with('@') => rest,
                ["dnat", "to", to, ..] => {
                    packet.translate(to.parse::<SocketAddrV4>().expect("dnat to ip:port"));
                    return Verdict::Accept;
                }
                ["masquerade", ..] => {
                    packet.masqueraded = true;
                    return Verdict::Accept;
                }
                verdict => return self.verdict(table, verdict, node, packet, choices),
            };
            w = rest;
        }
    }

    /// A verdict statement (and an optional comment after it).
    fn verdict(
        &self,
        table: &Table,
        words: &[&str],
        node: &Node,
        packet: &mut Packet,
        choices: &mut Choices,
    ) -> Verdict {
        match words {
            ["accept", ..] => {
                packet.accepted = true;
                Verdict::Accept
            }
            ["drop", ..] => Verdict::Drop,
            ["reject", ..] => Verdict::Reject,
            ["return", ..] => Verdict::Return,
            // A jump comes back here when its chain ends; a goto goes on in this chain's caller.
            ["jump", chain, ..] => self.run(table, chain, node, packet, choices),
            ["goto", chain, ..] => match self.run(table, chain, node, packet, choices) {
                Verdict::Continue => Verdict::Return,
                end => end,
            },
            other => panic!("the tracer does not know the statement {other:?}"),
        }
    }
}

impl Rules for Nftables {
    fn hook(&self, hook: Hook, node: &Node, packet: &mut Packet, choices: &mut Choices) -> Verdict {
        let mut chains: Vec<(i32, &Table, &str, &str)> = (self.tables.values())
            .flat_map(|t| t.chains.iter().map(move |(name, c)| (t, name, c)))
            .filter_map(|(t, name, c)| {
                let (kind, h, priority) = c.base.as_ref()?;
                (*h == hook).then_some((*priority, t, name.as_str(), kind.as_str()))
            })
            .collect();
        chains.sort_by_key(|c| c.0);
        for (_, table, chain, kind) in chains {
            if kind == "nat" && packet.nat_done && hook != Hook::Postrouting {
                continue;
            }
            match self.run(table, chain, node, packet, choices) {
                Verdict::Continue | Verdict::Return | Verdict::Accept => {}
                end => return end,
            }
        }
        Verdict::Continue
    }
}

/// The object a command names; panics when the table has none.
fn found<T>(object: Option<T>, line: &str) -> T {
    object.unwrap_or_else(|| panic!("{line:?}: no such object"))
}

fn hook_of(name: &str) -> Hook {
    match name {
        "prerouting" => Hook::Prerouting,
        "input" => Hook::Input,
        "forward" => Hook::Forward,
        "output" => Hook::Output,
        "postrouting" => Hook::Postrouting,
        other => panic!("the tracer does not know the hook {other}"),
    }
}

/// The key a concatenation (`ip daddr . meta l4proto . th dport`) makes of `packet`.
fn concat(words: &[&str], packet: &Packet) -> String {
    let parts: Vec<String> = (words.split(|w| *w == "."))
        .map(|selector| match selector {
            ["ip", "daddr"] => packet.destination.to_string(),
            ["ip", "saddr"] => packet.source.to_string(),
            ["meta", "l4proto"] => packet.protocol.to_owned(),
            ["th", "dport"] => packet.port.to_string(),
            other => panic!("the tracer does not know the selector {other:?}"),
        })
        .collect();
    parts.join(" . ")
}

/// A set operand: `@name`, `{ a, b }` or one value; and the words after it.
fn set_of<'a>(words: &'a [&'a str]) -> (Vec<&'a str>, &'a [&'a str]) {
    match words {
        ["{", rest @ ..] => {
            let end = rest
                .iter()
                .position(|w| *w == "}")
                .expect("a closing brace");
            let items = rest[..end]
                .iter()
                .map(|w| w.trim_end_matches(','))
                .collect();
            (items, &rest[end + 1..])
        }
        [one, rest @ ..] => (vec![*one], rest),
        [] => panic!("a set operand is missing"),
    }
}

/// The elements of `{ key [comment "..."] [: verdict], ... }`.
fn elements(words: &[&str]) -> Vec<(String, String)> {
    let inner = match words {
        ["{", inner @ .., "}"] => inner,
        other => panic!("the tracer does not know the elements {other:?}"),
    };
    let mut out = Vec::new();
    for element in inner.join(" ").split(", ") {
        let (key, verdict) = match element.split_once(" : ") {
            Some((key, verdict)) => (key, verdict.to_owned()),
            None => (element, String::new()),
        };
        // The comment (its words were unquoted by the split above) is not part of the key.
        let key = key.split(" comment ").next().unwrap_or_default();
        out.push((key.trim().to_owned(), verdict));
    }
    out
}

fn mark(text: &str) -> u32 {
    match text.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16).expect("a mark"),
        None => text.parse().expect("a mark"),
    }
}

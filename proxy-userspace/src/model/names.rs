//! The names of things: namespaced objects, Service ports, protocols.
use std::{
    borrow::Borrow,
    fmt,
    hash::Hash,
    str::FromStr,
    sync::{Arc, LazyLock, Mutex, PoisonError},
};

use foldhash::HashSet;

/// A namespaced object's name. The strings are shared: the tracker, the desired state and a
/// dataplane's bookkeeping each keep copies of the names of every service port, so a copy is a
/// reference count rather than two allocations.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NamespacedName {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl NamespacedName {
    pub fn new(namespace: impl Into<Arc<str>>, name: impl Into<Arc<str>>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for NamespacedName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    pub const ALL: [Protocol; 3] = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];

    /// The IP protocol number, as it appears in the IP header.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }

    /// The API's name (`TCP`), as the inspect rows show it too.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }

    /// The name iptables, nft and kube-proxy's chain hashes use (`tcp`).
    pub fn keyword(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }

    pub fn from_number(number: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.number() == number)
    }

    /// A protocol as netfilter's tools print it: its name in any case, or its number.
    pub fn from_tool(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|p| name.eq_ignore_ascii_case(p.keyword()) || name.parse() == Ok(p.number()))
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Protocol {
    type Err = String;

    /// Accepts the API's spelling only: "tcp" is rejected by the API server too.
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("protocol {s:?} is not TCP, UDP or SCTP"))
    }
}

/// One port of one service: the unit that is programmed. Its fields are [`PortName`]'s.
///
/// A shared pointer, 8 bytes: the tracker, the desired state and a dataplane's bookkeeping keep
/// several copies of every service port's name, mostly as map keys, so with tens of thousands
/// of ports the copies' size, not the names', is what counts. Compared, ordered and hashed by
/// value.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePortName(Arc<PortName>);

/// What a [`ServicePortName`] names.
#[derive(PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortName {
    pub service: NamespacedName,
    /// The port's name; "" for the single unnamed port a service may have.
    pub port: Arc<str>,
    pub protocol: Protocol,
}

impl std::ops::Deref for ServicePortName {
    type Target = PortName;

    fn deref(&self) -> &PortName {
        &self.0
    }
}

impl fmt::Debug for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServicePortName")
            .field("service", &self.service)
            .field("port", &self.port)
            .field("protocol", &self.protocol)
            .finish()
    }
}

impl ServicePortName {
    pub fn new(service: NamespacedName, port: impl Into<Arc<str>>, protocol: Protocol) -> Self {
        Self(Arc::new(PortName {
            service,
            port: port.into(),
            protocol,
        }))
    }

    /// The smallest name of `service`'s ports, to range over them in a sorted map.
    pub(crate) fn first_of(service: &NamespacedName) -> Self {
        Self::new(service.clone(), "", Protocol::Tcp)
    }
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() {
            write!(f, "{}", self.service)
        } else {
            write!(f, "{}:{}", self.service, self.port)
        }
    }
}

/// A string that many objects share (a namespace, a node, zone or port name), kept once
/// however many objects name it.
pub(crate) fn shared(name: &str) -> Arc<str> {
    static NAMES: LazyLock<Mutex<Interner<str>>> = LazyLock::new(Default::default);
    let mut names = NAMES.lock().unwrap_or_else(PoisonError::into_inner);
    names.intern(name, |name| Arc::from(name))
}

/// Values that many objects share, each kept once however many objects hold it. Those no
/// object holds any more are dropped as the set grows, so it stays within twice the values in
/// use.
pub(crate) struct Interner<T: ?Sized> {
    values: HashSet<Arc<T>>,
    /// Its size after the last clean-up.
    kept: usize,
}

impl<T: ?Sized> Default for Interner<T> {
    fn default() -> Self {
        Self {
            values: HashSet::default(),
            kept: 0,
        }
    }
}

impl<T: ?Sized + Hash + Eq> Interner<T> {
    /// The shared copy of `value`, made by `make` if there is none.
    pub(crate) fn intern<Q>(&mut self, value: &Q, make: impl FnOnce(&Q) -> Arc<T>) -> Arc<T>
    where
        Arc<T>: Borrow<Q>,
        Q: ?Sized + Hash + Eq,
    {
        if let Some(shared) = self.values.get(value) {
            return Arc::clone(shared);
        }
        if self.values.len() >= 2 * self.kept.max(512) {
            self.values.retain(|shared| Arc::strong_count(shared) > 1);
            self.kept = self.values.len();
        }
        let shared = make(value);
        self.values.insert(Arc::clone(&shared));
        shared
    }
}

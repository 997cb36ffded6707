//! Connection admission for the servers, without I/O: a cap on connections open at once, and a
//! smaller cap per source IP address, so that one address cannot take every slot and lock
//! out another. A slot is given back when its [`Slot`] drops.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::Mutex;

/// Most connections one server (control or data) serves at once; more are closed at accept.
pub(crate) const MAX_CONNECTIONS: usize = 4096;

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Full {
    /// Every slot is taken.
    Total(usize),
    /// This address has its share.
    PerIp(usize),
}

impl std::fmt::Display for Full {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Full::Total(n) => write!(f, "{n} connections already open"),
            Full::PerIp(n) => write!(f, "{n} connections already open from this address"),
        }
    }
}

/// Admission state shared by one server's accept loop and its connections.
#[derive(Debug)]
pub(crate) struct ConnLimit {
    total: usize,
    per_ip: usize,
    open: Mutex<(usize, HashMap<IpAddr, usize>)>,
}

/// One admitted connection; its slot is freed on drop.
#[derive(Debug)]
pub(crate) struct Slot {
    limit: Arc<ConnLimit>,
    ip: IpAddr,
}

impl ConnLimit {
    /// At most `total` connections, and at most `per_ip` from one address.
    pub(crate) fn new(total: usize, per_ip: usize) -> Arc<ConnLimit> {
        Arc::new(ConnLimit {
            total,
            per_ip: per_ip.min(total),
            open: Mutex::new((0, HashMap::new())),
        })
    }

    /// Admits a connection from `ip`, or says which cap it hit.
    pub(crate) fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<Slot, Full> {
        let ip = canonical(ip);
        let mut g = self.open.lock();
        let (all, by_ip) = &mut *g;
        if *all >= self.total {
            return Err(Full::Total(self.total));
        }
        let mine = by_ip.entry(ip).or_insert(0);
        if *mine >= self.per_ip {
            return Err(Full::PerIp(self.per_ip));
        }
        *mine += 1;
        *all += 1;
        Ok(Slot {
            limit: self.clone(),
            ip,
        })
    }

    /// Connections open now.
    pub(crate) fn open_now(&self) -> usize {
        self.open.lock().0
    }

    /// Connections open now: in all, and from `ip`.
    #[cfg(test)]
    fn open(&self, ip: IpAddr) -> (usize, usize) {
        let g = self.open.lock();
        (g.0, g.1.get(&canonical(ip)).copied().unwrap_or(0))
    }
}

/// The unit the per-address cap counts: an IPv4 address (also when seen through an IPv6
/// socket), or an IPv6 /64 (one host usually holds a whole /64).
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(prefix.into())
            }
        },
        v4 => v4,
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut g = self.limit.open.lock();
        let (all, by_ip) = &mut *g;
        *all -= 1;
        if let Some(n) = by_ip.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                by_ip.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_address_cannot_take_every_slot() {
        let l = ConnLimit::new(5, 3);
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        let b: IpAddr = "127.0.0.1".parse().unwrap();
        let held: Vec<Slot> = (0..3).map(|_| l.admit(a).unwrap()).collect();
        assert_eq!(l.admit(a).unwrap_err(), Full::PerIp(3));
        let mapped: IpAddr = "::ffff:127.0.0.2".parse().unwrap();
        assert_eq!(
            l.admit(mapped).unwrap_err(),
            Full::PerIp(3),
            "mapped v4 is the same"
        );
        let v6 = ConnLimit::new(5, 1);
        let _a = v6.admit("2001:db8::1".parse().unwrap()).unwrap();
        assert!(
            v6.admit("2001:db8::2".parse().unwrap()).is_err(),
            "the same /64"
        );
        assert!(
            v6.admit("2001:db8:0:1::1".parse().unwrap()).is_ok(),
            "another /64"
        );
        let b1 = l.admit(b).unwrap();
        let _b2 = l.admit(b).unwrap();
        assert_eq!(l.admit(b).unwrap_err(), Full::Total(5));
        drop(b1);
        assert_eq!(l.open(b), (4, 1));
        drop(held);
        assert_eq!(l.open(a), (1, 0));
        assert!(l.admit(a).is_ok());
    }
}

//! Peer authentication from a deployment key, without I/O: HMAC-SHA256 proofs over fresh
//! nonces (mutual challenge-response on the control plane), and the per-session secret that
//! binds each data connection to an authenticated control session. Why this construction, and
//! what it does not protect against: docs/security.md.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};

type HmacSha256 = Hmac<Sha256>;

/// Shortest key accepted, in bytes.
pub const MIN_KEY_BYTES: usize = 16;

/// The deployment key every engine of a cluster shares. `Debug` never prints it.
#[derive(Clone, PartialEq, Eq)]
pub struct AuthKey(Vec<u8>);

impl std::fmt::Debug for AuthKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AuthKey({} bytes, redacted)", self.0.len())
    }
}

impl AuthKey {
    /// A key of at least [`MIN_KEY_BYTES`] bytes (use 32 random bytes, e.g. `openssl rand -hex
    /// 32`; the text of the hex string is the key).
    pub fn new(key: impl Into<Vec<u8>>) -> Result<AuthKey> {
        let key = key.into();
        if key.len() < MIN_KEY_BYTES {
            return Err(Error::invalid(format!(
                "the authentication key has {} bytes; use at least {MIN_KEY_BYTES} (32 random bytes recommended)",
                key.len()
            )));
        }
        Ok(AuthKey(key))
    }

    /// The key from the environment: `KVLINK_AUTH_KEY` (its text), or the contents of the file
    /// `KVLINK_AUTH_KEY_FILE` names (a trailing newline is dropped). `Ok(None)` when neither is
    /// set.
    pub fn from_env() -> Result<Option<AuthKey>> {
        if let Some(k) = std::env::var_os("KVLINK_AUTH_KEY") {
            let k = k
                .into_string()
                .map_err(|_| Error::invalid("KVLINK_AUTH_KEY is not valid UTF-8"))?;
            return AuthKey::new(k.into_bytes()).map(Some);
        }
        if let Some(path) = std::env::var_os("KVLINK_AUTH_KEY_FILE") {
            let mut k = std::fs::read(&path)
                .map_err(|e| Error::io(format!("reading KVLINK_AUTH_KEY_FILE {path:?}"), &e))?;
            while k.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                k.pop();
            }
            return AuthKey::new(k).map(Some);
        }
        Ok(None)
    }

    /// HMAC-SHA256 of the parts, in order, under this key.
    pub(crate) fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        mac(&self.0, parts)
    }

    /// Whether `tag` is the HMAC of the parts under this key (constant time).
    pub(crate) fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        verify(&self.0, parts, tag)
    }
}

fn mac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

fn verify(key: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
    for p in parts {
        m.update(p);
    }
    m.verify_slice(tag).is_ok()
}

/// Labels that keep each proof from being replayed as another.
const SERVER_PROOF: &[u8] = b"kvlink-v1 server proof";
const CLIENT_PROOF: &[u8] = b"kvlink-v1 client proof";
const SESSION_ID: &[u8] = b"kvlink-v1 session id";
const SESSION_KEY: &[u8] = b"kvlink-v1 session key";
const DATA_PROOF: &[u8] = b"kvlink-v1 data proof";

/// 32 bytes from the operating system's random source.
pub(crate) fn nonce() -> Result<[u8; 32]> {
    use std::io::Read;
    let mut n = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut n))
        .map_err(|e| Error::io("reading /dev/urandom", &e))?;
    Ok(n)
}

/// The server's proof that it holds the key, over the reader's and its own nonce.
pub(crate) fn server_proof(key: &AuthKey, client: &[u8; 32], server: &[u8; 32]) -> [u8; 32] {
    key.mac(&[SERVER_PROOF, client, server])
}

/// The reader's proof that it holds the key.
pub(crate) fn client_proof(key: &AuthKey, client: &[u8; 32], server: &[u8; 32]) -> [u8; 32] {
    key.mac(&[CLIENT_PROOF, client, server])
}

/// Whether `proof` is the reader's proof over these nonces (constant time).
pub(crate) fn client_proof_checks(
    key: &AuthKey,
    client: &[u8; 32],
    server: &[u8; 32],
    proof: &[u8],
) -> bool {
    key.verify(&[CLIENT_PROOF, client, server], proof)
}

/// Whether `proof` is the server's proof over these nonces (constant time).
pub(crate) fn server_proof_checks(
    key: &AuthKey,
    client: &[u8; 32],
    server: &[u8; 32],
    proof: &[u8],
) -> bool {
    key.verify(&[SERVER_PROOF, client, server], proof)
}

/// What an authenticated control session shares between its two ends: an id the data server
/// looks sessions up by, and a key only those two ends can compute.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct SessionSecret {
    pub(crate) id: [u8; 16],
    key: [u8; 32],
    /// Derived from a deployment key. An unkeyed session (engines without a key) has only an
    /// id, which its data requests name; it proves nothing.
    keyed: bool,
}

impl std::fmt::Debug for SessionSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SessionSecret({:02x?}.., key redacted)", &self.id[..4])
    }
}

impl SessionSecret {
    /// The secret of the session authenticated with these nonces.
    pub(crate) fn derive(key: &AuthKey, client: &[u8; 32], server: &[u8; 32]) -> SessionSecret {
        let id = key.mac(&[SESSION_ID, client, server]);
        SessionSecret {
            id: id[..16].try_into().expect("16 of 32 bytes"),
            key: key.mac(&[SESSION_KEY, client, server]),
            keyed: true,
        }
    }

    /// The session of engines without a key: `id`, picked at random by the reader and sent in
    /// its `Hello`, which its data requests name so the server knows their reader. It carries
    /// no proof (anyone who sees the id could name it, as anyone could send a `Hello` without
    /// a key).
    pub(crate) fn unkeyed(id: [u8; 16]) -> SessionSecret {
        SessionSecret {
            id,
            key: [0; 32],
            keyed: false,
        }
    }

    /// A fresh random id for an unkeyed session.
    pub(crate) fn random_id() -> Result<[u8; 16]> {
        let n = nonce()?;
        Ok(n[..16].try_into().expect("16 of 32 bytes"))
    }

    /// Whether the session was derived from a deployment key (its data connections prove it).
    pub(crate) fn is_keyed(&self) -> bool {
        self.keyed
    }

    /// A data connection's proof, over the data server's nonce.
    pub(crate) fn data_proof(&self, nonce: &[u8; 32]) -> [u8; 32] {
        mac(&self.key, &[DATA_PROOF, &self.id, nonce])
    }

    /// Whether `proof` is this session's proof over `nonce` (constant time).
    pub(crate) fn verify_data(&self, nonce: &[u8; 32], proof: &[u8]) -> bool {
        self.keyed && verify(&self.key, &[DATA_PROOF, &self.id, nonce], proof)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> AuthKey {
        AuthKey::new(vec![b; 32]).unwrap()
    }

    #[test]
    fn proofs_check_with_the_key_and_fail_without_it() {
        let (c, s) = (nonce().unwrap(), nonce().unwrap());
        assert_ne!(c, s, "fresh nonces");
        let k = key(1);
        let sp = server_proof(&k, &c, &s);
        assert!(k.verify(&[SERVER_PROOF, &c, &s], &sp));
        // Another key, other nonces, or the other role's proof do not check.
        assert_ne!(server_proof(&key(2), &c, &s), sp);
        assert_ne!(server_proof(&k, &s, &c), sp);
        assert_ne!(client_proof(&k, &c, &s), sp);
        assert!(!k.verify(&[SERVER_PROOF, &c, &s], &sp[..31]));
    }

    #[test]
    fn a_session_secret_binds_data_proofs_to_its_session() {
        let (c, s, n) = (nonce().unwrap(), nonce().unwrap(), nonce().unwrap());
        let ours = SessionSecret::derive(&key(1), &c, &s);
        assert_eq!(
            ours,
            SessionSecret::derive(&key(1), &c, &s),
            "both ends derive the same"
        );
        let p = ours.data_proof(&n);
        assert!(ours.verify_data(&n, &p));
        let other = SessionSecret::derive(&key(1), &s, &c);
        assert_ne!(other.id, ours.id);
        assert!(!other.verify_data(&n, &p));
        assert!(
            !ours.verify_data(&nonce().unwrap(), &p),
            "a fresh nonce needs a fresh proof"
        );
        assert!(!format!("{ours:?}").contains(&format!("{:?}", ours.key)));
    }

    #[test]
    fn short_keys_are_refused_and_keys_never_print() {
        assert!(AuthKey::new(b"short".to_vec()).is_err());
        let k = AuthKey::new(b"0123456789abcdef-secret".to_vec()).unwrap();
        assert!(!format!("{k:?}").contains("secret"));
    }
}
